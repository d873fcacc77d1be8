"""Images through Turnstile in front of a real vLLM serving a tiny Qwen2-VL on the CPU.

The openai client sends screenshot-sized PNGs, whole and streamed, over two turns of one
rollout (the first image again in the second turn). The recorded prompt ids are vLLM's own,
each image's span covers exactly its placeholder tokens (as many as the model's processor
makes of it), the bytes are stored once per hash, and the processor's digest is recorded.
The trainer's `pixel_values` and `image_grid_thw`, rebuilt from the stored bytes, equal the
processor's output on the images the client sent.

In TITO mode the same conversation goes to vLLM's token-in route as token ids plus the
images: each turn's prompt extends the last one token for token, with the placeholders
expanded by vLLM exactly as its chat route expands them.
"""

from __future__ import annotations

import base64
import io
import itertools
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import numpy as np
import openai
import pyarrow.parquet as pq
import pytest
from PIL import Image

from tests.images import data_url, image_part, png
from tests.live import LiveServer
from tests.published import published_rollout
from turnstile.dev import devstack
from turnstile.dev.tinyvl import (
    TINY_VL_IMAGE_TOKEN_ID,
    TINY_VL_PREPROCESSOR_CONFIG,
    TINY_VL_SERVED_NAME,
    TINY_VL_VISION_END_ID,
    TINY_VL_VISION_START_ID,
    ensure_tiny_vl,
    ensure_vision_overlay,
    vision_env,
)
from turnstile.images import processor_digest, sha256_hex
from turnstile.reader import SampleArrays, ShardReader, open_output
from turnstile.server.app import create_app
from turnstile.settings import load_settings
from turnstile.train.vision import VisionProcessor

SCREENSHOT = png(1280, 800, seed=1)
WINDOW = png(640, 400, seed=2)
PATCH = 28  # 14-pixel patches merged 2x2


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _pil(data: bytes) -> Image.Image:
    with Image.open(io.BytesIO(data)) as image:
        image.load()
        return image.copy()


def _sample_arrays(reader: ShardReader, sample_index: int) -> SampleArrays:
    return next(s for s in reader.sample_arrays() if s["sample_index"] == sample_index)


def expected_tokens(width: int, height: int) -> int:
    """The placeholder tokens Qwen2-VL's processor makes of a width x height image: its
    `smart_resize` (each side a multiple of 28, the area within min/max pixels, the aspect
    kept), then one token per merged 28x28 patch."""
    config = TINY_VL_PREPROCESSOR_CONFIG
    low, high = config["min_pixels"], config["max_pixels"]
    h = max(PATCH, round(height / PATCH) * PATCH)
    w = max(PATCH, round(width / PATCH) * PATCH)
    if h * w > high:
        beta = math.sqrt(height * width / high)
        h = max(PATCH, math.floor(height / beta / PATCH) * PATCH)
        w = max(PATCH, math.floor(width / beta / PATCH) * PATCH)
    elif h * w < low:
        beta = math.sqrt(low / (height * width))
        h = math.ceil(height * beta / PATCH) * PATCH
        w = math.ceil(width * beta / PATCH) * PATCH
    return (h // PATCH) * (w // PATCH)


@pytest.fixture(scope="module")
def vl_model() -> Path:
    return ensure_tiny_vl(log=_log)


@pytest.fixture(scope="module")
def vl_vllm(
    vl_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[devstack.VLLMServer]:
    overlay = ensure_vision_overlay(log=_log)
    server = devstack.start_vllm(
        vl_model,
        devstack.free_port(),
        served_model_name=TINY_VL_SERVED_NAME,
        # --enable-scale-out: the token-in route TITO sends image turns to
        extra_args=["--limit-mm-per-prompt", '{"image": 4}', "--enable-scale-out"],
        log_path=tmp_path_factory.mktemp("vllm-vl") / "vllm.log",
        extra_env=vision_env(overlay),
    )
    try:
        server.wait_healthy()
    except devstack.DevstackError as exc:
        server.stop()
        pytest.fail(str(exc), pytrace=False)
    try:
        yield server
    finally:
        server.stop()


def _direct_prompt_ids(server: devstack.VLLMServer, messages: list[Any]) -> list[int]:
    body = {
        "model": TINY_VL_SERVED_NAME,
        "messages": messages,
        "max_tokens": 1,
        "temperature": 0,
        "return_token_ids": True,
    }
    resp = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=300)
    assert resp.status_code == 200, resp.text
    return list(resp.json()["prompt_token_ids"])


def test_images_are_recorded_with_exact_spans_and_stored_once(
    vl_vllm: devstack.VLLMServer, vl_model: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    settings = load_settings(
        None,
        {
            "backends": [vl_vllm.base_url],
            "output": out,
            "tokenizer": vl_model,  # gives the image token id and the processor digest
            "shard_max_age_s": 0.2,
        },
        environ={},
    )
    with LiveServer(create_app(settings)) as turnstile:
        rid = httpx.post(f"{turnstile.url}/rollouts", json={}, timeout=30).json()["rollout_id"]
        client = openai.OpenAI(
            base_url=f"{turnstile.url}/rollouts/{rid}/v1", api_key="unused", timeout=300
        )
        first: Any = {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is on this screen?"},
                image_part(data_url(SCREENSHOT)),
            ],
        }
        answer = client.chat.completions.create(
            model=TINY_VL_SERVED_NAME,
            messages=[first],
            max_tokens=8,
            temperature=0,
        )
        second_messages: list[Any] = [
            first,
            {"role": "assistant", "content": answer.choices[0].message.content or ""},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "And this window, beside the first screen?"},
                    image_part(data_url(WINDOW)),
                    image_part(data_url(SCREENSHOT)),
                ],
            },
        ]
        parts = [
            chunk.choices[0].delta.content or ""
            for chunk in client.chat.completions.create(
                model=TINY_VL_SERVED_NAME,
                messages=second_messages,
                max_tokens=8,
                temperature=0,
                stream=True,
            )
            if chunk.choices
        ]
        assert isinstance("".join(parts), str)
        assert httpx.post(f"{turnstile.url}/rollouts/{rid}/finish", timeout=30).status_code == 200
        samples, turns = published_rollout(out, rid)

    first_turn, second_turn = turns
    # The recorded prompt ids are the ones vLLM itself makes of the same messages.
    assert first_turn["prompt_token_ids"] == _direct_prompt_ids(vl_vllm, [first])
    assert second_turn["prompt_token_ids"] == _direct_prompt_ids(vl_vllm, second_messages)
    big, small = expected_tokens(1280, 800), expected_tokens(640, 400)
    for turn, images in (
        (first_turn, [SCREENSHOT]),
        (second_turn, [SCREENSHOT, WINDOW, SCREENSHOT]),
    ):
        ids = turn["prompt_token_ids"]
        spans = turn["image_spans"]
        assert [s["sha256"] for s in spans] == [sha256_hex(i) for i in images]
        assert [s["length"] for s in spans] == [big if i is SCREENSHOT else small for i in images]
        for span in spans:  # exactly the placeholder run, between its start and end marks
            start, end = span["start"], span["start"] + span["length"]
            assert set(ids[start:end]) == {TINY_VL_IMAGE_TOKEN_ID}
            assert ids[start - 1] == TINY_VL_VISION_START_ID and ids[end] == TINY_VL_VISION_END_ID
        assert ids.count(TINY_VL_IMAGE_TOKEN_ID) == sum(s["length"] for s in spans)
        assert turn["processor_digest"] == processor_digest(vl_model)
        assert "base64" not in (turn["request_messages_json"] or "")
    # Each image stored once, though sent three times over two calls.
    reader = open_output(out)
    media = reader.read("media")
    assert sorted(media.column("sha256").to_pylist()) == sorted(
        [sha256_hex(SCREENSHOT), sha256_hex(WINDOW)]
    )
    stored = reader.images([sha256_hex(SCREENSHOT)])[sha256_hex(SCREENSHOT)]
    assert stored.data == SCREENSHOT and stored.mime_type == "image/png"
    # The last sample's images sit on image tokens of its input_ids.
    last = max(samples, key=lambda s: s["sample_index"])
    for span in last["image_spans"]:
        run = last["input_ids"][span["start"] : span["start"] + span["length"]]
        assert set(run) == {TINY_VL_IMAGE_TOKEN_ID}
    # The trainer's tensors, rebuilt from the stored bytes with the model's processor, are
    # the processor's output on the images the client sent, and make vLLM's token counts.
    vision = VisionProcessor(vl_model)
    rebuilt = vision.sample_inputs(reader, _sample_arrays(reader, last["sample_index"]))
    originals = [_pil(i) for i in (SCREENSHOT, WINDOW, SCREENSHOT)]
    expected = vision.processor(images=originals, return_tensors="np")
    assert np.array_equal(rebuilt["pixel_values"], expected["pixel_values"])
    assert np.array_equal(rebuilt["image_grid_thw"], expected["image_grid_thw"])
    assert vision.tokens_per_image(rebuilt) == [s["length"] for s in last["image_spans"]]
    _log(
        f"rebuilt: pixel_values {rebuilt['pixel_values'].shape} "
        f"{rebuilt['pixel_values'].dtype}, image_grid_thw {rebuilt['image_grid_thw'].tolist()}"
    )
    shard_bytes = sum(p.stat().st_size for p in (out / "media").glob("part-*.parquet"))
    raw = len(SCREENSHOT) + len(WINDOW)
    rows = sum(pq.ParquetFile(p).metadata.num_rows for p in (out / "media").glob("part-*.parquet"))
    _log(
        f"images: spans {[(s['start'], s['length']) for s in second_turn['image_spans']]}; "
        f"media {rows} rows, {shard_bytes} bytes of shards for {raw} raw bytes "
        f"({shard_bytes / raw:.2f}x)"
    )


def test_responses_and_messages_images_reach_vllm_and_are_recorded(
    vl_vllm: devstack.VLLMServer, vl_model: Path, tmp_path: Path
) -> None:
    """The openai SDK's Responses `input_image` and the anthropic SDK's base64 `image`
    block, through Turnstile to the VL model: each prompt holds the image's placeholder
    run, as vLLM makes it of the same chat message, and the image is stored once."""
    out = tmp_path / "out"
    settings = load_settings(
        None,
        {
            "backends": [vl_vllm.base_url],
            "output": out,
            "tokenizer": vl_model,
            "shard_max_age_s": 0.2,
        },
        environ={},
    )
    question = "What is in this window?"
    with LiveServer(create_app(settings)) as turnstile:
        rid = httpx.post(f"{turnstile.url}/rollouts", json={}, timeout=30).json()["rollout_id"]
        base = f"{turnstile.url}/rollouts/{rid}"
        answer = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=300).responses
        response = answer.create(
            model=TINY_VL_SERVED_NAME,
            input=[
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": question},
                        {"type": "input_image", "image_url": data_url(WINDOW), "detail": "auto"},
                    ],
                }
            ],
            max_output_tokens=4,
            temperature=0,
        )
        assert response.status in ("completed", "incomplete")
        claude = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0, timeout=300)
        message = claude.messages.create(
            model=TINY_VL_SERVED_NAME,
            max_tokens=4,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": question},
                        {
                            "type": "image",
                            "source": {
                                "type": "base64",
                                "media_type": "image/png",
                                "data": base64.b64encode(WINDOW).decode(),
                            },
                        },
                    ],
                }
            ],
        )
        assert message.role == "assistant"
        assert httpx.post(f"{base}/finish", timeout=30).status_code == 200
        _, turns = published_rollout(out, rid)
    direct = _direct_prompt_ids(
        vl_vllm,
        [
            {
                "role": "user",
                "content": [{"type": "text", "text": question}, image_part(data_url(WINDOW))],
            }
        ],
    )
    assert len(turns) == 2  # the Responses call, then the Messages call
    for turn in turns:
        (span,) = turn["image_spans"]
        assert span["sha256"] == sha256_hex(WINDOW)
        assert span["length"] == expected_tokens(640, 400)
        ids = turn["prompt_token_ids"]
        assert set(ids[span["start"] : span["start"] + span["length"]]) == {TINY_VL_IMAGE_TOKEN_ID}
    # The Responses turn is the chat message vLLM itself renders (no system prompt).
    assert turns[0]["prompt_token_ids"] == direct
    media = open_output(out).read("media")
    assert media.column("sha256").to_pylist() == [sha256_hex(WINDOW)]


def _generate_prompt(server: devstack.VLLMServer, ids: list[int], images: list[bytes]) -> list[int]:
    body = {
        "model": TINY_VL_SERVED_NAME,
        "token_ids": ids,
        "content_parts": [{"type": "image_url", "url": data_url(i)} for i in images],
        "sampling_params": {"max_tokens": 1, "temperature": 0},
        "return_token_ids": True,
    }
    resp = httpx.post(f"{server.base_url}/inference/v1/generate", json=body, timeout=300)
    assert resp.status_code == 200, resp.text
    return list(resp.json()["prompt_token_ids"])


def test_tito_sends_image_turns_as_token_ids_with_their_images(
    vl_vllm: devstack.VLLMServer, vl_model: Path, tmp_path: Path
) -> None:
    """Three TITO turns (whole, streamed, whole) of one rollout with images in the first
    two: every prompt extends the last prompt and completion token for token, so the
    rollout is one exact sample, and its images sit on vLLM's own placeholder runs."""
    out = tmp_path / "out"
    settings = load_settings(
        None,
        {
            "backends": [vl_vllm.base_url],
            "output": out,
            "tokenizer": vl_model,
            "mode": "tito",
            "shard_max_age_s": 0.2,
        },
        environ={},
    )
    first: Any = {
        "role": "user",
        "content": [
            {"type": "text", "text": "What is on this screen?"},
            image_part(data_url(SCREENSHOT)),
        ],
    }
    with LiveServer(create_app(settings)) as turnstile:
        rid = httpx.post(f"{turnstile.url}/rollouts", json={}, timeout=30).json()["rollout_id"]
        client = openai.OpenAI(
            base_url=f"{turnstile.url}/rollouts/{rid}/v1", api_key="unused", timeout=300
        )
        answer = client.chat.completions.create(
            model=TINY_VL_SERVED_NAME, messages=[first], max_tokens=8, temperature=0
        )
        messages: list[Any] = [
            first,
            answer.choices[0].message.model_dump(exclude_none=True),
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "And this window, beside the first screen?"},
                    image_part(data_url(WINDOW)),
                    image_part(data_url(SCREENSHOT)),
                ],
            },
        ]
        pieces: list[str] = []
        for chunk in client.chat.completions.create(
            model=TINY_VL_SERVED_NAME, messages=messages, max_tokens=8, temperature=0, stream=True
        ):
            if chunk.choices:
                pieces.append(chunk.choices[0].delta.content or "")
                reasoning = getattr(chunk.choices[0].delta, "reasoning", None)
                pieces.append(reasoning or "")
        messages += [
            {"role": "assistant", "content": "", "reasoning": "".join(pieces)},
            {"role": "user", "content": "Thanks."},
        ]
        third = client.chat.completions.create(
            model=TINY_VL_SERVED_NAME, messages=messages, max_tokens=8, temperature=0
        )
        assert third.choices[0].finish_reason in ("stop", "length")
        stats = httpx.get(f"{turnstile.url}/stats", timeout=30).json()["tito"]
        assert httpx.post(f"{turnstile.url}/rollouts/{rid}/finish", timeout=30).status_code == 200
        samples, turns = published_rollout(out, rid)

    assert stats["image_turns"] == 3 and stats["extended"] == 2, stats
    assert stats["split"] == 0 and stats["placeholder_split"] == 0, stats
    # The first prompt is what vLLM's chat route makes of the same message.
    assert turns[0]["prompt_token_ids"] == _direct_prompt_ids(vl_vllm, [first])
    # Each prompt extends the previous prompt and completion token for token: one sample.
    for before, after in itertools.pairwise(turns):
        context = before["prompt_token_ids"] + before["completion_token_ids"]
        assert after["prompt_token_ids"][: len(context)] == context
    (sample,) = samples
    last = turns[-1]
    assert sample["break_kind"] == "first"
    assert sample["input_ids"] == last["prompt_token_ids"] + last["completion_token_ids"]
    big, small = expected_tokens(1280, 800), expected_tokens(640, 400)
    for turn, images in (
        (turns[0], [SCREENSHOT]),
        (turns[1], [SCREENSHOT, WINDOW, SCREENSHOT]),
        (turns[2], [SCREENSHOT, WINDOW, SCREENSHOT]),
    ):
        ids, spans = turn["prompt_token_ids"], turn["image_spans"]
        assert [s["sha256"] for s in spans] == [sha256_hex(i) for i in images]
        assert [s["length"] for s in spans] == [big if i is SCREENSHOT else small for i in images]
        for span in spans:
            start, end = span["start"], span["start"] + span["length"]
            assert set(ids[start:end]) == {TINY_VL_IMAGE_TOKEN_ID}
            assert ids[start - 1] == TINY_VL_VISION_START_ID and ids[end] == TINY_VL_VISION_END_ID
        assert ids.count(TINY_VL_IMAGE_TOKEN_ID) == sum(s["length"] for s in spans)
    assert sample["image_spans"] == last["image_spans"]
    # Why TITO keeps the placeholders unexpanded: vLLM expands ids it is sent again.
    recorded = turns[0]["prompt_token_ids"]
    assert len(_generate_prompt(vl_vllm, recorded, [SCREENSHOT])) == len(recorded) + big - 1
    # The trainer's tensors, rebuilt from the stored bytes, are the processor's output.
    reader = open_output(out)
    assert sorted(reader.read("media").column("sha256").to_pylist()) == sorted(
        [sha256_hex(SCREENSHOT), sha256_hex(WINDOW)]
    )
    vision = VisionProcessor(vl_model)
    rebuilt = vision.sample_inputs(reader, _sample_arrays(reader, sample["sample_index"]))
    expected = vision.processor(
        images=[_pil(i) for i in (SCREENSHOT, WINDOW, SCREENSHOT)], return_tensors="np"
    )
    assert np.array_equal(rebuilt["pixel_values"], expected["pixel_values"])
    assert vision.tokens_per_image(rebuilt) == [s["length"] for s in sample["image_spans"]]
    _log(
        f"TITO images: {len(sample['input_ids'])} ids in one sample; spans "
        f"{[(s['start'], s['length']) for s in sample['image_spans']]}; stats {stats}"
    )
