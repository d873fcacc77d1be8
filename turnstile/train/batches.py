"""Training samples from Turnstile shards, as padded or packed numpy batches.

``TrainSample`` is one row of the ``samples`` table with what a trainer needs: the exact
``input_ids``, ``loss_mask`` and ``behavior_logprobs``, the named rewards with their
verifier information, the group and the policy versions. ``pad_batch`` lays samples out
as ``(B, L)`` arrays with an attention mask; ``pack_batch`` concatenates them into one row
with restarting ``position_ids`` and ``cu_seqlens`` (the layout of varlen attention
kernels). Each sampled token carries the policy version that sampled it
(``behavior_versions``, from the samples' ``policy_version_spans``); ``mask_stale_tokens``
takes tokens more than N versions old out of the loss, and ``split_at_version_changes``
makes one sample per behaviour version of a sample that straddled a weight update.
Per-token advantages (from ``turnstile.train.advantages``) travel along, aligned with
``loss_mask``. Numpy and pyarrow only; ``to_torch`` converts lazily.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from turnstile.reader import NO_VERSION, list_parts, rewards_dict, spread_versions
from turnstile.train import advantages as adv

# The columns of the samples table a TrainSample is built from.
SAMPLE_COLUMNS: Final[tuple[str, ...]] = (
    "rollout_id",
    "sample_index",
    "group_id",
    "task_id",
    "rollout_status",
    "input_ids",
    "loss_mask",
    "behavior_logprobs",
    "rewards",
    "policy_versions",
    "min_policy_version",
    "max_policy_version",
    "policy_version_spans",
)

Batch = dict[str, npt.NDArray[Any]]


@dataclass
class TrainSample:
    """One training sample (a row of ``samples``) as numpy arrays."""

    rollout_id: str
    sample_index: int
    group_id: str | None
    task_id: str | None
    rollout_status: str
    input_ids: npt.NDArray[np.int32]
    loss_mask: npt.NDArray[np.int8]
    behavior_logprobs: npt.NDArray[np.float32]
    rewards: dict[str, float]
    reward_info: dict[str, str | None]
    policy_versions: npt.NDArray[np.int64]
    min_policy_version: int | None
    max_policy_version: int | None
    # The policy version that sampled each token of input_ids (NO_VERSION off the mask);
    # None: every sampled token under `min_policy_version` (shards before per-token
    # versions).
    behavior_versions: npt.NDArray[np.int64] | None = field(default=None, repr=False)
    # Per-token advantages on the input_ids layout (0 off the mask); set by the caller.
    advantages: npt.NDArray[np.float64] | None = field(default=None, repr=False)

    @property
    def key(self) -> tuple[str, int]:
        return (self.rollout_id, self.sample_index)

    @property
    def num_loss_tokens(self) -> int:
        return int(np.count_nonzero(self.loss_mask))

    def staleness(self, current_version: int) -> int:
        """How many versions behind ``current_version`` its oldest turn was sampled."""
        low = self.min_policy_version
        return 0 if low is None else current_version - low

    def token_versions(self) -> npt.NDArray[np.int64]:
        """The version that sampled each token (``NO_VERSION`` where ``loss_mask`` is 0)."""
        if self.behavior_versions is not None:
            return self.behavior_versions
        low = NO_VERSION if self.min_policy_version is None else self.min_policy_version
        return np.where(self.loss_mask > 0, low, NO_VERSION).astype(np.int64)

    def token_staleness(self, current_version: int) -> npt.NDArray[np.int64]:
        """Versions behind ``current_version`` per token (0 where ``loss_mask`` is 0)."""
        versions = self.token_versions()
        return np.where(versions == NO_VERSION, 0, current_version - versions).astype(np.int64)


def mask_stale_tokens(
    samples: Sequence[TrainSample], current_version: int, max_staleness: int
) -> int:
    """Take every token sampled more than ``max_staleness`` versions before
    ``current_version`` out of the loss (``loss_mask`` 0, in place), token by token: a
    stream that straddled a weight update keeps its fresh tokens. Advantages set before
    are zeroed there too. Returns how many tokens were masked."""
    if max_staleness < 0:
        raise ValueError(f"max_staleness must be >= 0, not {max_staleness}")
    masked = 0
    for s in samples:
        versions = s.token_versions()
        stale = (s.loss_mask > 0) & (versions != NO_VERSION)
        stale &= current_version - versions > max_staleness
        n = int(np.count_nonzero(stale))
        if not n:
            continue
        masked += n
        s.behavior_versions = np.where(stale, NO_VERSION, versions).astype(np.int64)
        s.loss_mask = np.where(stale, 0, s.loss_mask).astype(np.int8)
        if s.advantages is not None:
            s.advantages = np.where(stale, 0.0, s.advantages)
    return masked


def split_at_version_changes(sample: TrainSample) -> list[TrainSample]:
    """One sample per behaviour version of ``sample``'s sampled tokens, oldest first.

    A sample whose tokens were sampled by several policy versions (a stream that
    straddled a weight update in ``keep`` mode, or turns of one rollout on both sides of
    it) becomes one piece per version: each piece keeps the context up to its version's
    last token, and its loss covers that version's tokens only, so that every piece has
    one behaviour policy (a sequence-level ratio or correction then means one thing). A
    sample with one version (or none) is returned as it is, in a list of one. The pieces
    share ``rollout_id`` and ``sample_index``; ``min_policy_version`` and
    ``max_policy_version`` are the piece's version.
    """
    versions = sample.token_versions()
    sampled = versions[(sample.loss_mask > 0) & (versions != NO_VERSION)]
    distinct = sorted(set(sampled.tolist()))
    if len(distinct) <= 1:
        return [sample]
    pieces: list[TrainSample] = []
    for version in distinct:
        own = (versions == version) & (sample.loss_mask > 0)
        end = int(np.flatnonzero(own)[-1]) + 1
        mask = np.where(own, sample.loss_mask, 0).astype(np.int8)[:end]
        piece = replace(
            sample,
            input_ids=sample.input_ids[:end].copy(),
            loss_mask=mask,
            behavior_logprobs=sample.behavior_logprobs[:end].copy(),
            rewards=dict(sample.rewards),
            reward_info=dict(sample.reward_info),
            policy_versions=np.array([version], dtype=np.int64),
            min_policy_version=version,
            max_policy_version=version,
            behavior_versions=np.where(own, versions, NO_VERSION).astype(np.int64)[:end],
            advantages=None
            if sample.advantages is None
            else np.where(own, sample.advantages, 0.0)[:end],
        )
        pieces.append(piece)
    return pieces


def samples_from_batch(batch: pa.RecordBatch | pa.Table) -> Iterator[TrainSample]:
    """``TrainSample``s from a record batch holding at least ``SAMPLE_COLUMNS``."""
    cols = {name: batch.column(name) for name in SAMPLE_COLUMNS}
    lists = {
        name: cols[name].to_pylist()
        for name in (
            "rollout_id",
            "sample_index",
            "group_id",
            "task_id",
            "rollout_status",
            "rewards",
            "min_policy_version",
            "max_policy_version",
            "policy_version_spans",
        )
    }

    ids, ids_off = list_parts(cols["input_ids"], np.int32)
    mask, mask_off = list_parts(cols["loss_mask"], np.int8)
    logp, logp_off = list_parts(cols["behavior_logprobs"], np.float32)
    vers, vers_off = list_parts(cols["policy_versions"], np.int64)
    for i in range(batch.num_rows):
        items = lists["rewards"][i] or []
        loss_mask = mask[mask_off[i] : mask_off[i + 1]].copy()
        yield TrainSample(
            rollout_id=lists["rollout_id"][i],
            sample_index=lists["sample_index"][i],
            group_id=lists["group_id"][i],
            task_id=lists["task_id"][i],
            rollout_status=lists["rollout_status"][i],
            input_ids=ids[ids_off[i] : ids_off[i + 1]].copy(),
            loss_mask=loss_mask,
            behavior_logprobs=logp[logp_off[i] : logp_off[i + 1]].copy(),
            rewards=rewards_dict(items),
            reward_info={str(r["name"]): r.get("info") for r in items},
            policy_versions=vers[vers_off[i] : vers_off[i + 1]].copy(),
            min_policy_version=lists["min_policy_version"][i],
            max_policy_version=lists["max_policy_version"][i],
            behavior_versions=spread_versions(lists["policy_version_spans"][i], loss_mask),
        )


# ----------------------------------------------------------------- advantages on samples


def group_keys(samples: Sequence[TrainSample]) -> list[str]:
    """Each sample's group key; a sample without a group is its own (advantage 0)."""
    return [s.group_id if s.group_id is not None else f"\0{s.rollout_id}" for s in samples]


@dataclass(frozen=True)
class Rollouts:
    """The rollouts of a list of samples: a rollout split into several samples is one.

    ``members[r]`` are the indices (into the samples) of rollout ``r``'s samples in order of
    ``sample_index``; ``of_sample[i]`` is sample ``i``'s rollout. Rollouts are numbered in
    order of first appearance.
    """

    members: list[list[int]]
    of_sample: npt.NDArray[np.int64]

    @classmethod
    def of(cls, samples: Sequence[TrainSample]) -> Rollouts:
        numbers: dict[str, int] = {}
        members: list[list[int]] = []
        of_sample = np.zeros(len(samples), dtype=np.int64)
        for i, s in enumerate(samples):
            r = numbers.setdefault(s.rollout_id, len(numbers))
            if r == len(members):
                members.append([])
            members[r].append(i)
            of_sample[i] = r
        for m in members:
            m.sort(key=lambda i: samples[i].sample_index)
            first = samples[m[0]]
            for i in m[1:]:
                if samples[i].rewards != first.rewards or samples[i].group_id != first.group_id:
                    raise ValueError(
                        f"rollout {first.rollout_id}: its samples disagree on rewards or group"
                    )
        return cls(members, of_sample)

    def firsts(self, samples: Sequence[TrainSample]) -> list[TrainSample]:
        """One sample per rollout (the first), for its rewards and group."""
        return [samples[m[0]] for m in self.members]

    def loss_tokens(self, samples: Sequence[TrainSample]) -> npt.NDArray[np.int64]:
        """Each rollout's number of loss tokens over all its samples."""
        return np.array([sum(samples[i].num_loss_tokens for i in m) for m in self.members])


def _assign_per_rollout(
    samples: Sequence[TrainSample], values: npt.NDArray[np.float64], rollouts: Rollouts
) -> npt.NDArray[np.float64]:
    """Lay one value per rollout onto every sample of it; return the per-sample values."""
    per_sample = values[rollouts.of_sample]
    for s, value in zip(samples, per_sample, strict=True):
        s.advantages = adv.spread_over_mask(value, s.loss_mask)
    return np.asarray(per_sample, dtype=np.float64)


def assign_grpo(
    samples: Sequence[TrainSample],
    reward_names: Sequence[str] | None = None,
    weights: Sequence[float] | None = None,
    nan: str = "zero",
) -> npt.NDArray[np.float64]:
    """Set GRPO per-token advantages on ``samples``; return the per-sample advantages.

    The advantage is computed once per rollout (a rollout split into several samples
    counts once in its group) and laid onto each of its samples.
    """
    rollouts = Rollouts.of(samples)
    firsts = rollouts.firsts(samples)
    rewards, _ = adv.reward_matrix([s.rewards for s in firsts], reward_names)
    a = adv.grpo_advantages(rewards, group_keys(firsts), weights, nan=nan)
    return _assign_per_rollout(samples, a, rollouts)


def assign_gdpo(
    samples: Sequence[TrainSample],
    reward_names: Sequence[str] | None = None,
    weights: Sequence[float] | None = None,
    variant: str = "trl",
    nan: str = "zero",
) -> npt.NDArray[np.float64]:
    """Set GDPO per-token advantages on ``samples``; return the per-sample advantages.

    Per rollout, as ``assign_grpo``; the batch normalisation runs over rollouts
    (``variant="trl"``) or over all loss tokens of the rollouts (``variant="verl"``).
    """
    rollouts = Rollouts.of(samples)
    firsts = rollouts.firsts(samples)
    rewards, _ = adv.reward_matrix([s.rewards for s in firsts], reward_names)
    a = adv.gdpo_advantages(
        rewards,
        group_keys(firsts),
        weights,
        variant=variant,
        nan=nan,
        token_counts=rollouts.loss_tokens(samples),
    )
    return _assign_per_rollout(samples, a, rollouts)


def _rollout_relevance(
    samples: Sequence[TrainSample],
    members: Sequence[int],
    name: str,
    relevance: Mapping[tuple[str, int, str], npt.ArrayLike],
) -> npt.NDArray[np.float64] | None:
    """A reward's relevance over a rollout's loss tokens, its samples in order.

    A sample without an entry is unknown there (NaN); None when no sample has one.
    """
    parts: list[npt.NDArray[np.float64]] = []
    found = False
    for i in members:
        s = samples[i]
        d = relevance.get((s.rollout_id, s.sample_index, name))
        if d is None:
            parts.append(np.full(s.num_loss_tokens, np.nan))
            continue
        found = True
        values = np.asarray(d, dtype=np.float64)
        if values.shape != (s.num_loss_tokens,):
            raise ValueError(
                f"sample {s.key}: relevance of {name!r} has {values.shape[0]} values for "
                f"{s.num_loss_tokens} loss tokens"
            )
        parts.append(values)
    return np.concatenate(parts) if found else None


def assign_mrtpo(
    samples: Sequence[TrainSample],
    relevance: Mapping[tuple[str, int, str], npt.ArrayLike],
    reward_names: Sequence[str] | None = None,
    weights: Sequence[float] | None = None,
    floor: float = adv.MRTPO_DEFAULT_FLOOR,
    temperature: float = 1.0,
    max_weight: float | None = adv.MRTPO_DEFAULT_MAX_WEIGHT,
    nan: str = "zero",
) -> list[npt.NDArray[np.float64]]:
    """Set MRTPO per-token advantages on ``samples`` (implemented from the notes' reading).

    ``relevance[(rollout_id, sample_index, reward_name)]`` is that reward's per-token JSD
    over the sample's loss tokens (e.g. from ``turnstile.train.rescore.read_relevance`` and
    ``relevance_for``); NaN marks a token whose relevance is unknown. The weights are
    normalised over a rollout's loss tokens across all its samples (a rollout split into
    several samples counts once), so each rollout's token advantages sum to its length
    times its GDPO advantage. A reward without an entry is spread uniformly, as in GDPO.
    Returns the per-sample token advantages over each sample's loss tokens.
    """
    rollouts = Rollouts.of(samples)
    firsts = rollouts.firsts(samples)
    rewards, names = adv.reward_matrix([s.rewards for s in firsts], reward_names)
    per_reward = np.nan_to_num(
        adv.gdpo_reward_advantages(rewards, group_keys(firsts), nan=nan), nan=0.0
    )
    rel = [[_rollout_relevance(samples, m, k, relevance) for k in names] for m in rollouts.members]
    tokens = adv.mrtpo_batch(
        per_reward,
        rel,
        weights,
        floor,
        temperature,
        num_tokens=[int(n) for n in rollouts.loss_tokens(samples)],
        max_weight=max_weight,
    )
    out: list[npt.NDArray[np.float64]] = [np.zeros(0)] * len(samples)
    for r, m in enumerate(rollouts.members):
        start = 0
        for i in m:
            n = samples[i].num_loss_tokens
            out[i] = tokens[r][start : start + n]
            samples[i].advantages = adv.spread_over_mask(out[i], samples[i].loss_mask)
            start += n
    return out


def rollout_order(
    samples: Sequence[TrainSample],
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """``(rollout_index, sample_index)`` per sample: which rollout, and its place in it.

    ``turnstile.train.losses`` uses them to run the future-KL cost on across a rollout's
    samples.
    """
    rollouts = Rollouts.of(samples)
    return rollouts.of_sample, np.array([s.sample_index for s in samples], dtype=np.int64)


# ----------------------------------------------------------------- layouts


def _token_advantages(s: TrainSample) -> npt.NDArray[np.float64]:
    if s.advantages is None:
        return np.zeros(s.input_ids.shape[0], dtype=np.float64)
    if s.advantages.shape[0] != s.input_ids.shape[0]:
        raise ValueError(f"sample {s.key}: advantages not aligned with input_ids")
    return s.advantages


def pad_batch(
    samples: Sequence[TrainSample],
    pad_token_id: int = 0,
    max_length: int | None = None,
    pad_to_multiple_of: int = 1,
    group_ids: Sequence[str] | None = None,
) -> Batch:
    """Right-padded ``(B, L)`` arrays.

    Keys: ``input_ids`` (int64), ``attention_mask`` and ``loss_mask`` (int64, 0 on padding),
    ``position_ids``, ``behavior_logprobs`` (float32, 0 where the mask is 0),
    ``advantages`` (float32), ``group_index`` (int64, dense per group id),
    ``policy_version`` (int64, each sample's oldest turn; -1 if unknown),
    ``behavior_versions`` (int64, the version that sampled each token; -1 off the mask and
    on padding), ``rollout_index``
    and ``sample_index`` (int64 per row: its rollout, its place in it). Samples longer
    than ``max_length`` are truncated on the right.
    """
    if not samples:
        raise ValueError("an empty batch")
    lengths = [s.input_ids.shape[0] for s in samples]
    length = max(lengths) if max_length is None else min(max(lengths), max_length)
    length = -(-length // pad_to_multiple_of) * pad_to_multiple_of
    b = len(samples)
    out: Batch = {
        "input_ids": np.full((b, length), pad_token_id, dtype=np.int64),
        "attention_mask": np.zeros((b, length), dtype=np.int64),
        "loss_mask": np.zeros((b, length), dtype=np.int64),
        "position_ids": np.zeros((b, length), dtype=np.int64),
        "behavior_logprobs": np.zeros((b, length), dtype=np.float32),
        "advantages": np.zeros((b, length), dtype=np.float32),
        "behavior_versions": np.full((b, length), NO_VERSION, dtype=np.int64),
    }
    for i, s in enumerate(samples):
        n = min(lengths[i], length)
        mask = s.loss_mask[:n].astype(np.int64)
        out["input_ids"][i, :n] = s.input_ids[:n]
        out["attention_mask"][i, :n] = 1
        out["loss_mask"][i, :n] = mask
        out["position_ids"][i, :n] = np.arange(n)
        out["behavior_logprobs"][i, :n] = np.where(mask > 0, s.behavior_logprobs[:n], 0.0)
        out["advantages"][i, :n] = _token_advantages(s)[:n]
        out["behavior_versions"][i, :n] = s.token_versions()[:n]
    keys = list(group_ids) if group_ids is not None else group_keys(samples)
    out["group_index"] = adv._group_index(keys)[0]
    out["rollout_index"], out["sample_index"] = rollout_order(samples)
    out["policy_version"] = np.array(
        [-1 if s.min_policy_version is None else s.min_policy_version for s in samples],
        dtype=np.int64,
    )
    return out


def pack_batch(samples: Sequence[TrainSample], max_tokens: int | None = None) -> Batch:
    """All samples concatenated into one ``(1, N)`` row (no padding).

    ``behavior_versions`` is laid out as ``loss_mask`` (see ``pad_batch``).
    ``position_ids`` restart at 0 for every sample and ``cu_seqlens`` (``(B + 1,)``, int32)
    gives their boundaries, as varlen attention kernels expect; ``sequence_index`` says
    which sample each token belongs to; ``group_index``, ``rollout_index`` and
    ``sample_index`` are per sample. ``max_tokens`` raises when the total is larger.
    """
    if not samples:
        raise ValueError("an empty batch")
    lengths = np.array([s.input_ids.shape[0] for s in samples], dtype=np.int64)
    total = int(lengths.sum())
    if max_tokens is not None and total > max_tokens:
        raise ValueError(f"{total} tokens do not fit in a pack of {max_tokens}")
    cu = np.zeros(len(samples) + 1, dtype=np.int32)
    cu[1:] = np.cumsum(lengths)
    mask = np.concatenate([s.loss_mask.astype(np.int64) for s in samples])
    logp = np.concatenate([s.behavior_logprobs for s in samples]).astype(np.float32)
    out: Batch = {
        "input_ids": np.concatenate([s.input_ids for s in samples]).astype(np.int64)[None],
        "attention_mask": np.ones((1, total), dtype=np.int64),
        "loss_mask": mask[None],
        "position_ids": np.concatenate([np.arange(n) for n in lengths])[None],
        "behavior_logprobs": np.where(mask > 0, logp, 0.0).astype(np.float32)[None],
        "advantages": np.concatenate([_token_advantages(s) for s in samples]).astype(np.float32)[
            None
        ],
        "behavior_versions": np.concatenate([s.token_versions() for s in samples])[None],
        "sequence_index": np.repeat(np.arange(len(samples)), lengths)[None],
        "cu_seqlens": cu,
        "group_index": adv._group_index(group_keys(samples))[0],
    }
    out["rollout_index"], out["sample_index"] = rollout_order(samples)
    return out


def pack_greedy(samples: Sequence[TrainSample], max_tokens: int) -> list[list[TrainSample]]:
    """Split samples, in order, into consecutive packs of at most ``max_tokens`` tokens.

    A sample longer than ``max_tokens`` gets a pack of its own.
    """
    packs: list[list[TrainSample]] = []
    current: list[TrainSample] = []
    used = 0
    for s in samples:
        n = s.input_ids.shape[0]
        if current and used + n > max_tokens:
            packs.append(current)
            current, used = [], 0
        current.append(s)
        used += n
    if current:
        packs.append(current)
    return packs


def to_torch(batch: Batch, device: Any = None) -> dict[str, Any]:
    """The batch as torch tensors (needs the ``train`` extra)."""
    import torch

    return {k: torch.from_numpy(np.ascontiguousarray(v)).to(device) for k, v in batch.items()}
