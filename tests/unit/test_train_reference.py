"""Cross-checks: Turnstile's losses, corrections and GDPO against verl's and TRL's own code.

``tests/fixtures/train_reference/reference.json`` holds the outputs of the reference
functions themselves (verl 0.9.1 ``core_algos.compute_policy_loss_vanilla``, ``agg_loss``,
``kl_penalty``, ``rollout_corr_helper.compute_rollout_correction_weights`` and
``compute_rollout_rejection_mask``; verl's ``compute_grpo_outcome_advantage`` and
``masked_whiten`` as NVlabs' verl-GDPO fork combines them; TRL 1.16.0
``GRPOTrainer._compute_loss``) on fixed tensors, made by ``generate.py`` next to it: verl
cannot be installed here with its dependencies. Every comparison holds to 1e-6. TRL does
install (the ``reference`` extra), and the last test runs it live on the same tensors.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from turnstile.train import advantages as adv
from turnstile.train import corrections as corr
from turnstile.train import losses

REFERENCE = json.loads(
    (
        Path(__file__).resolve().parents[1] / "fixtures" / "train_reference" / "reference.json"
    ).read_text(encoding="utf-8")
)
TOL = 1e-6
F64 = torch.float64


def tensors() -> dict[str, torch.Tensor]:
    return {
        k: torch.tensor(v, dtype=F64)
        for k, v in REFERENCE["inputs"].items()
        if k in ("mask", "logp", "old", "rollout", "ref", "advantages", "entropy")
    }


def close(got: Any, expected: Any) -> None:
    got_np = got.detach().numpy() if isinstance(got, torch.Tensor) else np.asarray(got)
    np.testing.assert_allclose(got_np, np.asarray(expected, dtype=np.float64), atol=TOL, rtol=0)


def test_the_fixture_names_its_sources() -> None:
    assert REFERENCE["sources"]["verl"] == "0.9.1"
    assert REFERENCE["sources"]["trl"] == "1.16.0"


@pytest.mark.parametrize("case", range(len(REFERENCE["verl"]["policy_loss"])))
def test_policy_loss_matches_verl(case: int) -> None:
    ref = REFERENCE["verl"]["policy_loss"][case]
    cfg = ref["config"]
    x = tensors()
    logp = x["logp"].clone().requires_grad_(True)
    weights = corr.token_tis(x["old"], x["rollout"], x["mask"], 2.0) if cfg["is"] else None
    loss = losses.policy_loss(
        logp,
        x["old"],
        x["advantages"],
        x["mask"],
        clip_ratio=cfg["clip_ratio"],
        clip_ratio_low=cfg.get("clip_ratio_low"),
        clip_ratio_high=cfg.get("clip_ratio_high"),
        clip_ratio_c=cfg["clip_ratio_c"],
        loss_agg_mode=cfg["mode"],
        loss_scale_factor=cfg.get("loss_scale_factor"),
        weights=weights,
    )
    (grad,) = torch.autograd.grad(loss, logp)
    close(loss, ref["loss"])
    close(grad, ref["grad"])


def test_agg_loss_matches_verl() -> None:
    x = tensors()
    loss_mat = x["logp"] * x["advantages"]
    for key, expected in REFERENCE["verl"]["agg_loss"].items():
        mode, _, factor = key.partition("@")
        got = losses.agg_loss(loss_mat, x["mask"], mode, float(factor) if factor else None)
        close(got, expected)


@pytest.mark.parametrize("kind", sorted(REFERENCE["verl"]["kl_penalty"]))
def test_kl_estimators_match_verl(kind: str) -> None:
    x = tensors()
    ref = REFERENCE["verl"]["kl_penalty"][kind]
    logp = x["logp"].clone().requires_grad_(True)
    values = losses.kl_values(logp, x["ref"], kind)
    (grad,) = torch.autograd.grad((values * x["mask"]).sum(), logp)
    close(values, ref["values"])
    close(grad, ref["grad"])


def _bounds(threshold: str) -> tuple[float, float | None]:
    """verl's threshold string: ``"lower_upper"`` or ``"upper"``."""
    low, sep, high = threshold.partition("_")
    return (float(high), float(low)) if sep else (float(low), None)


def test_rollout_is_weights_match_verl() -> None:
    x = tensors()
    old, mu, mask = x["old"], x["rollout"], x["mask"]
    ours = {
        "token@2.0": corr.token_tis(old, mu, mask, 2.0),
        "sequence@2.0": corr.sequence_tis(old, mu, mask, 2.0),
        "token@0.5_5.0": corr.icepop(old, mu, mask, 0.5, 5.0),
        "sequence@1e-9_1.2": corr.sequence_mis_weights(old, mu, mask, 1.2, 1e-9),
        "sequence@0.7_3.0": corr.sequence_mis_weights(old, mu, mask, 3.0, 0.7),
    }
    assert set(ours) == set(REFERENCE["verl"]["rollout_is_weights"])
    for key, expected in REFERENCE["verl"]["rollout_is_weights"].items():
        close(ours[key], expected)
        # the fixture exercises the bounds: every sequence-level masking drops a sequence
        if key.startswith("sequence@") and "_" in key:
            seq = np.asarray(expected)[:, 0]
            assert (seq == 0).any() and (seq > 0).any()


@pytest.mark.parametrize("key", sorted(REFERENCE["verl"]["rollout_rs_mask"]))
def test_rejection_masks_match_verl(key: str) -> None:
    x = tensors()
    option, _, threshold = key.partition("@")
    upper, lower = _bounds(threshold)
    got = corr.rejection_mask(x["old"], x["rollout"], x["mask"], option, upper, lower)
    expected = np.asarray(REFERENCE["verl"]["rollout_rs_mask"][key])
    close(got.to(F64), expected)
    # not vacuous: the option rejects some of the tokens and keeps some
    assert 0 < expected.sum() < x["mask"].sum()


def test_gdpo_verl_variant_matches_the_nvlabs_verl_fork() -> None:
    inputs = REFERENCE["inputs"]
    got = adv.gdpo_advantages(
        inputs["rewards"], inputs["groups"], variant="verl", token_counts=inputs["lengths"]
    )
    close(got, REFERENCE["verl"]["gdpo_verl"])


# TRL's loss_type -> verl's loss_agg_mode (and Dr. GRPO's constant: max_completion_length)
TRL_MODES = {
    "grpo": "seq-mean-token-mean",
    "bnpo": "token-mean",
    "dr_grpo": "seq-mean-token-sum-norm",
}


@pytest.mark.parametrize("case", range(len(REFERENCE["trl"]["grpo_loss"])))
def test_grpo_loss_matches_trl(case: int) -> None:
    ref = REFERENCE["trl"]["grpo_loss"][case]
    x = tensors()
    mode = TRL_MODES[ref["loss_type"]]
    logp = x["logp"].clone().requires_grad_(True)
    width = float(x["mask"].shape[-1])
    loss = losses.policy_loss(
        logp,
        x["old"],
        x["advantages"],
        x["mask"],
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        loss_agg_mode=mode,
        loss_scale_factor=width,
    ) + ref["beta"] * losses.kl_loss(
        logp,
        x["ref"],
        x["mask"],
        "k3",
        mode,
        width,
        x["old"] if ref["use_bias_correction_kl"] else None,
    )
    (grad,) = torch.autograd.grad(loss, logp)
    close(loss, ref["loss"])
    close(grad, ref["grad"])


def _generator() -> Any:
    """tests/fixtures/train_reference/generate.py, the script that made the fixture."""
    path = Path(__file__).resolve().parents[1] / "fixtures" / "train_reference" / "generate.py"
    spec = importlib.util.spec_from_file_location("train_reference_generate", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_trl_itself_still_computes_the_fixture() -> None:
    """TRL installs here (the `reference` extra): its `GRPOTrainer._compute_loss` runs
    live on the fixture's tensors and gives the fixture's numbers, which the tests above
    hold Turnstile's losses to."""
    from importlib import metadata

    generate = _generator()
    assert metadata.version("trl") == REFERENCE["sources"]["trl"]
    x = generate.inputs()
    for name, value in tensors().items():
        assert torch.equal(x[name], value), name
    live = generate.trl_checks(x)["grpo_loss"]
    assert len(live) == len(REFERENCE["trl"]["grpo_loss"])
    for got, expected in zip(live, REFERENCE["trl"]["grpo_loss"], strict=True):
        assert got["loss_type"] == expected["loss_type"]
        np.testing.assert_allclose(got["loss"], expected["loss"], atol=1e-12, rtol=0)
        np.testing.assert_allclose(got["grad"], expected["grad"], atol=1e-12, rtol=0)
