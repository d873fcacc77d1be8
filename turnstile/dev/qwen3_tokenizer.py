"""The Qwen3 tokenizer of the embedded model, built offline from llama.cpp's vocabulary.

``ensure_qwen3_tokenizer`` turns the Qwen2/Qwen3 vocabulary (``ggml-vocab-qwen2.gguf``) and the
verbatim Qwen3 chat template from ``turnstile.dev.llama_cpp_assets`` into a Hugging Face
tokenizer directory, checked against llama.cpp's test vectors, cached under
``turnstile.dev.cache.cache_root()``.
"""

from __future__ import annotations

import json
import time
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
    REQUIRED_VOCAB_FILE,
    assets_digest,
    ensure_llama_cpp_assets,
    read_llama_cpp_test_vectors,
)

__all__ = [
    "QWEN2_VOCAB_FILE",
    "QWEN3_ADDED_TOKENS",
    "QWEN3_TEMPLATE_FILE",
    "TOKENIZER_FILES",
    "ensure_qwen3_tokenizer",
    "tokenizer_digest",
]

QWEN2_VOCAB_FILE = REQUIRED_VOCAB_FILE
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
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt")


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
    expected = tokenizer_digest()
    if is_current(marker, expected, "the Qwen3 tokenizer", log):
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
        (staging / marker.name).write_text(expected + "\n", encoding="utf-8")
        _remove(directory)
        staging.rename(directory)
        log(
            f"built the Qwen3 tokenizer in {directory} ({time.monotonic() - started:.1f} s; "
            f"{checked} llama.cpp test vectors match)"
        )
    return directory


def tokenizer_digest() -> str:
    """The digest the tokenizer directory is keyed by: its inputs (the assets' digest, the
    vocabulary and template chosen, Qwen's added tokens and split) and this module, which
    builds it."""
    recipe = {
        "assets": assets_digest(),
        "vocab": QWEN2_VOCAB_FILE,
        "template": QWEN3_TEMPLATE_FILE,
        "pretokenize": QWEN_PRETOKENIZE_PATTERN,
        "added": QWEN3_ADDED_TOKENS,
        "bpe_size": QWEN_BPE_VOCAB_SIZE,
    }
    return build_digest(recipe, [Path(__file__)])


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
