"""The trainer guide's code sample (docs/trainer.md) runs as written against real shards."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.unit.test_train_batches import group_records, write_shard
from tests.unit.test_train_rescore import TinyLM

ROOT = Path(__file__).resolve().parents[2]


def trainer_sample() -> str:
    readme = (ROOT / "docs" / "trainer.md").read_text(encoding="utf-8")
    section = readme[readme.index("## Trainer") :]
    begin = section.index("```python\n") + len("```python\n")
    return section[begin : section.index("```", begin)]


def test_readme_trainer_sample_trains_on_complete_groups(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    output = tmp_path / "turnstile-output"
    rewards = [(1.0, 0.0), (1.0, 0.0), (0.0, 1.0), (0.0, 0.0)]
    write_shard(output, group_records("a", rewards) + group_records("b", rewards[:3]), "w1")
    write_shard(output, group_records("b", rewards)[3:], "w2")
    monkeypatch.chdir(tmp_path)
    model = TinyLM()
    before = model.head.weight.detach().clone()
    namespace: dict[str, Any] = {
        "model": model,
        "optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
    }
    exec(compile(trainer_sample(), "docs/trainer.md", "exec"), namespace)
    assert not torch.equal(before, model.head.weight.detach())
    assert len(namespace["samples"]) == 8
    position = namespace["checkpoint"]["position"]
    # the batch completed on the second shard's only row: resuming starts after it
    assert len(position["done"]) == 1 and position["shard"].endswith("-w2-000001.parquet")
    assert position["row"] == 1
    assert float(namespace["out"].loss.detach()) != 0.0
