"""Record mode, opt-in: tool-call arguments exactly as the model sampled them.

vLLM's tool parsers re-serialise the arguments a model wrote (``json.dumps``: ``", "`` and
``": "`` separators, non-ASCII kept), so a model that samples compact JSON
(``{"city":"Zürich"}``) gets back ``{"city": "Zürich"}``. A harness that sends that message
back verbatim then sends text the model never wrote. With ``preserve_tool_arguments``
(``--preserve-tool-arguments``) ``PreserveToolArguments`` wraps the backend and, for a
whole (not streamed) chat answer, replaces each tool call's ``arguments`` with the JSON
text the model sampled for it: the object in the decoded completion (its ``token_ids``,
decoded with the served model's tokenizer) that parses to the same value, in order. The
answer the harness gets and the recorded ``response_message_json`` carry it.

That keeps the argument bytes only where the chat template renders a string argument as
given (Hermes-style ``{%- if arguments is string %}{{ arguments }}``) and the server hands
it the string: vLLM parses JSON-string arguments into objects before rendering, so behind
vLLM every template re-serialises them whatever the message says (see docs/tito.md,
"Tool-call arguments"). A call whose sampled text cannot be found keeps the backend's
arguments; streamed answers are relayed as the backend wrote them.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from typing import Any

import orjson

from turnstile.backends.protocol import Backend, BackendResponse

__all__ = ["PreserveToolArguments", "preserve_arguments", "sampled_objects"]

CHAT_PATH = "/v1/chat/completions"
_JSON = "application/json"
_DECODER = json.JSONDecoder()


def sampled_objects(text: str) -> list[tuple[str, Any]]:
    """Every top-level JSON object in ``text`` as written, with its value, in order."""
    found: list[tuple[str, Any]] = []
    at = text.find("{")
    while at >= 0:
        try:
            value, end = _DECODER.raw_decode(text, at)
        except json.JSONDecodeError:
            at = text.find("{", at + 1)
            continue
        found.append((text[at:end], value))
        # Nested objects are candidates too (a call's arguments inside its call object).
        at = text.find("{", at + 1)
    return found


def preserve_arguments(message: dict[str, Any], sampled: str) -> int:
    """Replace the arguments of ``message``'s tool calls with the text ``sampled`` holds
    for them (the first unused object, in order, equal in value); return how many were
    replaced."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list) or not calls:
        return 0
    candidates = sampled_objects(sampled)
    used = 0
    replaced = 0
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
            continue
        try:
            value = json.loads(function["arguments"])
        except json.JSONDecodeError:
            continue
        for index in range(used, len(candidates)):
            raw, candidate = candidates[index]
            if candidate == value and isinstance(value, dict):
                if raw != function["arguments"]:
                    function["arguments"] = raw
                    replaced += 1
                used = index + 1
                break
    return replaced


class _Answer:
    """A whole chat answer, rewritten, with the wrapped response's attributes."""

    def __init__(self, resp: BackendResponse, body: bytes) -> None:
        self._resp, self._body = resp, body
        self.status = resp.status
        self.served_by = resp.served_by
        self.failover_from = resp.failover_from
        self.headers: Mapping[str, str] = {"Content-Type": _JSON}

    async def read(self) -> bytes:
        return self._body

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        yield self._body

    def close(self) -> None:
        self._resp.close()


class PreserveToolArguments:
    """The backend ``inner``, with whole chat answers' tool-call arguments as sampled."""

    kind = "preserve-tool-arguments"

    def __init__(self, inner: Backend, tokenizer: Any) -> None:
        self.inner = inner
        self.tokenizer = tokenizer  # a Hugging Face tokenizer of the served model
        self.base_url = inner.base_url
        self.replaced = 0  # arguments replaced so far (GET /stats)

    async def request(
        self, method: str, path: str, body: bytes | None, headers: Mapping[str, str]
    ) -> BackendResponse:
        resp = await self.inner.request(method, path, body, headers)
        if method != "POST" or path != CHAT_PATH or body is None or resp.status >= 400:
            return resp
        try:
            streamed = orjson.loads(body).get("stream") is True
        except (orjson.JSONDecodeError, AttributeError):
            return resp
        if streamed:
            return resp
        raw = await resp.read()
        return _Answer(resp, self._rewrite(raw))

    def _rewrite(self, raw: bytes) -> bytes:
        try:
            answer = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return raw  # not ours to judge: the proxy reports an unusable answer
        changed = 0
        for choice in answer.get("choices") or () if isinstance(answer, dict) else ():
            message = choice.get("message") if isinstance(choice, dict) else None
            ids = choice.get("token_ids") if isinstance(choice, dict) else None
            if not isinstance(message, dict) or not isinstance(ids, list) or not ids:
                continue
            text = str(self.tokenizer.decode(ids, skip_special_tokens=False))
            changed += preserve_arguments(message, text)
        if not changed:
            return raw
        self.replaced += changed
        return orjson.dumps(answer)

    def forget(self, rollout_id: str) -> None:
        forget = getattr(self.inner, "forget", None)
        if callable(forget):
            forget(rollout_id)

    def stats(self) -> dict[str, Any]:
        inner = getattr(self.inner, "stats", None)
        return {**(inner() if callable(inner) else {}), "tool_arguments_preserved": self.replaced}

    async def aclose(self) -> None:
        await self.inner.aclose()
