"""Re-score recorded responses for MRTPO: per-token relevance of each reward's verifier info.

For every sample with a reward that carries verifier information (the ``info`` of a
``rewards`` entry: an execution result, a constraint verdict, a parse error), the policy
scores its own response twice: as recorded, and with the verifier information inserted
into the context right before the response's first token. For each response token ``t``
(``loss_mask`` 1) the relevance is the JSD between the two next-token distributions
(``turnstile.train.jsd``). This follows the reading of MRTPO's abstract given in
Turnstile's method notes.

Two paths write the same ``replays/`` table into the output directory:

* ``rescore_backend`` (``turnstile rescore DIR --backend URL``): a vLLM server's
  ``/v1/completions`` with token-ID prompts, ``max_tokens=1`` and ``prompt_logprobs=k``.
  Only the top-k (plus the scored token) of each distribution are known; the rest is one
  leftover bucket, so ``jsd`` is a lower bound and ``jsd_upper`` the bound
  ``jsd + 0.5 * (tail_base + tail_info) * ln 2``. Prompt logprobs are at temperature 1.
* ``turnstile.train.rescore_torch.rescore_model`` (``--model DIR``): full logits of a
  PyTorch causal LM, exact (``jsd_upper == jsd``, tails 0).

Samples already re-scored (same sample, reward and method) are skipped, so a run can be
resumed. Numpy, pyarrow and the standard library (plus rich for the progress bar).
"""

from __future__ import annotations

import json
import logging
import os
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.parquet as pq

from turnstile.reader import open_output
from turnstile.train.batches import SAMPLE_COLUMNS, TrainSample, samples_from_batch
from turnstile.train.jsd import bucketed_jsd_from_logprobs

log = logging.getLogger("turnstile.rescore")

REPLAYS_TABLE: Final[str] = "replays"
REPLAYS_SCHEMA_VERSION: Final[int] = 1
META_REPLAYS_VERSION: Final[str] = "turnstile.replays_schema_version"
METHOD_PROMPT_LOGPROBS: Final[str] = "prompt_logprobs"
METHOD_LOGITS: Final[str] = "logits"
# vLLM's default --max-logprobs is 20: the most top-k a server accepts unless raised.
DEFAULT_TOP_K: Final[int] = 20
# Where the verifier information goes, rendered with the reward's name and its info.
DEFAULT_INFO_TEMPLATE: Final[str] = "\nVerifier feedback on {name}: {info}\n"
# Prompts per /v1/completions request: large enough to batch well in vLLM, small enough
# that one response (k+1 logprobs per prompt token) stays a few MB.
DEFAULT_PROMPTS_PER_REQUEST: Final[int] = 16
# Requests in flight at once; vLLM batches concurrent requests itself.
DEFAULT_CONCURRENCY: Final[int] = 4
# One scoring request: a prefill of at most a few thousand tokens, slow on CPUs, and it
# may wait behind the server's other work.
REQUEST_TIMEOUT_S: Final[float] = 600.0
# A token whose top-k leave more than half of the mass (mean of both tails) unexplained
# has a JSD interval too wide to rank it: its relevance is unknown (NaN) rather than a guess.
DEFAULT_MAX_TAIL: Final[float] = 0.5
RELEVANCE_USES: Final[tuple[str, ...]] = ("jsd", "jsd_upper", "mid")
# Rows per written replays shard.
ROWS_PER_SHARD: Final[int] = 4096

REPLAYS_SCHEMA: Final[pa.Schema] = pa.schema(
    [
        pa.field("rollout_id", pa.string(), nullable=False),
        pa.field("sample_index", pa.int32(), nullable=False),
        pa.field("reward_name", pa.string(), nullable=False),
        pa.field("method", pa.string(), nullable=False),
        pa.field("top_k", pa.int32(), nullable=True),
        pa.field("info_num_tokens", pa.int32(), nullable=False),
        pa.field("positions", pa.list_(pa.int32()), nullable=False),
        pa.field("jsd", pa.list_(pa.float32()), nullable=False),
        pa.field("jsd_upper", pa.list_(pa.float32()), nullable=False),
        pa.field("tail_base", pa.list_(pa.float32()), nullable=False),
        pa.field("tail_info", pa.list_(pa.float32()), nullable=False),
        pa.field("logprobs_base", pa.list_(pa.float32()), nullable=False),
        pa.field("logprobs_info", pa.list_(pa.float32()), nullable=False),
        pa.field("model", pa.string(), nullable=True),
        pa.field("scored_at", pa.timestamp("us", tz="UTC"), nullable=False),
    ],
    metadata={META_REPLAYS_VERSION: str(REPLAYS_SCHEMA_VERSION), "turnstile.table": "replays"},
)


class RescoreError(RuntimeError):
    """The backend could not score a prompt."""


@dataclass(frozen=True)
class RescoreJob:
    """One (sample, reward) pair to score, with both prompts built."""

    sample: TrainSample
    reward_name: str
    info_ids: list[int]
    positions: npt.NDArray[np.int64]  # response token indices in input_ids

    @property
    def base_prompt(self) -> list[int]:
        return [int(t) for t in self.sample.input_ids]

    @property
    def insert_at(self) -> int:
        return int(self.positions[0]) if self.positions.size else 0

    @property
    def info_prompt(self) -> list[int]:
        ids = self.base_prompt
        return ids[: self.insert_at] + self.info_ids + ids[self.insert_at :]


@dataclass
class RescoreRow:
    """The scores of one job (one row of the replays table)."""

    job: RescoreJob
    method: str
    top_k: int | None
    jsd: npt.NDArray[np.float64]
    jsd_upper: npt.NDArray[np.float64]
    tail_base: npt.NDArray[np.float64]
    tail_info: npt.NDArray[np.float64]
    logprobs_base: npt.NDArray[np.float64]
    logprobs_info: npt.NDArray[np.float64]
    model: str | None


def response_positions(loss_mask: npt.ArrayLike) -> npt.NDArray[np.int64]:
    """Indices of the response tokens (loss mask 1) that have a context (index >= 1)."""
    idx = np.flatnonzero(np.asarray(loss_mask) > 0).astype(np.int64)
    return idx[idx >= 1]


def render_info(name: str, info: str, template: str = DEFAULT_INFO_TEMPLATE) -> str:
    return template.format(name=name, info=info)


def build_jobs(
    samples: Iterable[TrainSample],
    tokenize: Callable[[str], list[int]],
    template: str = DEFAULT_INFO_TEMPLATE,
    done: frozenset[tuple[str, int, str]] = frozenset(),
    rewards: Sequence[str] | None = None,
) -> Iterator[RescoreJob]:
    """A job per sample and reward with verifier information, skipping ``done`` keys."""
    for s in samples:
        for name, info in sorted(s.reward_info.items()):
            if not info or (rewards is not None and name not in rewards):
                continue
            if (s.rollout_id, s.sample_index, name) in done:
                continue
            positions = response_positions(s.loss_mask)
            if positions.size == 0:
                continue
            yield RescoreJob(s, name, tokenize(render_info(name, info, template)), positions)


def score_prompt_logprobs(
    job: RescoreJob,
    base: Sequence[Mapping[str, Mapping[str, Any]] | None],
    info: Sequence[Mapping[str, Mapping[str, Any]] | None],
    top_k: int,
    model: str | None = None,
) -> RescoreRow:
    """Bucketed JSD per response token from two vLLM ``prompt_logprobs`` lists.

    Entry ``j`` of a ``prompt_logprobs`` list is ``{"<token id>": {"logprob": ...}}`` for
    the distribution of prompt token ``j`` given the tokens before it (entry 0 is null).
    """
    shift = len(job.info_ids)
    n = job.positions.size
    out = {k: np.zeros(n) for k in ("jsd", "upper", "tp", "tq", "lpb", "lpi")}
    for i, t in enumerate(job.positions):
        p_entry, q_entry = base[int(t)], info[int(t) + shift]
        if p_entry is None or q_entry is None:
            raise RescoreError(f"no prompt logprobs at position {t}")
        top_p = {int(k): float(v["logprob"]) for k, v in p_entry.items()}
        top_q = {int(k): float(v["logprob"]) for k, v in q_entry.items()}
        result = bucketed_jsd_from_logprobs(top_p, top_q)
        token = int(job.sample.input_ids[t])
        out["jsd"][i], out["upper"][i] = result.value, result.upper
        out["tp"][i], out["tq"][i] = result.tail_p, result.tail_q
        out["lpb"][i] = top_p.get(token, np.nan)
        out["lpi"][i] = top_q.get(token, np.nan)
    return RescoreRow(
        job,
        METHOD_PROMPT_LOGPROBS,
        top_k,
        out["jsd"],
        out["upper"],
        out["tp"],
        out["tq"],
        out["lpb"],
        out["lpi"],
        model,
    )


# ----------------------------------------------------------------- the backend


def _post(url: str, body: Mapping[str, Any], api_key: str | None) -> Any:
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers=headers, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")[:500]
        raise RescoreError(f"{url}: HTTP {e.code}: {detail}") from e
    except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
        raise RescoreError(f"{url}: {e}") from e


class BackendScorer:
    """Scores token-ID prompts through a vLLM server's ``prompt_logprobs``."""

    def __init__(
        self,
        backend: str,
        model: str | None = None,
        top_k: int = DEFAULT_TOP_K,
        api_key: str | None = None,
    ) -> None:
        self.backend = backend.rstrip("/")
        if self.backend.endswith("/v1"):
            self.backend = self.backend[: -len("/v1")]
        self.top_k = top_k
        self.api_key = api_key
        self.model = model or self._first_model()

    def _first_model(self) -> str:
        request = urllib.request.Request(f"{self.backend}/v1/models")
        if self.api_key:
            request.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
                return str(json.loads(response.read())["data"][0]["id"])
        except (urllib.error.URLError, KeyError, IndexError, TimeoutError) as e:
            raise RescoreError(f"{self.backend}/v1/models: cannot find a model: {e}") from e

    def tokenize(self, text: str) -> list[int]:
        """Token IDs of ``text`` from the backend's ``/tokenize`` (no special tokens)."""
        body = {"model": self.model, "prompt": text, "add_special_tokens": False}
        return [int(t) for t in _post(f"{self.backend}/tokenize", body, self.api_key)["tokens"]]

    def prompt_logprobs(
        self, prompts: Sequence[Sequence[int]]
    ) -> list[list[dict[str, dict[str, Any]] | None]]:
        """vLLM's ``prompt_logprobs`` for each token-ID prompt, in order."""
        body = {
            "model": self.model,
            "prompt": [list(p) for p in prompts],
            "max_tokens": 1,
            "temperature": 1.0,
            "prompt_logprobs": self.top_k,
        }
        choices = _post(f"{self.backend}/v1/completions", body, self.api_key)["choices"]
        by_index = {int(c["index"]): c for c in choices}
        out = []
        for i in range(len(prompts)):
            entries = by_index[i].get("prompt_logprobs")
            if entries is None:
                raise RescoreError("the backend returned no prompt_logprobs")
            out.append(entries)
        return out

    def score(self, jobs: Sequence[RescoreJob]) -> list[RescoreRow]:
        """Score a chunk of jobs with one request (base and info prompt of each)."""
        prompts: list[list[int]] = []
        for job in jobs:
            prompts += [job.base_prompt, job.info_prompt]
        entries = self.prompt_logprobs(prompts)
        return [
            score_prompt_logprobs(job, entries[2 * i], entries[2 * i + 1], self.top_k, self.model)
            for i, job in enumerate(jobs)
        ]


# ----------------------------------------------------------------- the table


def rows_table(rows: Sequence[RescoreRow]) -> pa.Table:
    """The replays table for ``rows``."""

    def floats(name: str) -> pa.Array:
        return pa.array(
            [np.asarray(getattr(r, name), np.float32) for r in rows], type=pa.list_(pa.float32())
        )

    now = time.time()
    return pa.table(
        {
            "rollout_id": [r.job.sample.rollout_id for r in rows],
            "sample_index": pa.array([r.job.sample.sample_index for r in rows], pa.int32()),
            "reward_name": [r.job.reward_name for r in rows],
            "method": [r.method for r in rows],
            "top_k": pa.array([r.top_k for r in rows], pa.int32()),
            "info_num_tokens": pa.array([len(r.job.info_ids) for r in rows], pa.int32()),
            "positions": pa.array(
                [r.job.positions.astype(np.int32) for r in rows], type=pa.list_(pa.int32())
            ),
            "jsd": floats("jsd"),
            "jsd_upper": floats("jsd_upper"),
            "tail_base": floats("tail_base"),
            "tail_info": floats("tail_info"),
            "logprobs_base": floats("logprobs_base"),
            "logprobs_info": floats("logprobs_info"),
            "model": pa.array([r.model for r in rows], pa.string()),
            "scored_at": pa.array([int(now * 1e6)] * len(rows), pa.timestamp("us", tz="UTC")),
        },
        schema=REPLAYS_SCHEMA,
    )


def write_replays(output: str | Path, rows: Sequence[RescoreRow]) -> Path | None:
    """Publish ``rows`` as one shard of ``<output>/replays/`` (staged, then renamed)."""
    if not rows:
        return None
    root = Path(output)
    staging = root / ".tmp"
    target_dir = root / REPLAYS_TABLE
    staging.mkdir(parents=True, exist_ok=True)
    target_dir.mkdir(parents=True, exist_ok=True)
    name = f"part-{time.time_ns() // 1_000_000:013d}-replay-{uuid.uuid4().hex[:12]}.parquet"
    staged = staging / f"{REPLAYS_TABLE}-{name}.partial"
    pq.write_table(rows_table(rows), staged, compression="zstd")
    with staged.open("rb") as handle:
        os.fsync(handle.fileno())
    final = target_dir / name
    os.replace(staged, final)
    return final


def read_replays(output: str | Path, method: str | None = None) -> pa.Table:
    """All published replays rows (optionally of one method)."""
    files = sorted((Path(output) / REPLAYS_TABLE).glob("part-*.parquet"))
    if not files:
        return REPLAYS_SCHEMA.empty_table()
    table = pa.concat_tables([pq.read_table(f, schema=REPLAYS_SCHEMA) for f in files])
    if method is not None:
        table = table.filter(pa.compute.equal(table["method"], method))
    return table


def relevance_from_bounds(
    lower: npt.ArrayLike,
    upper: npt.ArrayLike,
    tail_base: npt.ArrayLike,
    tail_info: npt.ArrayLike,
    use: str = "jsd",
    max_tail: float = DEFAULT_MAX_TAIL,
) -> npt.NDArray[np.float64]:
    """Per-token relevance from a replay's JSD bounds, with the tail handled explicitly.

    ``use`` is ``jsd`` (the lower bound, the default: exact for ``logits``, and it does
    not grow with the mass the top-k miss), ``jsd_upper`` or ``mid`` (the middle of the
    interval: it grows with the tail, so a token the verifier info does not change but
    whose top-k cover little can outrank a truly relevant one; kept for comparison). A
    token whose mean tail ``(tail_base + tail_info) / 2`` exceeds ``max_tail`` is
    *unknown* (NaN): MRTPO gives it the uniform weight 1.
    """
    lo = np.asarray(lower, dtype=np.float64)
    hi = np.asarray(upper, dtype=np.float64)
    if use not in RELEVANCE_USES:
        raise ValueError(f"use must be one of {RELEVANCE_USES}, not {use!r}")
    values = {"jsd": lo, "jsd_upper": hi, "mid": 0.5 * (lo + hi)}[use].copy()
    tail = 0.5 * (np.asarray(tail_base, dtype=np.float64) + np.asarray(tail_info, np.float64))
    values[tail > max_tail] = np.nan
    return values


def read_relevance(
    output: str | Path,
    method: str | None = None,
    use: str = "jsd",
    max_tail: float = DEFAULT_MAX_TAIL,
) -> dict[tuple[str, int, str], npt.NDArray[np.float64]]:
    """``{(rollout_id, sample_index, reward): d over the scored tokens}`` from replays.

    See ``relevance_from_bounds`` for ``use`` and ``max_tail`` (NaN marks a token whose
    top-k covered too little of the mass to tell). Later rows win.
    """
    table = read_replays(output, method)
    out: dict[tuple[str, int, str], npt.NDArray[np.float64]] = {}
    for row in table.to_pylist():
        out[(row["rollout_id"], row["sample_index"], row["reward_name"])] = relevance_from_bounds(
            row["jsd"], row["jsd_upper"], row["tail_base"], row["tail_info"], use, max_tail
        )
    return out


def relevance_for(
    samples: Sequence[TrainSample], replays: Mapping[tuple[str, int, str], npt.ArrayLike]
) -> dict[tuple[str, int, str], npt.NDArray[np.float64]]:
    """Re-scored relevances laid out over each sample's loss tokens.

    NaN where not scored (a token at index 0 has no context): MRTPO treats it as unknown.
    """
    out: dict[tuple[str, int, str], npt.NDArray[np.float64]] = {}
    for s in samples:
        mask_idx = np.flatnonzero(s.loss_mask > 0)
        scored = mask_idx[mask_idx >= 1]
        for name in s.rewards:
            d = replays.get((s.rollout_id, s.sample_index, name))
            if d is None:
                continue
            full = np.full(mask_idx.size, np.nan)
            full[np.searchsorted(mask_idx, scored)] = np.asarray(d, dtype=np.float64)
            out[(s.rollout_id, s.sample_index, name)] = full
    return out


def done_keys(output: str | Path, method: str) -> frozenset[tuple[str, int, str]]:
    table = read_replays(output, method)
    return frozenset(
        zip(
            table["rollout_id"].to_pylist(),
            table["sample_index"].to_pylist(),
            table["reward_name"].to_pylist(),
            strict=True,
        )
    )


def load_samples(
    output: str | Path, statuses: Sequence[str] | None = ("finished",)
) -> list[TrainSample]:
    """Every matching sample of an output directory."""
    reader = open_output(output)
    samples: list[TrainSample] = []
    for batch in reader.iter_sample_batches(1024, statuses=statuses, columns=SAMPLE_COLUMNS):
        samples.extend(samples_from_batch(batch))
    return samples


class _Bar:
    """A rich progress bar: count, bar, rate (responses/s) and ETA."""

    def __init__(self, total: int, description: str, enabled: bool) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[rate]}"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            disable=not enabled,
            transient=False,
        )
        self._task = self._progress.add_task(description, total=total, rate="")

    def update(self, n: int) -> None:
        self._progress.advance(self._task, n)
        speed = self._progress.tasks[0].speed
        rate = "" if speed is None else f"{speed:.1f} responses/s"
        self._progress.update(self._task, rate=rate)

    def __enter__(self) -> _Bar:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()


def progress_bar(total: int, description: str, enabled: bool = True) -> _Bar:
    """A progress bar showing count, rate and ETA (``enabled=False``: a silent one)."""
    return _Bar(total, description, enabled)


def _chunks(items: Sequence[RescoreJob], size: int) -> list[Sequence[RescoreJob]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def rescore_backend(
    output: str | Path,
    backend: str,
    *,
    model: str | None = None,
    top_k: int = DEFAULT_TOP_K,
    template: str = DEFAULT_INFO_TEMPLATE,
    samples: Sequence[TrainSample] | None = None,
    rewards: Sequence[str] | None = None,
    prompts_per_request: int = DEFAULT_PROMPTS_PER_REQUEST,
    concurrency: int = DEFAULT_CONCURRENCY,
    progress: bool = True,
    api_key: str | None = None,
) -> int:
    """Score every not yet re-scored (sample, reward) through the backend; return rows written.

    ``prompts_per_request`` counts jobs (each sends two prompts).
    """
    scorer = BackendScorer(backend, model, top_k, api_key)
    pool = list(samples) if samples is not None else load_samples(output)
    done = done_keys(output, METHOD_PROMPT_LOGPROBS)
    jobs = list(build_jobs(pool, scorer.tokenize, template, done, rewards))
    written = 0
    pending: list[RescoreRow] = []
    with (
        progress_bar(len(jobs), "rescore", progress) as bar,
        ThreadPoolExecutor(max_workers=max(1, concurrency)) as executor,
    ):
        for rows in executor.map(scorer.score, _chunks(jobs, max(1, prompts_per_request))):
            pending.extend(rows)
            bar.update(len(rows))
            if len(pending) >= ROWS_PER_SHARD:
                write_replays(output, pending)
                written += len(pending)
                pending = []
    write_replays(output, pending)
    written += len(pending)
    log.info("rescored %d responses through %s", written, scorer.backend)
    return written


# The names from before `turnstile rescore`, kept for trainers that import them (deprecated).
replay_backend = rescore_backend
ReplayJob = RescoreJob
ReplayRow = RescoreRow
ReplayError = RescoreError
