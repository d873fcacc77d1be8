"""A whole answer assembled from the events of a stream, in vLLM's whole-answer shape.

With `stream_whole_calls`, a client's whole (non-streamed) call goes upstream as a
stream (with `stream_options.include_usage`), so that the tokens received after a policy
switch can carry the new version; `WholeAnswer` collects the stream's chunks and builds the
`chat.completion` or `text_completion` body vLLM (0.32) would have answered: the same keys
in the same order, the content, reasoning, tool calls, logprobs, token ids, finish and stop
reasons and usage of the stream. The fields a stream never carries are written as vLLM
writes them when unset (`null`). The injected recording fields are then stripped as for
any whole answer (`CapturePlan.strip`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from turnstile.proxy.capture import CHAT, ResponseCapture


@dataclass(slots=True)
class _ChoiceLogprobs:
    """One choice's logprobs, as the stream sent them (chat entries, or completion lists)."""

    seen: bool = False
    content: list[Any] = field(default_factory=list)  # chat: logprobs.content entries
    tokens: list[Any] = field(default_factory=list)  # completions: the four parallel lists
    token_logprobs: list[Any] = field(default_factory=list)
    top_logprobs: list[Any] = field(default_factory=list)
    text_offset: list[Any] = field(default_factory=list)


class WholeAnswer:
    """The chunks of one stream, and the whole answer they make."""

    __slots__ = ("chat", "created", "fingerprint", "id", "logprobs", "object")

    def __init__(self, endpoint: str) -> None:
        self.chat = endpoint == CHAT
        self.id: Any = None
        self.created: Any = None
        self.fingerprint: Any = None
        self.logprobs: dict[int, _ChoiceLogprobs] = {}

    def add(self, chunk: dict[str, Any]) -> None:
        """Take one stream chunk (already recorded into the call's `ResponseCapture`)."""
        if self.id is None:
            self.id, self.created = chunk.get("id"), chunk.get("created")
        if chunk.get("system_fingerprint") is not None:
            self.fingerprint = chunk["system_fingerprint"]
        for choice in chunk.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            logprobs = choice.get("logprobs")
            if not isinstance(logprobs, dict):
                continue
            index = choice.get("index")
            slot = self.logprobs.setdefault(
                index if isinstance(index, int) else 0, _ChoiceLogprobs()
            )
            slot.seen = True
            if self.chat:
                slot.content.extend(logprobs.get("content") or ())
            else:
                slot.tokens.extend(logprobs.get("tokens") or ())
                slot.token_logprobs.extend(logprobs.get("token_logprobs") or ())
                slot.top_logprobs.extend(logprobs.get("top_logprobs") or ())
                slot.text_offset.extend(logprobs.get("text_offset") or ())

    def answer(self, capture: ResponseCapture) -> dict[str, Any]:
        """The whole answer (injected fields included: strip them as for any answer)."""
        choices = [self._choice(capture, i) for i in sorted(capture.choices)]
        usage = capture.usage
        whole_usage = None
        if usage is not None:
            whole_usage = {
                "prompt_tokens": usage.get("prompt_tokens"),
                "total_tokens": usage.get("total_tokens"),
                "completion_tokens": usage.get("completion_tokens"),
                "prompt_tokens_details": usage.get("prompt_tokens_details"),
                "completion_tokens_details": usage.get("completion_tokens_details"),
            }
        body: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": capture.model,
            "choices": choices,
            "service_tier": None,
            "system_fingerprint": self.fingerprint,
            "usage": whole_usage,
        }
        if self.chat:
            prompt = capture.prompt_token_ids
            body["prompt_logprobs"] = None
            body["prompt_token_ids"] = None if prompt is None else [int(t) for t in prompt]
            body["prompt_text"] = None
        body["kv_transfer_params"] = None
        body["ec_transfer_params"] = None
        body["metrics"] = None
        return body

    def _choice(self, capture: ResponseCapture, index: int) -> dict[str, Any]:
        cap = capture.choices[index]
        lp = self.logprobs.get(index)
        ids = [int(t) for t in cap.token_ids] if cap.saw_token_ids else None
        if self.chat:
            message: dict[str, Any] = {
                "role": cap.role,
                "content": "".join(cap.content) if cap.content else None,
                "refusal": None,
                "annotations": None,
                "audio": None,
                "function_call": None,
            }
            if cap.tool_calls:
                message["tool_calls"] = [cap.tool_calls[k] for k in sorted(cap.tool_calls)]
            message["reasoning"] = "".join(cap.reasoning) if cap.reasoning else None
            return {
                "index": index,
                "message": message,
                "logprobs": {"content": lp.content} if lp is not None and lp.seen else None,
                "finish_reason": cap.finish_reason,
                "stop_reason": cap.stop_reason,
                "token_ids": ids,
                "routed_experts": None,
            }
        logprobs = None
        if lp is not None and lp.seen:
            logprobs = {
                "text_offset": lp.text_offset,
                "token_logprobs": lp.token_logprobs,
                "tokens": lp.tokens,
                "top_logprobs": lp.top_logprobs,
            }
        prompt = capture.prompt_ids_for(cap)
        return {
            "index": index,
            "text": cap.text(),
            "logprobs": logprobs,
            "finish_reason": cap.finish_reason,
            "stop_reason": cap.stop_reason,
            "token_ids": ids,
            "prompt_logprobs": None,
            "prompt_token_ids": None if prompt is None else [int(t) for t in prompt],
            "routed_experts": None,
        }
