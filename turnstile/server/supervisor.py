"""`turnstile serve --workers N`: starts N worker processes and keeps them running.

Each worker is the same `turnstile serve` command line with `TURNSTILE_WORKER_INDEX`
and `TURNSTILE_WORKER_RUNDIR` set; it binds the public port with SO_REUSEPORT plus its
own Unix socket in the run directory (see `turnstile.server.workers`). The supervisor forwards
SIGTERM/SIGINT to every worker, waits for each to drain and publish, and exits 0 when
all did. A worker that dies is started again (it rebuilds from its own journal), unless it
keeps dying right after start. When the worker count differs from the previous run's,
rollouts left open are sealed as `interrupted` rather than restored, because their
owners have changed.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType
from typing import Final

from turnstile.journal.rebuild import JOURNAL_DIR
from turnstile.limits import DRAIN_TIMEOUT_S, WRITER_JOIN_TIMEOUT_S
from turnstile.server.workers import ENV_INDEX, ENV_RUNDIR
from turnstile.settings import Settings

log = logging.getLogger("turnstile.supervisor")

# How often the supervisor looks at its workers.
POLL_INTERVAL_S: Final[float] = 0.5
# A worker that exits sooner than this after its start is crash-looping ...
CRASH_LOOP_S: Final[float] = 10.0
# ... and after this many such exits in a row the supervisor gives up (exit 1).
MAX_QUICK_RESTARTS: Final[int] = 5
# On shutdown each worker drains (drain_timeout_s) and publishes; past this it is killed.
STOP_GRACE_S: Final[float] = DRAIN_TIMEOUT_S + WRITER_JOIN_TIMEOUT_S
# Remembers the previous run's worker count, next to the journals.
WORKERS_FILE: Final[str] = "workers"


class Supervisor:
    def __init__(self, settings: Settings, argv: list[str]) -> None:
        self.settings = settings
        self.argv = argv
        self.rundir = Path(tempfile.mkdtemp(prefix="turnstile-workers-"))
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.started: dict[int, float] = {}
        self.quick_exits = 0
        self.stopping = False
        self.terminated: set[int] = set()  # pids already sent SIGTERM

    def _env(self, index: int, count_changed: bool) -> dict[str, str]:
        env = {**os.environ, ENV_INDEX: str(index), ENV_RUNDIR: str(self.rundir)}
        if count_changed:
            env["TURNSTILE_RECOVER_OPEN_ROLLOUTS"] = "interrupt"
        return env

    def _count_changed(self) -> bool:
        path = self.settings.output / JOURNAL_DIR / WORKERS_FILE
        try:
            previous = int(path.read_text().strip())
        except (OSError, ValueError):
            return False
        return previous != self.settings.workers

    def _start(self, index: int, env: dict[str, str]) -> None:
        self.procs[index] = subprocess.Popen(
            [sys.executable, "-m", "turnstile", *self.argv], env=env
        )
        self.started[index] = time.monotonic()

    def _signal(self, sig: int, frame: FrameType | None) -> None:
        self.stopping = True
        for proc in self.procs.values():
            self._terminate(proc)

    def _terminate(self, proc: subprocess.Popen[bytes]) -> None:
        """SIGTERM once: a worker takes a second signal as "stop now, skip the drain"."""
        if proc.poll() is None and proc.pid not in self.terminated:
            self.terminated.add(proc.pid)
            proc.send_signal(signal.SIGTERM)

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._signal)
        signal.signal(signal.SIGINT, self._signal)
        changed = self._count_changed()
        envs = {i: self._env(i, changed) for i in range(self.settings.workers)}
        journal_root = self.settings.output / JOURNAL_DIR
        journal_root.mkdir(parents=True, exist_ok=True)
        (journal_root / WORKERS_FILE).write_text(f"{self.settings.workers}\n")
        try:
            for i, env in envs.items():
                self._start(i, env)
            log.info(
                "started %d workers on %s:%d",
                len(self.procs),
                self.settings.host,
                self.settings.port,
            )
            return self._watch(envs)
        finally:
            self._stop_all()
            shutil.rmtree(self.rundir, ignore_errors=True)

    def _watch(self, envs: dict[int, dict[str, str]]) -> int:
        while not self.stopping:
            time.sleep(POLL_INTERVAL_S)
            for i, proc in list(self.procs.items()):
                code = proc.poll()
                if code is None or self.stopping:
                    continue
                quick = time.monotonic() - self.started[i] < CRASH_LOOP_S
                self.quick_exits = self.quick_exits + 1 if quick else 0
                if self.quick_exits > MAX_QUICK_RESTARTS:
                    log.error("worker %d keeps exiting (code %s); giving up", i, code)
                    return 1
                log.error("worker %d exited with code %s; starting it again", i, code)
                self._start(i, {**envs[i], "TURNSTILE_RECOVER_OPEN_ROLLOUTS": "restore"})
        return self._stop_all()

    def _stop_all(self) -> int:
        deadline = time.monotonic() + STOP_GRACE_S
        worst = 0
        for i, proc in self.procs.items():
            self._terminate(proc)
            try:
                code = proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.error("worker %d did not stop in %.0f s; killing it", i, STOP_GRACE_S)
                proc.kill()
                code = proc.wait()
            if code != 0:
                log.error("worker %d exited with code %d", i, code)
                worst = 1
        return worst


def run_workers(settings: Settings, argv: list[str]) -> int:
    return Supervisor(settings, argv).run()
