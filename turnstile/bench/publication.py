"""`python -m turnstile.bench.publication`: how long a finished rollout takes to reach a reader.

Starts the bench's fast fake backend and `turnstile serve` in front of it (both their own
processes), then runs `--clients` concurrent harness loops for `--seconds`: each creates
a rollout in a group of `--group-size`, makes `--calls` chat calls, and finishes it. A
watcher polls the output directory's `rollouts/` every 10 ms and notes when each
rollout id first appears in a published shard. The figure is finish-to-visible: from
the moment the last `/finish` of a rollout's group returned to the moment its row is
readable, as p50, p99 and max, with the number of shards published per table.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Final

import httpx
import pyarrow.parquet as pq

from turnstile.bench import free_port, stop_group
from turnstile.bench.runner import Server, spawn

READY_TIMEOUT_S: Final[float] = 60.0
# The watcher's poll: 10 ms adds at most that to each figure.
WATCH_POLL_S: Final[float] = 0.01
REQUEST_TIMEOUT_S: Final[float] = 30.0
BODY: Final[dict[str, object]] = {
    "model": "bench",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 16,
}


class Watcher(threading.Thread):
    """Notes when each rollout id first appears in a published `rollouts` shard."""

    def __init__(self, output: Path) -> None:
        super().__init__(name="publication-watcher", daemon=True)
        self.output = output
        self.seen: dict[str, float] = {}
        self.shards: set[str] = set()
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set():
            self.poll()
            time.sleep(WATCH_POLL_S)
        self.poll()

    def poll(self) -> None:
        now = time.time()
        for path in sorted((self.output / "rollouts").glob("part-*.parquet")):
            if path.name in self.shards:
                continue
            self.shards.add(path.name)
            for rid in pq.read_table(path, columns=["rollout_id"]).column(0).to_pylist():
                self.seen.setdefault(rid, now)


async def _harness(
    client: httpx.AsyncClient,
    base: str,
    worker: int,
    args: argparse.Namespace,
    deadline: float,
    finished: dict[str, float],
) -> None:
    group = 0
    while time.monotonic() < deadline:
        gid = f"w{worker}-g{group}"
        group += 1
        members = []
        for member in range(args.group_size):
            created = await client.post(
                f"{base}/rollouts",
                json={
                    "group_id": gid,
                    "group_size": args.group_size,
                    "rollout_id": f"{gid}-{member}",
                },
            )
            created.raise_for_status()
            rid = created.json()["rollout_id"]
            members.append(rid)
            for _ in range(args.calls):
                answer = await client.post(f"{base}/rollouts/{rid}/v1/chat/completions", json=BODY)
                answer.raise_for_status()
            done = await client.post(f"{base}/rollouts/{rid}/finish")
            done.raise_for_status()
        at = time.time()  # the group's last /finish has returned
        for rid in members:
            finished[rid] = at


async def _load(base: str, args: argparse.Namespace) -> dict[str, float]:
    finished: dict[str, float] = {}
    deadline = time.monotonic() + args.seconds
    limits = httpx.Limits(max_connections=args.clients)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
        await asyncio.gather(
            *(_harness(client, base, w, args, deadline, finished) for w in range(args.clients))
        )
    return finished


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--calls", type=int, default=2, help="chat calls per rollout")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--publish-delay-s", type=float, default=0.5)
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="turnstile-publication-"))
    output = workdir / "out"
    backend_port, proxy_port = free_port(), free_port()
    backend = spawn(
        "backend",
        [
            "-m",
            "turnstile.bench.backend",
            "--port",
            str(backend_port),
            "--prompt-tokens",
            "500",
            "--completion-tokens",
            "16",
        ],
        backend_port,
        workdir,
    )
    os.environ["TURNSTILE_PUBLISH_DELAY_S"] = str(args.publish_delay_s)  # for the child
    proxy: Server = spawn(
        "turnstile",
        [
            "-m",
            "turnstile",
            "serve",
            "--backend",
            f"http://127.0.0.1:{backend_port}",
            "--output",
            str(output),
            "--port",
            str(proxy_port),
            "--log-level",
            "warning",
        ],
        proxy_port,
        workdir,
    )
    watcher = Watcher(output)
    try:
        proxy.wait_ready(READY_TIMEOUT_S)
        watcher.start()
        finished = asyncio.run(_load(proxy.url, args))
        time.sleep(max(2.0, 4 * args.publish_delay_s))  # the last groups' publication
    finally:
        watcher.stopping.set()
        stop_group(proxy.proc)
        stop_group(backend.proc)
    watcher.join()
    delays = sorted(watcher.seen[r] - t for r, t in finished.items() if r in watcher.seen)
    unseen = [r for r in finished if r not in watcher.seen]
    if not delays:
        raise SystemExit(f"no rollout was published; see {workdir}")
    p99 = delays[min(len(delays) - 1, int(0.99 * len(delays)))]
    shards = {
        t: len(list((output / t).glob("part-*.parquet"))) for t in ("turns", "samples", "rollouts")
    }
    print(
        f"{len(finished)} rollouts in groups of {args.group_size} from {args.clients} clients "
        f"over {args.seconds:.0f} s, publish_delay_s={args.publish_delay_s}"
    )
    print(
        f"finish-to-visible: p50 {statistics.median(delays) * 1e3:.0f} ms, "
        f"p99 {p99 * 1e3:.0f} ms, max {delays[-1] * 1e3:.0f} ms; not seen before the "
        f"end: {len(unseen)}"
    )
    per_shard = len(finished) / max(1, shards["rollouts"])
    print(f"shards published: {shards} (rows per rollouts shard: {per_shard:.1f})")


if __name__ == "__main__":
    main()
