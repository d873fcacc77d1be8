"""The Turnstile cache directory: paths, locks, markers and logged subprocesses.

Everything the development stack builds (``turnstile.dev.vllm_env``, ``llama_cpp_assets``,
``qwen3_tokenizer``, ``tinyqwen`` and ``vocab``)
lives under ``cache_root()`` (``$TURNSTILE_CACHE``, else ``~/.cache/turnstile``)::

    vllm-0.32.0-venv/        the vLLM virtual environment
    downloads/               the llama-cpp-python source distribution
    template-audit/          one tokenizer directory per vocabulary of the template corpus
    llama-cpp-assets/        vocab/ (ggml-vocab-*.gguf and their .inp/.out test vectors),
                             templates/ (*.jinja chat templates), LICENSE (llama.cpp's)
    qwen3-tokenizer/         the Hugging Face tokenizer directory
    tiny-qwen3/              the tiny model directory (weights, configs, tokenizer files)
    vllm-cache/              vLLM's cache (torch.compile artefacts: warm restarts)
    logs/                    install, build and server logs

Each artefact is built into a temporary directory and renamed into place with a marker file
holding the digest of everything that builds it (``build_digest``: the recipe's values and
the source of the modules that build it), so an interrupted build is redone rather than
trusted, and a change to a builder, its pinned versions or its inputs rebuilds the artefact
(``is_current`` logs why). Builds take a
file lock, so concurrent processes (parallel test sessions) wait for one another. This module
holds the helpers for that: the cache paths, the file lock, marker checks, removal, running
a logged subprocess, and the offline environment. POSIX only (``fcntl`` locks).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
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
    "NO_BUILD_ENV",
    "PIP_INSTALL_TIMEOUT_S",
    "DevstackError",
    "Log",
    "build_digest",
    "cache_root",
    "is_current",
    "read_marker",
]

Log = Callable[[str], None]

# Set (to anything) where nothing may be built or downloaded: tests/unit sets it.
NO_BUILD_ENV = "TURNSTILE_NO_BUILD"

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


def build_digest(recipe: object, sources: Sequence[Path] = ()) -> str:
    """The digest an artefact is keyed by: SHA-256 over its recipe (JSON: pinned versions,
    configs, the digests of its inputs) and the bytes of every source file that builds it."""
    digest = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode())
    for source in sources:
        digest.update(b"\0" + source.name.encode() + b"\0")
        digest.update(source.read_bytes())
    return digest.hexdigest()


def read_marker(marker: Path) -> str | None:
    """The digest a built artefact's marker holds, or None when it is missing."""
    try:
        return marker.read_text(encoding="utf-8").strip()
    except OSError:
        return None


def is_current(marker: Path, digest: str, what: str, log: Log) -> bool:
    """Whether the artefact behind ``marker`` was built from ``digest``; if not, log why it is
    about to be (re)built, or refuse when ``$TURNSTILE_NO_BUILD`` is set."""
    found = read_marker(marker)
    if found == digest:
        return True
    if os.environ.get(NO_BUILD_ENV):
        raise DevstackError(
            f"{what} would be built (or downloaded) into {marker.parent}, but {NO_BUILD_ENV} "
            "is set: this process may use only what is already built"
        )
    if found is None:
        log(f"cache: {what} not built yet (digest {digest[:12]}); building")
    else:
        log(f"cache: {what} was built from digest {found[:12]}, now {digest[:12]}; rebuilding")
    return False


def _marker_matches(marker: Path, expected: str) -> bool:
    return read_marker(marker) == expected.strip()


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
