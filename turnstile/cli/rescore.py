"""``turnstile rescore DIR``: score recorded responses for MRTPO (see ``turnstile.train.rescore``).

``turnstile replay`` is the command's former name, still accepted (hidden, deprecated).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from turnstile.train import rescore

NAME = "rescore"
HELP = "score recorded responses with and without verifier info (MRTPO)"
DESCRIPTION = (
    "For every sample with a reward that has verifier information, score "
    "the response with and without that information in the context, through a vLLM "
    "backend's prompt_logprobs (top-k plus a leftover bucket, with the JSD's error "
    "bound) or exactly from a local model's full logits, and write the per-token JSD "
    "to DIR/replays/."
)
# Former names of the command: still parsed, not listed, and each run says so.
DEPRECATED_ALIASES = ("replay",)

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("directory", type=Path, help="Turnstile output directory")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--backend",
        metavar="URL",
        help="vLLM server to score through (prompt_logprobs, top-k + bucket)",
    )
    source.add_argument(
        "--model",
        type=Path,
        metavar="DIR",
        help="local Hugging Face model directory: exact JSD from full logits "
        "(needs the train extra)",
    )
    p.add_argument("--served-model", help="model name on the backend (default: its first)")
    p.add_argument(
        "--top-k",
        type=int,
        default=rescore.DEFAULT_TOP_K,
        help=f"prompt_logprobs per token (default {rescore.DEFAULT_TOP_K}; the "
        "server caps it at its --max-logprobs)",
    )
    p.add_argument(
        "--reward",
        action="append",
        metavar="NAME",
        help="only this reward (repeatable; default: every reward with info)",
    )
    p.add_argument(
        "--template",
        default=rescore.DEFAULT_INFO_TEMPLATE,
        help="how verifier info is rendered ({name}, {info})",
    )
    p.add_argument("--concurrency", type=int, default=rescore.DEFAULT_CONCURRENCY)
    p.add_argument(
        "--backend-api-key-env",
        metavar="NAME",
        help="environment variable holding the backend's API key",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    if not args.directory.is_dir():
        print(f"turnstile rescore: {args.directory} is not a directory", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        if args.backend:
            key = os.environ.get(args.backend_api_key_env) if args.backend_api_key_env else None
            written = rescore.rescore_backend(
                args.directory,
                args.backend,
                model=args.served_model,
                top_k=args.top_k,
                template=args.template,
                rewards=args.reward,
                concurrency=args.concurrency,
                progress=not args.no_progress,
                api_key=key,
            )
        else:
            try:
                from turnstile.train import rescore_torch
            except ImportError as e:
                print(
                    "turnstile rescore --model needs PyTorch "
                    f"(pip install 'turnstile[train]'): {e}",
                    file=sys.stderr,
                )
                return EXIT_BAD_INPUT
            model, tokenize = rescore_torch.load_hf_model(args.model)
            written = rescore_torch.rescore_model(
                args.directory,
                model,
                tokenize,
                template=args.template,
                rewards=args.reward,
                model_name=str(args.model),
                progress=not args.no_progress,
            )
    except rescore.RescoreError as e:
        print(f"turnstile rescore: {e}", file=sys.stderr)
        return EXIT_FAILED
    print(f"rescored {written} responses into {args.directory / rescore.REPLAYS_TABLE}")
    return EXIT_OK
