"""Images in calls: checked where they enter, stored once per hash, located in the prompt,
stitched only where they line up, and read back with their bytes."""

from __future__ import annotations

import asyncio
import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from starlette.testclient import TestClient

from tests.fakes_sink import InMemorySink, make_turn
from tests.images import data_url, image_part, png
from tests.unit.conftest import MakeApp
from turnstile.backends.fake import FAKE_IMAGE_TOKEN_ID, fake_image_tokens
from turnstile.errors import Overloaded, Unprocessable
from turnstile.images import media_url, processor_digest, sha256_hex, sniff_mime
from turnstile.journal.codec import decode_turn, encode_turn
from turnstile.output.recorder import Recorder
from turnstile.output.shards import ParquetShardSink
from turnstile.proxy.media import collect_images, locate_images
from turnstile.reader import open_output
from turnstile.records import BreakKind, ImageRef, MediaBlob, MediaRecord
from turnstile.server.app import TITO_IMAGE_REFUSAL, media_policy
from turnstile.settings import load_settings

SCREENSHOT = png(640, 400, seed=1)
OTHER = png(640, 400, seed=2)  # same size: the same placeholders, other pixels
SMALL = png(56, 56, seed=3)


def user(*parts: dict[str, Any] | str) -> dict[str, Any]:
    content = [{"type": "text", "text": p} if isinstance(p, str) else p for p in parts]
    return {"role": "user", "content": content}


def app(make_app: MakeApp, **overrides: Any) -> Any:
    return make_app(image_token_id=FAKE_IMAGE_TOKEN_ID, **overrides)


def runs(ids: np.ndarray, token: int) -> list[tuple[int, int]]:
    """(start, length) of each run of `token` in `ids`."""
    out: list[tuple[int, int]] = []
    for i, t in enumerate(ids.tolist()):
        if t != token:
            continue
        if out and out[-1][0] + out[-1][1] == i:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((i, 1))
    return out


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_an_inline_image_is_stored_once_with_its_placeholder_span(
    make_app: MakeApp, stream: bool
) -> None:
    h = app(make_app)
    url = data_url(SCREENSHOT)
    messages = [user("What is on the screen?", image_part(url), "And here?", image_part(url))]
    with TestClient(h.app) as client:
        resp = client.post(
            "/v1/chat/completions", json={"model": "m", "messages": messages, "stream": stream}
        )
        assert resp.status_code == 200, resp.text
    sent = h.backend.requests[-1][2]
    assert sent is not None
    assert sent["messages"][0]["content"][1]["image_url"]["url"] == url  # forwarded as sent
    (turn,) = h.sink.turns
    sha = sha256_hex(SCREENSHOT)
    n = fake_image_tokens(url)
    assert n == 23 * 15
    located = runs(turn.prompt_token_ids, FAKE_IMAGE_TOKEN_ID)
    assert turn.images == [ImageRef(sha, None, s, length) for s, length in located]
    assert [length for _, length in located] == [n, n]
    assert turn.media == [MediaBlob(sha, "image/png", SCREENSHOT)]  # once, though sent twice
    (row,) = h.sink.media
    assert row.sha256 == sha and row.data == SCREENSHOT and row.rollout_id == turn.rollout_id
    recorded = json.loads(turn.request_messages_json or "")
    assert recorded[0]["content"][1]["image_url"]["url"] == media_url(sha)
    assert url.split(",")[1][:100] not in (turn.request_messages_json or "")


def _chat(client: TestClient, rid: str, messages: list[dict[str, Any]]) -> str:
    resp = client.post(
        f"/rollouts/{rid}/v1/chat/completions", json={"model": "m", "messages": messages}
    )
    assert resp.status_code == 200, resp.text
    return str(resp.json()["choices"][0]["message"]["content"])


def test_a_rollout_stitches_its_images_and_journals_each_once(make_app: MakeApp) -> None:
    h = app(make_app)
    first = user("Click the button.", image_part(data_url(SCREENSHOT)))
    with TestClient(h.app) as client:
        rid = client.post("/rollouts", json={}).json()["rollout_id"]
        answer = _chat(client, rid, [first])
        second = user("Now?", image_part(data_url(SMALL)), image_part(data_url(SCREENSHOT)))
        history = [first, {"role": "assistant", "content": answer}, second]
        _chat(client, rid, history)
        assert client.post(f"/rollouts/{rid}/finish", json={}).status_code == 200
    t1, t2 = sorted(h.sink.turns, key=lambda t: t.turn_index)
    assert [b.sha256 for b in t1.media] == [sha256_hex(SCREENSHOT)]
    assert [b.sha256 for b in t2.media] == [sha256_hex(SMALL)]  # the screenshot was journaled
    assert sorted(m.sha256 for m in h.sink.media) == sorted(
        [sha256_hex(SCREENSHOT), sha256_hex(SMALL)]
    )
    (sample,) = h.sink.samples
    assert sample.break_kind is BreakKind.FIRST
    assert sample.images == t2.images  # the last prompt holds every image, at its place
    assert [i.sha256 for i in sample.images] == [
        sha256_hex(SCREENSHOT),
        sha256_hex(SMALL),
        sha256_hex(SCREENSHOT),
    ]
    for image in sample.images:
        assert image.start is not None and image.length is not None
        span = sample.input_ids[image.start : image.start + image.length]
        assert (span == FAKE_IMAGE_TOKEN_ID).all() and not sample.loss_mask[image.start]


def test_another_image_at_the_same_placeholders_breaks_the_sample(make_app: MakeApp) -> None:
    h = app(make_app)
    with TestClient(h.app) as client:
        rid = client.post("/rollouts", json={}).json()["rollout_id"]
        first = user("Look.", image_part(data_url(SCREENSHOT)))
        answer = _chat(client, rid, [first])
        swapped = user("Look.", image_part(data_url(OTHER)))  # same size: same tokens
        _chat(client, rid, [swapped, {"role": "assistant", "content": answer}, user("More?")])
        assert client.post(f"/rollouts/{rid}/finish", json={}).status_code == 200
    t1, t2 = sorted(h.sink.turns, key=lambda t: t.turn_index)
    context = np.concatenate([t1.prompt_token_ids, t1.completion_token_ids])
    assert np.array_equal(t2.prompt_token_ids[: context.size], context)  # tokens extend
    first, second = sorted(h.sink.samples, key=lambda s: s.sample_index)
    assert second.break_kind is BreakKind.IMAGES and second.parent_sample_index == 0
    assert second.break_position == t1.images[0].start
    assert [i.sha256 for i in second.images] == [sha256_hex(OTHER)]


@pytest.mark.parametrize(
    ("part", "status", "fragment"),
    [
        (image_part("data:image/png;base64,@@@@"), 400, "invalid base64"),
        (image_part(data_url(b"just some text bytes")), 400, "not a PNG, JPEG, GIF or WebP"),
        (image_part(data_url(SCREENSHOT, "text/plain")), 400, "of type 'text/plain'"),
        (image_part("data:image/png,rawdata"), 400, "not base64"),
        (image_part("file:///etc/passwd"), 400, "scheme 'file'"),
        ({"type": "image_url", "image_url": {}}, 400, "non-empty 'url'"),
        ({"type": "video_url", "video_url": {"url": "x"}}, 422, "records images only"),
        ({"type": "input_audio", "input_audio": {"data": "x"}}, 422, "records images only"),
    ],
    ids=["base64", "not-image", "mime", "not-base64", "file", "no-url", "video", "audio"],
)
def test_a_bad_image_part_is_refused_with_a_clear_error_and_nothing_is_sent(
    make_app: MakeApp, part: dict[str, Any], status: int, fragment: str
) -> None:
    h = app(make_app)
    with TestClient(h.app) as client:
        resp = client.post(
            "/v1/chat/completions", json={"model": "m", "messages": [user("hi", part)]}
        )
    assert resp.status_code == status, resp.text
    assert fragment in resp.json()["error"]["message"]
    assert not [r for r in h.backend.requests if r[1] == "/v1/chat/completions"]
    assert not h.sink.turns and not h.sink.media


def test_an_image_over_the_limit_gets_413(make_app: MakeApp) -> None:
    h = app(make_app, max_image_bytes=len(SCREENSHOT) - 1)
    with TestClient(h.app) as client:
        resp = client.post(
            "/v1/chat/completions",
            json={"model": "m", "messages": [user(image_part(data_url(SCREENSHOT)))]},
        )
    assert resp.status_code == 413 and "over the limit" in resp.json()["error"]["message"]


@pytest.fixture
def image_host() -> Iterator[str]:
    """A loopback HTTP server: /shot.png (the screenshot), /big.png (over the limit the
    tests set), anything else 404."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = {"/shot.png": SCREENSHOT, "/big.png": SCREENSHOT * 3}.get(self.path)
            if body is None:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _post_image(h: Any, url: str) -> Any:
    with TestClient(h.app) as client:
        return client.post(
            "/v1/chat/completions", json={"model": "m", "messages": [user("see", image_part(url))]}
        )


def test_remote_images_are_recorded_by_url_by_default(make_app: MakeApp, image_host: str) -> None:
    h = app(make_app)
    resp = _post_image(h, f"{image_host}/shot.png")
    assert resp.status_code == 200
    (turn,) = h.sink.turns
    assert [(i.sha256, i.url) for i in turn.images] == [(None, f"{image_host}/shot.png")]
    assert turn.images[0].start is not None and not h.sink.media


def test_remote_images_are_fetched_stored_and_forwarded_inline(
    make_app: MakeApp, image_host: str
) -> None:
    h = app(make_app, remote_images="fetch", remote_image_hosts="127.0.0.1")
    resp = _post_image(h, f"{image_host}/shot.png")
    assert resp.status_code == 200, resp.text
    sent = h.backend.requests[-1][2]
    assert sent is not None
    assert sent["messages"][0]["content"][1]["image_url"]["url"] == data_url(SCREENSHOT)
    (turn,) = h.sink.turns
    assert turn.images[0].sha256 == sha256_hex(SCREENSHOT)
    assert turn.images[0].url == f"{image_host}/shot.png"
    assert [m.data for m in h.sink.media] == [SCREENSHOT]


@pytest.mark.parametrize(
    ("settings", "path", "status", "fragment"),
    [
        ({"remote_images": "refuse"}, "/shot.png", 400, "remote_images: refuse"),
        (
            {"remote_images": "fetch", "remote_image_hosts": "example.org"},
            "/shot.png",
            400,
            "only from example.org",
        ),
        ({"remote_images": "fetch"}, "/missing.png", 400, "answered HTTP 404"),
        (
            {"remote_images": "fetch", "max_image_bytes": len(SCREENSHOT) + 10},
            "/big.png",
            413,
            "over the limit",
        ),
    ],
    ids=["refuse", "host", "404", "too-big"],
)
def test_remote_images_that_cannot_be_taken_are_refused(
    make_app: MakeApp,
    image_host: str,
    settings: dict[str, Any],
    path: str,
    status: int,
    fragment: str,
) -> None:
    h = app(make_app, **settings)
    resp = _post_image(h, image_host + path)
    assert resp.status_code == status, resp.text
    assert fragment in resp.json()["error"]["message"]
    assert not h.sink.turns


def test_tito_mode_takes_images_in_front_of_vllm(tmp_path: Path) -> None:
    settings = load_settings(
        None, {"output": tmp_path / "o", "mode": "tito", "tokenizer": tmp_path}, environ={}
    )
    policy = media_policy(settings)
    assert policy.refusal is None
    body = {"messages": [user("hi", image_part(data_url(SMALL)))]}
    found = asyncio.run(collect_images(body, policy))
    assert found is not None and len(found.refs) == 1


def test_tito_mode_refuses_images_in_front_of_sglang_before_anything_is_sent(
    tmp_path: Path,
) -> None:
    settings = load_settings(
        None,
        {"output": tmp_path / "o", "mode": "tito", "tokenizer": tmp_path, "backend_kind": "sglang"},
        environ={},
    )
    policy = media_policy(settings)
    assert policy.refusal == TITO_IMAGE_REFUSAL
    body = {"messages": [user("hi", image_part(data_url(SMALL)))]}
    with pytest.raises(Unprocessable, match="record mode"):
        asyncio.run(collect_images(body, policy))
    assert asyncio.run(collect_images({"messages": [user("text only")]}, policy)) is None


def test_the_model_directory_gives_the_image_token_and_the_processor_digest(
    tmp_path: Path,
) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"image_token_id": 151655}))
    (model / "preprocessor_config.json").write_text(json.dumps({"patch_size": 14}))
    settings = load_settings(None, {"output": tmp_path / "o", "tokenizer": model}, environ={})
    policy = media_policy(settings)
    assert policy.image_token_id == 151655
    assert policy.processor_digest == processor_digest(model)
    (model / "preprocessor_config.json").write_text(json.dumps({"patch_size": 16}))
    assert processor_digest(model) != policy.processor_digest  # a change shows
    explicit = load_settings(
        None, {"output": tmp_path / "o", "tokenizer": model, "image_token_id": 7}, environ={}
    )
    assert media_policy(explicit).image_token_id == 7


def test_spans_stay_unknown_where_the_runs_do_not_match_the_images() -> None:
    refs = [ImageRef("a", None, None, None), ImageRef("b", None, None, None)]
    ids = np.array([1, 9, 9, 2, 3], dtype=np.int32)  # one run, two images
    assert locate_images(refs, ids, 9) == refs
    assert locate_images(refs[:1], ids, 9) == [ImageRef("a", None, 1, 2)]
    assert locate_images(refs[:1], ids, None) == refs[:1]


def test_sniffing_knows_the_four_image_types() -> None:
    assert sniff_mime(SCREENSHOT) == "image/png"
    assert sniff_mime(b"\xff\xd8\xff\xe0rest") == "image/jpeg"
    assert sniff_mime(b"GIF89a...") == "image/gif"
    assert sniff_mime(b"RIFF\x00\x00\x00\x00WEBPVP8 ") == "image/webp"
    assert sniff_mime(b"<svg") is None


def test_a_turns_images_and_their_bytes_survive_the_journal() -> None:
    turn = make_turn("r1", 0, prompt_len=6, completion_len=2)
    turn.images = [
        ImageRef(sha256_hex(SMALL), None, 1, 4),
        ImageRef(None, "http://h/x.png", None, None),
    ]
    turn.media = [MediaBlob(sha256_hex(SMALL), "image/png", SMALL)]
    turn.processor_digest = "d" * 64
    back = decode_turn(encode_turn(turn))
    assert back.images == turn.images and back.media == turn.media
    assert back.processor_digest == turn.processor_digest
    plain = make_turn("r1", 1)
    assert decode_turn(encode_turn(plain)).media == []


def test_media_shards_hold_each_image_once_across_restarts_and_the_reader_returns_them(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"

    def record(sha: str, data: bytes) -> MediaRecord:
        return MediaRecord(sha, "image/png", data, "r1", 1.0)

    sink = ParquetShardSink(out, writer_id="w1", identity={})
    sink.write_media([record(sha256_hex(SMALL), SMALL), record(sha256_hex(SMALL), SMALL)])
    turn = make_turn("r1", 0, prompt_len=8)
    turn.images = [ImageRef(sha256_hex(SMALL), None, 2, 3)]
    sink.write_turns([turn])
    sink.close()
    again = ParquetShardSink(out, writer_id="w2", identity={})
    again.write_media([record(sha256_hex(SMALL), SMALL), record(sha256_hex(OTHER), OTHER)])
    again.close()
    reader = open_output(out)
    media = reader.read("media")
    assert sorted(media.column("sha256").to_pylist()) == sorted(
        [sha256_hex(SMALL), sha256_hex(OTHER)]
    )
    assert reader.images([sha256_hex(SMALL), None])[sha256_hex(SMALL)].data == SMALL
    with pytest.raises(KeyError, match="no published media shard"):
        reader.images(["0" * 64])
    (spans,) = reader.turns(columns=["image_spans"]).column("image_spans").to_pylist()
    assert spans == [{"sha256": sha256_hex(SMALL), "url": None, "start": 2, "length": 3}]


def test_the_recorder_writes_a_turns_images_before_the_turn(tmp_path: Path) -> None:
    sink = InMemorySink()
    recorder = Recorder(sink, max_backlog=10)
    turn = make_turn("r1", 0)
    turn.media = [MediaBlob(sha256_hex(SMALL), "image/png", SMALL)]
    recorder._write_turns([turn])
    assert [m.sha256 for m in sink.media] == [sha256_hex(SMALL)]
    assert sink.media[0].rollout_id == "r1"


def test_the_recorder_refuses_new_calls_while_too_many_image_bytes_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("turnstile.output.recorder.MAX_RECORDER_MEDIA_BYTES", len(SMALL))
    recorder = Recorder(InMemorySink(), max_backlog=10)  # not started: nothing is written
    turn = make_turn("r1", 0)
    turn.media = [MediaBlob(sha256_hex(SMALL), "image/png", SMALL)]
    recorder.admit()
    recorder.submit_turns([turn])
    with pytest.raises(Overloaded, match="MiB of images not yet written"):
        recorder.admit()
    recorder.start()
    recorder.stop(10)
    recorder.admit()  # written: room again
