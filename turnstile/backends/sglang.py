"""The SGLang adapter: SGLang behind the `Backend` seam, speaking vLLM's dialect upward.

Turnstile's capture (`turnstile.proxy.capture`) asks for vLLM's recording fields
(`return_token_ids`, `logprobs`) and reads vLLM's response shapes. SGLang's OpenAI
server has the same ideas under other names, which this module translates:

- chat: SGLang returns a choice's `token_ids` for `return_token_ids` and its
  `prompt_token_ids` only for `return_prompt_token_ids`; the adapter asks for both.
  Whole responses already carry them per choice, which the capture reads as is.
- chat streams: SGLang's chat chunks carry no token IDs at all. A streamed chat call is
  therefore sent to SGLang's native `/generate` (token IDs in via `input_ids`, prompt
  rendered with the local tokenizer's chat template; token IDs and
  `meta_info.output_token_logprobs` `[logprob, token_id, text]` out) and assembled into
  vLLM-shaped `chat.completion.chunk` events. Where that is not possible (no
  `--tokenizer`, `tools` in the request that SGLang's parser must turn into tool calls,
  `n > 1`), the call is sent whole and its answer restreamed as chunks: exact
  IDs, SGLang's own tool and reasoning parsing, but no token-by-token latency.
- completions: SGLang's `/v1/completions` returns `token_ids` and `prompt_token_ids`
  per choice for `return_token_ids`, streams included; only vLLM-only fields are dropped.
- `return_tokens_as_token_ids` is vLLM-only: it is dropped, so top-k alternatives are not
  recorded as IDs with SGLang.

Everything else (`/v1/models`, `/generate`, `/health`, ...) passes through unchanged.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any, Literal, Protocol

import orjson

from turnstile.backends.protocol import Backend, BackendResponse
from turnstile.errors import BackendError, TurnstileError
from turnstile.proxy.sse import DONE, SSEParser, encode_data

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
GENERATE_PATH = "/generate"
_SSE = "text/event-stream"

log = logging.getLogger("turnstile.sglang")

# vLLM-only request fields SGLang's pydantic models would silently ignore (or reject
# in a strict deployment): dropped before forwarding.
_VLLM_ONLY = ("return_tokens_as_token_ids", "prompt_logprobs", "include_stop_str_in_output")

# Chat sampling fields and their names in SGLang's `/generate` `sampling_params`.
_GENERATE_SAMPLING = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "max_tokens": "max_new_tokens",
    "max_completion_tokens": "max_new_tokens",
    "min_tokens": "min_new_tokens",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty",
    "seed": "sampling_seed",
    "ignore_eos": "ignore_eos",
    "skip_special_tokens": "skip_special_tokens",
    "logit_bias": "logit_bias",
}

StreamMode = Literal["generate", "restream"]


class PromptRenderer(Protocol):
    """What the `/generate` stream needs from the local tokenizer."""

    def render_prompt(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> list[int]: ...


def chat_stream_mode(body: Mapping[str, Any], renderer: PromptRenderer | None) -> StreamMode:
    """How a streamed chat call reaches SGLang (see the module docstring)."""
    if renderer is None or body.get("tools") or int(body.get("n") or 1) != 1:
        return "restream"
    return "generate"


def translate_chat_request(body: dict[str, Any]) -> dict[str, Any]:
    """A vLLM-dialect chat request as SGLang's chat endpoint wants it (a new dict)."""
    out = {k: v for k, v in body.items() if k not in _VLLM_ONLY}
    if out.get("return_token_ids") is True:
        out["return_prompt_token_ids"] = True
    return out


def translate_completions_request(body: dict[str, Any]) -> dict[str, Any]:
    """A vLLM-dialect completions request for SGLang (a new dict)."""
    return {k: v for k, v in body.items() if k not in _VLLM_ONLY}


def generate_request(body: Mapping[str, Any], input_ids: Sequence[int]) -> dict[str, Any]:
    """The `/generate` request that samples what the chat request asks for."""
    params: dict[str, Any] = {}
    for key, name in _GENERATE_SAMPLING.items():
        if body.get(key) is not None:
            params[name] = body[key]
    top = body.get("top_logprobs")
    out: dict[str, Any] = {
        "input_ids": list(input_ids),
        "sampling_params": params,
        "stream": True,
        "return_logprob": True,
        "logprob_start_len": -1,  # logprobs of the output tokens only
        "return_text_in_logprobs": True,
    }
    if isinstance(top, int) and top > 0:
        out["top_logprobs_num"] = top
    return out


def _finish(meta: Mapping[str, Any]) -> tuple[str | None, str | int | None]:
    """SGLang's `meta_info.finish_reason` as vLLM's (finish_reason, stop_reason)."""
    reason = meta.get("finish_reason")
    if reason is None:
        return None, None
    if isinstance(reason, str):
        return reason, None
    if not isinstance(reason, dict):
        return str(reason), None
    kind = str(reason.get("type") or "stop")
    matched = reason.get("matched")
    stop = matched if isinstance(matched, (str, int)) and not isinstance(matched, bool) else None
    return kind, stop


def _token_bytes(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))


def _logprob_entries(triples: Sequence[Any], tops: Sequence[Any] | None) -> list[dict[str, Any]]:
    """`meta_info.output_token_logprobs` entries as chat `logprobs.content` entries."""
    entries = []
    for pos, triple in enumerate(triples):
        if not isinstance(triple, (list, tuple)) or len(triple) < 2:
            raise BackendError(f"SGLang sent a malformed output_token_logprobs entry: {triple!r}")
        text = triple[2] if len(triple) > 2 and isinstance(triple[2], str) else ""
        logprob = triple[0] if isinstance(triple[0], (int, float)) else None
        top_entries = []
        if tops is not None and pos < len(tops) and isinstance(tops[pos], (list, tuple)):
            for alt in tops[pos]:
                if isinstance(alt, (list, tuple)) and len(alt) >= 2:
                    alt_text = alt[2] if len(alt) > 2 and isinstance(alt[2], str) else ""
                    top_entries.append(
                        {"token": alt_text, "logprob": alt[0], "bytes": _token_bytes(alt_text)}
                    )
        entries.append(
            {
                "token": text,
                "logprob": logprob,
                "bytes": _token_bytes(text),
                "top_logprobs": top_entries,
            }
        )
    return entries


class GenerateStreamAssembler:
    """Turns SGLang `/generate` stream events into vLLM-shaped chat chunks.

    SGLang sends either cumulative outputs (the default: every event holds all text,
    `output_ids` and logprobs so far) or deltas (`--incremental-streaming-output`); the
    two are told apart by `meta_info.completion_tokens`, which is always the running
    total: an event whose `output_ids` are all the tokens so far is cumulative.
    """

    def __init__(self, model: str, prompt_ids: Sequence[int], *, include_usage: bool) -> None:
        self.chunk_id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.prompt_ids = list(prompt_ids)
        self.include_usage = include_usage
        self.ids_seen = 0
        self.text_seen = 0
        self.logprobs_seen = 0
        self.finished = False
        self.completion_tokens = 0

    def _chunk(self, choice: dict[str, Any], **top: Any) -> bytes:
        obj = {
            "id": self.chunk_id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            **top,
        }
        return encode_data(orjson.dumps(obj))

    def first(self) -> bytes:
        """The role chunk, carrying the prompt's token IDs as vLLM's first chunk does."""
        delta = {"role": "assistant", "content": ""}
        return self._chunk(
            {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None},
            prompt_token_ids=self.prompt_ids,
        )

    def event(self, obj: Mapping[str, Any]) -> bytes:
        """The chat chunk for one `/generate` event (b"" when it carries nothing new)."""
        meta = obj.get("meta_info")
        meta = meta if isinstance(meta, Mapping) else {}
        ids = obj.get("output_ids")
        if not isinstance(ids, list):
            raise BackendError("SGLang's /generate event has no output_ids")
        total = meta.get("completion_tokens")
        cumulative = not isinstance(total, int) or len(ids) >= total
        new_ids = ids[self.ids_seen :] if cumulative else ids
        text = obj.get("text") if isinstance(obj.get("text"), str) else ""
        assert isinstance(text, str)
        new_text = text[self.text_seen :] if cumulative else text
        triples = meta.get("output_token_logprobs") or []
        tops = meta.get("output_top_logprobs")
        if cumulative:
            new_triples = triples[self.logprobs_seen :]
            new_tops = tops[self.logprobs_seen :] if isinstance(tops, list) else None
        else:
            new_triples, new_tops = triples, tops if isinstance(tops, list) else None
        self.ids_seen += len(new_ids)
        self.text_seen += len(new_text)
        self.logprobs_seen += len(new_triples)
        self.completion_tokens = self.ids_seen
        finish, stop = _finish(meta)
        if not new_ids and finish is None:
            return b""
        choice: dict[str, Any] = {
            "index": 0,
            "delta": {"content": new_text},
            "logprobs": {"content": _logprob_entries(new_triples, new_tops)}
            if new_triples
            else None,
            "finish_reason": finish,
            "stop_reason": stop,
            "token_ids": [int(i) for i in new_ids],
        }
        out = self._chunk(choice)
        if finish is not None:
            self.finished = True
            if self.include_usage:
                out += self.usage()
        return out

    def usage(self) -> bytes:
        usage = {
            "prompt_tokens": len(self.prompt_ids),
            "completion_tokens": self.completion_tokens,
            "total_tokens": len(self.prompt_ids) + self.completion_tokens,
        }
        obj = {
            "id": self.chunk_id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": usage,
        }
        return encode_data(orjson.dumps(obj))


def restream_chunks(whole: Mapping[str, Any], *, include_usage: bool) -> list[bytes]:
    """A whole SGLang chat response as the vLLM-shaped chunks of a stream (no [DONE])."""
    choices = whole.get("choices")
    if not isinstance(choices, list):
        raise BackendError("SGLang's chat response has no choices")
    base = {
        "id": whole.get("id") or f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion.chunk",
        "created": whole.get("created") or int(time.time()),
        "model": whole.get("model") or "",
    }
    out: list[bytes] = []
    prompt_ids: Any = None
    for choice in choices:
        if isinstance(choice, dict) and isinstance(choice.get("prompt_token_ids"), list):
            prompt_ids = choice["prompt_token_ids"]
            break
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        index = choice.get("index", 0)
        role = {
            "index": index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        out.append(
            encode_data(orjson.dumps({**base, "choices": [role], "prompt_token_ids": prompt_ids}))
        )
        message = choice.get("message") if isinstance(choice.get("message"), dict) else {}
        assert isinstance(message, dict)
        delta: dict[str, Any] = {"content": message.get("content") or ""}
        if message.get("reasoning_content"):
            delta["reasoning_content"] = message["reasoning_content"]
        if message.get("tool_calls"):
            delta["tool_calls"] = [
                {**call, "index": pos}
                for pos, call in enumerate(message["tool_calls"])
                if isinstance(call, dict)
            ]
        matched = choice.get("matched_stop")
        body = {
            "index": index,
            "delta": delta,
            "logprobs": choice.get("logprobs"),
            "finish_reason": choice.get("finish_reason"),
            "stop_reason": matched if isinstance(matched, (str, int)) else None,
            "token_ids": choice.get("token_ids"),
        }
        out.append(encode_data(orjson.dumps({**base, "choices": [body]})))
    if include_usage and isinstance(whole.get("usage"), dict):
        out.append(encode_data(orjson.dumps({**base, "choices": [], "usage": whole["usage"]})))
    return out


class _MadeResponse:
    """A response whose body the adapter produces from an upstream response."""

    def __init__(
        self,
        status: int,
        content_type: str,
        chunks: AsyncIterator[bytes],
        upstream: BackendResponse,
    ) -> None:
        self.status = status
        self.headers: Mapping[str, str] = {"Content-Type": content_type}
        self.served_by = upstream.served_by
        self.failover_from = upstream.failover_from
        self._chunks = chunks
        self._upstream = upstream

    async def read(self) -> bytes:
        return b"".join([c async for c in self.iter_chunks()])

    def iter_chunks(self) -> AsyncIterator[bytes]:
        return self._chunks

    def close(self) -> None:
        self._upstream.close()


async def _generate_chunks(
    resp: BackendResponse, assembler: GenerateStreamAssembler
) -> AsyncIterator[bytes]:
    parser = SSEParser()
    yield assembler.first()
    try:
        async for raw in resp.iter_chunks():
            for event in parser.feed(raw):
                data = event.data
                if data is None:
                    continue
                if data.strip() == DONE:
                    if not assembler.finished:
                        raise BackendError("SGLang ended the stream without a finish reason")
                    yield encode_data(DONE)
                    return
                try:
                    obj = orjson.loads(data)
                except orjson.JSONDecodeError as exc:
                    raise BackendError(f"SGLang sent a non-JSON stream event: {exc}") from None
                if not isinstance(obj, dict):
                    raise BackendError("SGLang sent a stream event that is not an object")
                if "error" in obj:
                    yield encode_data(orjson.dumps({"error": obj["error"]}))
                    continue
                piece = assembler.event(obj)
                if piece:
                    yield piece
    finally:
        resp.close()


async def _restreamed(chunks: list[bytes]) -> AsyncIterator[bytes]:
    for chunk in chunks:
        yield chunk
    yield encode_data(DONE)


class SGLangBackend:
    """An SGLang server behind the `Backend` seam (wraps the HTTP client `inner`)."""

    kind = "sglang"

    def __init__(self, inner: Backend, *, renderer: PromptRenderer | None = None) -> None:
        self.inner = inner
        self.base_url = inner.base_url
        self.renderer = renderer

    async def request(
        self, method: str, path: str, body: bytes | None, headers: Mapping[str, str]
    ) -> BackendResponse:
        if method != "POST" or body is None or path not in (CHAT_PATH, COMPLETIONS_PATH):
            return await self.inner.request(method, path, body, headers)
        try:
            req = orjson.loads(body)
        except orjson.JSONDecodeError:
            return await self.inner.request(method, path, body, headers)
        if not isinstance(req, dict):
            return await self.inner.request(method, path, body, headers)
        if path == COMPLETIONS_PATH:
            out = orjson.dumps(translate_completions_request(req))
            return await self.inner.request(method, path, out, headers)
        chat = translate_chat_request(req)
        if chat.get("stream") is not True:
            return await self.inner.request(method, path, orjson.dumps(chat), headers)
        return await self._stream_chat(chat, headers)

    async def _stream_chat(
        self, chat: dict[str, Any], headers: Mapping[str, str]
    ) -> BackendResponse:
        options = chat.get("stream_options")
        include_usage = isinstance(options, dict) and options.get("include_usage") is True
        model = str(chat.get("model") or "")
        if chat_stream_mode(chat, self.renderer) == "generate":
            assert self.renderer is not None
            messages = chat.get("messages")
            if not isinstance(messages, list):
                raise BackendError("a chat request without a messages list")
            input_ids = chat.get("input_ids")
            if not isinstance(input_ids, list):
                input_ids = self.renderer.render_prompt(messages, None)
            gen = orjson.dumps(generate_request(chat, input_ids))
            resp = await self.inner.request("POST", GENERATE_PATH, gen, headers)
            if resp.status >= 400:
                return resp
            assembler = GenerateStreamAssembler(model, input_ids, include_usage=include_usage)
            return _MadeResponse(resp.status, _SSE, _generate_chunks(resp, assembler), resp)
        whole = {k: v for k, v in chat.items() if k not in ("stream", "stream_options")}
        resp = await self.inner.request("POST", CHAT_PATH, orjson.dumps(whole), headers)
        if resp.status >= 400:
            return resp
        try:
            raw = await resp.read()
        except BaseException:
            resp.close()
            raise
        try:
            obj = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            resp.close()
            raise BackendError(f"SGLang's chat response is not JSON: {exc}") from None
        if not isinstance(obj, dict):
            resp.close()
            raise BackendError("SGLang's chat response is not a JSON object")
        chunks = restream_chunks(obj, include_usage=include_usage)
        return _MadeResponse(resp.status, _SSE, _restreamed(chunks), resp)

    async def aclose(self) -> None:
        await self.inner.aclose()


# -- backend kind detection ------------------------------------------------------------
BackendKind = Literal["vllm", "sglang"]


async def detect_kind(backend: Backend) -> BackendKind:
    """Whether `backend` is vLLM or SGLang, from `/v1/models` (`owned_by`).

    SGLang's model cards say `owned_by: "sglang"`, vLLM's say `"vllm"`; anything else
    (or no answer) is treated as vLLM, Turnstile's native dialect.
    """
    try:
        resp = await backend.request("GET", "/v1/models", None, {})
        try:
            raw = await resp.read()
        finally:
            resp.close()
        data = orjson.loads(raw).get("data") or []
    except (TurnstileError, orjson.JSONDecodeError, AttributeError):
        return "vllm"
    owners = {str(m.get("owned_by", "")).lower() for m in data if isinstance(m, dict)}
    return "sglang" if "sglang" in owners else "vllm"


class AutoKindBackend:
    """A backend whose dialect is asked on first use (`--backend-kind auto`)."""

    def __init__(self, inner: Backend, *, renderer: PromptRenderer | None = None) -> None:
        self.inner = inner
        self.base_url = inner.base_url
        self.renderer = renderer
        self.kind: BackendKind | None = None
        self._target: Backend | None = None
        self._lock = asyncio.Lock()

    async def resolve(self) -> Backend:
        """The vLLM client itself or the SGLang adapter over it, detected once."""
        if self._target is None:
            async with self._lock:
                if self._target is None:
                    self.kind = await detect_kind(self.inner)
                    log.info("backend %s speaks %s", self.base_url, self.kind)
                    self._target = (
                        SGLangBackend(self.inner, renderer=self.renderer)
                        if self.kind == "sglang"
                        else self.inner
                    )
        return self._target

    async def request(
        self, method: str, path: str, body: bytes | None, headers: Mapping[str, str]
    ) -> BackendResponse:
        target = await self.resolve()
        return await target.request(method, path, body, headers)

    async def aclose(self) -> None:
        await self.inner.aclose()
