"""The scripted, vLLM-shaped fake behind the `Backend` seam, for unit tests.

It is `turnstile.backends.fake` (see there for its tokenizer and chat template); this
module keeps the names the tests import.
"""

from __future__ import annotations

from turnstile.backends.fake import (
    EOT,
    FakeResponse,
    FakeVLLM,
    Reply,
    ids_of,
    logprob,
    render,
)

__all__ = ["EOT", "FakeResponse", "FakeVLLM", "Reply", "ids_of", "logprob", "render"]
