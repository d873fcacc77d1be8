"""Decodes only the recorded fields of a whole (non-streaming) backend response.

A vLLM answer with 2,000 prompt and 500 completion tokens is ~60 KB of JSON, most of
it per-token logprob entries (token text, UTF-8 byte lists, top-k). Decoding all of it
into Python dicts, walking it and freeing it was the largest CPU cost of a
non-streaming call. These msgspec types name only what `turnstile.proxy.capture` records;
msgspec skips everything else without building objects for it. The client still gets
the backend's bytes unchanged. A body that does not fit these types (a backend that
writes something unexpected) raises `msgspec.DecodeError` (or its subclass
`ValidationError`), and the caller falls back to a full decode.
"""

from __future__ import annotations

from typing import Any

import msgspec


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
    index: Any = 0
    message: Any = None
    text: Any = None
    finish_reason: Any = None
    stop_reason: Any = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    logprobs: Logprobs | None = None


class Body(msgspec.Struct):
    model: Any = None
    prompt_token_ids: list[int] | None = None
    usage: Any = None
    choices: list[Choice] | None = None


DECODER = msgspec.json.Decoder(Body)
DecodeError = msgspec.DecodeError
