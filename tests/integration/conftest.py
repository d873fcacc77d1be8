"""Fixtures for tests against real components: a real vLLM serving a tiny Qwen3, and the
real vocabularies and chat templates of llama.cpp (tests marked ``assets``).

The first session builds the vLLM environment, the tokenizer and the model into the
Turnstile cache (``turnstile.dev.devstack``); later sessions reuse them. One vLLM server is
started per session, on a free port, and stopped when the session ends. Every test in this
directory gets the ``integration`` marker, so ``-m "not integration"`` skips them.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from turnstile.dev import devstack

_HERE = Path(__file__).parent
EXISTING_VLLM_ENV = "TURNSTILE_TEST_VLLM_URL"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if _HERE in item.path.parents:
            item.add_marker(pytest.mark.integration)


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@pytest.fixture(scope="session")
def qwen3_tokenizer_dir() -> Path:
    """The Hugging Face tokenizer directory of Qwen3 (the one the tiny model is served with)."""
    return devstack.ensure_qwen3_tokenizer(log=_log)


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The tiny random Qwen3 model directory."""
    return devstack.ensure_tiny_qwen3(log=_log)


@dataclass(frozen=True)
class ExistingServer:
    base_url: str
    served_model_name: str = devstack.DEFAULT_SERVED_MODEL_NAME


@pytest.fixture(scope="session")
def vllm_server(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[devstack.VLLMServer | ExistingServer]:
    """A healthy vLLM server for the tiny model; its log is in the session's temp dir.

    `TURNSTILE_TEST_VLLM_URL` points the suite at an already running tiny-model vLLM
    (`python -m turnstile.dev.devstack serve-vllm --port P`) instead of starting one.
    """
    existing = os.environ.get(EXISTING_VLLM_ENV)
    if existing:
        yield ExistingServer(existing.rstrip("/"))
        return
    log_path = tmp_path_factory.mktemp("vllm") / "vllm.log"
    # Development routes on: the weight-update test pauses, reloads and resumes it.
    server = devstack.start_vllm(
        tiny_model_dir, devstack.free_port(), log_path=log_path, dev_mode=True
    )
    try:
        server.wait_healthy()
    except devstack.DevstackError as exc:
        server.stop()
        pytest.fail(str(exc), pytrace=False)
    try:
        yield server
    finally:
        server.stop()
