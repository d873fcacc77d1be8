"""`turnstile view`: the viewer's JSON API and page, over shards a real app recorded; the
stored images it serves, and `turnstile inspect`'s media counts."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from rich.console import Console
from starlette.testclient import TestClient

from tests.fakes_backend import FakeVLLM
from tests.images import data_url, image_part, png
from tests.unit.test_inspect import record_output
from turnstile.backends.fake import FAKE_IMAGE_TOKEN_ID
from turnstile.cli.inspection import run as run_inspect
from turnstile.cli.main import build_parser
from turnstile.images import sha256_hex
from turnstile.server.app import create_app
from turnstile.settings import load_settings
from turnstile.view.roles import token_roles
from turnstile.view.server import STATIC_DIR, build_app


@pytest.fixture(scope="module")
def viewer(tmp_path_factory: pytest.TempPathFactory) -> tuple[TestClient, dict[str, str]]:
    out = tmp_path_factory.mktemp("view") / "out"
    ids = record_output(out)
    return TestClient(build_app(out)), ids


def test_overview_lists_rollouts_and_versions(
    viewer: tuple[TestClient, dict[str, str]],
) -> None:
    client, ids = viewer
    body = client.get("/api/overview").json()
    assert {r["rollout_id"] for r in body["rollouts"]} == set(ids.values())
    assert body["reward_names"] == ["correct", "format"]
    versions = {v["version"]: v for v in body["versions"]}
    assert sorted(versions) == [0, 1, 2]
    assert versions[0]["mean_reward"] == 1.5 and versions[1]["mean_reward"] == 0.0
    assert all(v["rollouts"] == 1 and v["mean_tokens"] > 0 for v in versions.values())
    assert body["tokenizer"] is None


def test_rollout_has_tokens_spans_and_the_break_side_by_side(
    viewer: tuple[TestClient, dict[str, str]],
) -> None:
    client, ids = viewer
    body = client.get(f"/api/rollouts/{ids['break']}").json()
    assert body["rewards"] == {"correct": 0.0} and body["decoded"] is False
    first, *rest = body["samples"]
    assert first["break"] is None and first["break_kind"] == "first"
    rewritten = next(s for s in rest if s["break_kind"] == "history_rewritten")
    brk = rewritten["break"]
    pos = brk["position"]
    assert brk["parent"] is not None and brk["start"] <= pos
    # The side-by-side windows agree before the break and differ at it.
    k = pos - brk["start"]
    assert brk["parent_tokens"][:k] == brk["tokens"][:k]
    assert brk["parent_tokens"][k] != brk["tokens"][k]
    tokens = rewritten["tokens"]
    assert len(tokens) == rewritten["num_tokens"]
    assert sum(t[2] for t in tokens) == rewritten["num_loss_tokens"]
    # Sampled tokens carry their behaviour logprob; prompt tokens carry none.
    assert all((t[3] is None) == (t[2] == 0) for t in tokens)
    span = rewritten["turn_spans"][0]
    assert all(t[2] == 1 for t in tokens[span["completion_start"] : span["completion_end"]])
    assert [t["turn_index"] for t in body["turns"]] == [0, 1, 2]


def test_page_and_assets_are_local(viewer: tuple[TestClient, dict[str, str]]) -> None:
    client, _ = viewer
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    for name in ("app.js", "style.css"):
        assert client.get(f"/static/{name}").status_code == 200
    assert client.get("/static/../server.py").status_code == 404
    assert client.get("/api/rollouts/nope").status_code == 404
    # No external assets: every src/href/url in the shipped files is local.
    for path in STATIC_DIR.iterdir():
        text = path.read_text(encoding="utf-8")
        urls = re.findall(r"(?:src|href)=\"([^\"]+)\"|url\(([^)]+)\)|fetch\(`?\"?([^`\")]+)", text)
        for found in urls:
            url = next(u for u in found if u)
            assert not re.match(r"^(https?:)?//", url), (path.name, url)
        assert "http://" not in text.replace("http://www.w3.org/2000/svg", "")
        assert "https://" not in text


def test_roles_follow_the_chat_template_markers() -> None:
    pieces = [
        "<|im_start|>",
        "user",
        "\n",
        "hi",
        "<|im_end|>",
        "\n",
        "<|im_start|>",
        "assistant",
        "\n",
        "<tool_call>",
        "{}",
        "</tool_call>",
        "<|im_end|>",
        "<|im_start|>",
        "user",
        "\n",
        "<tool_response>",
        "sunny",
        "</tool_response>",
        "<|im_end|>",
    ]
    special = [p.startswith("<|") for p in pieces]
    roles = token_roles(pieces, special)
    assert roles[3] == "user" and roles[8] == "assistant"
    assert roles[9:12] == ["tool_call"] * 3 and roles[12] == "assistant"
    assert roles[16:19] == ["tool"] * 3 and roles[19] == "user"
    assert token_roles(["[1]", "[2]"], [False, False]) == ["", ""]


def test_view_is_registered_in_the_cli(tmp_path: Path) -> None:
    args = build_parser().parse_args(["view", str(tmp_path), "--port", "9999"])
    assert args.port == 9999 and args.host == "127.0.0.1"


SCREEN = png(112, 84, seed=1)
ICON = png(56, 56, seed=2)


def record_images(directory: Path) -> str:
    """One rollout of two image calls (the screen sent twice) through the app on the fake
    backend, published to `directory`; its id."""
    settings = load_settings(
        None, {"output": directory, "image_token_id": FAKE_IMAGE_TOKEN_ID}, environ={}
    )
    with TestClient(create_app(settings, backend=FakeVLLM())) as c:
        rid = str(c.post("/rollouts", json={}).json()["rollout_id"])
        first = {
            "role": "user",
            "content": [{"type": "text", "text": "Click OK."}, image_part(data_url(SCREEN))],
        }
        url = f"/rollouts/{rid}/v1/chat/completions"
        reply = c.post(url, json={"model": "m", "messages": [first]}).json()
        again = {
            "role": "user",
            "content": [
                image_part(data_url(ICON)),
                image_part(data_url(SCREEN)),
                {"type": "text", "text": "Now?"},
            ],
        }
        history = [first, reply["choices"][0]["message"], again]
        assert c.post(url, json={"model": "m", "messages": history}).status_code == 200
        assert c.post(f"/rollouts/{rid}/finish").status_code == 200
    return rid


def test_images_are_served_by_hash_and_placed_at_their_spans(tmp_path: Path) -> None:
    out = tmp_path / "out"
    rid = record_images(out)
    client = TestClient(build_app(out))
    (sample,) = client.get(f"/api/rollouts/{rid}").json()["samples"]
    spans = sample["image_spans"]
    assert [s["sha256"] for s in spans] == [sha256_hex(i) for i in (SCREEN, ICON, SCREEN)]
    for s in spans:  # the page collapses these tokens under the thumbnail
        run = sample["tokens"][s["start"] : s["start"] + s["length"]]
        assert {t[0] for t in run} == {FAKE_IMAGE_TOKEN_ID}
    resp = client.get(f"/media/{sha256_hex(SCREEN)}")
    assert resp.status_code == 200 and resp.content == SCREEN
    assert resp.headers["content-type"] == "image/png"
    assert resp.headers["x-content-type-options"] == "nosniff"
    assert "immutable" in resp.headers["cache-control"]
    missing = client.get(f"/media/{'0' * 64}")
    assert missing.status_code == 404 and "no stored image" in missing.json()["detail"]
    bad = client.get("/media/..%2Fapi%2Foverview")
    assert bad.status_code in (400, 404)
    assert client.get("/media/ABC").status_code == 400
    assert "renderImage" in client.get("/static/app.js").text


def test_inspect_counts_the_stored_images_and_their_bytes(tmp_path: Path) -> None:
    out = tmp_path / "out"
    record_images(out)
    console = Console(record=True, width=120, color_system=None)
    assert run_inspect(build_parser().parse_args(["inspect", str(out)]), console) == 0
    text = console.export_text()
    lines = {" ".join(line.replace("│", " ").split()) for line in text.splitlines()}
    total = len(SCREEN) + len(ICON)
    assert "images stored (media) 2" in lines
    assert any(line.startswith("bytes") and f"({total} B)" in line for line in lines)
    assert "1 media shards" in text
