"""The trainer's vision tensors, rebuilt from recorded image bytes with the model's own image
processor (a Qwen2-VL configuration, as the tiny VL model ships), and the checks that keep
them what the backend processed."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image
from starlette.testclient import TestClient

from tests.fakes_backend import FakeVLLM
from tests.images import data_url, image_part, png
from turnstile.backends.fake import FAKE_IMAGE_TOKEN_ID
from turnstile.dev.tinyvl import TINY_VL_PREPROCESSOR_CONFIG
from turnstile.reader import ShardReader, open_output
from turnstile.server.app import create_app
from turnstile.settings import load_settings
from turnstile.train.vision import VisionMismatch, VisionProcessor, recorded_processor_digests

# Sides that are multiples of 28 within the configuration's pixel bounds: the fake backend's
# placeholder count (one per 28x28 patch) is then the Qwen2-VL processor's.
WIDE = png(112, 84, seed=1)  # 4 x 3 merged patches
SQUARE = png(56, 56, seed=2)  # 2 x 2


def _processor_dir(root: Path, **changes: Any) -> Path:
    model = root / "model"
    model.mkdir(parents=True, exist_ok=True)
    (model / "preprocessor_config.json").write_text(
        json.dumps(TINY_VL_PREPROCESSOR_CONFIG | changes)
    )
    return model


def _record(tmp_path: Path, model: Path, *parts: dict[str, Any]) -> ShardReader:
    """One rollout with one image call through the app on the fake backend; its shards."""
    out = tmp_path / "out"
    settings = load_settings(
        None,
        {"output": out, "processor": model, "image_token_id": FAKE_IMAGE_TOKEN_ID},
        environ={},
    )
    with TestClient(create_app(settings, backend=FakeVLLM())) as client:
        rid = client.post("/rollouts", json={}).json()["rollout_id"]
        content = [{"type": "text", "text": "What is on the screen?"}, *parts]
        resp = client.post(
            f"/rollouts/{rid}/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": content}]},
        )
        assert resp.status_code == 200, resp.text
        assert client.post(f"/rollouts/{rid}/finish", json={}).status_code == 200
    return open_output(out)


def _pil(data: bytes) -> Image.Image:
    with Image.open(io.BytesIO(data)) as image:
        image.load()
        return image.copy()


def test_a_samples_tensors_are_the_processors_on_the_original_images(tmp_path: Path) -> None:
    model = _processor_dir(tmp_path)
    reader = _record(
        tmp_path,
        model,
        image_part(data_url(WIDE)),
        image_part(data_url(SQUARE)),
        image_part(data_url(WIDE)),
    )
    (sample,) = reader.sample_arrays()
    vision = VisionProcessor(model)
    assert recorded_processor_digests(reader, sample["rollout_id"]) == {vision.digest}
    rebuilt = vision.sample_inputs(reader, sample)
    original = vision.processor(images=[_pil(WIDE), _pil(SQUARE), _pil(WIDE)], return_tensors="np")
    assert sorted(rebuilt) == ["image_grid_thw", "pixel_values"]
    assert np.array_equal(rebuilt["pixel_values"], original["pixel_values"])
    assert rebuilt["pixel_values"].dtype == np.float32
    assert rebuilt["image_grid_thw"].tolist() == [[1, 6, 8], [1, 4, 4], [1, 6, 8]]
    assert vision.tokens_per_image(rebuilt) == [s["length"] for s in sample["images"]]
    assert [s["length"] for s in sample["images"]] == [12, 4, 12]


def test_a_text_only_sample_has_no_vision_tensors(tmp_path: Path) -> None:
    model = _processor_dir(tmp_path)
    reader = _record(tmp_path, model)
    (sample,) = reader.sample_arrays()
    assert VisionProcessor(model).sample_inputs(reader, sample) == {}


def test_another_processor_configuration_is_refused(tmp_path: Path) -> None:
    reader = _record(tmp_path, _processor_dir(tmp_path), image_part(data_url(WIDE)))
    (sample,) = reader.sample_arrays()
    other = VisionProcessor(_processor_dir(tmp_path / "other", max_pixels=500_000))
    with pytest.raises(VisionMismatch, match="image-processor configuration"):
        other.sample_inputs(reader, sample)


def test_spans_that_the_processor_would_not_make_are_refused(tmp_path: Path) -> None:
    """A processor that merges no patches makes 4x the tokens the record holds."""
    reader = _record(tmp_path, _processor_dir(tmp_path), image_part(data_url(SQUARE)))
    (sample,) = reader.sample_arrays()
    unmerged = VisionProcessor(_processor_dir(tmp_path / "unmerged", merge_size=1))
    with pytest.raises(VisionMismatch, match=r"has 4 placeholder tokens .* makes 16"):
        unmerged.sample_inputs(reader, sample, check_digest=False)


def test_undecodable_bytes_are_named(tmp_path: Path) -> None:
    vision = VisionProcessor(_processor_dir(tmp_path))
    with pytest.raises(VisionMismatch, match="image 1 cannot be decoded"):
        vision.process([SQUARE, SQUARE[:40]])


def test_an_image_recorded_by_url_only_cannot_be_rebuilt(tmp_path: Path) -> None:
    reader = _record(
        tmp_path, _processor_dir(tmp_path), image_part("http://127.0.0.1:9/screen.png")
    )
    (sample,) = reader.sample_arrays()
    with pytest.raises(VisionMismatch, match=r"recorded by URL only .*remote_images = 'fetch'"):
        VisionProcessor(tmp_path / "model").sample_inputs(reader, sample)
