"""The whole-model learning example: every estimator learns, the controls do not."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "train"))
import learn_whole

STEPS = 15
SEED = 0
# Measured with these settings (seed 0, 15 steps): every estimator moves the mean reward
# (at most 2) from about 0.55 to 0.91-0.95, i.e. by 0.36-0.39; learning rate 0 by +0.003
# and shuffled rewards by -0.03. The thresholds sit between the two.
MIN_GAIN = 0.25
MAX_CONTROL_CHANGE = 0.1


def gain(curve: list[float]) -> float:
    return float(np.mean(curve[-3:]) - np.mean(curve[:3]))


def test_estimators_train_the_whole_model_and_the_controls_stay_flat() -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(learn_whole.TORCH_THREADS)
    try:
        runs = {
            name: learn_whole.train(name, SEED, STEPS)
            for name in (*learn_whole.ESTIMATORS, *learn_whole.CONTROLS)
        }
    finally:
        torch.set_num_threads(threads)
    for name in learn_whole.ESTIMATORS:
        assert gain(runs[name].mean_reward) >= MIN_GAIN, (name, runs[name].mean_reward)
        assert len(runs[name].mean_reward) == STEPS + 1
    for name in learn_whole.CONTROLS:
        assert abs(gain(runs[name].mean_reward)) <= MAX_CONTROL_CHANGE, (
            name,
            runs[name].mean_reward,
        )
