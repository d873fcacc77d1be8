"""A trainer reading Turnstile shards with Ray Data and with Hugging Face `datasets`
streaming, filtered by policy version."""

from __future__ import annotations

from pathlib import Path

import pytest
from starlette.testclient import TestClient

from tests.fakes_backend import FakeVLLM
from turnstile.reader import open_output
from turnstile.server.app import create_app
from turnstile.settings import load_settings


@pytest.fixture(scope="module")
def output(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("shards")
    settings = load_settings(None, {"output": out, "shard_max_rows": 2}, environ={})
    with TestClient(create_app(settings, backend=FakeVLLM())) as client:
        for version in (1, 2, 3):
            for _ in range(2):
                rid = client.post("/rollouts", json={}).json()["rollout_id"]
                body = {"model": "fake-model", "messages": [{"role": "user", "content": "q"}]}
                client.post(
                    f"/rollouts/{rid}/v1/chat/completions",
                    json=body,
                    headers={"X-Turnstile-Policy-Version": str(version)},
                )
                client.post(f"/rollouts/{rid}/finish", json={"rewards": {"ok": 1.0}})
    return out


# Ray Data reads deprecated options of its own context while planning (ray internals).
@pytest.mark.filterwarnings("ignore::DeprecationWarning:ray")
def test_ray_data_reads_shards_with_a_policy_version_filter(output: Path) -> None:
    import ray

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        files = [str(p) for p in open_output(output).files("samples")]
        ds = ray.data.read_parquet(files).select_columns(
            ["input_ids", "loss_mask", "min_policy_version"]
        )
        from ray.data.expressions import col

        rows = ds.filter(expr=col("min_policy_version") >= 2).take_all()
    finally:
        ray.shutdown()
    assert len(rows) == 4 and {r["min_policy_version"] for r in rows} == {2, 3}
    assert all(len(r["input_ids"]) == len(r["loss_mask"]) for r in rows)


def test_hf_datasets_streams_the_shards(output: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from datasets import load_dataset

    files = [str(p) for p in open_output(output).files("samples")]
    stream = load_dataset("parquet", data_files=files, split="train", streaming=True)
    fresh = stream.filter(lambda row: row["min_policy_version"] >= 3)
    rows = list(fresh)
    assert len(rows) == 2 and all(r["reward"] == 1.0 for r in rows)
