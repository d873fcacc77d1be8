"""The exact re-scoring path: MRTPO relevance from full logits of a PyTorch causal LM.

Same jobs and the same ``replays/`` table as ``turnstile.train.rescore``, but the JSD is
computed over the whole vocabulary, so ``jsd_upper == jsd`` and the tails are 0. This
follows the reading of MRTPO's abstract given in Turnstile's method notes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from turnstile.train import rescore
from turnstile.train.batches import TrainSample
from turnstile.train.policy import next_token_logprobs


def jsd_torch(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """JSD (nats) between distributions given as log-probabilities along the last axis."""
    logm = torch.logaddexp(logp, logq) - math.log(2.0)
    kl_pm = (logp.exp() * (logp - logm)).sum(-1)
    kl_qm = (logq.exp() * (logq - logm)).sum(-1)
    return (0.5 * kl_pm + 0.5 * kl_qm).clamp(0.0, math.log(2.0))


@torch.no_grad()
def score_model(model: Any, job: rescore.RescoreJob, name: str | None = None) -> rescore.RescoreRow:
    """Exact per-token JSD for one job."""
    device = next(iter(model.parameters())).device if hasattr(model, "parameters") else None
    base = torch.tensor([job.base_prompt], device=device)
    info = torch.tensor([job.info_prompt], device=device)
    lp_base = next_token_logprobs(model, base)[0]
    lp_info = next_token_logprobs(model, info)[0]
    pos = torch.as_tensor(job.positions, device=lp_base.device)
    p, q = lp_base[pos], lp_info[pos + len(job.info_ids)]
    d = jsd_torch(p, q).double().cpu().numpy()
    tokens = base[0, pos].long()
    lpb = p.gather(-1, tokens[:, None]).squeeze(-1).double().cpu().numpy()
    lpi = q.gather(-1, tokens[:, None]).squeeze(-1).double().cpu().numpy()
    zeros = np.zeros_like(d)
    return rescore.RescoreRow(
        job, rescore.METHOD_LOGITS, None, d, d.copy(), zeros, zeros.copy(), lpb, lpi, name
    )


def rescore_model(
    output: str | Path,
    model: Any,
    tokenize: Callable[[str], list[int]],
    *,
    samples: Sequence[TrainSample] | None = None,
    template: str = rescore.DEFAULT_INFO_TEMPLATE,
    rewards: Sequence[str] | None = None,
    model_name: str | None = None,
    progress: bool = True,
) -> int:
    """Score every not yet re-scored (sample, reward) with ``model``; return rows written."""
    pool = list(samples) if samples is not None else rescore.load_samples(output)
    done = rescore.done_keys(output, rescore.METHOD_LOGITS)
    jobs = list(rescore.build_jobs(pool, tokenize, template, done, rewards))
    rows: list[rescore.RescoreRow] = []
    with rescore.progress_bar(len(jobs), "rescore (logits)", progress) as bar:
        for job in jobs:
            rows.append(score_model(model, job, model_name))
            bar.update(1)
    for start in range(0, len(rows), rescore.ROWS_PER_SHARD):
        rescore.write_replays(output, rows[start : start + rescore.ROWS_PER_SHARD])
    return len(rows)


def load_hf_model(model_dir: str | Path) -> tuple[Any, Callable[[str], list[int]]]:
    """A local ``transformers`` causal LM (float32, eval mode) and its tokenize function."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32, local_files_only=True
    )
    model.train(False)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)

    def tokenize(text: str) -> list[int]:
        return [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]

    return model, tokenize


# The name from before `turnstile rescore`, kept for trainers that import it (deprecated).
replay_model = rescore_model
