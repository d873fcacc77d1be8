"""The Turnstile cache directory: paths, locks, markers and logged subprocesses.

Everything the embedded backend builds (``turnstile.dev.devstack`` and ``turnstile.dev.tinyqwen``)
lives under ``cache_root()`` (``$TURNSTILE_CACHE``, else ``~/.cache/turnstile``)::

    vllm-0.32.0-venv/        the vLLM virtual environment
    downloads/               the llama-cpp-python source distribution
    llama-cpp-assets/        vocab/ (ggml-vocab-*.gguf and their .inp/.out test vectors),
                             templates/ (*.jinja chat templates), LICENSE (llama.cpp's)
    qwen3-tokenizer/         the Hugging Face tokenizer directory
    tiny-qwen3/              the tiny model directory (weights, configs, tokenizer files)
    vllm-cache/              vLLM's cache (torch.compile artefacts: warm restarts)
    logs/                    install, build and server logs

Each artefact is built into a temporary directory and renamed into place with a marker file
naming what was built, so an interrupted build is redone rather than trusted. Builds take a
file lock, so concurrent processes (parallel test sessions) wait for one another. This module
holds the helpers for that: the cache paths, the file lock, marker checks, removal, running
a logged subprocess, and the offline environment. POSIX only (``fcntl`` locks).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

__all__ = [
    "LOCK_POLL_INTERVAL_S",
    "LOCK_WAIT_TIMEOUT_S",
    "LOG_TAIL_LINES",
    "PIP_INSTALL_TIMEOUT_S",
    "DevstackError",
    "Log",
    "cache_root",
]

Log = Callable[[str], None]

# --- Timeouts and limits ------------------------------------------------------------------

# Installing vLLM downloads 2.5-3.5 GB and takes about 2 minutes with a warm pip cache; a
# cold cache on a slow link can take many times that.
PIP_INSTALL_TIMEOUT_S = 3600.0
# A lock is held for at most one build, of which installing vLLM is the longest.
LOCK_WAIT_TIMEOUT_S = PIP_INSTALL_TIMEOUT_S + 300.0
# How often a waiting process retries a held lock.
LOCK_POLL_INTERVAL_S = 0.5
# How many trailing log lines error messages quote.
LOG_TAIL_LINES = 40


class DevstackError(RuntimeError):
    """A step of building or running the embedded backend failed."""


# --- Paths and small helpers --------------------------------------------------------------


def cache_root() -> Path:
    """Return the directory that holds every cached artefact: ``$TURNSTILE_CACHE`` or
    ``~/.cache/turnstile``."""
    configured = os.environ.get("TURNSTILE_CACHE")
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".cache" / "turnstile"


def _root(root: Path | None) -> Path:
    path = cache_root() if root is None else root
    path.mkdir(parents=True, exist_ok=True)
    return path


def _tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """Return the last lines of a log file, or a note that it cannot be read."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        return f"(log {path} unreadable: {exc})"
    return "\n".join(text.splitlines()[-lines:])


@contextlib.contextmanager
def _file_lock(path: Path, timeout_s: float = LOCK_WAIT_TIMEOUT_S) -> Iterator[None]:
    """Hold an exclusive advisory lock on ``path`` (created if missing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise DevstackError(
                        f"could not take the lock {path} within {timeout_s:.0f} s; "
                        "another process is building the same artefact"
                    ) from None
                time.sleep(LOCK_POLL_INTERVAL_S)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _marker_matches(marker: Path, expected: str) -> bool:
    try:
        return marker.read_text(encoding="utf-8") == expected
    except OSError:
        return False


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _run_logged(
    cmd: Sequence[str],
    log_path: Path,
    timeout_s: float,
    what: str,
    env: dict[str, str] | None = None,
) -> None:
    """Run ``cmd`` with its output appended to ``log_path``; raise with the log's tail if it
    fails or runs past ``timeout_s``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as out:
        out.write(f"$ {' '.join(cmd)}\n".encode())
        out.flush()
        try:
            completed = subprocess.run(
                list(cmd),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                timeout=timeout_s,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise DevstackError(
                f"{what} did not finish within {timeout_s:.0f} s; "
                f"last lines of {log_path}:\n{_tail(log_path)}"
            ) from None
    if completed.returncode != 0:
        raise DevstackError(
            f"{what} failed with exit status {completed.returncode}; "
            f"last lines of {log_path}:\n{_tail(log_path)}"
        )


def _offline_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["HF_HUB_OFFLINE"] = "1"
    if extra:
        env.update(extra)
    return env
