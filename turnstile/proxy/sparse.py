"""Decodes only the recorded fields of a whole (non-streaming) backend response.

A vLLM answer with 2,000 prompt and 500 completion tokens is ~60 KB of JSON, most of
it per-token logprob entries (token text, UTF-8 byte lists, top-k). Decoding all of it
into Python dicts, walking it and freeing it was the largest CPU cost of a
non-streaming call. These msgspec types name only what `turnstile.proxy.capture` records;
msgspec skips everything else without building objects for it. The client still gets
the backend's bytes unchanged. A body that does not fit these types (a backend that
writes something unexpected) raises `msgspec.DecodeError` (or its subclass
`ValidationError`), and the caller falls back to a full decode. Token ids and choice
indices are bounded here as they are decoded (in C, at no cost to a good answer): one out
of range makes the body not fit, and the full decode's checks
(`turnstile.proxy.capture.checked_ids`) name it.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from turnstile.limits import MAX_CHOICE_INDEX, MAX_TOKEN_ID

TokenId = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKEN_ID)]
ChoiceIndex = Annotated[int, msgspec.Meta(ge=0, le=MAX_CHOICE_INDEX)]


class TopEntry(msgspec.Struct):
    token: Any = None
    logprob: Any = None


class TokenEntry(msgspec.Struct):
    logprob: Any = None
    top_logprobs: list[TopEntry] | None = None


class Logprobs(msgspec.Struct):
    content: list[TokenEntry] | None = None  # chat
    token_logprobs: list[Any] | None = None  # completions
    top_logprobs: list[Any] | None = None  # completions: one {token: logprob} per position


class Choice(msgspec.Struct):
    index: ChoiceIndex = 0
    message: Any = None
    text: Any = None
    finish_reason: Any = None
    stop_reason: Any = None
    token_ids: list[TokenId] | None = None
    prompt_token_ids: list[TokenId] | None = None
    logprobs: Logprobs | None = None


class Body(msgspec.Struct):
    model: Any = None
    prompt_token_ids: list[TokenId] | None = None
    usage: Any = None
    choices: list[Choice] | None = None


DECODER = msgspec.json.Decoder(Body)
DecodeError = msgspec.DecodeError
