"""`turnstile inspect`: the terminal summary and the one-rollout view, over shards that a
real app (fake backend, real Parquet sink) recorded."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from starlette.testclient import TestClient

from tests.fakes_backend import FakeVLLM, Reply
from turnstile.cli.inspection import run, token_style
from turnstile.cli.main import build_parser
from turnstile.server.app import create_app
from turnstile.settings import load_settings
from turnstile.view.data import OutputData, TokenText

CONSOLE_WIDTH = 160


def _script(body: dict[str, Any]) -> Reply:
    last = body["messages"][-1].get("content") or ""
    if last == "fail":
        return Reply(status=400)
    if last == "cut":
        return Reply(text="partial answer", die_after_events=2)
    if last == "weather?":
        call = {
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
        }
        return Reply(text="", tool_calls=[call])
    return Reply(text="hello")


def record_output(directory: Path) -> dict[str, str]:
    """Record rollouts through the app into `directory`; their ids by scenario name."""
    settings = load_settings(None, {"output": directory}, environ={})
    app = create_app(settings, backend=FakeVLLM(_script))
    ids: dict[str, str] = {}
    with TestClient(app) as c:

        def chat(
            rid: str, messages: list[dict[str, Any]], version: int, stream: bool = False
        ) -> dict[str, Any]:
            body = {"model": "m", "messages": messages, "max_tokens": 16, "stream": stream}
            headers = {"X-Turnstile-Policy-Version": str(version)}
            url = f"/rollouts/{rid}/v1/chat/completions"
            if stream:
                with c.stream("POST", url, json=body, headers=headers) as resp:
                    resp.read()
                return {}
            resp = c.post(url, json=body, headers=headers)
            return dict(resp.json())

        # A clean two-turn rollout at version 0, with two rewards.
        a = c.post(
            "/rollouts",
            json={"group_id": "g1", "task_id": "t1", "metadata": {"difficulty": "easy"}},
        ).json()["rollout_id"]
        m: list[dict[str, Any]] = [{"role": "user", "content": "2+2?"}]
        reply = chat(a, m, 0)["choices"][0]["message"]["content"]
        m += [{"role": "assistant", "content": reply}, {"role": "user", "content": "sure?"}]
        chat(a, m, 0)
        c.post(
            f"/rollouts/{a}/rewards",
            json={"rewards": {"correct": 1.0, "format": 0.5}, "info": {"correct": "4 == 4"}},
        )
        c.post(f"/rollouts/{a}/finish")
        ids["clean"] = a
        # Version 1: a tool call, its result, then a turn whose history was rewritten.
        b = c.post("/rollouts", json={"group_id": "g1"}).json()["rollout_id"]
        m = [{"role": "user", "content": "weather?"}]
        msg = chat(b, m, 1)["choices"][0]["message"]
        m += [
            {
                "role": "assistant",
                "content": msg.get("content") or "",
                "tool_calls": msg["tool_calls"],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ]
        chat(b, m, 1)
        chat(b, [{"role": "user", "content": "rewritten history"}], 1)
        c.post(f"/rollouts/{b}/finish", json={"rewards": {"correct": 0.0}})
        ids["break"] = b
        # Version 2: an ok turn, a refused turn and a stream cut by the backend.
        d = c.post("/rollouts", json={}).json()["rollout_id"]
        chat(d, [{"role": "user", "content": "hi"}], 2)
        chat(d, [{"role": "user", "content": "fail"}], 2)
        chat(d, [{"role": "user", "content": "cut"}], 2, stream=True)
        c.post(f"/rollouts/{d}/finish", json={"rewards": {"correct": 0.25}})
        ids["failures"] = d
    return ids


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    out = tmp_path_factory.mktemp("inspect") / "out"
    return out, record_output(out)


def _inspect(argv: list[str]) -> tuple[int, str]:
    console = Console(record=True, width=CONSOLE_WIDTH, color_system=None)
    args = build_parser().parse_args(["inspect", *argv])
    code = run(args, console)
    return code, console.export_text()


def test_summary_counts_everything(recorded: tuple[Path, dict[str, str]]) -> None:
    out, _ = recorded
    code, text = _inspect([str(out)])
    assert code == 0
    lines = {" ".join(line.replace("│", " ").split()) for line in text.splitlines()}
    assert "rollouts 3" in lines and "finished 3" in lines
    assert "turns 8" in lines and "ok 6" in lines and "error 1" in lines
    assert "aborted 1" in lines
    # rewards per name: correct over three rollouts, format once, and the per-rollout sum
    assert "correct 3 0.417 0.425 0.000 1.000" in lines
    assert "format 1 0.500 0.000 0.500 0.500" in lines
    # the rewritten history, and the aborted turn after a refused one; the tool result
    # turn does not extend the tool call's tokens (the fake renders calls as JSON)
    assert "history_rewritten 2" in lines and "unclassified 1" in lines
    # policy versions: turns and rollouts per version, with the mean reward
    assert "0 2 1 1.500" in lines and "1 3 1 0.000" in lines and "2 3 1 0.250" in lines
    assert "Error and aborted turns (2)" in text and "Slowest turns" in text


def test_rollout_view_shows_tokens_mask_and_the_break(
    recorded: tuple[Path, dict[str, str]],
) -> None:
    out, ids = recorded
    code, text = _inspect([str(out), "--rollout", ids["break"]])
    assert code == 0
    assert f"rollout {ids['break']}" in text and "rewards: correct=0" in text
    assert "sample 1:" in text and "starts: history_rewritten" in text
    assert "breaks from sample 0" in text and "break at token" in text
    # No tokenizer: the ids are shown; the fake's ids are character codes.
    assert "[119][101][97][116][104][101][114]" in text  # "weather"
    assert "no tokenizer" in text
    code, text = _inspect([str(out), "--rollout", ids["clean"]])
    assert "correct: 4 == 4" in text and "difficulty" in text


def test_unknown_rollout_and_missing_directory(
    recorded: tuple[Path, dict[str, str]],
    tmp_path: Path,
) -> None:
    out, _ = recorded
    assert _inspect([str(out), "--rollout", "nope"])[0] == 1
    assert _inspect([str(tmp_path / "missing")])[0] == 2


def test_empty_directory_prints_an_empty_summary(tmp_path: Path) -> None:
    code, text = _inspect([str(tmp_path)])
    assert code == 0 and "rollouts 0" in " ".join(text.replace("│", " ").split())
    assert "No rewards recorded." in text


def test_loss_mask_and_logprob_colours() -> None:
    assert token_style(0, None, False) == "grey62"
    assert token_style(1, -0.1, False) == "green"
    assert token_style(1, -1.0, False) == "yellow"
    assert token_style(1, -5.0, False) == "bold red"
    assert "magenta" in token_style(0, None, True)


def test_data_layer_rollout(recorded: tuple[Path, dict[str, str]]) -> None:
    out, ids = recorded
    data = OutputData(out)
    r = data.rollout(ids["failures"])
    assert r is not None
    assert [t["status"] for t in r["turns"]] == ["ok", "error", "aborted"]
    assert r["rewards"] == {"correct": 0.25}
    sample = r["samples"][0]
    assert len(sample["input_ids"]) == len(sample["loss_mask"]) == sample["num_tokens"]
    assert data.rollout("unknown") is None
    assert TokenText(None).pieces([5, 6]) == ["[5]", "[6]"]


def test_inspect_is_registered_in_the_cli() -> None:
    args = build_parser().parse_args(["inspect", "d", "--rollout", "r", "--top", "3"])
    assert isinstance(args, argparse.Namespace) and args.top == 3
