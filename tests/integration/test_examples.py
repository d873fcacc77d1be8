"""The harness examples in `examples/`, each run as its own process against Turnstile in
front of the real CPU vLLM: every one must leave a finished rollout with its rewards and
exact backend tokens in the shards."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.live import TurnstileServer
from turnstile.reader import open_output, rewards_dict

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
# One example on the tiny CPU model takes seconds; the bound covers a loaded 2-core machine
# (the agent example makes several model calls).
EXAMPLE_TIMEOUT_S = 300
# Shards roll every second in these tests (`shard_max_age_s`); publication is prompt.
PUBLISH_TIMEOUT_S = 30.0
POLL_S = 0.1


Turnstile = TurnstileServer


def published_rollouts(output: Path, group_id: str, count: int) -> list[dict[str, Any]]:
    """The rollout rows of `group_id`, once `count` of them are published."""
    deadline = time.monotonic() + PUBLISH_TIMEOUT_S
    while True:
        rows = [r for r in open_output(output).rollouts().to_pylist() if r["group_id"] == group_id]
        if len(rows) >= count or time.monotonic() > deadline:
            return rows
        time.sleep(POLL_S)


@pytest.fixture(scope="module")
def turnstile(
    vllm_server: Any, qwen3_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Turnstile]:
    out = tmp_path_factory.mktemp("examples") / "out"
    with Turnstile(vllm_server.base_url, out, qwen3_tokenizer_dir) as ts:
        yield ts


def run_example(command: list[str], turnstile: Turnstile) -> str:
    env = {**os.environ, "TURNSTILE_URL": turnstile.url, "PYTHON": sys.executable}
    env.pop("OPENAI_BASE_URL", None)
    env.pop("OPENAI_API_KEY", None)
    proc = subprocess.run(
        command,
        cwd=EXAMPLES.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=EXAMPLE_TIMEOUT_S,
        check=False,
    )
    assert proc.returncode == 0, f"{command} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


# (script, group id it records under, rollouts it makes, reward names it posts)
CASES = [
    ("openai_sync.py", "sync-demo", 1, {"correct"}),
    ("openai_async.py", "async-demo", 4, {"correct"}),
    ("openai_streaming.py", "stream-demo", 1, {"three_lines"}),
    ("langgraph_agent.py", "langgraph-demo", 1, {"correct", "used_tool"}),
]


@pytest.mark.parametrize(("script", "group", "count", "rewards"), CASES, ids=[c[0] for c in CASES])
def test_python_example(
    turnstile: Turnstile, script: str, group: str, count: int, rewards: set[str]
) -> None:
    print(run_example([sys.executable, str(EXAMPLES / script)], turnstile))
    check_recorded(turnstile.output, group, count, rewards)


def test_env_var_recipe(turnstile: Turnstile) -> None:
    # env_recipe.sh needs curl and jq (.ci/run installs them): missing is a failure.
    missing = [tool for tool in ("curl", "jq") if shutil.which(tool) is None]
    assert not missing, f"env_recipe.sh needs {', '.join(missing)} (apt-get install curl jq)"
    out = run_example(["bash", str(EXAMPLES / "env_recipe.sh")], turnstile)
    assert "finished" in out
    check_recorded(turnstile.output, "env-demo", 1, {"exit_ok"})
    row = published_rollouts(turnstile.output, "env-demo", 1)[0]
    assert rewards_dict(row["rewards"]) == {"exit_ok": 1.0}


def check_recorded(output: Path, group: str, count: int, rewards: set[str]) -> None:
    rows = published_rollouts(output, group, count)
    assert len(rows) == count, f"{len(rows)} of {count} rollouts of {group} published"
    ids = {r["rollout_id"] for r in rows}
    for row in rows:
        assert row["status"] == "finished"
        assert set(rewards_dict(row["rewards"])) == rewards
        assert row["num_turns"] >= 1 and row["num_samples"] >= 1
    turns = [t for t in open_output(output).turns().to_pylist() if t["rollout_id"] in ids]
    assert turns and all(t["status"] == "ok" for t in turns)
    assert all(t["token_source"] == "backend" and t["num_completion_tokens"] > 0 for t in turns)
    if group == "langgraph-demo":
        # The agent offered its tool on every model call.
        assert all("multiply" in (t["request_tools_json"] or "") for t in turns)
