"""Chat Completions request -> token-ID completions request, and the answer back.

TITO sends the prompt as token IDs to the backend's `/v1/completions`; the harness spoke
Chat Completions and must get a Chat Completions answer. `completions_body` maps the chat
request's sampling fields onto a completions request; `ChatAnswer` turns a whole
completions response into a chat response, and `ChatStream` turns completions stream
chunks into chat chunks, parsing content, reasoning and tool calls from the sampled text
(`turnstile.tito.parsers`) and mapping the finish reason as vLLM's chat endpoint does
(`tool_calls` when calls were parsed and sampling stopped normally).

The chat objects keep vLLM 0.32's shapes, including the recording fields (top-level
`prompt_token_ids`, per-choice `token_ids`, `logprobs.content`), so the proxy records and
strips them exactly as it does for a backend's own chat answer.

The prompt ids are the ones TITO sent (`known_prompt`): vLLM 0.32 has no switch that
returns the sampled ids without echoing the prompt's (`return_token_ids` gives both), so
`decode_completion` reads the backend's answers without the echo, which is skipped
unparsed. Only where the backend may have cut the prompt (`truncate_prompt_tokens`) is the
echo read and used (`echo_needed`).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec

from turnstile.errors import Unprocessable
from turnstile.tito.parsers import OutputParser, ParsedDelta, ParsedMessage, finish_reason

__all__ = ["ChatAnswer", "ChatStream", "completions_body", "decode_completion", "echo_needed"]

# Chat request fields that mean the same on /v1/completions and are passed through.
PASSED_FIELDS = (
    "model",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "n",
    "ignore_eos",
    "min_tokens",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "stream",
    "stream_options",
    "user",
    "return_tokens_as_token_ids",
    "priority",
    "structured_outputs",
    "response_format",
    "spaces_between_special_tokens",
    "bad_words",
    "allowed_token_ids",
    "truncate_prompt_tokens",
)
# tool_choice values TITO can honour: it parses the tools the model chose to call. Forcing
# a call ("required" or a named function) needs the backend's guided decoding of chat.
SUPPORTED_TOOL_CHOICES = (None, "auto", "none")


def completions_body(chat: dict[str, Any], prompt_ids: list[int]) -> dict[str, Any]:
    """The `/v1/completions` request for a chat request whose prompt is `prompt_ids`.

    `chat` already carries the recording fields (`return_token_ids`, `logprobs`, ...).
    """
    n = chat.get("n", 1)
    if n not in (None, 1):
        raise Unprocessable(
            "TITO mode samples one continuation per turn: 'n' must be 1 (send n requests "
            "with the same rollout id to branch)",
            param="n",
        )
    choice = chat.get("tool_choice")
    if choice not in SUPPORTED_TOOL_CHOICES:
        raise Unprocessable(
            "TITO mode supports tool_choice 'auto' and 'none' only (forcing a call needs "
            "the backend's chat endpoint)",
            param="tool_choice",
        )
    body = {k: chat[k] for k in PASSED_FIELDS if k in chat}
    body["prompt"] = prompt_ids
    # Chat's default is "up to the context length"; /v1/completions defaults to 16.
    body["max_tokens"] = chat.get("max_completion_tokens", chat.get("max_tokens"))
    body["return_token_ids"] = True
    top = chat.get("top_logprobs")
    body["logprobs"] = int(top) if isinstance(top, int) and not isinstance(top, bool) else 0
    body["echo"] = False
    return body


def echo_needed(forward: dict[str, Any]) -> bool:
    """Whether the backend's echo of the prompt ids must be read: only where it may have
    cut the prompt TITO sent."""
    return forward.get("truncate_prompt_tokens") is not None


class _Choice(msgspec.Struct):
    """A completions choice: everything TITO converts, not the prompt ids' echo."""

    index: Any = msgspec.UNSET
    text: Any = msgspec.UNSET
    logprobs: Any = msgspec.UNSET
    finish_reason: Any = msgspec.UNSET
    stop_reason: Any = msgspec.UNSET
    token_ids: Any = msgspec.UNSET


class _Completion(msgspec.Struct):
    """A completions response or stream chunk, its choices without the echo."""

    id: Any = msgspec.UNSET
    created: Any = msgspec.UNSET
    model: Any = msgspec.UNSET
    choices: list[_Choice] | None = None
    usage: Any = msgspec.UNSET
    system_fingerprint: Any = msgspec.UNSET
    error: Any = msgspec.UNSET


_COMPLETION = msgspec.json.Decoder(_Completion)
_FIELDS = _Completion.__struct_fields__
_CHOICE_FIELDS = _Choice.__struct_fields__


def decode_completion(raw: bytes) -> Any:
    """A completions response or chunk as `orjson.loads` gives it, less every choice's
    `prompt_token_ids` (skipped without being decoded), and less the fields TITO does not
    use; `msgspec.DecodeError` where it is not JSON or not that shape."""
    found = _COMPLETION.decode(raw)
    out = {k: v for k in _FIELDS if (v := getattr(found, k)) is not msgspec.UNSET}
    if found.choices is not None:
        out["choices"] = [
            {k: v for k in _CHOICE_FIELDS if (v := getattr(c, k)) is not msgspec.UNSET}
            for c in found.choices
        ]
    elif "choices" in out:
        del out["choices"]
    return out


def _logprob_entries(logprobs: Any, top_k: int) -> list[dict[str, Any]]:
    """Completions `logprobs` as chat `logprobs.content` entries (sampled token first).
    Entries already in the chat form (vLLM's token-in route) keep it, cut to `top_k`."""
    if not isinstance(logprobs, dict):
        return []
    content = logprobs.get("content")
    if isinstance(content, list):
        return [
            {**entry, "top_logprobs": list(entry.get("top_logprobs") or [])[:top_k]}
            for entry in content
            if isinstance(entry, dict)
        ]
    tokens = logprobs.get("tokens") or []
    values = logprobs.get("token_logprobs") or []
    tops = logprobs.get("top_logprobs") or []
    out = []
    for i, token in enumerate(tokens):
        top = tops[i] if i < len(tops) and isinstance(tops[i], dict) else {}
        out.append(
            {
                "token": token,
                "logprob": values[i] if i < len(values) else None,
                "bytes": list(str(token).encode()),
                "top_logprobs": [
                    {"token": t, "logprob": lp, "bytes": list(str(t).encode())}
                    for t, lp in list(top.items())[:top_k]
                ],
            }
        )
    return out


def _chat_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex[:16]}"


@dataclass(slots=True)
class ChatAnswer:
    """A whole completions response as a chat response."""

    parser: OutputParser
    top_k: int

    def convert(
        self, completion: dict[str, Any], known_prompt: list[int] | None = None
    ) -> tuple[dict[str, Any], ParsedMessage]:
        """The chat answer; its prompt ids are `known_prompt` where given, else the echo."""
        choices = completion.get("choices") or []
        if not choices or not isinstance(choices[0], dict):
            raise ValueError("the completions response has no choices")
        choice = choices[0]
        parsed = self.parser.parse(str(choice.get("text") or ""))
        message = parsed.to_openai()
        message.setdefault("reasoning", None)
        message.setdefault("tool_calls", [])
        chat_choice = {
            "index": 0,
            "message": {
                "refusal": None,
                "annotations": None,
                "audio": None,
                "function_call": None,
                **message,
            },
            "logprobs": {"content": _logprob_entries(choice.get("logprobs"), self.top_k)},
            "finish_reason": finish_reason(choice.get("finish_reason"), parsed),
            "stop_reason": choice.get("stop_reason"),
            "token_ids": choice.get("token_ids"),
        }
        return {
            "id": _chat_id(),
            "object": "chat.completion",
            "created": completion.get("created", int(time.time())),
            "model": completion.get("model"),
            "choices": [chat_choice],
            "system_fingerprint": completion.get("system_fingerprint"),
            "usage": completion.get("usage"),
            "prompt_logprobs": None,
            "prompt_token_ids": (
                known_prompt if known_prompt is not None else choice.get("prompt_token_ids")
            ),
        }, parsed


@dataclass(slots=True)
class ChatStream:
    """Completions stream chunks as chat stream chunks, one for one (plus the role chunk)."""

    parser: OutputParser
    top_k: int
    chat_id: str = field(default_factory=_chat_id)
    deltas: list[ParsedDelta] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    prompt_ids: list[int] | None = None
    finish: str | None = None
    started: bool = False
    called: bool = False
    known_prompt: list[int] | None = None  # the prompt TITO sent, used instead of the echo

    def _chunk(self, src: dict[str, Any], choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.chat_id,
            "object": "chat.completion.chunk",
            "created": src.get("created", int(time.time())),
            "model": src.get("model"),
            "choices": choices,
        }

    def convert(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        choices = chunk.get("choices")
        if not isinstance(choices, list):
            return out
        if not choices:  # the usage chunk
            usage = self._chunk(chunk, [])
            usage["usage"] = chunk.get("usage")
            usage["system_fingerprint"] = chunk.get("system_fingerprint")
            return [usage]
        choice = choices[0] if isinstance(choices[0], dict) else {}
        if not self.started:
            self.started = True
            prompt = self.known_prompt
            if prompt is None:
                prompt = choice.get("prompt_token_ids")
            self.prompt_ids = prompt if isinstance(prompt, list) else None
            first = self._chunk(
                chunk,
                [
                    {
                        "index": 0,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
            )
            first["prompt_token_ids"] = self.prompt_ids
            out.append(first)
        ids = choice.get("token_ids")
        if isinstance(ids, list):
            self.token_ids.extend(int(i) for i in ids)
        delta = self.parser.feed(str(choice.get("text") or ""))
        backend_finish = choice.get("finish_reason")
        if backend_finish is not None:
            delta.extend(self.parser.finish())
        self.deltas.append(delta)
        self.called = self.called or bool(delta.tool_calls)
        entries = _logprob_entries(choice.get("logprobs"), self.top_k)
        chat_choice: dict[str, Any] = {
            "index": 0,
            "delta": delta.to_openai(),
            "logprobs": {"content": entries} if entries else None,
            "finish_reason": None,
            "token_ids": ids if isinstance(ids, list) else None,
        }
        if backend_finish is not None:
            self.finish = finish_reason(backend_finish, self.called)
            chat_choice["finish_reason"] = self.finish
            chat_choice["stop_reason"] = choice.get("stop_reason")
        out.append(self._chunk(chunk, [chat_choice]))
        return out

    def message(self) -> ParsedMessage:
        return ParsedMessage.from_deltas(self.deltas)
