"""`turnstile bench`: Turnstile against a fake backend, directly and via nginx (flags only;
the measurement is `turnstile.bench.runner`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

NAME = "bench"
HELP = "measure Turnstile against a fake backend, directly and via nginx"
DESCRIPTION = (
    "Start a fake vLLM-shaped backend, nginx (when installed) and Turnstile "
    "in front of it, and run interleaved rounds of non-streaming, streaming and paced "
    "load; reports latency, throughput and CPU per request for each."
)

EXIT_BAD_CONFIG = 2
EXIT_FAILED = 1


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers: {text!r}") from None


def _name_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def add_arguments(p: argparse.ArgumentParser) -> None:
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
        "--servers",
        type=_name_list,
        default=["uvicorn"],
        metavar="S,S,...",
        help="run each Turnstile target under each of these HTTP servers, interleaved: "
        "uvicorn (the target keeps its name), raw, granian (named turnstile-raw, ...; "
        "granian needs the granian extra and runs one worker); default uvicorn",
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
        "--long-context",
        type=_int_list,
        default=[32000, 128000],
        metavar="N,N,...",
        help="prompt lengths of the long-context scenarios (concurrency 1, streaming and "
        "not; default 32000,128000; 0 for none; --quick runs none)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="2 rounds of 1 s, concurrency 1 and 32, paced 32 streams x 20 tokens",
    )
    p.add_argument("--keep", action="store_true", help="keep the temp dir (logs, shards)")
    p.add_argument("--json", type=Path, metavar="FILE", help="write the full report here")


def run(args: argparse.Namespace) -> int:
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
        long_context=[n for n in args.long_context if n != 0],
        servers=args.servers,
    )
    try:
        run_bench(cfg, args.json)
    except ValueError as exc:
        print(f"turnstile bench: {exc}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    except RuntimeError as exc:  # a server or a load generator failed; all were stopped
        print(f"turnstile bench failed: {exc}", file=sys.stderr)
        return EXIT_FAILED
    return 0
