"""Jensen-Shannon divergence between next-token distributions, full or from top-k.

``JSD(P || Q) = 0.5 KL(P || M) + 0.5 KL(Q || M)`` with ``M = (P + Q) / 2``, in nats, so it
lies in ``[0, ln 2]``. A backend's ``prompt_logprobs`` give only the top-k tokens of each
distribution. The tokens known under both are kept and everything else is merged into one
leftover bucket (``1 - P(S)`` against ``1 - Q(S)``). Merging outcomes never increases a
divergence, and the tail's share of the JSD is at most half its mass times ``ln 2``, so

    JSD_S <= JSD <= JSD_S + 0.5 * ((1 - P(S)) + (1 - Q(S))) * ln 2.

Works on numpy alone.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Final, NamedTuple

import numpy as np
import numpy.typing as npt

LN2: Final[float] = math.log(2.0)
# Probabilities are clipped to [0, 1] before use: top-k logprobs from a backend can sum to
# a hair above 1 in float32, which would give a negative tail mass.
_PROB_MAX: Final[float] = 1.0


def _xlogy(x: npt.NDArray[np.float64], y: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """``x * log(x / y)`` with ``0 log 0 = 0``."""
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(x > 0, x * (np.log(np.where(x > 0, x, 1.0)) - np.log(y)), 0.0)
    return np.asarray(out, dtype=np.float64)


def jsd(p: npt.ArrayLike, q: npt.ArrayLike, axis: int = -1) -> npt.NDArray[np.float64]:
    """JSD (nats) between probability vectors along ``axis``."""
    pp = np.asarray(p, dtype=np.float64)
    qq = np.asarray(q, dtype=np.float64)
    m = 0.5 * (pp + qq)
    value = 0.5 * _xlogy(pp, m).sum(axis=axis) + 0.5 * _xlogy(qq, m).sum(axis=axis)
    # Rounding can leave a hair outside [0, ln 2].
    return np.asarray(np.clip(value, 0.0, LN2), dtype=np.float64)


def jsd_from_logits(
    logits_p: npt.ArrayLike, logits_q: npt.ArrayLike, axis: int = -1
) -> npt.NDArray[np.float64]:
    """JSD between the softmaxes of two logit arrays (the exact path)."""

    def softmax(x: npt.ArrayLike) -> npt.NDArray[np.float64]:
        z = np.asarray(x, dtype=np.float64)
        z = z - z.max(axis=axis, keepdims=True)
        e = np.exp(z)
        return np.asarray(e / e.sum(axis=axis, keepdims=True), dtype=np.float64)

    return jsd(softmax(logits_p), softmax(logits_q), axis=axis)


class BucketedJSD(NamedTuple):
    """JSD over the shared known tokens plus one leftover bucket, with its upper bound."""

    value: float  # JSD_S: a lower bound of the true JSD
    upper: float  # JSD_S + 0.5 * (tail_p + tail_q) * ln 2, at most ln 2
    tail_p: float  # 1 - P(S)
    tail_q: float  # 1 - Q(S)


def bucketed_jsd(p_known: npt.ArrayLike, q_known: npt.ArrayLike) -> BucketedJSD:
    """JSD of ``(p_S, 1 - P(S))`` against ``(q_S, 1 - Q(S))``, and its upper bound.

    ``p_known`` and ``q_known`` are the probabilities of the same tokens ``S``.
    """
    ps = np.clip(np.asarray(p_known, dtype=np.float64), 0.0, _PROB_MAX)
    qs = np.clip(np.asarray(q_known, dtype=np.float64), 0.0, _PROB_MAX)
    if ps.shape != qs.shape or ps.ndim != 1:
        raise ValueError(f"p and q must be aligned 1-d vectors, got {ps.shape} and {qs.shape}")
    tail_p = max(0.0, 1.0 - float(ps.sum()))
    tail_q = max(0.0, 1.0 - float(qs.sum()))
    value = float(jsd(np.append(ps, tail_p), np.append(qs, tail_q)))
    upper = min(LN2, value + 0.5 * (tail_p + tail_q) * LN2)
    return BucketedJSD(value, upper, tail_p, tail_q)


def bucketed_jsd_from_logprobs(
    top_p: Mapping[int, float], top_q: Mapping[int, float]
) -> BucketedJSD:
    """``bucketed_jsd`` from two ``{token_id: logprob}`` maps (e.g. vLLM prompt_logprobs).

    ``S`` is the set of tokens present in both maps; every other token is in the bucket.
    """
    shared = sorted(set(top_p) & set(top_q))
    p = np.exp(np.array([top_p[t] for t in shared], dtype=np.float64))
    q = np.exp(np.array([top_q[t] for t in shared], dtype=np.float64))
    return bucketed_jsd(p, q)
