"""Build a tiny randomly initialised Qwen2-VL model directory from a build spec.

Run by ``turnstile.dev.tinyvl.ensure_tiny_vl`` with the vLLM environment's Python, which has
torch (the project's own environment need not). It imports only torch, transformers and the
standard library, and runs with ``-P`` so that the modules beside it cannot shadow the ones
torch imports::

    python -P tiny_vl_builder.py --spec build-spec.json --out MODEL_DIR

The spec is JSON with ``config`` (``Qwen2VLConfig`` keyword arguments, with ``text_config``
and ``vision_config``), ``generation_config`` and ``seed``. The weights are initialised from
the seed, cast to bfloat16 and saved as safetensors, so the same spec gives the same files.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def build(spec: dict[str, Any], out: Path) -> int:
    """Write config.json, generation_config.json and model.safetensors into ``out``; return
    the parameter count."""
    import torch
    from transformers import GenerationConfig, Qwen2VLConfig, Qwen2VLForConditionalGeneration

    torch.manual_seed(int(spec["seed"]))
    config = Qwen2VLConfig(**spec["config"])
    model = Qwen2VLForConditionalGeneration(config)
    model = model.bfloat16()
    model.generation_config = GenerationConfig(**spec["generation_config"])  # type: ignore[no-untyped-call]
    model.save_pretrained(str(out))
    return sum(parameter.numel() for parameter in model.parameters())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", type=Path, required=True, help="the build spec (JSON)")
    parser.add_argument("--out", type=Path, required=True, help="the model directory")
    args = parser.parse_args(argv)
    spec = json.loads(args.spec.read_text(encoding="utf-8"))
    args.out.mkdir(parents=True, exist_ok=True)
    parameters = build(spec, args.out)
    print(f"saved {parameters} parameters to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
