"""The learning example end to end: a tiny policy trained through Turnstile gets better."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train" / "learn.py"
STEPS = 4
# Starting its own vLLM takes 1-4 minutes on two shared cores; the three training runs of
# STEPS steps take about two more.
EXAMPLE_TIMEOUT_S = 900
# With the example's fixed seeds the mean reward (at most 2) rises by 0.3-0.6 within
# STEPS steps for every estimator; 0.15 leaves room for vLLM's batch-dependent numerics.
MIN_GAIN = 0.15
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_mean_reward_rises_for_grpo_gdpo_and_mrtpo(tmp_path: Path) -> None:
    plot, result = tmp_path / "reward.png", tmp_path / "reward.json"
    done = subprocess.run(
        [
            sys.executable,
            str(EXAMPLE),
            "--steps",
            str(STEPS),
            "--plot",
            str(plot),
            "--json",
            str(result),
            "--workdir",
            str(tmp_path / "work"),
        ],
        capture_output=True,
        text=True,
        timeout=EXAMPLE_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    curves = json.loads(result.read_text())
    assert set(curves) == {"grpo", "gdpo", "mrtpo"}
    for name, curve in curves.items():
        rewards = curve["mean_reward"]
        assert len(rewards) == STEPS + 1, name
        assert rewards[-1] >= rewards[0] + MIN_GAIN, (name, rewards)
        # every step trains on turns of the current policy version, recorded per turn
        assert curve["policy_versions"] == [[v] for v in range(STEPS + 1)], name
        assert curve["staleness"] == [0] * (STEPS + 1), name
    assert plot.read_bytes().startswith(PNG_MAGIC)
    assert (tmp_path / "work" / "out-mrtpo" / "replays").is_dir()
