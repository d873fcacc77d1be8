"""`turnstile bench`: measure Turnstile against a fake backend directly and behind nginx.

Modules: `backend` (a fake vLLM-shaped server), `loadgen` (the load generator, its own
process), `nginx` (an nginx reverse proxy as the reference point), `runner` (starts
everything, runs interleaved rounds, reports). This module holds the few process
helpers they share; it imports nothing heavy, as the backend and loadgen import it.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from typing import Final

# A process group asked to stop (SIGTERM or SIGQUIT) gets this long before SIGKILL:
# Turnstile publishes what it recorded on SIGTERM, which takes a second or two.
STOP_GRACE_S: Final[float] = 10.0
# After SIGKILL, how long to wait for the kernel to reap the leader.
KILL_WAIT_S: Final[float] = 5.0
# One GET /health while waiting for a server to come up.
HEALTH_PROBE_TIMEOUT_S: Final[float] = 2.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def healthy(port: int) -> bool:
    """Whether GET http://127.0.0.1:`port`/health answers 200."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=HEALTH_PROBE_TIMEOUT_S)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status == 200
    except OSError:
        return False
    finally:
        conn.close()


def child_pids(pid: int) -> list[int]:
    """The pids whose parent is `pid` (by a scan of /proc; Linux only)."""
    found: list[int] = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # the command name may hold spaces and parentheses: split after the last ')'
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) > 1 and int(fields[1]) == pid:
            found.append(int(entry))
    return sorted(found)


def descendants(pid: int) -> list[int]:
    """`pid` and every process below it."""
    out = [pid]
    i = 0
    while i < len(out):
        out.extend(p for p in child_pids(out[i]) if p not in out)
        i += 1
    return out


def stop_group(
    proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, grace_s: float = STOP_GRACE_S
) -> None:
    """Stop a process started with `start_new_session=True`, and its whole group.

    Sends `sig` to the group, waits up to `grace_s` for the leader, then SIGKILLs the
    group (whatever is left of it, leader or not).
    """
    try:
        pgid = os.getpgid(proc.pid)
    except ProcessLookupError:
        pgid = proc.pid
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(grace_s)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(KILL_WAIT_S)


def wait_until(check: Callable[[], bool], timeout_s: float, interval_s: float = 0.05) -> bool:
    """Poll `check()` until it is true (True) or `timeout_s` passes (False)."""
    end = time.monotonic() + timeout_s
    while True:
        if check():
            return True
        if time.monotonic() >= end:
            return False
        time.sleep(interval_s)
