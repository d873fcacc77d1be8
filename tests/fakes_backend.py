"""A scripted, vLLM-shaped fake behind the `Backend` seam, for unit tests.

Its "tokenizer" maps every character to its code point, and its "chat template"
renders `\\x01role\\ncontent\\x02` per message plus `\\x01assistant\\n`, with `\\x02`
(id 2) as the end-of-turn token that ends every completion. That template is
prefix-preserving, so multi-turn conversations stitch exactly unless a test makes them
drift on purpose.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from turnstile.errors import BackendError, BackendTimeout, BackendUnreachable

EOT = 2


def render(messages: list[dict[str, Any]]) -> str:
    out = []
    for m in messages:
        content = m.get("content") or ""
        if m.get("tool_calls"):
            content += orjson.dumps(m["tool_calls"], option=orjson.OPT_SORT_KEYS).decode()
        out.append(f"\x01{m['role']}\n{content}\x02")
    return "".join(out) + "\x01assistant\n"


def ids_of(text: str) -> list[int]:
    return [ord(c) for c in text]


def logprob(position: int) -> float:
    return -0.125 * (position % 7 + 1)


@dataclass
class Reply:
    """What the fake answers to one request."""

    text: str = "hello"
    status: int = 200
    error_body: bytes | None = None
    fail: str | None = None  # "unreachable", "timeout" before the response
    die_after_events: int | None = None  # stream: backend dies after this many events
    event_delay_s: float = 0.0
    finish_reason: str = "stop"
    no_token_ids: bool = False  # behave like a backend that returns no IDs
    tool_calls: list[dict[str, Any]] | None = None


@dataclass
class FakeResponse:
    status: int
    headers: Mapping[str, str]
    body: list[bytes]
    die_after: int | None = None
    delay_s: float = 0.0
    closed: bool = False
    sent: int = 0
    served_by: str | None = None
    failover_from: str | None = None

    async def read(self) -> bytes:
        return b"".join([c async for c in self.iter_chunks()])

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        for i, chunk in enumerate(self.body):
            if self.die_after is not None and i >= self.die_after:
                raise BackendError("backend connection failed mid-response: reset by peer")
            if self.closed:
                return
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            self.sent += 1
            yield chunk

    def close(self) -> None:
        self.closed = True


@dataclass
class FakeVLLM:
    """Answers chat and completions like vLLM 0.32 with `return_token_ids`."""

    script: Callable[[dict[str, Any]], Reply] = field(default=lambda body: Reply())
    base_url: str = "http://fake-vllm"
    requests: list[tuple[str, str, dict[str, Any] | None, dict[str, str]]] = field(
        default_factory=list
    )
    responses: list[FakeResponse] = field(default_factory=list)
    closed: bool = False

    async def request(
        self, method: str, path: str, body: bytes | None, headers: Mapping[str, str]
    ) -> FakeResponse:
        parsed = orjson.loads(body) if body else None
        self.requests.append((method, path, parsed, dict(headers)))
        if path == "/v1/models":
            data = {"object": "list", "data": [{"id": "fake-model", "root": "/models/fake"}]}
            return self._keep(
                FakeResponse(200, {"Content-Type": "application/json"}, [orjson.dumps(data)])
            )
        if path not in ("/v1/chat/completions", "/v1/completions"):
            return self._keep(
                FakeResponse(
                    200,
                    {"Content-Type": "application/json"},
                    [orjson.dumps({"path": path, "method": method})],
                )
            )
        assert parsed is not None
        reply = self.script(parsed)
        if reply.fail == "unreachable":
            raise BackendUnreachable(f"backend {self.base_url} is unreachable: refused")
        if reply.fail == "timeout":
            raise BackendTimeout(f"backend {self.base_url} did not answer within 1 s")
        if reply.status >= 400:
            body_bytes = reply.error_body or orjson.dumps(
                {
                    "error": {
                        "message": "bad thing",
                        "type": "BadRequestError",
                        "param": None,
                        "code": reply.status,
                    }
                }
            )
            return self._keep(
                FakeResponse(reply.status, {"Content-Type": "application/json"}, [body_bytes])
            )
        chat = path == "/v1/chat/completions"
        if chat:
            prompt_text = render(parsed["messages"])
        else:
            prompt = parsed["prompt"]
            prompt_text = prompt if isinstance(prompt, str) else "".join(map(chr, prompt))
        n = int(parsed.get("n") or 1)
        if parsed.get("stream"):
            events = self._stream(parsed, reply, prompt_text, n, chat)
            return self._keep(
                FakeResponse(
                    200,
                    {"Content-Type": "text/event-stream; charset=utf-8"},
                    events,
                    die_after=reply.die_after_events,
                    delay_s=reply.event_delay_s,
                )
            )
        return self._keep(
            FakeResponse(
                200,
                {"Content-Type": "application/json"},
                [orjson.dumps(self._whole(parsed, reply, prompt_text, n, chat))],
            )
        )

    async def aclose(self) -> None:
        self.closed = True

    def _keep(self, resp: FakeResponse) -> FakeResponse:
        self.responses.append(resp)
        return resp

    @staticmethod
    def completion_ids(reply: Reply, choice: int) -> list[int]:
        text = reply.text if choice == 0 else f"{reply.text} #{choice}"
        return [*ids_of(text), EOT]

    def _whole(
        self, body: dict[str, Any], reply: Reply, prompt_text: str, n: int, chat: bool
    ) -> dict[str, Any]:
        want_ids = body.get("return_token_ids") and not reply.no_token_ids
        choices = []
        for c in range(n):
            ids = self.completion_ids(reply, c)
            text = "".join(map(chr, ids[:-1]))
            choice: dict[str, Any] = {
                "index": c,
                "finish_reason": reply.finish_reason,
                "stop_reason": None,
            }
            if chat:
                message: dict[str, Any] = {
                    "role": "assistant",
                    "content": text,
                    "reasoning": None,
                    "tool_calls": [],
                }
                if reply.tool_calls:
                    message["tool_calls"] = reply.tool_calls
                choice["message"] = message
                choice["logprobs"] = (
                    {
                        "content": [
                            {
                                "token": chr(t),
                                "logprob": logprob(i),
                                "bytes": [t],
                                "top_logprobs": self._tops_chat(body, t, i),
                            }
                            for i, t in enumerate(ids)
                        ]
                    }
                    if body.get("logprobs")
                    else None
                )
            else:
                choice["text"] = text
                choice["logprobs"] = (
                    {
                        "text_offset": list(range(len(ids))),
                        "token_logprobs": [logprob(i) for i in range(len(ids))],
                        "tokens": [chr(t) for t in ids],
                        "top_logprobs": [
                            self._tops_completion(body, t, i) for i, t in enumerate(ids)
                        ],
                    }
                    if body.get("logprobs") is not None
                    else None
                )
                choice["prompt_token_ids"] = ids_of(prompt_text) if want_ids else None
            choice["token_ids"] = ids if want_ids else None
            choices.append(choice)
        out: dict[str, Any] = {
            "id": "chatcmpl-fake",
            "object": "chat.completion" if chat else "text_completion",
            "created": 1,
            "model": body.get("model", "fake-model"),
            "choices": choices,
            "usage": {"prompt_tokens": len(prompt_text), "completion_tokens": 0},
        }
        if chat:
            out["prompt_token_ids"] = ids_of(prompt_text) if want_ids else None
        return out

    @staticmethod
    def _tops_chat(body: dict[str, Any], token: int, pos: int) -> list[dict[str, Any]]:
        k = int(body.get("top_logprobs") or 0)
        as_ids = body.get("return_tokens_as_token_ids")
        name = (lambda t: f"token_id:{t}") if as_ids else chr
        return [{"token": name(token + j), "logprob": logprob(pos) - j} for j in range(k)]

    @staticmethod
    def _tops_completion(body: dict[str, Any], token: int, pos: int) -> dict[str, float]:
        k = int(body.get("logprobs") or 0)
        as_ids = body.get("return_tokens_as_token_ids")
        name = (lambda t: f"token_id:{t}") if as_ids else chr
        return {name(token + j): logprob(pos) - j for j in range(max(k, 1))}

    def _stream(
        self, body: dict[str, Any], reply: Reply, prompt_text: str, n: int, chat: bool
    ) -> list[bytes]:
        whole = self._whole(body, reply, prompt_text, n, chat)
        want_ids = body.get("return_token_ids") and not reply.no_token_ids
        events: list[dict[str, Any]] = []
        head: dict[str, Any] = {
            "id": "chatcmpl-fake",
            "object": "chat.completion.chunk",
            "model": whole["model"],
            "choices": [],
        }
        if chat:
            first = dict(
                head,
                choices=[
                    {
                        "index": c,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                    for c in range(n)
                ],
            )
            first["prompt_token_ids"] = whole["prompt_token_ids"]  # null unless asked
            events.append(first)
        for c, choice in enumerate(whole["choices"]):
            ids = self.completion_ids(reply, c)
            for i, t in enumerate(ids):
                last = i == len(ids) - 1
                piece = "" if t == EOT else chr(t)
                ch: dict[str, Any] = {
                    "index": c,
                    "finish_reason": reply.finish_reason if last else None,
                }
                if chat:
                    ch["delta"] = {"content": piece}
                    lp = choice["logprobs"]
                    ch["logprobs"] = {"content": [lp["content"][i]]} if lp else None
                else:
                    ch["text"] = piece
                    lp = choice["logprobs"]
                    ch["logprobs"] = (
                        {
                            "text_offset": [i],
                            "token_logprobs": [lp["token_logprobs"][i]],
                            "tokens": [lp["tokens"][i]],
                            "top_logprobs": [lp["top_logprobs"][i]],
                        }
                        if lp
                        else None
                    )
                    ch["prompt_token_ids"] = choice["prompt_token_ids"] if i == 0 else None
                ch["token_ids"] = [t] if want_ids else None  # vLLM writes null
                if last:
                    ch["stop_reason"] = None
                events.append(dict(head, choices=[ch]))
        raw = [b"data: " + orjson.dumps(e) + b"\n\n" for e in events]
        raw.append(b"data: [DONE]\n\n")
        return raw
