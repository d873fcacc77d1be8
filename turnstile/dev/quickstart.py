"""Prove the README's quickstart on a fresh machine: a clean clone, a clean HOME, as pasted.

``python -m turnstile.dev.quickstart`` (run by ``.ci/run``) clones the repository into a
temporary directory and runs the Quickstart section of README.md exactly as a new user
would paste it:

1. its first ``bash`` block (create ``.venv``, install, ``turnstile demo``) with ``HOME``
   pointing at an empty directory, so nothing cached from earlier runs is used except what
   ``--reuse`` names: the vLLM environment and the llama-cpp-python sdist download, the two
   costly artefacts that do not depend on this repository's code (both are keyed by their
   digests all the same). The tokenizer and the tiny model are built from scratch;
2. once the demo prints ``Turnstile is up``, its ``python`` blocks, in order, in one
   interpreter of the clone's ``.venv`` (the client session, then reading the shards);
3. then it stops the demo with SIGINT, as Ctrl-C would.

It prints the fresh cache's listing and the cache lines the demo logged (what was rebuilt),
and leaves the fresh cache in place for the tests that follow (``--home``). POSIX only.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from turnstile.dev.cache import _tail

__all__ = ["main", "quickstart_blocks"]

# Creating the venv and installing the project downloads its dependencies (a clean HOME has
# no pip cache); then the demo fetches llama.cpp's assets, builds the tokenizer and the
# model (about a minute) and starts vLLM cold (93-215 s on two cores).
DEMO_UP_TIMEOUT_S = 1200.0
# The client snippet makes two short calls to the tiny model; reading waits up to 60 s.
SNIPPETS_TIMEOUT_S = 300.0
# After SIGINT the demo drains, publishes its shards and stops vLLM (up to 30 s).
DEMO_STOP_TIMEOUT_S = 90.0
# How often the demo's log is read while it starts.
POLL_INTERVAL_S = 1.0
# How many lines of a log failure messages quote.
TAIL_LINES = 60
# Cloning a local repository only copies files.
CLONE_TIMEOUT_S = 120.0

UP_LINE = "Turnstile is up"
# How the cache's builders report (turnstile.dev.cache.is_current and each builder's log).
_BUILD_LINES = ("cache: ", "built the ", "extracted ", "installed ", "downloading ")
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```\s*$", re.MULTILINE | re.DOTALL)


class QuickstartError(RuntimeError):
    """The quickstart did not work as written; the message says where and quotes the log."""


def quickstart_blocks(readme: str) -> tuple[str, list[str]]:
    """The Quickstart section's first ``bash`` block and the ``python`` blocks before the
    first ``bash`` block that follows them (the harness and the reader snippets)."""
    start = readme.find("\n## Quickstart")
    if start < 0:
        raise QuickstartError("README.md has no '## Quickstart' section")
    end = readme.find("\n## ", start + 1)
    section = readme[start : end if end >= 0 else len(readme)]
    command: str | None = None
    snippets: list[str] = []
    for match in _FENCE.finditer(section):
        language, body = match.group(1), match.group(2)
        if language == "bash":
            if command is None:
                command = body.strip()
                continue
            if snippets:
                break
        elif language == "python" and command is not None:
            snippets.append(body)
    if command is None or not snippets:
        raise QuickstartError("the Quickstart section needs a bash block, then python blocks")
    return command, snippets


def _listing(directory: Path) -> str:
    if not directory.exists():
        return f"{directory}: (does not exist)"
    rows = [f"{directory}:"]
    for entry in sorted(directory.iterdir()):
        if entry.is_symlink():
            rows.append(f"  {entry.name} -> {os.readlink(entry)}")
        else:
            rows.append(f"  {entry.name}{'/' if entry.is_dir() else ''}")
    return "\n".join(rows)


def _prepare_home(home: Path, reuse: Path | None) -> Path:
    cache = home / ".cache" / "turnstile"
    cache.mkdir(parents=True)
    if reuse is not None:
        for name in ("vllm-0.32.0-venv", "downloads"):
            source = reuse / name
            if source.exists():
                (cache / name).symlink_to(source.resolve())
    return cache


def _stop(process: subprocess.Popen[bytes]) -> int:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGINT)
    try:
        return process.wait(DEMO_STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(DEMO_STOP_TIMEOUT_S)
        raise QuickstartError(f"the demo did not stop within {DEMO_STOP_TIMEOUT_S:.0f} s") from None


def run(repo: Path, workdir: Path, reuse: Path | None, log: Path) -> Path:
    """Run the quickstart in ``workdir``; return the fresh cache it built."""
    command, snippets = quickstart_blocks((repo / "README.md").read_text(encoding="utf-8"))
    clone = workdir / "clone"
    subprocess.run(
        ["git", "clone", "-q", str(repo), str(clone)], check=True, timeout=CLONE_TIMEOUT_S
    )
    home = workdir / "home"
    cache = _prepare_home(home, reuse)
    print(f"quickstart: the cache before the demo\n{_listing(cache)}", flush=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TURNSTILE_", "VIRTUAL_ENV"))}
    env["HOME"] = str(home)
    env.pop("PIP_CACHE_DIR", None)
    print(f"quickstart: $ {command}", flush=True)
    started = time.monotonic()
    with log.open("wb") as out:
        process = subprocess.Popen(
            ["bash", "-c", command],
            cwd=clone,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    try:
        while UP_LINE not in log.read_text(encoding="utf-8", errors="replace"):
            if process.poll() is not None:
                raise QuickstartError(
                    f"the quickstart command exited with {process.returncode} before "
                    f"'{UP_LINE}'; last lines of {log}:\n{_tail(log, TAIL_LINES)}"
                )
            if time.monotonic() - started > DEMO_UP_TIMEOUT_S:
                raise QuickstartError(
                    f"no '{UP_LINE}' within {DEMO_UP_TIMEOUT_S:.0f} s; last lines of {log}:\n"
                    f"{_tail(log, TAIL_LINES)}"
                )
            time.sleep(POLL_INTERVAL_S)
        print(f"quickstart: '{UP_LINE}' after {time.monotonic() - started:.0f} s", flush=True)
        script = "\n".join(snippets)
        result = subprocess.run(
            [str(clone / ".venv" / "bin" / "python"), "-c", script],
            cwd=clone,
            env=env,
            capture_output=True,
            text=True,
            timeout=SNIPPETS_TIMEOUT_S,
            check=False,
        )
        print(f"quickstart: the README's python snippets printed:\n{result.stdout}", flush=True)
        if result.returncode != 0:
            raise QuickstartError(
                f"the README's python snippets failed ({result.returncode}):\n{result.stderr}"
            )
    finally:
        status = _stop(process)
    if status != 0:
        raise QuickstartError(f"the demo exited with {status} on SIGINT; see {log}")
    logged = log.read_text(encoding="utf-8", errors="replace").splitlines()
    rebuilt = [line for line in logged if line.startswith(_BUILD_LINES)]
    print("quickstart: what the demo built\n" + "\n".join(rebuilt), flush=True)
    print(f"quickstart: the cache after the demo\n{_listing(cache)}", flush=True)
    return cache


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m turnstile.dev.quickstart", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--repo", type=Path, default=Path.cwd(), help="default: .")
    parser.add_argument(
        "--workdir", type=Path, help="where the clone and HOME go (default: a new temp dir)"
    )
    parser.add_argument(
        "--reuse", type=Path, help="a cache to take the vLLM venv and the sdist download from"
    )
    args = parser.parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="turnstile-quickstart-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        cache = run(args.repo.resolve(), workdir, args.reuse, workdir / "demo.log")
    except (QuickstartError, subprocess.SubprocessError) as exc:
        print(f"quickstart: FAILED: {exc}", file=sys.stderr, flush=True)
        return 1
    print(f"quickstart: ok; fresh cache: {cache}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
