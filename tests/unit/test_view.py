"""`turnstile view`: the viewer's JSON API and page, over shards a real app recorded."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from tests.unit.test_inspect import record_output
from turnstile.cli.main import build_parser
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
