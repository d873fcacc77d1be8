"""The tiny Qwen3 model of the embedded backend, built offline from a fixed seed.

``ensure_tiny_qwen3`` builds a randomly initialised Qwen3 (about 20M parameters) with the real
Qwen3 tokenizer (``turnstile.dev.qwen3_tokenizer``), by running ``tiny_model_builder.py`` with
the vLLM environment's Python (``turnstile.dev.vllm_env``), which has torch. The model
directory is cached under ``turnstile.dev.cache.cache_root()``, keyed by ``tiny_model_digest``.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

from turnstile.dev.cache import (
    Log,
    _file_lock,
    _marker_matches,
    _offline_env,
    _remove,
    _root,
    _run_logged,
    build_digest,
    is_current,
)
from turnstile.dev.qwen3_tokenizer import (
    QWEN3_BOS_ID,
    QWEN3_EOS_ID,
    QWEN3_PAD_ID,
    QWEN3_PADDED_VOCAB_SIZE,
    TOKENIZER_FILES,
    ensure_qwen3_tokenizer,
    tokenizer_digest,
)
from turnstile.dev.vllm_env import ensure_vllm_env, vllm_env_digest

__all__ = ["BUILDER_SCRIPT", "TINY_QWEN3_CONFIG", "ensure_tiny_qwen3", "tiny_model_digest"]

# Run as a script by the vLLM environment's Python (it imports only torch and transformers).
BUILDER_SCRIPT = Path(__file__).with_name("tiny_model_builder.py")

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

# Building the tiny model starts torch and transformers and initialises 20M parameters:
# about 10 s when the machine is quiet.
MODEL_BUILD_TIMEOUT_S = 600.0


def _tiny_model_spec() -> dict[str, Any]:
    """What the builder script reads: the model's config, generation config and seed."""
    return {
        "config": TINY_QWEN3_CONFIG,
        "generation_config": TINY_QWEN3_GENERATION_CONFIG,
        "seed": TINY_QWEN3_SEED,
    }


def tiny_model_digest(vllm_env: str, tokenizer: str) -> str:
    """The digest the model directory is keyed by: the spec, the digests of the vLLM
    environment (whose torch and transformers build it) and of the tokenizer copied into it,
    the builder script and this module."""
    recipe = {**_tiny_model_spec(), "vllm_env": vllm_env, "tokenizer": tokenizer}
    return build_digest(recipe, [BUILDER_SCRIPT, Path(__file__)])


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
    python = ensure_vllm_env(base, log)
    tokenizer_dir = ensure_qwen3_tokenizer(base, log)
    # Both were just made current, so their digests are what their markers hold.
    expected = tiny_model_digest(vllm_env_digest(), tokenizer_digest())
    if is_current(marker, expected, "the tiny Qwen3 model", log):
        return directory
    with _file_lock(base / "locks" / "tiny-qwen3.lock"):
        if _marker_matches(marker, expected):
            return directory
        started = time.monotonic()
        staging = base / "tiny-qwen3.partial"
        _remove(staging)
        staging.mkdir(parents=True)
        spec_file = staging / "build-spec.json"
        spec_file.write_text(json.dumps(_tiny_model_spec(), indent=2), encoding="utf-8")
        log_path = base / "logs" / "tiny-qwen3-build.log"
        # -P: the script's own directory (this package) is not put on sys.path, so none of
        # its modules can shadow one that torch or transformers imports.
        command = [str(python), "-P", str(BUILDER_SCRIPT), "--spec", str(spec_file)]
        _run_logged(
            [*command, "--out", str(staging)],
            log_path,
            MODEL_BUILD_TIMEOUT_S,
            "building the tiny Qwen3 model",
            env=_offline_env(),
        )
        spec_file.unlink()
        for name in TOKENIZER_FILES:
            shutil.copy2(tokenizer_dir / name, staging / name)
        marker_tmp = staging / marker.name
        marker_tmp.write_text(expected + "\n", encoding="utf-8")
        _remove(directory)
        staging.rename(directory)
        log(f"built the tiny Qwen3 model in {directory} ({time.monotonic() - started:.1f} s)")
    return directory
