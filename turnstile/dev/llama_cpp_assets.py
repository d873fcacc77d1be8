"""llama.cpp's real tokenizer vocabularies, test vectors and chat templates, fetched offline.

``ensure_llama_cpp_assets`` takes them from the ``llama-cpp-python`` source distribution on
PyPI, which vendors llama.cpp (MIT licensed; its licence is kept beside the files), and
``read_llama_cpp_test_vectors`` reads a vocabulary's test vectors: texts and the token IDs the
original tokenizer gives them. The tokenizers of the embedded model
(``turnstile.dev.qwen3_tokenizer``) and of the template corpus (``turnstile.dev.vocab``) are
built from these files.
"""

from __future__ import annotations

import shutil
import sys
import tarfile
from pathlib import Path

from turnstile.dev.cache import (
    DevstackError,
    Log,
    _file_lock,
    _marker_matches,
    _remove,
    _root,
    _run_logged,
    build_digest,
    is_current,
)

__all__ = [
    "LLAMA_CPP_PYTHON_REQUIREMENT",
    "REQUIRED_VOCAB_FILE",
    "assets_digest",
    "ensure_llama_cpp_assets",
    "read_llama_cpp_test_vectors",
]

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
LLAMA_CPP_PYTHON_REQUIREMENT = f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}"
_LLAMA_CPP_MODELS = "vendor/llama.cpp/models/"
_LLAMA_CPP_LICENSE = "vendor/llama.cpp/LICENSE"
# The vocabulary of the embedded model (Qwen2, 2.5 and 3 share it): an sdist without it is
# not the one these helpers were written for.
REQUIRED_VOCAB_FILE = "ggml-vocab-qwen2.gguf"
# Separates the cases in llama.cpp's .inp/.out test vector files.
_LLAMA_CPP_TEST_SEPARATOR = "\n__ggml_vocab_test__\n"

# The llama-cpp-python source distribution is 76 MB, and pip prepares its metadata (which
# installs its build backend) before saving it.
PIP_DOWNLOAD_TIMEOUT_S = 900.0


def assets_digest() -> str:
    """The digest the assets directory is keyed by: the sdist pinned and this module."""
    return build_digest(
        {"sdist": LLAMA_CPP_PYTHON_REQUIREMENT, "required": REQUIRED_VOCAB_FILE},
        [Path(__file__)],
    )


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
    expected = assets_digest()
    if is_current(marker, expected, "llama.cpp assets", log):
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
        if not (staging / "vocab" / REQUIRED_VOCAB_FILE).is_file():
            raise DevstackError(f"{sdist} has no {_LLAMA_CPP_MODELS}{REQUIRED_VOCAB_FILE}")
        (staging / marker.name).write_text(expected + "\n", encoding="utf-8")
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
