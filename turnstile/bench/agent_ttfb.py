"""`python -m turnstile.bench.agent_ttfb`: time to the first text delta, through Turnstile
and direct to vLLM, for Anthropic Messages, OpenAI Responses and Chat Completions.

Starts the tiny CPU vLLM (`turnstile.dev.devstack`, or `--vllm URL` for a running one)
and `turnstile serve` in front of it, then alternates, for each protocol, one streamed
call direct to vLLM's own route and one through Turnstile's, `--rounds` times after
`--warmup` pairs: the two sides see the same machine state. It prints, per protocol,
the median and range of the time from sending the request to the first text delta
event (`content_block_delta` / `response.output_text.delta` / a chat chunk with
content), and the ratio of the medians.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final

import httpx

from turnstile.bench import free_port, stop_group
from turnstile.bench.runner import spawn

READY_TIMEOUT_S: Final[float] = 120.0
CALL_TIMEOUT_S: Final[float] = 120.0
MODEL: Final[str] = "tiny-qwen3"
MAX_TOKENS: Final[int] = 16

Body = dict[str, object]
_PROTOCOLS: Final[dict[str, tuple[str, Callable[[], Body], Callable[[str], bool]]]] = {
    "messages": (
        "/v1/messages",
        lambda: {
            "model": MODEL,
            "max_tokens": MAX_TOKENS,
            "stream": True,
            "messages": [{"role": "user", "content": "Say something."}],
        },
        lambda line: '"content_block_delta"' in line and '"text_delta"' in line,
    ),
    "responses": (
        "/v1/responses",
        lambda: {
            "model": MODEL,
            "max_output_tokens": MAX_TOKENS,
            "stream": True,
            "input": "Say something.",
        },
        lambda line: '"response.output_text.delta"' in line,
    ),
    "chat": (
        "/v1/chat/completions",
        lambda: {
            "model": MODEL,
            "max_tokens": MAX_TOKENS,
            "stream": True,
            "messages": [{"role": "user", "content": "Say something."}],
        },
        lambda line: '"content":"' in line.replace(" ", "") and "delta" in line,
    ),
}


def first_delta_s(
    client: httpx.Client, url: str, body: Body, is_delta: Callable[[str], bool]
) -> float:
    """Seconds from sending `body` to the first line that `is_delta` accepts."""
    start = time.perf_counter()
    with client.stream("POST", url, json=body, timeout=CALL_TIMEOUT_S) as resp:
        resp.raise_for_status()
        first = None
        for line in resp.iter_lines():
            if first is None and line.startswith("data:") and is_delta(line):
                first = time.perf_counter() - start
    if first is None:
        raise RuntimeError(f"{url} sent no text delta")
    return first


def _describe(values: list[float]) -> str:
    return (
        f"{statistics.median(values) * 1e3:.0f} ms "
        f"({min(values) * 1e3:.0f}-{max(values) * 1e3:.0f})"
    )


def run(vllm_url: str, workdir: Path, rounds: int, warmup: int) -> None:
    port = free_port()
    proxy = spawn(
        "turnstile",
        ["-m", "turnstile", "serve", "--backend", vllm_url, "--output", str(workdir / "out"),
         "--port", str(port), "--log-level", "warning"],
        port,
        workdir,
    )  # fmt: skip
    try:
        proxy.wait_ready(READY_TIMEOUT_S)
        print("| protocol | direct to vLLM | through Turnstile | ratio |")
        print("|---|---|---|---|")
        with httpx.Client() as client:
            for name, (path, body, is_delta) in _PROTOCOLS.items():
                direct: list[float] = []
                through: list[float] = []
                for i in range(warmup + rounds):
                    d = first_delta_s(client, vllm_url + path, body(), is_delta)
                    t = first_delta_s(
                        client, proxy.url + f"/rollouts/ttfb-{name}-{i}" + path, body(), is_delta
                    )
                    if i >= warmup:
                        direct.append(d)
                        through.append(t)
                ratio = statistics.median(through) / statistics.median(direct)
                print(f"| {name} | {_describe(direct)} | {_describe(through)} | {ratio:.2f} |")
    finally:
        stop_group(proxy.proc)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm", help="a running tiny-model vLLM (default: start one)")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="turnstile-agent-ttfb-"))
    if args.vllm:
        run(args.vllm.rstrip("/"), workdir, args.rounds, args.warmup)
        return
    from turnstile.dev import devstack  # development tooling: only when starting vLLM

    server = devstack.start_vllm(
        devstack.ensure_tiny_qwen3(), devstack.free_port(), log_path=workdir / "vllm.log"
    )
    try:
        server.wait_healthy()
        run(server.base_url, workdir, args.rounds, args.warmup)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
