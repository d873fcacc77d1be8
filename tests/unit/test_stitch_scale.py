"""Stitching is linear in choices and turns, and gives exactly the samples of the plain
definition (every chain compared with every turn) on random rollouts."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.test_stitch import INFO, CharTokenizer, turn
from turnstile.output import stitch as stitching
from turnstile.output.stitch import (
    _Chain,
    _common_prefix,
    _to_sample,
    classify_break,
    prefix_hashes,
    stitch,
)
from turnstile.records import SampleRecord, TokenSource, TurnRecord, TurnStatus


def reference_stitch(turns: list[TurnRecord], tok: Any) -> list[SampleRecord]:
    """The definition, quadratic: each turn is compared with every chain."""
    ordered = sorted(turns, key=lambda t: (t.turn_index, t.choice_index))
    chains: list[_Chain] = []
    for t in ordered:
        if t.status is TurnStatus.ERROR or len(t.prompt_token_ids) == 0:
            continue
        exact = t.token_source is TokenSource.BACKEND
        best = None
        for chain in chains:
            if not (chain.exact and exact) or chain.last is None:
                continue
            if chain.last.turn_id == t.turn_id:
                continue
            n = chain.length
            if (
                n <= len(t.prompt_token_ids)
                and np.array_equal(chain.context, t.prompt_token_ids[:n])
                and (best is None or n > best.length)
            ):
                best = chain
        if best is not None:
            best.append(t)
            continue
        new = _Chain(index=len(chains))
        if chains:
            parent = max(
                chains, key=lambda c: (_common_prefix(c.context, t.prompt_token_ids), c.length)
            )
            new.break_kind, new.break_position, new.break_detail = classify_break(parent, t, tok)
            new.parent = parent.index
        new.exact = exact
        new.append(t)
        chains.append(new)
    return [_to_sample(INFO, c) for c in chains]


def _same(a: list[SampleRecord], b: list[SampleRecord]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.input_ids.tobytes() == y.input_ids.tobytes()
        assert x.loss_mask.tobytes() == y.loss_mask.tobytes()
        assert x.behavior_logprobs.tobytes() == y.behavior_logprobs.tobytes()
        assert (x.sample_index, x.turn_spans, x.policy_versions, x.turn_statuses) == (
            y.sample_index,
            y.turn_spans,
            y.policy_versions,
            y.turn_statuses,
        )
        assert (x.break_kind, x.break_position, x.break_detail, x.parent_sample_index) == (
            y.break_kind,
            y.break_position,
            y.break_detail,
            y.parent_sample_index,
        )
        assert x.token_source == y.token_source


def _random_rollout(rng: random.Random) -> list[TurnRecord]:
    """Calls with siblings, continuations of any earlier choice, retries, rewrites,
    truncations, error and inexact turns, empty completions, over a tiny vocabulary (so
    that accidental prefixes happen)."""
    vocab = [97, 98, 99]
    turns: list[TurnRecord] = []
    contexts: list[list[int]] = [[]]
    for index in range(rng.randint(1, 9)):
        base = rng.choice(contexts)
        kind = rng.random()
        if kind < 0.6:
            prompt = base + [rng.choice(vocab) for _ in range(rng.randint(0, 3))]
        elif kind < 0.8 and base:
            cut = rng.randint(0, len(base))
            prompt = base[:cut] + [rng.choice(vocab) for _ in range(rng.randint(0, 2))]
        else:
            prompt = [rng.choice(vocab) for _ in range(rng.randint(0, 6))]
        if not prompt:
            prompt = [rng.choice(vocab)]
        for choice in range(rng.choice([1, 1, 2, 3, 5])):
            completion = [rng.choice(vocab) for _ in range(rng.choice([0, 1, 2, 3]))]
            status = rng.choice([TurnStatus.OK] * 6 + [TurnStatus.ERROR, TurnStatus.ABORTED])
            source = rng.choice([TokenSource.BACKEND] * 8 + [TokenSource.RETOKENIZED])
            turns.append(
                turn(index, prompt, completion, choice=choice, status=status, source=source)
            )
            contexts.append(prompt + completion)
    rng.shuffle(turns)  # stitch sorts them
    return turns


@settings(max_examples=400, deadline=None, derandomize=True)
@given(st.integers(min_value=0, max_value=2**32 - 1))
def test_the_indexed_stitch_gives_the_samples_of_the_definition(seed: int) -> None:
    turns = _random_rollout(random.Random(seed))
    tok = CharTokenizer()
    _same(stitch(INFO, turns, tok), reference_stitch(turns, tok))
    _same(stitch(INFO, turns, None), reference_stitch(turns, None))


def test_prefix_hashes_tell_prefixes_apart() -> None:
    ids = np.asarray([0, 0, 5, 2**31 - 1], dtype=np.int32)
    h = prefix_hashes(ids)
    assert len(h) == 5 and len(set(h.tolist())) == 5
    assert h[2] == prefix_hashes(ids[:2])[2]


def _count_prefix_work(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Count the token comparisons stitching makes (the quadratic part, if any)."""
    counts = {"tokens": 0}
    real = stitching._common_prefix

    def counted(a: np.ndarray, b: np.ndarray) -> int:
        counts["tokens"] += min(len(a), len(b))
        return real(a, b)

    real_equal = np.array_equal

    def counted_equal(a: Any, b: Any, *args: Any, **kwargs: Any) -> bool:
        counts["tokens"] += min(len(a), len(b))
        return bool(real_equal(a, b, *args, **kwargs))

    monkeypatch.setattr(stitching, "_common_prefix", counted)
    monkeypatch.setattr(np, "array_equal", counted_equal)
    return counts


def _siblings(n: int) -> list[TurnRecord]:
    prompt = list(range(100, 164))
    first = [turn(0, prompt, [7, 8, 9 + i % 5], choice=i) for i in range(n)]
    follow = turn(1, [*prompt, 7, 8, 9, 1, 2], [3])
    return [*first, follow]


def _breaking_turns(n: int) -> list[TurnRecord]:
    """A conversation whose every call re-renders the history (record mode on Qwen3)."""
    out, context = [], list(range(100, 132))
    for i in range(n):
        out.append(turn(i, context, [5, 6, 7]))
        context = [*context, 9, 9, 9, 1000 + i]  # the sampled [5, 6, 7] came back as [9, 9, 9]
    return out


@pytest.mark.parametrize("make", [_siblings, _breaking_turns], ids=["choices", "turns"])
def test_token_comparisons_grow_linearly(make: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    counts = _count_prefix_work(monkeypatch)
    per_token = []
    for n in (250, 500, 1000):
        turns = make(n)
        size = sum(len(t.prompt_token_ids) + len(t.completion_token_ids) for t in turns)
        counts["tokens"] = 0
        samples = stitch(INFO, turns, CharTokenizer())
        assert len(samples) >= n
        per_token.append(counts["tokens"] / size)
    # Linear in the rollout's size: the tokens compared per recorded token stay flat as
    # calls and choices grow (comparing every turn with every sample would grow them
    # in proportion to n).
    assert per_token[0] < 4 and per_token[2] <= 1.1 * per_token[0], per_token
