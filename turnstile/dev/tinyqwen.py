"""The tiny Qwen3 model and its real tokenizer, built offline for the embedded backend.

* ``ensure_llama_cpp_assets`` takes real tokenizer vocabularies, their test vectors and
  verbatim chat templates from llama.cpp, as vendored in the ``llama-cpp-python`` source
  distribution on PyPI (llama.cpp is MIT licensed; its licence is kept beside the files).
* ``ensure_qwen3_tokenizer`` turns the Qwen2/Qwen3 vocabulary and the Qwen3 chat template into
  a Hugging Face tokenizer directory, checked against llama.cpp's test vectors.
* ``ensure_tiny_qwen3`` builds a tiny randomly initialised Qwen3 (about 20M parameters) with
  that tokenizer, reproducibly from a fixed seed, using the vLLM environment's Python
  (``turnstile.dev.devstack.ensure_vllm_env``).

Everything is cached under ``turnstile.dev.cache.cache_root()``;
``turnstile.dev.devstack`` re-exports these functions and serves the model.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

from turnstile.dev.cache import (
    DevstackError,
    Log,
    _file_lock,
    _marker_matches,
    _offline_env,
    _remove,
    _root,
    _run_logged,
)

__all__ = [
    "QWEN2_VOCAB_FILE",
    "QWEN3_ADDED_TOKENS",
    "QWEN3_TEMPLATE_FILE",
    "ensure_llama_cpp_assets",
    "ensure_qwen3_tokenizer",
    "ensure_tiny_qwen3",
    "read_llama_cpp_test_vectors",
]

# --- Versions and names -------------------------------------------------------------------

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

# --- Timeouts -----------------------------------------------------------------------------

# The llama-cpp-python source distribution is 76 MB, and pip prepares its metadata (which
# installs its build backend) before saving it.
PIP_DOWNLOAD_TIMEOUT_S = 900.0
# Building the tiny model starts torch and transformers and initialises 20M parameters:
# about 10 s when the machine is quiet.
MODEL_BUILD_TIMEOUT_S = 600.0


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
    # Imported here: turnstile.dev.devstack imports this module.
    from turnstile.dev.devstack import VLLM_REQUIREMENT

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
    weights are built by ``turnstile/dev/tiny_model_builder.py`` run with the vLLM
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
    # Imported here: turnstile.dev.devstack imports this module.
    from turnstile.dev.devstack import ensure_vllm_env

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
