"""The recorded fields of a whole backend answer, as arrays, straight from its bytes.

`read_answer` gives a whole (non-streaming) chat or completions answer's prompt and
completion token ids (int32 arrays), one behaviour logprob per token (a float32 array),
the top-k ids and values where they are recorded, and the few small fields Turnstile
keeps (model, usage, message, text, finish and stop reasons).

Two implementations give the same values bit for bit (a property test compares them):

- `scan`: the compiled scanner `turnstile.proxy._tokenscan` (built by `pip install` with
  the machine's C compiler), which fills the arrays without making a Python object per
  token. It returns None for any answer that is not exactly the expected shape.
- `decode`: msgspec with types that name only the recorded fields
  (`turnstile.proxy.sparse`), then numpy. Used where the extension is not built, and for
  the answers `scan` declines.

`read_answer` returns None when neither fits (a backend that writes something
unexpected): the caller then decodes the body whole, whose checks name what is wrong.
A logprob that is not finite, or a top-k token id beyond int32, is refused
(`BackendValueError`) as the caller's checks would.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import msgspec
import numpy as np

from turnstile.errors import BackendValueError
from turnstile.limits import MAX_TOKEN_ID
from turnstile.proxy import sparse
from turnstile.records import Float32Array, Int32Array

_tokenscan: ModuleType | None
try:
    import turnstile.proxy._tokenscan as _tokenscan
except ImportError:  # built without a C compiler: `decode` does it all
    _tokenscan = None

COMPILED: bool = _tokenscan is not None
"""Whether the compiled scanner is built and in use."""

_TOKEN_ID_PREFIX = "token_id:"
# Digits a "token_id:N" may have: int32 ids have at most 10.
_MAX_ID_DIGITS = 10
_SPAN_DECODER = msgspec.json.Decoder()
# The kinds of recorded values `_tokenscan.scan` locates (`AnswerTokens.strip`).
RECORDED_IDS = 0
RECORDED_LOGPROBS = 1
# A stream chunk of one token (~300 bytes) decodes as fast with orjson as with the scanner,
# whose Python around it then costs more (3.4 vs 2.6 us a chunk, measured); chunks with a
# prompt's ids (the first) or many tokens are several times faster scanned.
SCAN_CHUNK_MIN_BYTES = 1024
# Logprobs are float32 columns: a double this large or larger rounds to infinity there.
_FLOAT32_OVERFLOW = 2.0**128 - 2.0**103


@dataclass(slots=True)
class ChoiceTokens:
    """One choice's recorded fields; token arrays are None where the answer had none."""

    index: int
    token_ids: Int32Array | None
    prompt_token_ids: Int32Array | None
    logprobs: Float32Array | None  # one per logprobs entry, NaN where none was given
    top_ids: list[list[int]] | None  # rows of "token_id:N" alternatives, when recorded
    top_values: list[list[float]] | None
    message: Any
    text: Any
    finish_reason: Any
    stop_reason: Any


@dataclass(slots=True)
class AnswerTokens:
    """A whole answer's recorded fields."""

    prompt_token_ids: Int32Array | None
    model: Any
    usage: Any
    choices: list[ChoiceTokens]
    # Where the body holds the recorded values (scanned answers only; see `strip`).
    recorded: list[tuple[int, int, int]] | None = None

    def strip(self, body: bytes, token_ids: bool, logprobs: bool) -> bytes | None:
        """`body` with the recorded values the client did not ask for written as `null`,
        as vLLM writes fields it was not asked for; everything else byte for byte. None
        where the answer was not scanned (then decode and strip it whole)."""
        if self.recorded is None:
            return None
        view = memoryview(body)
        out: list[bytes | memoryview] = []
        pos = 0
        for start, end, kind in self.recorded:
            if (kind == RECORDED_IDS and not token_ids) or (
                kind == RECORDED_LOGPROBS and not logprobs
            ):
                out += [view[pos:start], b"null"]
                pos = end
        if not out:
            return body
        out.append(view[pos:])
        return b"".join(out)


def logprob_value(value: Any) -> float:
    """A logprob: a finite number, or NaN where none was given."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return math.nan
    try:
        result = float(value)
    except OverflowError:  # an integer beyond any double
        result = math.inf
    if math.isinf(result):
        raise BackendValueError(f"the backend sent a logprob of {result}: not finite")
    if abs(result) >= _FLOAT32_OVERFLOW:
        raise BackendValueError(f"the backend sent a logprob of {result}: beyond float32")
    return result


def top_token_id(token: Any) -> int | None:
    """The id of a top-k token written as "token_id:N"; None for any other token."""
    if isinstance(token, str) and token.startswith(_TOKEN_ID_PREFIX):
        digits = token[len(_TOKEN_ID_PREFIX) :]
        if not digits.isascii() or not digits.isdigit():
            return None
        if len(digits) > _MAX_ID_DIGITS or int(digits) > MAX_TOKEN_ID:
            raise BackendValueError(
                f"the backend sent top-logprob token id {digits[:24]}: beyond int32"
            )
        return int(digits)
    return None


def read_answer(body: bytes, completions: bool, tokens_as_ids: bool) -> AnswerTokens | None:
    """The recorded fields of `body`, compiled where possible; None where it does not fit."""
    found = scan(body, completions, tokens_as_ids)
    return found if found is not None else decode(body, completions, tokens_as_ids)


# -- compiled ----------------------------------------------------------------------------
def scan(body: bytes, completions: bool, tokens_as_ids: bool) -> AnswerTokens | None:
    """`_tokenscan.scan` as `AnswerTokens`; None where it is not built or declines."""
    if _tokenscan is None:
        return None
    found = _tokenscan.scan(body, completions, tokens_as_ids)
    if found is None:
        return None
    prompt, model, usage, _error, choices, recorded = found
    view = memoryview(body)
    try:
        return AnswerTokens(
            prompt_token_ids=_ids(prompt),
            model=_span(view, model),
            usage=_span(view, usage),
            choices=[_scanned_choice(view, c) for c in choices or ()],
            recorded=recorded,
        )
    except msgspec.DecodeError:  # pragma: no cover - the scanner validated every span
        return None


def scan_chunk(data: bytes, completions: bool, tokens_as_ids: bool) -> ScannedChunk | None:
    """One stream chunk's recorded fields by the compiled scanner (ids, logprobs and top-k
    as buffers, the rest as spans of `data`); None where it is not built, where it
    declines, or where the chunk is small enough for orjson (`SCAN_CHUNK_MIN_BYTES`)."""
    if _tokenscan is None or len(data) < SCAN_CHUNK_MIN_BYTES:
        return None
    found = _tokenscan.scan(data, completions, tokens_as_ids)
    return None if found is None else ScannedChunk(memoryview(data), *found)


@dataclass(slots=True)
class ScannedChunk:
    """`_tokenscan.scan`'s answer for one stream chunk, its spans decoded on demand."""

    view: memoryview
    prompt_token_ids: bytearray | None
    model: str | tuple[int, int] | None
    usage: tuple[int, int] | None
    error: tuple[int, int] | None
    choices: list[tuple[Any, ...]] | None
    recorded: list[tuple[int, int, int]]

    def value(self, span: str | tuple[int, int] | None) -> Any:
        """The JSON value at `span` (None where absent)."""
        return _span(self.view, span)


def _ids(raw: bytearray | None) -> Int32Array | None:
    return None if raw is None else np.frombuffer(raw, dtype=np.int32)


def _span(view: memoryview, span: str | tuple[int, int] | None) -> Any:
    """A value the scanner gave: as it is (None or a str), or decoded from its span."""
    if span is None or isinstance(span, str):
        return span
    return _SPAN_DECODER.decode(view[span[0] : span[1]])


def _scanned_choice(view: memoryview, c: tuple[Any, ...]) -> ChoiceTokens:
    index, ids, prompt, lps, counts, top_ids, top_values, message, _delta, text, fin, stop = c
    rows_ids: list[list[int]] | None = None
    rows_values: list[list[float]] | None = None
    if counts is not None:
        ends = np.cumsum(np.frombuffer(counts, dtype=np.int64)).tolist()
        flat_ids = np.frombuffer(top_ids, dtype=np.int64).tolist()
        flat_values = np.frombuffer(top_values, dtype=np.float64).tolist()
        starts = [0, *ends][:-1]
        rows_ids = [flat_ids[a:b] for a, b in zip(starts, ends, strict=True)]
        rows_values = [flat_values[a:b] for a, b in zip(starts, ends, strict=True)]
    return ChoiceTokens(
        index=index,
        token_ids=_ids(ids),
        prompt_token_ids=_ids(prompt),
        logprobs=None if lps is None else np.frombuffer(lps, dtype=np.float32),
        top_ids=rows_ids,
        top_values=rows_values,
        message=_span(view, message),
        text=_span(view, text),
        finish_reason=_span(view, fin),
        stop_reason=_span(view, stop),
    )


# -- msgspec ------------------------------------------------------------------------------
def decode(body: bytes, completions: bool, tokens_as_ids: bool) -> AnswerTokens | None:
    """The same fields by msgspec and numpy; None where the body does not fit."""
    try:
        parsed = sparse.DECODER.decode(body)
    except sparse.DecodeError:
        return None
    return AnswerTokens(
        prompt_token_ids=_array_ids(parsed.prompt_token_ids),
        model=parsed.model,
        usage=parsed.usage,
        choices=[_decoded_choice(c, completions, tokens_as_ids) for c in parsed.choices or ()],
    )


def _array_ids(ids: list[int] | None) -> Int32Array | None:
    return None if ids is None else np.asarray(ids, dtype=np.int32)


def _decoded_choice(c: sparse.Choice, completions: bool, tokens_as_ids: bool) -> ChoiceTokens:
    values: list[float] | None = None
    rows: tuple[list[list[int]], list[list[float]]] | None = None
    lp = c.logprobs
    if lp is not None and not completions and lp.content:
        values = [logprob_value(e.logprob) for e in lp.content]
        if tokens_as_ids:
            rows = _chat_rows(lp.content)
    elif lp is not None and completions:
        if lp.token_logprobs:
            values = [logprob_value(v) for v in lp.token_logprobs]
        if tokens_as_ids and isinstance(lp.top_logprobs, list):
            rows = _completion_rows(lp.top_logprobs)
    return ChoiceTokens(
        index=c.index,
        token_ids=_array_ids(c.token_ids),
        prompt_token_ids=_array_ids(c.prompt_token_ids),
        logprobs=None if values is None else np.asarray(values, dtype=np.float32),
        top_ids=None if rows is None else rows[0],
        top_values=None if rows is None else rows[1],
        message=c.message,
        text=c.text,
        finish_reason=c.finish_reason,
        stop_reason=c.stop_reason,
    )


def _chat_rows(
    entries: list[sparse.TokenEntry],
) -> tuple[list[list[int]], list[list[float]]] | None:
    ids_rows: list[list[int]] = []
    value_rows: list[list[float]] = []
    for entry in entries:
        if not entry.top_logprobs:
            continue
        ids, values = [], []
        for top in entry.top_logprobs:
            tid = top_token_id(top.token)
            if tid is not None:
                ids.append(tid)
                values.append(logprob_value(top.logprob))
        ids_rows.append(ids)
        value_rows.append(values)
    return (ids_rows, value_rows) if ids_rows else None


def _completion_rows(tops: list[Any]) -> tuple[list[list[int]], list[list[float]]]:
    ids_rows: list[list[int]] = []
    value_rows: list[list[float]] = []
    for top in tops:
        ids, values = [], []
        if isinstance(top, dict):
            for token, value in top.items():
                tid = top_token_id(token)
                if tid is not None:
                    ids.append(tid)
                    values.append(logprob_value(value))
        ids_rows.append(ids)
        value_rows.append(values)
    return ids_rows, value_rows
