"""`codex exec` and `claude -p`, installed from the npm registry, through Turnstile in front
of the CPU vLLM, in record and TITO mode.

Each agent must get answers (Codex exits 0 with the model's text; Claude Code reports the
answer the random model could only end at its token limit) and leave `ok` turns with the
backend's exact token ids; in TITO mode no call is split or refused and every turn that
extends an earlier one does so token for token. The vLLM here has room for the agents'
long system prompts (32k tokens) and a default of 24 new tokens, since Codex sends no
`max_output_tokens` and the random model never stops on its own.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.live import TurnstileServer
from turnstile.dev import devstack
from turnstile.dev.agent_clis import AgentCLIs, ensure_agent_clis
from turnstile.reader import open_output

MODEL = devstack.DEFAULT_SERVED_MODEL_NAME
# Room for Codex's and Claude Code's system prompts and tool definitions (6-20k tokens).
AGENT_MAX_MODEL_LEN = 32768
# Codex sends no max_output_tokens: vLLM's default answer length for such calls.
AGENT_DEFAULT_NEW_TOKENS = 24
# Claude Code's own cap on answer length (it sends it as max_tokens).
CLAUDE_MAX_OUTPUT_TOKENS = 16
# One agent run: a few model calls of a few seconds each on the CPU.
AGENT_RUN_TIMEOUT_S = 300


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@pytest.fixture(scope="module")
def agent_vllm(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log_path = tmp_path_factory.mktemp("agent-vllm") / "vllm.log"
    extra = [
        "--max-model-len",
        str(AGENT_MAX_MODEL_LEN),
        "--override-generation-config",
        f'{{"max_new_tokens": {AGENT_DEFAULT_NEW_TOKENS}}}',
    ]
    server = devstack.start_vllm(
        tiny_model_dir, devstack.free_port(), extra_args=extra, log_path=log_path
    )
    try:
        server.wait_healthy()
        yield server.base_url
    finally:
        server.stop()


@pytest.fixture(scope="module")
def agents() -> AgentCLIs:
    return ensure_agent_clis(log=_log)


def _run(command: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        command,
        env={**os.environ, **env},
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=AGENT_RUN_TIMEOUT_S,
        check=False,
    )


def run_codex(codex: Path, url: str, rollout: str, tmp: Path) -> subprocess.CompletedProcess[str]:
    home = tmp / f"codex-home-{rollout}"
    home.mkdir()
    (home / "config.toml").write_text(
        f'model = "{MODEL}"\n'
        'model_provider = "turnstile"\n\n'
        "[model_providers.turnstile]\n"
        'name = "Turnstile"\n'
        f'base_url = "{url}/rollouts/{rollout}/v1"\n'
        'env_key = "TURNSTILE_API_KEY"\n'
        'wire_api = "responses"\n',
        encoding="utf-8",
    )
    env = {"CODEX_HOME": str(home), "TURNSTILE_API_KEY": "unused"}
    command = [str(codex), "exec", "--skip-git-repo-check", "Say hello"]
    return _run(command, env, tmp)


def run_claude(claude: Path, url: str, rollout: str, tmp: Path) -> subprocess.CompletedProcess[str]:
    home = tmp / f"claude-home-{rollout}"
    home.mkdir()
    env = {
        "HOME": str(home),
        "ANTHROPIC_BASE_URL": f"{url}/rollouts/{rollout}",
        "ANTHROPIC_API_KEY": "unused",
        "ANTHROPIC_MODEL": MODEL,
        "ANTHROPIC_SMALL_FAST_MODEL": MODEL,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(CLAUDE_MAX_OUTPUT_TOKENS),
    }
    return _run([str(claude), "-p", "Say hello", "--max-turns", "2"], env, tmp)


def _summary(agent: str, mode: str, turns: list[Any], samples: list[Any]) -> str:
    breaks = Counter(s["break_kind"] for s in samples)
    return (
        f"{agent} {mode}: {len(turns)} turns, {len(samples)} samples, "
        f"breaks {dict(sorted(breaks.items(), key=str))}"
    )


@pytest.mark.parametrize("mode", ["record", "tito"])
def test_codex_and_claude_code_run_through_turnstile(
    agents: AgentCLIs,
    agent_vllm: str,
    qwen3_tokenizer_dir: Path,
    tmp_path: Path,
    mode: str,
) -> None:
    ts = TurnstileServer(
        agent_vllm, tmp_path / "out", qwen3_tokenizer_dir, mode=mode, shard_max_age_s=0.2
    )
    ts.start()
    try:
        codex = run_codex(agents.codex, ts.url, "codex-1", tmp_path)
        assert codex.returncode == 0, codex.stdout + codex.stderr
        assert "tokens used" in codex.stderr + codex.stdout
        claude = run_claude(agents.claude, ts.url, "claude-1", tmp_path)
        # The random model never ends its turn: Claude Code reports the cut-off answer.
        said = claude.stdout + claude.stderr
        assert claude.returncode == 0 or "output token maximum" in said, said
        stats = httpx.get(f"{ts.url}/stats", timeout=10).json()
        for rollout in ("codex-1", "claude-1"):
            httpx.post(f"{ts.url}/rollouts/{rollout}/finish", timeout=30).raise_for_status()
    finally:
        ts.stop()
    if mode == "tito":
        assert stats["tito"]["split"] == 0 and stats["tito"]["refused"] == 0
    out = open_output(ts.output)
    all_turns, all_samples = out.turns().to_pylist(), out.samples().to_pylist()
    for agent, rollout in (("codex", "codex-1"), ("claude", "claude-1")):
        turns = sorted(
            (t for t in all_turns if t["rollout_id"] == rollout), key=lambda t: t["turn_index"]
        )
        samples = [s for s in all_samples if s["rollout_id"] == rollout]
        _log(_summary(agent, mode, turns, samples))
        assert turns, f"{agent} left no turns"
        assert all(t["status"] == "ok" and t["token_source"] == "backend" for t in turns)
        assert all(t["endpoint"] == "chat.completions" for t in turns)
        assert samples
        for sample in samples:
            ids = sample["input_ids"]
            for span in sample["turn_spans"]:
                turn = turns[span["turn_index"]]
                assert ids[: span["completion_start"]] == turn["prompt_token_ids"]
                completion = ids[span["completion_start"] : span["completion_end"]]
                assert completion == turn["completion_token_ids"]
        if mode == "tito":  # within a sample, every turn extends the one before exactly
            for sample in samples:
                spans = [turns[s["turn_index"]] for s in sample["turn_spans"]]
                for prev, turn in itertools.pairwise(spans):
                    context = prev["prompt_token_ids"] + prev["completion_token_ids"]
                    assert turn["prompt_token_ids"][: len(context)] == context
