"""Pixel values for a recorded sample's images, rebuilt with the model's own processor.

A vision-language sample is trained from its `input_ids` *and* the tensors the vision tower
reads (for Qwen2-VL and Qwen2.5-VL: `pixel_values` and `image_grid_thw`). Turnstile does
not store those tensors (they are tens of times larger than the image); it stores each
image's bytes exactly as the backend received them (the `media` table) and, with each image
turn, the digest of the image-processor configuration the proxy was started with
(`turnstile.images.processor_digest`). `VisionProcessor` rebuilds the tensors from the
bytes with the model's Hugging Face image processor, after two checks that make them what
the backend processed:

- the configuration's digest equals every digest recorded for the sample's turns (another
  `preprocessor_config.json` resizes differently and the tokens would not line up);
- where the processor reports a patch grid, each image's placeholder span in `input_ids` has
  exactly as many tokens as the grid makes (`tokens_per_image`).

A failed check is a `VisionMismatch` naming the image, never a silently wrong batch. Needs
Pillow (the ``train`` extra); the processor is loaded from the local directory only.
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import pyarrow.compute as pc

from turnstile.images import processor_digest
from turnstile.reader import SampleArrays, ShardReader

__all__ = [
    "VisionMismatch",
    "VisionProcessor",
    "recorded_processor_digests",
]

# The processor output that gives each image's patch grid (time, height, width), where the
# model has one (the Qwen2-VL family and the processors modelled on it).
GRID_KEY: Final = "image_grid_thw"


class VisionMismatch(ValueError):
    """The stored images cannot be turned into the tensors the backend processed."""


def recorded_processor_digests(reader: ShardReader, rollout_id: str) -> set[str]:
    """The processor digests recorded with the image turns of one rollout."""
    table = reader.dataset("turns").to_table(
        columns=["processor_digest"], filter=pc.field("rollout_id") == rollout_id
    )
    return {d for d in table.column("processor_digest").to_pylist() if d is not None}


class VisionProcessor:
    """A model's image processor, loaded from its directory, with the digest that ties it to
    the recorded turns."""

    def __init__(self, model_dir: Path | str) -> None:
        from transformers import AutoImageProcessor  # heavy: loaded on first use

        self.model_dir = Path(model_dir)
        self.digest = processor_digest(self.model_dir)
        self.processor: Any = AutoImageProcessor.from_pretrained(
            str(self.model_dir), local_files_only=True
        )
        self.merge_size: int | None = getattr(self.processor, "merge_size", None)

    def check_digests(self, recorded: Iterable[str | None]) -> None:
        """`VisionMismatch` unless every recorded digest is this processor's."""
        others = sorted({d for d in recorded if d is not None and d != self.digest})
        if others:
            raise VisionMismatch(
                f"the images were recorded with image-processor configuration {others[0][:12]}, "
                f"but {self.model_dir} has {self.digest[:12]}: rebuild with the configuration "
                "the backend served (its preprocessor_config.json)"
            )

    def process(self, images: Sequence[bytes]) -> dict[str, npt.NDArray[Any]]:
        """The processor's tensors for these encoded images, in order, as numpy arrays."""
        from PIL import Image  # Pillow comes with the train extra

        opened = []
        for k, data in enumerate(images):
            try:
                with Image.open(io.BytesIO(data)) as image:
                    image.load()
                    opened.append(image.copy())
            except (OSError, ValueError) as e:
                raise VisionMismatch(f"image {k} cannot be decoded: {e}") from e
        if not opened:
            return {}
        out = self.processor(images=opened, return_tensors="np")
        return {k: np.asarray(v) for k, v in out.items()}

    def tokens_per_image(self, tensors: Mapping[str, npt.NDArray[Any]]) -> list[int] | None:
        """Placeholder tokens per image from the patch grid (None: this processor gives no
        grid to count from)."""
        grid = tensors.get(GRID_KEY)
        if grid is None or not self.merge_size:
            return None
        per = np.prod(grid.astype(np.int64), axis=-1) // (self.merge_size**2)
        return [int(n) for n in per]

    def sample_inputs(
        self, reader: ShardReader, sample: SampleArrays, *, check_digest: bool = True
    ) -> dict[str, npt.NDArray[Any]]:
        """The vision tensors for one sample's images (empty for a text-only sample).

        The images are read from the media table in their order in `input_ids`; the checks
        are the module's. An image recorded by URL only (`remote_images = "url"`) has no
        bytes to rebuild from: that is a `VisionMismatch` too.
        """
        pairs = reader.sample_images(sample)
        if not pairs:
            return {}
        if check_digest:
            self.check_digests(recorded_processor_digests(reader, sample["rollout_id"]))
        data: list[bytes] = []
        for k, (span, stored) in enumerate(pairs):
            if stored is None:
                raise VisionMismatch(
                    f"image {k} of rollout {sample['rollout_id']} was recorded by URL only "
                    f"({span['url']}): start Turnstile with remote_images = 'fetch' to keep "
                    "the bytes"
                )
            data.append(stored.data)
        tensors = self.process(data)
        counts = self.tokens_per_image(tensors)
        if counts is not None:
            for k, (span, n) in enumerate(zip((s for s, _ in pairs), counts, strict=True)):
                if span["length"] != n:
                    raise VisionMismatch(
                        f"image {k} of rollout {sample['rollout_id']} has {span['length']} "
                        f"placeholder tokens in input_ids but this processor makes {n}"
                    )
        return tensors
