"""The optional local tokenizer (`--tokenizer DIR`), used off the request path only.

Two jobs: decoding token IDs to classify stitching breaks (re-render vs tokenization),
and the fallback for backends that return no token IDs, where Turnstile tokenizes the
request and the response itself. Fallback IDs are marked `retokenized`: they are what
the template and tokenizer produce, not necessarily what the backend consumed.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any


class TokenizerError(Exception):
    """The tokenizer directory could not be loaded."""


class LocalTokenizer:
    """A Hugging Face tokenizer loaded from a local directory (never from a hub)."""

    def __init__(self, path: Path) -> None:
        try:
            from transformers import AutoTokenizer
        except ImportError as exc:  # pragma: no cover - transformers is a core dependency
            raise TokenizerError("transformers is required for --tokenizer") from exc
        if not path.is_dir():
            raise TokenizerError(f"tokenizer directory {path} does not exist")
        try:
            self._tok: Any = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError) as exc:
            raise TokenizerError(f"cannot load a tokenizer from {path}: {exc}") from exc
        self.path = path
        self.name = str(getattr(self._tok, "name_or_path", path))
        # Hugging Face fast tokenizers are not safe to share across threads mid-call.
        self._lock = threading.Lock()

    @property
    def hf(self) -> Any:
        """The underlying Hugging Face tokenizer (TITO renders with it directly)."""
        return self._tok

    def decode(self, ids: Sequence[int]) -> str:
        with self._lock:
            return str(self._tok.decode(list(ids), skip_special_tokens=False))

    def encode(self, text: str) -> list[int]:
        with self._lock:
            return list(self._tok.encode(text, add_special_tokens=False))

    def render_prompt(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> list[int]:
        """The chat template's prompt for `messages`, with the generation prompt."""
        with self._lock:
            out = self._tok.apply_chat_template(
                messages, tools=tools, add_generation_prompt=True, tokenize=True
            )
        if isinstance(out, dict) or hasattr(out, "keys"):
            out = out["input_ids"]
        return [int(i) for i in out]
