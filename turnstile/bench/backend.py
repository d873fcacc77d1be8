"""A fast vLLM-shaped fake backend for `turnstile bench`.

It answers `POST /v1/chat/completions` as vLLM 0.32 does when asked for token IDs and
logprobs: non-streaming, one JSON body with `prompt_token_ids`, per-choice `token_ids`
and `logprobs.content`; streaming, a first `role` chunk carrying `prompt_token_ids`,
then one SSE event per completion token (its text, id and logprob), the last with the
finish reason, then `data: [DONE]`, in chunked transfer encoding. Tokens are sent back
to back (each event its own write, the event loop free between them) or paced at
`--tokens-per-s`. Fields the request did not ask for are `null`, as in vLLM.

The answers are built with the in-process fake's builders (`turnstile.backends.fake`),
once per request shape, and cached as bytes, so the backend costs a few microseconds
per request and never limits what is measured through it. It is a
plain asyncio Protocol speaking HTTP/1.1 with keep-alive, on loopback only.

    python -m turnstile.bench.backend --port 8001 --prompt-tokens 2000 \\
        --completion-tokens 500 [--tokens-per-s 50]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import signal
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, Final

import orjson

from turnstile.backends.fake import (
    SSE_DONE,
    chat_choice,
    chat_completion,
    chat_message,
    chat_role_chunk,
    chat_token_chunk,
    logprob_entry,
    model_list,
    sse_event,
    usage,
)

# Request heads larger than this are not a benchmark client: drop the connection.
MAX_HEAD_BYTES: Final[int] = 64 * 1024
# Request bodies larger than this likewise (the bench sends a few hundred bytes).
MAX_BODY_BYTES: Final[int] = 8 * 1024 * 1024
# Token ids are drawn below Qwen3's vocabulary size, as a real model's would be.
VOCAB_SIZE: Final[int] = 151_000
LOOPBACK: Final[frozenset[str]] = frozenset({"127.0.0.1", "::1", "localhost"})
MODEL: Final[str] = "bench-model"
COMPLETION_ID: Final[str] = "chatcmpl-bench"
SYSTEM_FINGERPRINT: Final[str] = "vllm-0.32.0-bench"
# Every completion runs to its token budget.
FINISH_REASON: Final[str] = "length"


@dataclass(frozen=True, slots=True)
class Shape:
    """What a request asked for, which decides the bytes of the answer."""

    stream: bool
    token_ids: bool
    logprobs: bool
    top_logprobs: int
    tokens_as_ids: bool


class Corpus:
    """The fixed prompt and completion every answer is made of (seeded, reproducible)."""

    def __init__(self, prompt_tokens: int, completion_tokens: int, seed: int = 0) -> None:
        rng = random.Random(seed)
        self.prompt_ids = [rng.randrange(VOCAB_SIZE) for _ in range(prompt_tokens)]
        self.ids = [rng.randrange(VOCAB_SIZE) for _ in range(completion_tokens)]
        self.logprobs = [-round(rng.random() * 3, 6) for _ in range(completion_tokens)]
        self.pieces = [f" w{t % 9973}" for t in self.ids]
        self._cache: dict[Shape, bytes | list[bytes]] = {}

    def answer(self, shape: Shape) -> bytes | list[bytes]:
        found = self._cache.get(shape)
        if found is None:
            found = self._cache[shape] = self._events(shape) if shape.stream else self._whole(shape)
        return found

    def _entry(self, shape: Shape, i: int) -> dict[str, Any]:
        name = f"token_id:{self.ids[i]}" if shape.tokens_as_ids else self.pieces[i]
        tops = [
            (name if j == 0 else f"token_id:{(self.ids[i] + j) % VOCAB_SIZE}", self.logprobs[i] - j)
            for j in range(shape.top_logprobs)
        ]
        return logprob_entry(name, self.logprobs[i], tops)

    def _whole(self, shape: Shape) -> bytes:
        entries = [self._entry(shape, i) for i in range(len(self.ids))] if shape.logprobs else None
        choice = chat_choice(
            0,
            chat_message("".join(self.pieces)),
            entries,
            FINISH_REASON,
            self.ids if shape.token_ids else None,
        )
        body = chat_completion(
            COMPLETION_ID,
            MODEL,
            [choice],
            usage(len(self.prompt_ids), len(self.ids)),
            self.prompt_ids if shape.token_ids else None,
            SYSTEM_FINGERPRINT,
        )
        data = orjson.dumps(body)
        return _head(200, "application/json", len(data)) + data

    def _events(self, shape: Shape) -> list[bytes]:
        prompt_ids = self.prompt_ids if shape.token_ids else None
        events = [chat_role_chunk(COMPLETION_ID, MODEL, 1, prompt_ids)]
        last = len(self.ids) - 1
        for i, token in enumerate(self.ids):
            events.append(
                chat_token_chunk(
                    COMPLETION_ID,
                    MODEL,
                    0,
                    self.pieces[i],
                    self._entry(shape, i) if shape.logprobs else None,
                    token if shape.token_ids else None,
                    FINISH_REASON if i == last else None,
                )
            )
        out = [_head_chunked(200, "text/event-stream; charset=utf-8")]
        out += [_chunk(sse_event(e)) for e in events]
        out.append(_chunk(SSE_DONE) + b"0\r\n\r\n")
        return out


def _head(status: int, content_type: str, length: int) -> bytes:
    return (
        f"HTTP/1.1 {status} OK\r\ncontent-type: {content_type}\r\ncontent-length: {length}\r\n\r\n"
    ).encode()


def _head_chunked(status: int, content_type: str) -> bytes:
    return (
        f"HTTP/1.1 {status} OK\r\ncontent-type: {content_type}\r\n"
        "transfer-encoding: chunked\r\n\r\n"
    ).encode()


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def _json_answer(status: int, obj: object) -> bytes:
    data = orjson.dumps(obj)
    return _head(status, "application/json", len(data)) + data


def shape_of(body: bytes) -> Shape:
    req = orjson.loads(body) if body else {}
    if not isinstance(req, dict):
        raise ValueError("the body is not a JSON object")
    top = req.get("top_logprobs")
    return Shape(
        stream=bool(req.get("stream")),
        token_ids=bool(req.get("return_token_ids")),
        logprobs=bool(req.get("logprobs")),
        top_logprobs=int(top) if isinstance(top, int) and req.get("logprobs") else 0,
        tokens_as_ids=bool(req.get("return_tokens_as_token_ids")),
    )


class BackendProtocol(asyncio.Protocol):
    """One keep-alive connection: parse a request, answer it, repeat."""

    def __init__(self, corpus: Corpus, tokens_per_s: float) -> None:
        self.corpus = corpus
        self.interval = 1.0 / tokens_per_s if tokens_per_s > 0 else 0.0
        self.buf = bytearray()
        self.transport: asyncio.WriteTransport | None = None
        self.busy = False  # a streamed answer is being written
        self.can_write = asyncio.Event()
        self.can_write.set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no subclass

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.can_write.set()

    def pause_writing(self) -> None:
        self.can_write.clear()

    def resume_writing(self) -> None:
        self.can_write.set()

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if not self.busy:
            self._serve()

    def _serve(self) -> None:
        while self.transport is not None and not self.busy:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buf) > MAX_HEAD_BYTES:
                    self.transport.close()
                return
            head = bytes(self.buf[:end]).decode("latin-1")
            lines = head.split("\r\n")
            method, path, _ = [*lines[0].split(" "), "", ""][:3]
            length = 0
            for line in lines[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value.strip())
            if length > MAX_BODY_BYTES:
                self.transport.close()
                return
            if len(self.buf) < end + 4 + length:
                return
            body = bytes(self.buf[end + 4 : end + 4 + length])
            del self.buf[: end + 4 + length]
            self._answer(method, path.split("?")[0], body)

    def _answer(self, method: str, path: str, body: bytes) -> None:
        assert self.transport is not None
        if method == "GET" and path in ("/health", "/v1/models"):
            models = model_list(MODEL, MODEL)
            self.transport.write(_json_answer(200, models if path == "/v1/models" else {}))
            return
        if method != "POST" or path != "/v1/chat/completions":
            self.transport.write(_json_answer(404, {"error": {"message": "not found"}}))
            return
        try:
            answer = self.corpus.answer(shape_of(body))
        except (ValueError, orjson.JSONDecodeError) as exc:
            self.transport.write(_json_answer(400, {"error": {"message": str(exc)}}))
            return
        if isinstance(answer, bytes):
            self.transport.write(answer)
            return
        self.busy = True
        asyncio.get_running_loop().create_task(self._stream(answer))

    async def _stream(self, events: list[bytes]) -> None:
        loop = asyncio.get_running_loop()
        start = loop.time()
        try:
            for n, event in enumerate(events):
                if self.transport is None:
                    return
                await self.can_write.wait()
                if self.transport is None:
                    return
                self.transport.write(event)
                if self.interval and 1 <= n < len(events) - 1:
                    delay = start + n * self.interval - loop.time()
                    await asyncio.sleep(max(0.0, delay))
                else:
                    await asyncio.sleep(0)
        finally:
            self.busy = False
        if self.buf:
            self._serve()


async def serve(host: str, port: int, corpus: Corpus, tokens_per_s: float) -> None:
    if host not in LOOPBACK:
        raise SystemExit(f"the bench backend listens on loopback only, not {host!r}")
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: BackendProtocol(corpus, tokens_per_s),
        host,
        port,
        backlog=4096,
        reuse_address=True,
    )
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--completion-tokens", type=int, default=500)
    parser.add_argument(
        "--tokens-per-s", type=float, default=0.0, help="pace streamed tokens (0: back to back)"
    )
    args = parser.parse_args(argv)
    if args.prompt_tokens < 1 or args.completion_tokens < 1:
        parser.error("--prompt-tokens and --completion-tokens must be at least 1")
    corpus = Corpus(args.prompt_tokens, args.completion_tokens)
    run_fast(serve(args.host, args.port, corpus, args.tokens_per_s))


def run_fast(coro: Coroutine[Any, Any, None]) -> None:
    """Run `coro` on uvloop where it is installed (as the proxy does), else asyncio."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(coro)
    else:
        uvloop.run(coro)


if __name__ == "__main__":
    main()
