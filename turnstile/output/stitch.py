"""Stitching a sealed rollout's turns into training samples.

Turns are taken in order. A turn extends an existing sample when its prompt starts,
token for token, with that sample's whole context (previous prompt + sampled
completion): the token-in-token-out property. The new prompt tokens get loss mask 0
and the sampled tokens loss mask 1 with their behaviour logprobs. Where no sample's
context is a prefix of the prompt, a new sample starts and the break is recorded: the
position of the first mismatching token and its kind (see `BreakKind`). Nothing is ever
merged through a mismatch, and turns without exact backend token IDs never merge.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

import numpy as np
import orjson

from turnstile.records import (
    BreakKind,
    ImageRef,
    Reward,
    RolloutStatus,
    SampleRecord,
    TokenSource,
    TurnRecord,
    TurnSpan,
    TurnStatus,
)

# Tokens of context shown on each side of a break in `break_detail`.
BREAK_CONTEXT_TOKENS = 4


class Detokenizer(Protocol):
    def decode(self, ids: Sequence[int]) -> str: ...


@dataclass(slots=True)
class _Chain:
    index: int
    ids: list[np.ndarray] = field(default_factory=list)
    mask: list[np.ndarray] = field(default_factory=list)
    logprobs: list[np.ndarray] = field(default_factory=list)
    spans: list[TurnSpan] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    version_spans: list[tuple[int, int]] = field(default_factory=list)
    statuses: list[str] = field(default_factory=list)
    images: list[ImageRef] = field(default_factory=list)  # placed in input_ids
    length: int = 0
    context: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    last: TurnRecord | None = None
    break_kind: BreakKind = BreakKind.FIRST
    break_position: int | None = None
    break_detail: str | None = None
    parent: int | None = None
    exact: bool = True

    def append(self, turn: TurnRecord) -> None:
        prompt = turn.prompt_token_ids
        new_prompt = prompt[self.length :] if self.length else prompt
        completion = turn.completion_token_ids
        sampled = turn.status is TurnStatus.OK
        start = self.length
        # the images of the new prompt tokens (positions in the prompt are positions in
        # input_ids, as the prompt starts with the whole context)
        self.images += [i for i in turn.images if i.start is None or i.start >= start]
        self.ids += [new_prompt, completion]
        self.mask += [
            np.zeros(len(new_prompt), dtype=np.int8),
            np.full(len(completion), 1 if sampled else 0, dtype=np.int8),
        ]
        completion_lp = (
            turn.behavior_logprobs
            if sampled
            else np.full(len(completion), np.nan, dtype=np.float32)
        )
        self.logprobs += [np.full(len(new_prompt), np.nan, dtype=np.float32), completion_lp]
        completion_start = start + len(new_prompt)
        self.length = completion_start + len(completion)
        self.spans.append(
            TurnSpan(turn.turn_index, turn.choice_index, start, completion_start, self.length)
        )
        self.versions.append(turn.policy_version)
        if sampled:  # the sampled tokens' versions, placed in input_ids
            for first, version in turn.version_spans():
                if first < len(completion):
                    self.version_spans.append((completion_start + first, version))
        self.statuses.append(turn.status.value)
        self.context = np.concatenate([prompt, completion]).astype(np.int32, copy=False)
        self.last = turn
        self.exact = self.exact and turn.token_source is TokenSource.BACKEND


def images_line_up(chain: _Chain, turn: TurnRecord) -> bool:
    """Whether `turn`'s images inside `chain`'s context are the chain's images, at the
    same placeholders: equal token ids do not make equal images (a new screenshot of the
    same size has the same placeholders). Unlocated images never line up."""
    if not chain.images and not turn.images:
        return True
    if any(i.start is None for i in chain.images) or any(i.start is None for i in turn.images):
        return False
    inside = [i for i in turn.images if i.start is not None and i.start < chain.length]
    return inside == chain.images


def _first_image_difference(chain: _Chain, turn: TurnRecord) -> int:
    inside = [i for i in turn.images if i.start is None or i.start < chain.length]
    for mine, theirs in zip(chain.images, inside, strict=False):
        if mine != theirs:
            return min(x for x in (mine.start, theirs.start, chain.length) if x is not None)
    shorter = chain.images[len(inside) :] or inside[len(chain.images) :]
    return shorter[0].start if shorter and shorter[0].start is not None else 0


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.nonzero(a[:n] != b[:n])[0]
    return int(diff[0]) if len(diff) else n


def _canon(value: Any) -> bytes:
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)


def _same_tool_calls(a: Any, b: Any) -> bool:
    a_calls, b_calls = a or [], b or []
    if len(a_calls) != len(b_calls):
        return False
    for x, y in zip(a_calls, b_calls, strict=True):
        fx, fy = (x or {}).get("function") or {}, (y or {}).get("function") or {}
        if fx.get("name") != fy.get("name"):
            return False
        args_x, args_y = fx.get("arguments"), fy.get("arguments")
        if args_x != args_y:
            try:
                if orjson.loads(args_x or "null") != orjson.loads(args_y or "null"):
                    return False
            except (orjson.JSONDecodeError, TypeError):
                return False
    return True


def messages_extend(previous: TurnRecord, turn: TurnRecord) -> bool | None:
    """Whether `turn`'s messages are `previous`'s plus the assistant reply it got.

    None when the turns are not chat turns (nothing to compare).
    """
    if previous.request_messages_json is None or turn.request_messages_json is None:
        return None
    before = orjson.loads(previous.request_messages_json)
    after = orjson.loads(turn.request_messages_json)
    if not isinstance(before, list) or not isinstance(after, list):
        return None
    if len(after) <= len(before):
        return False
    if any(_canon(x) != _canon(y) for x, y in zip(before, after[: len(before)], strict=True)):
        return False
    reply = orjson.loads(previous.response_message_json or "null") or {}
    sent = after[len(before)]
    if not isinstance(sent, dict) or sent.get("role") != "assistant":
        return False
    if (sent.get("content") or None) != (reply.get("content") or None):
        return False
    return _same_tool_calls(sent.get("tool_calls"), reply.get("tool_calls"))


def _snippet(ids: np.ndarray, pos: int, tok: Detokenizer | None) -> str:
    lo, hi = max(0, pos - BREAK_CONTEXT_TOKENS), pos + BREAK_CONTEXT_TOKENS
    window = [int(i) for i in ids[lo:hi]]
    if tok is None:
        return str(window)
    return f"{window} {tok.decode(window)!r}"


def classify_break(
    chain: _Chain, turn: TurnRecord, tok: Detokenizer | None
) -> tuple[BreakKind, int, str]:
    """Why `turn` cannot extend `chain`: kind, first mismatching position, detail."""
    prev = chain.last
    assert prev is not None
    context, prompt = chain.context, turn.prompt_token_ids
    pos = _common_prefix(context, prompt)
    detail = (
        f"context {_snippet(context, pos, tok)} vs prompt {_snippet(prompt, pos, tok)} "
        f"at token {pos}"
    )
    if prev.turn_id == turn.turn_id:
        return BreakKind.BRANCH, pos, f"sibling choice {turn.choice_index} of the same call"
    if not chain.exact or turn.token_source is not TokenSource.BACKEND:
        return BreakKind.TOKEN_SOURCE, pos, "a side has no exact backend token IDs; " + detail
    if pos == len(context) and not images_line_up(chain, turn):
        where = _first_image_difference(chain, turn)
        return (
            BreakKind.IMAGES,
            where,
            f"the tokens extend the context, but the images at the placeholders from token "
            f"{where} differ (or could not be located)",
        )
    extends = messages_extend(prev, turn)
    if extends is False:
        why = "messages do not extend the previous turn; "
        return BreakKind.HISTORY_REWRITTEN, pos, why + detail
    if pos == len(prompt) and len(prompt) < len(context):
        why = "the prompt is shorter than the previous context; "
        return BreakKind.TRUNCATED, pos, why + detail
    if tok is None:
        return BreakKind.UNCLASSIFIED, pos, detail
    context_text = tok.decode([int(i) for i in context])
    prompt_text = tok.decode([int(i) for i in prompt])
    if prompt_text.startswith(context_text):
        return BreakKind.TOKENIZATION, pos, "same text, different token IDs; " + detail
    return BreakKind.RERENDER, pos, "the re-rendered text differs; " + detail


@dataclass(frozen=True, slots=True)
class RolloutInfo:
    rollout_id: str
    group_id: str | None
    task_id: str | None
    status: RolloutStatus
    rewards: list[Reward]


def stitch(
    info: RolloutInfo, turns: Sequence[TurnRecord], tok: Detokenizer | None = None
) -> list[SampleRecord]:
    """Turn a sealed rollout's turns into samples, never merging through a mismatch.

    A turn extends the longest sample whose whole context is a prefix of its prompt
    (the earliest sample among equals), unless that sample's last turn is the same call
    (sibling choices branch) or either side lacks exact token IDs. A turn that extends
    none starts a sample whose parent is the one sharing the longest prefix with it (the
    longest, then the earliest, among equals). The cost is linear in turns and choices:
    samples are found through a hash index of their contexts (see `_Index`), and the
    samples that start with a call's prompt are tracked per call.
    """
    ordered = sorted(turns, key=lambda t: (t.turn_index, t.choice_index))
    chains: list[_Chain] = []
    index = _Index()
    call: _Call | None = None
    for turn in ordered:
        if turn.status is TurnStatus.ERROR or len(turn.prompt_token_ids) == 0:
            continue
        prompt = turn.prompt_token_ids
        if call is None or not call.same(turn):
            call = _Call(turn, chains)
        exact = turn.token_source is TokenSource.BACKEND
        best = index.extendable(turn, call.hashes, exact) if exact else None
        if best is not None:
            index.remove(best)
            best.append(turn)
            index.add(best, call.extend_hash(best, turn))
            call.touched(best)
            continue
        new = _Chain(index=len(chains))
        if chains:
            parent = (
                call.longest_prefix if call.longest_prefix is not None else _parent(chains, prompt)
            )
            new.break_kind, new.break_position, new.break_detail = classify_break(parent, turn, tok)
            new.parent = parent.index
        new.exact = exact
        new.append(turn)
        chains.append(new)
        index.add(new, call.extend_hash(new, turn))
        call.touched(new)
    return [_to_sample(info, c) for c in chains]


def _parent(chains: Sequence[_Chain], prompt: np.ndarray) -> _Chain:
    """The chain sharing the longest prefix with `prompt`; the longest, then the earliest,
    among equals. The most recent chains are looked at first: they usually share the
    most, and a chain too short to beat the best so far is not compared at all."""
    best: _Chain | None = None
    best_key = (-1, -1)
    for chain in reversed(chains):
        bound = min(chain.length, len(prompt))
        if bound < best_key[0] or (bound == best_key[0] and chain.length < best_key[1]):
            continue
        key = (_common_prefix(chain.context, prompt), chain.length)
        if key >= best_key:  # equal keys: the earlier chain wins, as it comes later here
            best, best_key = chain, key
    assert best is not None
    return best


# A 64-bit polynomial hash of token sequences (mod 2**64): the base is odd and large, so
# every power is odd and sequences of equal length rarely collide; a match is always
# confirmed token by token, so a collision can cost time, never a wrong merge.
_HASH_BASE: Final = np.uint64(0x9E3779B97F4A7C15)
_HASH_MASK: Final = 2**64 - 1
_powers = np.ones(1, dtype=np.uint64)


def _hash_powers(n: int) -> np.ndarray:
    """base**0 .. base**(n-1) (mod 2**64), grown and kept for later calls."""
    global _powers
    if len(_powers) < n:
        grown = np.full(max(n, 2 * len(_powers)), _HASH_BASE, dtype=np.uint64)
        grown[0] = 1
        _powers = np.cumprod(grown, dtype=np.uint64)
    return _powers[:n]


def _weighted(ids: np.ndarray, start: int) -> np.ndarray:
    """Each token's (id + 1) * base**position, for positions from `start`."""
    weighted: np.ndarray = (ids.astype(np.uint64) + np.uint64(1)) * _hash_powers(start + len(ids))[
        start:
    ]
    return weighted


def prefix_hashes(ids: np.ndarray) -> np.ndarray:
    """h[k] = the hash of ids[:k], for k = 0 .. len(ids)."""
    out = np.zeros(len(ids) + 1, dtype=np.uint64)
    np.cumsum(_weighted(ids, 0), dtype=np.uint64, out=out[1:])
    return out


class _Call:
    """One backend call's turns (its choices share a prompt) while they are stitched:
    the prompt's prefix hashes, and the longest chain whose context starts with the
    prompt (every chain a choice of this call touched, and any earlier one)."""

    def __init__(self, turn: TurnRecord, chains: Sequence[_Chain]) -> None:
        self.turn_id = turn.turn_id
        self.prompt = turn.prompt_token_ids
        self.hashes = prefix_hashes(self.prompt)
        self.longest_prefix: _Chain | None = None
        n = len(self.prompt)
        for chain in chains:
            if chain.length >= n and np.array_equal(chain.context[:n], self.prompt):
                self.touched(chain)

    def same(self, turn: TurnRecord) -> bool:
        return turn.turn_id == self.turn_id and np.array_equal(turn.prompt_token_ids, self.prompt)

    def touched(self, chain: _Chain) -> None:
        """`chain`'s context now starts with this call's prompt."""
        best = self.longest_prefix
        if best is None or (chain.length, -chain.index) > (best.length, -best.index):
            self.longest_prefix = chain

    def extend_hash(self, chain: _Chain, turn: TurnRecord) -> int:
        """The hash of `chain`'s context, which is now this call's prompt + `turn`'s
        completion."""
        n = len(self.prompt)
        tail = _weighted(turn.completion_token_ids, n).sum(dtype=np.uint64)
        return (int(self.hashes[n]) + int(tail)) & _HASH_MASK


class _Index:
    """Chains by the length and hash of their context, to find the chain a prompt
    extends with one hash look-up per distinct chain length (longest first)."""

    def __init__(self) -> None:
        self._chains: dict[tuple[int, int], list[_Chain]] = {}
        self._keys: dict[int, tuple[int, int]] = {}  # chain index -> its key
        self._lengths: list[int] = []  # distinct context lengths, ascending
        self._count: dict[int, int] = {}  # chains per length

    def add(self, chain: _Chain, context_hash: int) -> None:
        key = (chain.length, context_hash)
        self._chains.setdefault(key, []).append(chain)
        self._keys[chain.index] = key
        if self._count.get(chain.length, 0) == 0:
            bisect.insort(self._lengths, chain.length)
        self._count[chain.length] = self._count.get(chain.length, 0) + 1

    def remove(self, chain: _Chain) -> None:
        key = self._keys.pop(chain.index)
        same = self._chains[key]
        same.remove(chain)
        if not same:
            del self._chains[key]
        self._count[key[0]] -= 1
        if self._count[key[0]] == 0:
            del self._count[key[0]]
            del self._lengths[bisect.bisect_left(self._lengths, key[0])]

    def extendable(self, turn: TurnRecord, hashes: np.ndarray, exact: bool) -> _Chain | None:
        """The longest exact chain whose context is a prefix of `turn`'s prompt and whose
        last turn is another call; the earliest among equals."""
        prompt = turn.prompt_token_ids
        stop = bisect.bisect_right(self._lengths, len(prompt))
        for length in reversed(self._lengths[:stop]):
            found = [
                chain
                for chain in self._chains.get((length, int(hashes[length])), ())
                if chain.exact
                and exact
                and chain.last is not None
                and chain.last.turn_id != turn.turn_id
                and np.array_equal(chain.context, prompt[:length])
                and images_line_up(chain, turn)
            ]
            if found:
                return min(found, key=lambda c: c.index)
        return None


def _to_sample(info: RolloutInfo, chain: _Chain) -> SampleRecord:
    return SampleRecord(
        rollout_id=info.rollout_id,
        sample_index=chain.index,
        group_id=info.group_id,
        task_id=info.task_id,
        input_ids=np.concatenate(chain.ids).astype(np.int32, copy=False),
        loss_mask=np.concatenate(chain.mask).astype(np.int8, copy=False),
        behavior_logprobs=np.concatenate(chain.logprobs).astype(np.float32, copy=False),
        turn_spans=chain.spans,
        rewards=info.rewards,
        policy_versions=chain.versions,
        token_source=TokenSource.BACKEND if chain.exact else TokenSource.RETOKENIZED,
        rollout_status=info.status,
        break_kind=chain.break_kind,
        break_position=chain.break_position,
        break_detail=chain.break_detail,
        parent_sample_index=chain.parent,
        turn_statuses=chain.statuses,
        policy_version_spans=chain.version_spans,
        images=chain.images,
    )
