"""Hugging Face tokenizers built offline from llama.cpp's vendored GGUF vocabularies.

The template audit needs a real tokenizer for each chat template it checks: token-level
prefix checks and end-of-turn detection depend on which markers are single special tokens
and how text next to them is split. llama.cpp ships real vocabularies
(``ggml-vocab-*.gguf``, see ``turnstile.dev.llama_cpp_assets``) with test vectors; this
module turns one into a ``tokenizer.json`` + ``tokenizer_config.json`` (+
``generation_config.json`` for stop tokens) directory and checks it against those vectors.

Two GGUF tokenizer models are supported: ``gpt2`` (byte-level BPE with merges: Qwen2/2.5/3,
Llama 3) and ``llama`` (SentencePiece BPE with scores and byte fallback: Phi-3). A
``VocabSpec`` names a vocabulary plus what a model family changes on top of it: renamed
placeholder tokens, appended tokens, and its EOS and stop tokens.

Built vocabularies are cached under ``cache_root()/template-audit/`` keyed by a digest of the
spec, so tests and the corpus audit build each once.
"""

from __future__ import annotations

import json
import re
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from turnstile.dev.cache import (
    DevstackError,
    Log,
    _file_lock,
    _marker_matches,
    _remove,
    _root,
    build_digest,
    is_current,
)
from turnstile.dev.llama_cpp_assets import (
    assets_digest,
    ensure_llama_cpp_assets,
    read_llama_cpp_test_vectors,
)
from turnstile.dev.qwen3_tokenizer import QWEN_PRETOKENIZE_PATTERN

__all__ = [
    "VocabSpec",
    "build_tokenizer_dir",
    "ensure_vocab_tokenizer",
    "load_tokenizer",
]

# GGUF token types (llama.cpp's llama_token_type).
_TYPE_NORMAL = 1
_TYPE_CONTROL = 3
_TYPE_USER_DEFINED = 4
_TYPE_BYTE = 6
# llama.cpp pads some vocabularies up to the model's embedding size with these
# placeholders; the published tokenizers have no such tokens, so they are left out.
_PADDING_TOKEN = re.compile(r"\[PAD\d+\]")
# SentencePiece's word-boundary marker.
_SPM_SPACE = "\u2581"

# Llama 3's pre-tokenizer split (as in Meta's published tokenizer.json): like Qwen's but
# numbers split into runs of up to three digits.
LLAMA3_PRETOKENIZE_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# For each GGUF ``tokenizer.ggml.pre`` value this module can rebuild, as its published
# tokenizer has it (and llama.cpp's test vectors confirm): the pre-tokenizer split, whether
# text is NFC-normalised first, and whether a pre-token found whole in the vocabulary is
# used as is rather than merged (Llama 3's ``ignore_merges``).
_BPE_PRETOKENIZERS: dict[str, tuple[str, bool, bool]] = {
    "qwen2": (QWEN_PRETOKENIZE_PATTERN, True, False),
    "qwen35": (QWEN_PRETOKENIZE_PATTERN, False, False),
    "llama-bpe": (LLAMA3_PRETOKENIZE_PATTERN, False, True),
}
# Bump when the files this module writes change, so cached tokenizers are rebuilt.
_CACHE_DIR = "template-audit"


@dataclass(frozen=True)
class VocabSpec:
    """A vendored vocabulary and what one model family changes on top of it.

    ``token_overrides`` renames tokens at fixed ids (llama.cpp's placeholders or a base
    vocabulary's reserved slots) as ``(id, content, special)``; ``appended_tokens`` adds
    tokens after the vocabulary as ``(content, special)`` for families whose markers the
    vocabulary lacks (their ids are then not the model's). ``eos_token`` becomes the
    tokenizer's EOS; ``stop_tokens`` become ``generation_config.json``'s ``eos_token_id``
    list, which is what vLLM stops on.
    """

    vocab_file: str
    token_overrides: tuple[tuple[int, str, bool], ...] = ()
    appended_tokens: tuple[tuple[str, bool], ...] = ()
    eos_token: str | None = None
    bos_token: str | None = None
    stop_tokens: tuple[str, ...] = ()
    # An appended token the vocabulary already has as an ordinary token becomes an added
    # token at its id (text-level vocabularies, whose markers may be ordinary text there,
    # e.g. "</s>" in Qwen2's); otherwise that is an error in the spec.
    promote_existing: bool = False

    def digest(self) -> str:
        """The digest this vocabulary's tokenizer directory is keyed by: the spec, the
        assets' digest and this module, which builds it."""
        recipe = [
            assets_digest(),
            self.vocab_file,
            self.token_overrides,
            self.appended_tokens,
            self.eos_token,
            self.bos_token,
            self.stop_tokens,
            self.promote_existing,
            sorted(_BPE_PRETOKENIZERS.items()),
        ]
        return build_digest(recipe, [Path(__file__)])[:16]


@dataclass
class _Gguf:
    model: str
    pre: str | None
    tokens: list[str]
    types: list[int]
    merges: list[str]
    scores: list[float]
    bos_id: int | None
    eos_id: int | None


# GGUF metadata value types (gguf's GGUFValueType) and the struct format of the scalar ones.
_GGUF_MAGIC = b"GGUF"
_GGUF_STRING, _GGUF_ARRAY = 8, 9
_GGUF_SCALARS: dict[int, str] = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}


def _gguf_metadata(path: Path) -> dict[str, Any]:
    """The key/value metadata of a little-endian GGUF file (version 2 or 3).

    A direct parse: ``gguf.GGUFReader`` builds a numpy view per array element, which takes
    seconds for a vocabulary of 150k tokens and as many merges.
    """
    data = path.read_bytes()
    if data[:4] != _GGUF_MAGIC:
        raise DevstackError(f"{path} is not a GGUF file")
    (version,) = struct.unpack_from("<I", data, 4)
    if version < 2:
        raise DevstackError(f"{path}: GGUF version {version} is not supported")
    _tensors, count = struct.unpack_from("<QQ", data, 8)
    offset = 24

    def string(at: int) -> tuple[str, int]:
        (length,) = struct.unpack_from("<Q", data, at)
        start = at + 8
        return data[start : start + length].decode("utf-8"), start + length

    def value(kind: int, at: int) -> tuple[Any, int]:
        if kind == _GGUF_STRING:
            return string(at)
        if kind in _GGUF_SCALARS:
            fmt = "<" + _GGUF_SCALARS[kind]
            return struct.unpack_from(fmt, data, at)[0], at + struct.calcsize(fmt)
        if kind != _GGUF_ARRAY:
            raise DevstackError(f"{path}: unknown GGUF value type {kind}")
        item_kind, items = struct.unpack_from("<IQ", data, at)
        at += 12
        if item_kind in _GGUF_SCALARS:
            fmt = f"<{items}{_GGUF_SCALARS[item_kind]}"
            return list(struct.unpack_from(fmt, data, at)), at + struct.calcsize(fmt)
        out = []
        for _ in range(items):
            item, at = value(item_kind, at)
            out.append(item)
        return out, at

    metadata: dict[str, Any] = {}
    for _ in range(count):
        key, offset = string(offset)
        (kind,) = struct.unpack_from("<I", data, offset)
        metadata[key], offset = value(kind, offset + 4)
    return metadata


def _read_gguf(vocab_file: Path) -> _Gguf:
    metadata = _gguf_metadata(vocab_file)
    model = metadata.get("tokenizer.ggml.model")
    tokens: list[str] = list(metadata.get("tokenizer.ggml.tokens", []))
    if not isinstance(model, str) or not tokens:
        raise DevstackError(f"{vocab_file} has no tokenizer vocabulary")
    types = [int(kind) for kind in metadata.get("tokenizer.ggml.token_type", [])]
    return _Gguf(
        model=model,
        pre=metadata.get("tokenizer.ggml.pre"),
        tokens=tokens,
        types=types or [_TYPE_NORMAL] * len(tokens),
        merges=list(metadata.get("tokenizer.ggml.merges", [])),
        scores=[float(score) for score in metadata.get("tokenizer.ggml.scores", [])],
        bos_id=metadata.get("tokenizer.ggml.bos_token_id"),
        eos_id=metadata.get("tokenizer.ggml.eos_token_id"),
    )


def _added_tokens(vocab: _Gguf, spec: VocabSpec) -> dict[int, tuple[str, bool]]:
    """The vocabulary's added tokens by id: control (special) and user-defined tokens,
    without llama.cpp's padding placeholders, with the spec's overrides applied."""
    added: dict[int, tuple[str, bool]] = {}
    for token_id, (content, kind) in enumerate(zip(vocab.tokens, vocab.types, strict=True)):
        if kind in (_TYPE_CONTROL, _TYPE_USER_DEFINED) and not _PADDING_TOKEN.fullmatch(content):
            added[token_id] = (content, kind == _TYPE_CONTROL)
    for token_id, content, special in spec.token_overrides:
        if token_id >= len(vocab.tokens):
            raise DevstackError(f"{spec.vocab_file}: override id {token_id} is past the vocab")
        added[token_id] = (content, special)
        vocab.tokens[token_id] = content
    return added


def _spm_merges(tokens: list[str], types: list[int], scores: list[float]) -> list[tuple[str, str]]:
    """Merges for a SentencePiece BPE vocabulary: every split of a normal piece into two
    pieces of the vocabulary, highest piece score first (as Hugging Face's converter does)."""
    index = {token: token_id for token_id, token in enumerate(tokens)}
    ranked: list[tuple[float, int, int, str, str]] = []
    for token_id, piece in enumerate(tokens):
        if types[token_id] != _TYPE_NORMAL:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in index and right in index:
                ranked.append((-scores[token_id], index[left], index[right], left, right))
    ranked.sort()
    return [(left, right) for _, _, _, left, right in ranked]


def _build_tokenizer(vocab: _Gguf, spec: VocabSpec) -> Any:
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

    added = _added_tokens(vocab, spec)
    if len(set(vocab.tokens)) != len(vocab.tokens):
        raise DevstackError(f"{spec.vocab_file} has duplicate tokens")
    model_vocab = {token: token_id for token_id, token in enumerate(vocab.tokens)}
    tokenizer: Any
    if vocab.model == "gpt2":
        if vocab.pre not in _BPE_PRETOKENIZERS:
            raise DevstackError(f"{spec.vocab_file}: no pre-tokenizer known for {vocab.pre!r}")
        pattern, nfc, ignore_merges = _BPE_PRETOKENIZERS[vocab.pre]
        merges: list[tuple[str, str]] = []
        for merge in vocab.merges:
            left, _, right = merge.partition(" ")
            merges.append((left, right))
        tokenizer = Tokenizer(
            models.BPE(
                vocab=model_vocab,
                merges=merges,
                unk_token=None,
                continuing_subword_prefix="",
                end_of_word_suffix="",
                fuse_unk=False,
                byte_fallback=False,
                ignore_merges=ignore_merges,
            )
        )
        if nfc:
            tokenizer.normalizer = normalizers.NFC()
        byte_level: dict[str, bool] = {
            "add_prefix_space": False,
            "trim_offsets": False,
            "use_regex": False,
        }
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                pre_tokenizers.ByteLevel(**byte_level),
            ]
        )
        tokenizer.post_processor = processors.ByteLevel(**byte_level)
        tokenizer.decoder = decoders.ByteLevel()
    elif vocab.model == "llama":
        unk = next(
            (token for token, kind in zip(vocab.tokens, vocab.types, strict=True) if kind == 2),
            None,
        )
        tokenizer = Tokenizer(
            models.BPE(
                vocab=model_vocab,
                merges=_spm_merges(vocab.tokens, vocab.types, vocab.scores),
                unk_token=unk,
                fuse_unk=True,
                byte_fallback=any(kind == _TYPE_BYTE for kind in vocab.types),
            )
        )
        # The published Llama-family SentencePiece converters: mark word starts with U+2581
        # and prefix the text with one.
        tokenizer.normalizer = normalizers.Sequence(
            [normalizers.Prepend(_SPM_SPACE), normalizers.Replace(" ", _SPM_SPACE)]
        )
        tokenizer.decoder = decoders.Sequence(
            [
                decoders.Replace(_SPM_SPACE, " "),
                decoders.ByteFallback(),
                decoders.Fuse(),
                decoders.Strip(" ", 1, 0),
            ]
        )
    else:
        raise DevstackError(f"{spec.vocab_file}: unsupported GGUF tokenizer model {vocab.model!r}")
    for token_id in sorted(added):
        content, special = added[token_id]
        tokenizer.add_tokens(
            [AddedToken(content, normalized=False, special=special, lstrip=False, rstrip=False)]
        )
        if tokenizer.token_to_id(content) != token_id:
            raise DevstackError(
                f"{spec.vocab_file}: {content} got id {tokenizer.token_to_id(content)}, "
                f"expected {token_id}"
            )
    for content, special in spec.appended_tokens:
        if tokenizer.token_to_id(content) is not None and not spec.promote_existing:
            raise DevstackError(f"{spec.vocab_file} already has {content}")
        tokenizer.add_tokens([AddedToken(content, normalized=False, special=special)])
    return tokenizer


def _token_content(vocab: _Gguf, token_id: int | None) -> str | None:
    return None if token_id is None else vocab.tokens[token_id]


def _write_directory(vocab_file: Path, spec: VocabSpec, out: Path) -> int:
    """Write the tokenizer files into ``out``; return how many llama.cpp test vectors the
    result reproduces (all of them, or this raises)."""
    vocab = _read_gguf(vocab_file)
    tokenizer = _build_tokenizer(vocab, spec)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    eos = spec.eos_token or _token_content(vocab, vocab.eos_id)
    bos = spec.bos_token or _token_content(vocab, vocab.bos_id)
    added = tokenizer.get_added_tokens_decoder()
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": eos,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1 << 20,
        "added_tokens_decoder": {
            str(token_id): {
                "content": token.content,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": token.special,
            }
            for token_id, token in sorted(added.items())
        },
    }
    (out / "tokenizer_config.json").write_text(
        json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    stops = [tokenizer.token_to_id(token) for token in spec.stop_tokens]
    if any(stop is None for stop in stops):
        raise DevstackError(f"{spec.vocab_file}: a stop token of {spec.stop_tokens} is unknown")
    if stops:
        (out / "generation_config.json").write_text(
            json.dumps({"eos_token_id": stops}, indent=2) + "\n", encoding="utf-8"
        )
    return _verify(tokenizer, vocab_file)


def _verify(tokenizer: Any, vocab_file: Path) -> int:
    if not Path(f"{vocab_file}.inp").is_file():
        return 0
    mismatches: list[str] = []
    vectors = read_llama_cpp_test_vectors(vocab_file)
    for text, expected in vectors:
        got = tokenizer.encode(text, add_special_tokens=False).ids
        if got != expected:
            mismatches.append(f"{text!r}: expected {expected}, got {got}")
    if mismatches:
        raise DevstackError(
            f"the tokenizer built from {vocab_file} disagrees with llama.cpp in "
            f"{len(mismatches)} of {len(vectors)} test vectors:\n" + "\n".join(mismatches[:10])
        )
    return len(vectors)


def ensure_vocab_tokenizer(spec: VocabSpec, root: Path | None = None, log: Log = print) -> Path:
    """Build (once) the tokenizer directory for ``spec`` and return it; it has no chat
    template (pass one to the audit, or use ``build_tokenizer_dir``)."""
    base = _root(root)
    directory = base / _CACHE_DIR / f"{Path(spec.vocab_file).stem}-{spec.digest()}"
    marker = directory / ".turnstile-complete"
    expected = spec.digest() + "\n"
    if is_current(marker, expected.strip(), f"the {spec.vocab_file} tokenizer", log):
        return directory
    assets = ensure_llama_cpp_assets(base, log)
    vocab_file = assets / "vocab" / spec.vocab_file
    if not vocab_file.is_file():
        raise DevstackError(f"no vendored vocabulary {vocab_file}")
    with _file_lock(base / "locks" / f"{directory.name}.lock"):
        if _marker_matches(marker, expected):
            return directory
        staging = directory.with_name(directory.name + ".partial")
        _remove(staging)
        _write_directory(vocab_file, spec, staging)
        (staging / marker.name).write_text(expected, encoding="utf-8")
        _remove(directory)
        staging.rename(directory)
    return directory


def build_tokenizer_dir(
    vocab_gguf: Path,
    template_jinja: Path | None,
    out_dir: Path,
    spec: VocabSpec | None = None,
) -> Path:
    """Write a Hugging Face tokenizer directory for a vendored vocabulary and chat template.

    ``vocab_gguf`` is a ``ggml-vocab-*.gguf`` file; ``spec`` (default: the vocabulary as it
    is) adds a model family's tokens and stop tokens. A vocabulary inside the llama.cpp
    assets directory is built once into the cache and copied; any other is built in place.
    The template, when given, becomes ``chat_template`` in ``tokenizer_config.json``.
    """
    spec = spec or VocabSpec(vocab_gguf.name)
    if spec.vocab_file != vocab_gguf.name:
        raise ValueError(f"spec is for {spec.vocab_file}, not {vocab_gguf.name}")
    if not vocab_gguf.is_file():
        raise FileNotFoundError(vocab_gguf)
    # Vendored vocabularies are built once into the cache; looked up without extracting
    # the assets, so a vocabulary from elsewhere needs no download.
    assets_vocab = _root(None) / "llama-cpp-assets" / "vocab" / vocab_gguf.name
    out_dir.mkdir(parents=True, exist_ok=True)
    if assets_vocab.is_file() and assets_vocab.samefile(vocab_gguf):
        cached = ensure_vocab_tokenizer(spec)
        for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            if (cached / name).is_file():
                shutil.copy2(cached / name, out_dir / name)
    else:
        _write_directory(vocab_gguf, spec, out_dir)
    if template_jinja is not None:
        config_path = out_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text(encoding="utf-8"))
        config["chat_template"] = template_jinja.read_text(encoding="utf-8")
        config_path.write_text(
            json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
        )
    return out_dir


def load_tokenizer(directory: Path) -> Any:
    """Load a Hugging Face tokenizer from a local directory (never from a hub)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
