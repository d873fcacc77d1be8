"""Rendering for the template audit: one tokenizer and template, as vLLM would render.

``Renderer`` renders conversations with ``apply_chat_template`` (optionally after
``as_vllm_renders``, the message normalisation vLLM's OpenAI server applies) and caches token
IDs; ``stop_ids`` finds the tokens a model stops on, as vLLM reads them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from turnstile.tito.templates.model import AuditError

__all__ = ["Renderer", "as_vllm_renders", "hf_tokenizer", "stop_ids"]


@dataclass
class Renderer:
    """Renders and tokenizes with one tokenizer and template, caching token IDs."""

    tokenizer: Any
    template: str
    kwargs: Mapping[str, Any]
    vllm_messages: bool
    _ids: dict[str, list[int]] = field(default_factory=dict)

    def render(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, gen: bool
    ) -> str:
        out = self.tokenizer.apply_chat_template(
            as_vllm_renders(messages) if self.vllm_messages else messages,
            tools=tools,
            chat_template=self.template,
            add_generation_prompt=gen,
            tokenize=False,
            **self.kwargs,
        )
        if not isinstance(out, str):
            raise AuditError(f"apply_chat_template returned {type(out).__name__}, not text")
        return out

    def ids(self, text: str) -> list[int]:
        if text not in self._ids:
            self._ids[text] = list(self.tokenizer.encode(text, add_special_tokens=False))
        return self._ids[text]

    def piece(self, token_id: int) -> str:
        return str(self.tokenizer.decode([token_id], skip_special_tokens=False))


def as_vllm_renders(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as vLLM's OpenAI server hands them to the template: a missing or null
    ``content`` as ``""`` (an assistant message with only tool calls, as the openai SDK
    sends it back, would otherwise break templates that read ``message['content']``),
    JSON-string tool-call arguments parsed into dicts (empty ones become ``{}``) and
    ``reasoning`` copied into ``reasoning_content`` (vLLM's ``chat_utils``)."""
    out: list[dict[str, Any]] = []
    for message in messages:
        message = dict(message)
        if message.get("content") is None:
            message["content"] = ""
        if message.get("role") == "assistant":
            if message.get("reasoning") is not None:
                message["reasoning_content"] = message["reasoning"]
            if isinstance(message.get("tool_calls"), list):
                calls = []
                for call in message["tool_calls"]:
                    function = dict(call["function"])
                    arguments = function.get("arguments")
                    if not arguments:
                        function["arguments"] = {}
                    elif isinstance(arguments, str):
                        function["arguments"] = json.loads(arguments)
                    calls.append({**call, "function": function})
                message["tool_calls"] = calls
        out.append(message)
    return out


def stop_ids(tokenizer: Any, extra: Sequence[int]) -> set[int]:
    """What the model stops on: EOS, generation_config.json's eos_token_id (as vLLM reads
    it) and ``extra``."""
    stops = {int(token) for token in extra}
    if tokenizer.eos_token_id is not None:
        stops.add(int(tokenizer.eos_token_id))
    directory = Path(str(getattr(tokenizer, "name_or_path", "")))
    config_path = directory / "generation_config.json"
    if config_path.is_file():
        configured = json.loads(config_path.read_text(encoding="utf-8")).get("eos_token_id")
        if isinstance(configured, int):
            stops.add(configured)
        elif isinstance(configured, list):
            stops.update(int(token) for token in configured)
    return stops


def hf_tokenizer(tokenizer: Any) -> Any:
    from turnstile.output.tokenizer import LocalTokenizer

    if isinstance(tokenizer, str | Path):
        from turnstile.dev.vocab import load_tokenizer

        return load_tokenizer(Path(tokenizer))
    if isinstance(tokenizer, LocalTokenizer):
        return tokenizer._tok
    return tokenizer
