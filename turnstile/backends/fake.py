"""A vLLM-shaped fake backend in process, and the builders of vLLM's answers it is made of.

The builders write the JSON objects vLLM 0.32 returns when asked for token IDs and
logprobs (`chat.completion`, `chat.completion.chunk`, `text_completion`, the model list)
and their SSE framing; fields a request did not ask for are `null`, as in vLLM. The
bench's HTTP fake (`turnstile.bench.backend`) and the drift corpus's simulated model
(`turnstile.dev.drift`) build their answers with them too.

`FakeVLLM` implements `turnstile.backends.protocol.Backend` without a socket: a script
(`Reply` per request) decides what it answers. Its "tokenizer" maps every character to
its code point, and its "chat template" renders `\\x01role\\ncontent\\x02` per message plus
`\\x01assistant\\n`, with `\\x02` (id 2) as the end-of-turn token that ends every
completion. That template is prefix-preserving, so multi-turn conversations stitch
exactly unless a test makes them drift on purpose. `FakeResponse` is the in-memory
`BackendResponse` it returns.
"""

from __future__ import annotations

import asyncio
import base64
import struct
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import orjson

from turnstile.errors import BackendError, BackendTimeout, BackendUnreachable

__all__ = [
    "EOT",
    "JSON_HEADERS",
    "SSE_DONE",
    "SSE_HEADERS",
    "FakeResponse",
    "FakeVLLM",
    "Reply",
    "chat_choice",
    "chat_completion",
    "chat_message",
    "chat_role_chunk",
    "chat_token_chunk",
    "completion_choice",
    "completion_chunk",
    "completion_logprobs",
    "ids_of",
    "logprob",
    "logprob_entry",
    "model_list",
    "render",
    "sse_event",
    "text_completion",
    "usage",
]

# The end-of-turn token of `FakeVLLM`'s chat template (its text is "\x02").
EOT: Final[int] = 2
SSE_DONE: Final[bytes] = b"data: [DONE]\n\n"
JSON_HEADERS: Final[Mapping[str, str]] = {"Content-Type": "application/json"}
SSE_HEADERS: Final[Mapping[str, str]] = {"Content-Type": "text/event-stream; charset=utf-8"}
# Top-k alternatives of `FakeVLLM`'s completions logprobs: at least this many.
MIN_COMPLETION_TOP_LOGPROBS: Final[int] = 1


# -- vLLM's answers ------------------------------------------------------------------------
def sse_event(obj: object) -> bytes:
    """One server-sent event carrying `obj` as JSON."""
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def model_list(model_id: str, root: str) -> dict[str, Any]:
    """`GET /v1/models` with one model."""
    return {"object": "list", "data": [{"id": model_id, "object": "model", "root": root}]}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": None,
    }


def logprob_entry(
    token: str,
    value: float,
    top: Sequence[tuple[str, float]] = (),
    token_bytes: list[int] | None = None,
) -> dict[str, Any]:
    """One sampled token of a chat answer's `logprobs.content`, with its alternatives."""
    return {
        "token": token,
        "logprob": value,
        "bytes": token_bytes,
        "top_logprobs": [{"token": t, "logprob": lp, "bytes": None} for t, lp in top],
    }


def chat_message(
    content: str, tool_calls: list[dict[str, Any]] | None = None, reasoning: str | None = None
) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": content,
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "tool_calls": tool_calls or [],
        "reasoning": reasoning,
    }


def chat_choice(
    index: int,
    message: dict[str, Any],
    content_logprobs: list[dict[str, Any]] | None,
    finish_reason: str,
    token_ids: list[int] | None,
    stop_reason: int | str | None = None,
) -> dict[str, Any]:
    return {
        "index": index,
        "message": message,
        "logprobs": None if content_logprobs is None else {"content": content_logprobs},
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
        "token_ids": token_ids,
    }


def chat_completion(
    completion_id: str,
    model: str,
    choices: list[dict[str, Any]],
    token_usage: dict[str, Any],
    prompt_token_ids: list[int] | None,
    system_fingerprint: str | None = None,
) -> dict[str, Any]:
    """A whole `chat.completion`: `prompt_token_ids` is null unless token IDs were asked for."""
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": 1,
        "model": model,
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": system_fingerprint,
        "usage": token_usage,
        "prompt_logprobs": None,
        "prompt_token_ids": prompt_token_ids,
        "kv_transfer_params": None,
    }


def _chunk(completion_id: str, model: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "id": completion_id,
        "object": "chat.completion.chunk",
        "created": 1,
        "model": model,
        "choices": choices,
    }


def chat_role_chunk(
    completion_id: str, model: str, n: int, prompt_token_ids: list[int] | None
) -> dict[str, Any]:
    """A chat stream's first chunk: the role of every choice, and the prompt's token IDs."""
    choices = [
        {
            "index": c,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        for c in range(n)
    ]
    return dict(_chunk(completion_id, model, choices), prompt_token_ids=prompt_token_ids)


def chat_token_chunk(
    completion_id: str,
    model: str,
    index: int,
    piece: str,
    entry: dict[str, Any] | None,
    token_id: int | None,
    finish_reason: str | None,
    stop_reason: int | str | None = None,
) -> dict[str, Any]:
    """One sampled token of choice `index`: its text, logprob entry and id (null unless
    asked for); the last token of a choice carries its `finish_reason` and `stop_reason`."""
    choice: dict[str, Any] = {
        "index": index,
        "delta": {"content": piece},
        "logprobs": None if entry is None else {"content": [entry]},
        "finish_reason": finish_reason,
        "token_ids": None if token_id is None else [token_id],
    }
    if finish_reason is not None:
        choice["stop_reason"] = stop_reason
    return _chunk(completion_id, model, [choice])


def completion_logprobs(
    tokens: list[str],
    token_logprobs: list[float],
    top_logprobs: list[dict[str, float]],
    text_offset: list[int],
) -> dict[str, Any]:
    """The `logprobs` of a `text_completion` choice (or of one streamed token)."""
    return {
        "text_offset": text_offset,
        "token_logprobs": token_logprobs,
        "tokens": tokens,
        "top_logprobs": top_logprobs,
    }


def completion_choice(
    index: int,
    text: str,
    logprobs: dict[str, Any] | None,
    finish_reason: str | None,
    token_ids: list[int] | None,
    prompt_token_ids: list[int] | None,
    stop_reason: int | str | None = None,
) -> dict[str, Any]:
    """A `text_completion` choice: whole, or one streamed token (`finish_reason` on the last)."""
    return {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
        "prompt_token_ids": prompt_token_ids,
        "token_ids": token_ids,
    }


def text_completion(
    completion_id: str,
    model: str,
    choices: list[dict[str, Any]],
    token_usage: dict[str, Any],
) -> dict[str, Any]:
    return {
        "id": completion_id,
        "object": "text_completion",
        "created": 1,
        "model": model,
        "choices": choices,
        "usage": token_usage,
    }


def completion_chunk(completion_id: str, model: str, choice: dict[str, Any]) -> dict[str, Any]:
    """One event of a `/v1/completions` stream."""
    return {
        "id": completion_id,
        "object": "text_completion",
        "created": 1,
        "model": model,
        "choices": [choice],
    }


# -- the in-process fake ---------------------------------------------------------------------
# The fake's image placeholders (private-use characters, so one token each): an image is
# its start mark, one image token per 28x28 patch of a PNG (4 for any other image), and
# its end mark, as Qwen2-VL lays them out.
FAKE_IMAGE_TOKEN_ID: Final[int] = 0xE000
FAKE_VISION_START_ID: Final[int] = 0xE001
FAKE_VISION_END_ID: Final[int] = 0xE002
FAKE_IMAGE_PATCH: Final[int] = 28
_PNG_SIZE_AT: Final[int] = 16  # width and height in a PNG's IHDR chunk


def fake_image_tokens(url: str) -> int:
    """How many image tokens the fake gives the image at `url` (a data URL)."""
    _, _, payload = url.partition(",")
    try:
        data = base64.b64decode(payload[:64], validate=False)
    except ValueError:
        return 4
    if not data.startswith(b"\x89PNG") or len(data) < _PNG_SIZE_AT + 8:
        return 4
    width, height = (int(v) for v in struct.unpack(">II", data[_PNG_SIZE_AT : _PNG_SIZE_AT + 8]))
    return max(1, -(-width // FAKE_IMAGE_PATCH)) * max(1, -(-height // FAKE_IMAGE_PATCH))


def _content_text(content: Any) -> str:
    """A message's content as the fake's template renders it: text parts as they are,
    image parts as their placeholders."""
    if not isinstance(content, list):
        return str(content or "")
    out = []
    for part in content:
        if part.get("type") == "image_url":
            image = part["image_url"]
            url = image["url"] if isinstance(image, dict) else image
            out.append(
                chr(FAKE_VISION_START_ID)
                + chr(FAKE_IMAGE_TOKEN_ID) * fake_image_tokens(url)
                + chr(FAKE_VISION_END_ID)
            )
        else:
            out.append(str(part.get("text", "")))
    return "".join(out)


def render(messages: list[dict[str, Any]]) -> str:
    """`FakeVLLM`'s chat template (tool calls as sorted JSON after the content)."""
    out = []
    for m in messages:
        content = _content_text(m.get("content"))
        if m.get("tool_calls"):
            content += orjson.dumps(m["tool_calls"], option=orjson.OPT_SORT_KEYS).decode()
        out.append(f"\x01{m['role']}\n{content}\x02")
    return "".join(out) + "\x01assistant\n"


def ids_of(text: str) -> list[int]:
    """`FakeVLLM`'s tokenizer: one token per character, its code point."""
    return [ord(c) for c in text]


def logprob(position: int) -> float:
    """The logprob `FakeVLLM` samples the token at `position` of a completion with."""
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
    # what stopped it, as vLLM says: a stop token's id, a stop string, or None (EOS)
    stop_reason: int | str | None = None
    no_token_ids: bool = False  # behave like a backend that returns no IDs
    tool_calls: list[dict[str, Any]] | None = None  # streamed after the text, one per chunk
    reasoning: str | None = None  # streamed before the text, a character per chunk
    whole_delay_s: float = 0.0  # a whole answer: seconds before its body arrives


@dataclass
class FakeResponse:
    """An answer held in memory; a stream can stall between chunks or die mid-way."""

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


def _default_script(body: dict[str, Any]) -> Reply:
    return Reply()


@dataclass
class FakeVLLM:
    """Answers chat and completions like vLLM 0.32 with `return_token_ids`."""

    script: Callable[[dict[str, Any]], Reply] = _default_script
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
            models = orjson.dumps(model_list("fake-model", "/models/fake"))
            return self._keep(FakeResponse(200, JSON_HEADERS, [models]))
        if path == "/tokenize" and isinstance(parsed, dict) and "messages" in parsed:
            count = len(ids_of(render(parsed["messages"])))
            answer = {"count": count, "max_model_len": 2048, "tokens": [], "token_strs": None}
            return self._keep(FakeResponse(200, JSON_HEADERS, [orjson.dumps(answer)]))
        if path not in ("/v1/chat/completions", "/v1/completions"):
            echo = orjson.dumps({"path": path, "method": method})
            return self._keep(FakeResponse(200, JSON_HEADERS, [echo]))
        if not isinstance(parsed, dict):
            raise BackendError(f"the fake backend got no JSON object for {path}")
        reply = self.script(parsed)
        if reply.fail == "unreachable":
            raise BackendUnreachable(f"backend {self.base_url} is unreachable: refused")
        if reply.fail == "timeout":
            raise BackendTimeout(f"backend {self.base_url} did not answer within 1 s")
        if reply.status >= 400:
            error = {
                "error": {
                    "message": "bad thing",
                    "type": "BadRequestError",
                    "param": None,
                    "code": reply.status,
                }
            }
            body_bytes = reply.error_body or orjson.dumps(error)
            return self._keep(FakeResponse(reply.status, JSON_HEADERS, [body_bytes]))
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
                    SSE_HEADERS,
                    events,
                    die_after=reply.die_after_events,
                    delay_s=reply.event_delay_s,
                )
            )
        whole = self._whole(parsed, reply, prompt_text, n, chat)
        return self._keep(
            FakeResponse(200, JSON_HEADERS, [orjson.dumps(whole)], delay_s=reply.whole_delay_s)
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

    @staticmethod
    def _wants_ids(body: dict[str, Any], reply: Reply) -> bool:
        return bool(body.get("return_token_ids")) and not reply.no_token_ids

    @staticmethod
    def _token_name(body: dict[str, Any]) -> Callable[[int], str]:
        if body.get("return_tokens_as_token_ids"):
            return lambda t: f"token_id:{t}"
        return chr

    def _chat_entries(self, body: dict[str, Any], ids: list[int]) -> list[dict[str, Any]] | None:
        if not body.get("logprobs"):
            return None
        k = int(body.get("top_logprobs") or 0)
        name = self._token_name(body)
        return [
            logprob_entry(
                chr(t), logprob(i), [(name(t + j), logprob(i) - j) for j in range(k)], [t]
            )
            for i, t in enumerate(ids)
        ]

    def _completion_logprobs(self, body: dict[str, Any], ids: list[int]) -> dict[str, Any] | None:
        if body.get("logprobs") is None:
            return None
        k = max(int(body.get("logprobs") or 0), MIN_COMPLETION_TOP_LOGPROBS)
        name = self._token_name(body)
        return completion_logprobs(
            [chr(t) for t in ids],
            [logprob(i) for i in range(len(ids))],
            [{name(t + j): logprob(i) - j for j in range(k)} for i, t in enumerate(ids)],
            list(range(len(ids))),
        )

    def _whole(
        self, body: dict[str, Any], reply: Reply, prompt_text: str, n: int, chat: bool
    ) -> dict[str, Any]:
        want_ids = self._wants_ids(body, reply)
        model = str(body.get("model", "fake-model"))
        prompt_ids = ids_of(prompt_text) if want_ids else None
        choices = []
        completion_tokens = 0
        for c in range(n):
            ids = self.completion_ids(reply, c)
            completion_tokens += len(ids)
            text = "".join(map(chr, ids[:-1]))
            token_ids = ids if want_ids else None
            if chat:
                message = chat_message(text, reply.tool_calls, reply.reasoning)
                entries = self._chat_entries(body, ids)
                choices.append(
                    chat_choice(
                        c, message, entries, reply.finish_reason, token_ids, reply.stop_reason
                    )
                )
            else:
                lp = self._completion_logprobs(body, ids)
                choices.append(
                    completion_choice(
                        c, text, lp, reply.finish_reason, token_ids, prompt_ids, reply.stop_reason
                    )
                )
        token_usage = usage(len(prompt_text), completion_tokens)
        if chat:
            return chat_completion("chatcmpl-fake", model, choices, token_usage, prompt_ids)
        return text_completion("cmpl-fake", model, choices, token_usage)

    def _stream(
        self, body: dict[str, Any], reply: Reply, prompt_text: str, n: int, chat: bool
    ) -> list[bytes]:
        want_ids = self._wants_ids(body, reply)
        model = str(body.get("model", "fake-model"))
        prompt_ids = ids_of(prompt_text) if want_ids else None
        events: list[dict[str, Any]] = []
        if chat:
            events.append(chat_role_chunk("chatcmpl-fake", model, n, prompt_ids))
            for piece in reply.reasoning or "":
                events.append(_delta_chunk(model, {"reasoning": piece}))
        for c in range(n):
            ids = self.completion_ids(reply, c)
            entries = self._chat_entries(body, ids) if chat else None
            lp = None if chat else self._completion_logprobs(body, ids)
            for i, t in enumerate(ids):
                finish = reply.finish_reason if i == len(ids) - 1 else None
                stop = reply.stop_reason if finish is not None else None
                piece = "" if t == EOT else chr(t)
                token_id = t if want_ids else None
                if chat:
                    if t == EOT and reply.tool_calls:
                        events.extend(_tool_call_chunks(model, reply.tool_calls))
                    entry = None if entries is None else entries[i]
                    events.append(
                        chat_token_chunk(
                            "chatcmpl-fake", model, c, piece, entry, token_id, finish, stop
                        )
                    )
                    continue
                one = None
                if lp is not None:
                    one = completion_logprobs(
                        [lp["tokens"][i]],
                        [lp["token_logprobs"][i]],
                        [lp["top_logprobs"][i]],
                        [i],
                    )
                first_ids = prompt_ids if i == 0 else None
                choice = completion_choice(
                    c,
                    piece,
                    one,
                    finish,
                    None if token_id is None else [token_id],
                    first_ids,
                    stop,
                )
                events.append(completion_chunk("cmpl-fake", model, choice))
        options = body.get("stream_options")
        if isinstance(options, dict) and options.get("include_usage"):
            completion_tokens = sum(len(self.completion_ids(reply, c)) for c in range(n))
            usage_chunk = _chunk("chatcmpl-fake" if chat else "cmpl-fake", model, [])
            if not chat:
                usage_chunk["object"] = "text_completion"
            usage_chunk["usage"] = usage(len(prompt_text), completion_tokens)
            events.append(usage_chunk)
        return [*(sse_event(e) for e in events), SSE_DONE]


def _delta_chunk(model: str, delta: dict[str, Any]) -> dict[str, Any]:
    """A chat chunk of choice 0 carrying `delta` and no token (reasoning, tool calls)."""
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
    return _chunk("chatcmpl-fake", model, [choice])


def _tool_call_chunks(model: str, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """vLLM's tool-call deltas: the id and name first, then the arguments in two pieces."""
    chunks = []
    for index, call in enumerate(calls):
        fn = call["function"]
        head = {"index": index, "id": call["id"], "type": "function"}
        head["function"] = {"name": fn["name"], "arguments": ""}
        chunks.append(_delta_chunk(model, {"tool_calls": [head]}))
        half = len(fn["arguments"]) // 2
        for piece in (fn["arguments"][:half], fn["arguments"][half:]):
            part = {"index": index, "function": {"arguments": piece}}
            chunks.append(_delta_chunk(model, {"tool_calls": [part]}))
    return chunks
