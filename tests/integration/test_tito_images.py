"""TITO image turns through the app, in front of a simulated vLLM token-in route.

`VisionModel` is `SimulatedModel` (the real Qwen vocabulary, Qwen3.5's verbatim template)
with vLLM's `/inference/v1/generate`: it takes token ids with one `<|image_pad|>` per image
and the images as `content_parts`, and expands each placeholder to one token per 28x28
patch, as vLLM does (the real route is exercised in `test_images_vllm.py`). The tests
check what TITO sends (placeholders unexpanded, every image of the conversation, in
order), what it records (the expanded ids), and its errors: a backend without the route,
a template that lays out no placeholders, and a sampled placeholder token.
"""

from __future__ import annotations

import base64
import struct
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest

from tests.images import data_url, image_part, png
from tests.live import LiveServer
from turnstile.backends.fake import JSON_HEADERS, SSE_DONE, FakeResponse, sse_event, usage
from turnstile.dev.drift import SimulatedModel
from turnstile.dev.llama_cpp_assets import ensure_llama_cpp_assets
from turnstile.dev.qwen3_tokenizer import ensure_qwen3_tokenizer
from turnstile.dev.vocab import load_tokenizer
from turnstile.images import sha256_hex
from turnstile.server.app import create_app
from turnstile.settings import load_settings
from turnstile.tito import TemplateRenderer
from turnstile.tito.generate import GENERATE_PATH
from turnstile.tito.parsers import parser_for_template

pytestmark = pytest.mark.assets

TEMPLATE = "Qwen3.5-4B.jinja"
IMAGE = 151655  # <|image_pad|>
PATCH = 28
SCREEN = png(280, 168, seed=1)  # 10 x 6 patches
WINDOW = png(112, 84, seed=2)  # 4 x 3 patches
# Renders text parts only: no image placeholders.
TEXT_ONLY_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.content is string %}{{ m.content }}{% else %}"
    "{% for p in m.content %}{% if p.type == 'text' %}{{ p.text }}{% endif %}{% endfor %}"
    "{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _patches(url: str) -> int:
    """One token per 28x28 patch of the PNG a data URL holds (its IHDR size)."""
    data = base64.b64decode(url.split(",", 1)[1])
    width, height = struct.unpack(">II", data[16:24])
    return int(width // PATCH) * int(height // PATCH)


@dataclass
class VisionModel(SimulatedModel):
    """A simulated vLLM with the token-in route (or without it: `route_status`)."""

    route_status: int = 200
    sent: list[list[int]] = field(default_factory=list)  # the ids as TITO sent them
    images: list[list[str]] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)

    async def request(
        self, method: str, path: str, body: bytes | None, headers: Mapping[str, str]
    ) -> FakeResponse:
        self.paths.append(path)
        if path != GENERATE_PATH:
            return await super().request(method, path, body, headers)
        if self.route_status != 200:  # vLLM without --enable-scale-out answers 403
            error = {"error": {"message": "Scale-out endpoints are disabled.", "code": 403}}
            return FakeResponse(self.route_status, JSON_HEADERS, [orjson.dumps(error)])
        req = orjson.loads(body or b"{}")
        ids = [int(t) for t in req["token_ids"]]
        urls = [p["url"] for p in req["content_parts"]]
        if ids.count(IMAGE) != len(urls):
            error = {"error": {"message": "prompt updates do not match the images"}}
            return FakeResponse(400, JSON_HEADERS, [orjson.dumps(error)])
        self.sent.append(ids)
        self.images.append(urls)
        expanded: list[int] = []
        sizes = iter(_patches(u) for u in urls)
        for token in ids:
            expanded += [IMAGE] * next(sizes) if token == IMAGE else [token]
        self.prompts.append(expanded)
        whole = self._completion(expanded, str(req.get("model")))["choices"][0]
        top_k = int(req["sampling_params"]["logprobs"])
        entries = [
            {
                "token": f"token_id:{t}",
                "logprob": lp,
                "bytes": None,
                "top_logprobs": [{"token": f"token_id:{t}", "logprob": lp}] * (top_k + 1),
            }
            for t, lp in zip(whole["token_ids"], whole["logprobs"]["token_logprobs"], strict=True)
        ]
        if req.get("stream") is not True:
            answer = {
                "model": req.get("model"),
                "prompt_token_ids": expanded,
                "mm_placeholders": {"image": []},
                "usage": usage(len(expanded), len(whole["token_ids"])),
                "choices": [
                    {
                        "index": 0,
                        "text": whole["text"],
                        "token_ids": whole["token_ids"],
                        "finish_reason": whole["finish_reason"],
                        "stop_reason": None,
                        "logprobs": {"content": entries},
                    }
                ],
            }
            return FakeResponse(200, JSON_HEADERS, [orjson.dumps(answer)])
        events = []
        for i, (token, entry) in enumerate(zip(whole["token_ids"], entries, strict=True)):
            last = i == len(entries) - 1
            chunk: dict[str, Any] = {
                "choices": [
                    {
                        "index": 0,
                        "text": whole["text"] if last else "",
                        "token_ids": [token],
                        "finish_reason": whole["finish_reason"] if last else None,
                        "stop_reason": None,
                        "logprobs": {"content": [entry]},
                    }
                ]
            }
            if i == 0:
                chunk["prompt_token_ids"] = expanded
            events.append(sse_event(chunk))
        events.append(sse_event({"usage": usage(len(expanded), len(entries)), "choices": []}))
        return FakeResponse(200, {"Content-Type": "text/event-stream"}, [*events, SSE_DONE])


class Harness:
    def __init__(self, server: LiveServer, model: VisionModel, out: Path) -> None:
        self.server, self.model, self.out = server, model, out

    def client(self, rollout: str) -> Any:
        return openai.OpenAI(
            base_url=f"{self.server.url}/rollouts/{rollout}/v1", api_key="k", max_retries=0
        )

    def stats(self) -> dict[str, Any]:
        result: dict[str, Any] = httpx.get(f"{self.server.url}/stats").json()["tito"]
        return result

    def finish(self, rollout: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        from turnstile.reader import open_output

        assert httpx.post(f"{self.server.url}/rollouts/{rollout}/finish").status_code == 200
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            reader = open_output(self.out)
            samples = [s for s in reader.samples().to_pylist() if s["rollout_id"] == rollout]
            if samples:
                turns = [t for t in reader.turns().to_pylist() if t["rollout_id"] == rollout]
                return samples, sorted(turns, key=lambda t: t["turn_index"])
            time.sleep(0.05)
        raise AssertionError("no samples published")


@pytest.fixture
def harness(tmp_path: Path, live: Callable[[Any], LiveServer]) -> Iterator[Callable[..., Harness]]:
    tokenizer_dir = ensure_qwen3_tokenizer(log=lambda _: None)
    assets = ensure_llama_cpp_assets(log=lambda _: None)

    def _start(template: str | None = None, **overrides: Any) -> Harness:
        path = assets / "templates" / TEMPLATE
        if template is not None:
            path = tmp_path / "template.jinja"
            path.write_text(template)
        settings = load_settings(
            None,
            {
                "output": tmp_path / "out",
                "tokenizer": tokenizer_dir,
                "mode": "tito",
                "chat_template": path,
                "image_token_id": IMAGE,
                "shard_max_age_s": 0.05,
                **overrides,
            },
            environ={},
        )
        hf = load_tokenizer(tokenizer_dir)
        text = path.read_text()
        model = VisionModel(TemplateRenderer(hf, text), parser_for_template(text))
        app = create_app(settings, backend=model)
        engine = app.state.tito
        model.renderer = TemplateRenderer(
            hf, engine.renderer.template, engine.renderer.default_kwargs
        )
        return Harness(live(app), model, tmp_path / "out")

    yield _start


def _user(text: str, *images: bytes) -> dict[str, Any]:
    return {
        "role": "user",
        "content": [{"type": "text", "text": text}, *(image_part(data_url(i)) for i in images)],
    }


def test_image_turns_send_unexpanded_placeholders_and_record_the_expanded_ids(
    harness: Callable[..., Harness],
) -> None:
    h = harness()
    client = h.client("r1")
    messages: list[dict[str, Any]] = [_user("What is on the screen?", SCREEN)]
    h.model.sample(messages, {"role": "assistant", "content": "A chart."}, "none", None)
    answer = client.chat.completions.create(model="m", messages=messages)
    assert answer.choices[0].message.content.strip() == "A chart."
    messages += [
        answer.choices[0].message.model_dump(exclude_none=True),
        _user("And this window beside it?", WINDOW, SCREEN),
    ]
    h.model.sample(messages, {"role": "assistant", "content": "A form."}, "none", None)
    stream = client.chat.completions.create(model="m", messages=messages, stream=True)
    assert (
        "".join(c.choices[0].delta.content or "" for c in stream if c.choices).strip() == "A form."
    )
    # Both calls went to the token-in route, with every image of the conversation in order
    # and one unexpanded placeholder each; the second prompt extends the first token for
    # token (its prompt as sent, then the completion).
    assert h.model.paths.count(GENERATE_PATH) == 2 and "/v1/completions" not in h.model.paths
    first, second = h.model.sent
    assert h.model.images == [
        [data_url(SCREEN)],
        [data_url(SCREEN), data_url(WINDOW), data_url(SCREEN)],
    ]
    assert first.count(IMAGE) == 1 and second.count(IMAGE) == 3
    stats = h.stats()
    assert stats["image_turns"] == 2 and stats["extended"] == 1 and stats["placeholder_split"] == 0
    samples, turns = h.finish("r1")
    # The recorded prompts are the backend's expanded ones, and they stitch into one sample.
    assert [t["prompt_token_ids"] for t in turns] == h.model.prompts
    sampled = turns[0]["completion_token_ids"]
    assert second[: len(first) + len(sampled)] == first + sampled
    context = turns[0]["prompt_token_ids"] + sampled
    assert turns[1]["prompt_token_ids"][: len(context)] == context
    (sample,) = samples
    assert sample["break_kind"] == "first"
    spans = turns[1]["image_spans"]
    assert [s["sha256"] for s in spans] == [sha256_hex(i) for i in (SCREEN, WINDOW, SCREEN)]
    assert [s["length"] for s in spans] == [60, 12, 60]
    ids = turns[1]["prompt_token_ids"]
    for span in spans:
        assert set(ids[span["start"] : span["start"] + span["length"]]) == {IMAGE}
    assert sample["image_spans"] == spans


def test_text_only_rollouts_stay_on_the_completions_route(harness: Callable[..., Harness]) -> None:
    h = harness()
    # Text that spells the placeholder is no image: not counted, not refused.
    messages = [{"role": "user", "content": "Hello? <|image_pad|>"}]
    h.model.sample(messages, {"role": "assistant", "content": "Hi."}, "none", None)
    answer = h.client("r-text").chat.completions.create(model="m", messages=messages)
    assert answer.choices[0].message.content.strip() == "Hi."
    assert GENERATE_PATH not in h.model.paths and "/v1/completions" in h.model.paths
    assert h.stats()["image_turns"] == 0


def test_a_backend_without_the_token_in_route_gets_a_clear_422(
    harness: Callable[..., Harness],
) -> None:
    h = harness()
    h.model.route_status = 403
    messages = [_user("What is this?", SCREEN)]
    with pytest.raises(openai.UnprocessableEntityError) as err:
        h.client("r-old").chat.completions.create(model="m", messages=messages)
    message = err.value.body["message"]  # type: ignore[index]
    assert "--enable-scale-out" in message and "HTTP 403" in message
    assert h.stats()["open_rollouts"] == 0  # no token state was kept
    # Served again with the route, the same call goes through.
    h.model.route_status = 200
    h.model.sample(messages, {"role": "assistant", "content": "A chart."}, "none", None)
    answer = h.client("r-old").chat.completions.create(model="m", messages=messages)
    assert answer.choices[0].message.content.strip() == "A chart."


def test_a_template_without_image_placeholders_is_refused(
    harness: Callable[..., Harness],
) -> None:
    h = harness(TEXT_ONLY_TEMPLATE, allow_unsafe_template=True)
    with pytest.raises(openai.UnprocessableEntityError) as err:
        h.client("r-t").chat.completions.create(
            model="m", messages=[_user("What is this?", SCREEN)]
        )
    message = err.value.body["message"]  # type: ignore[index]
    assert "renders 0 image placeholders" in message and "1 images" in message
    assert GENERATE_PATH not in h.model.paths  # refused before anything was sent


def test_a_sampled_placeholder_token_starts_a_new_segment(
    harness: Callable[..., Harness],
) -> None:
    h = harness()
    client = h.client("r-pad")
    messages: list[dict[str, Any]] = [_user("Describe it.", SCREEN)]
    planned = h.model.sample(
        messages, {"role": "assistant", "content": "It is a chart."}, "none", None
    )
    h.model.plan = [*planned[:2], IMAGE, *planned[2:]]  # the model samples <|image_pad|>
    answer = client.chat.completions.create(model="m", messages=messages)
    messages += [answer.choices[0].message.model_dump(exclude_none=True), _user("More?")]
    h.model.sample(messages, {"role": "assistant", "content": "No."}, "none", None)
    client.chat.completions.create(model="m", messages=messages)
    stats = h.stats()
    assert stats["placeholder_split"] == 1 and stats["extended"] == 0
    # The second prompt was rendered whole: one placeholder for the one image.
    assert [ids.count(IMAGE) for ids in h.model.sent] == [1, 1]
    samples, _ = h.finish("r-pad")
    assert len(samples) == 2  # the rollout is split where it could not be extended
