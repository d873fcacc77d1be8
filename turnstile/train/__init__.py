"""Trainer-side library for Turnstile's shards: batches, advantages, corrections, losses.

Numpy only: ``batches`` (padded and packed batches, advantages assigned to samples per
rollout), ``dataset`` (follow published shards, resumable, filters, complete GRPO groups),
``advantages`` (GRPO, GDPO's two forks, MRTPO), ``shaping`` (DAPO's overlong shaping and
filtering, dynamic sampling, KL in the reward), ``corrections`` (TIS, IcePop, Seq-MIS,
Seq-RS, verl's rejection options, veto, KL estimators; also on torch tensors),
``packing`` (packed rows by ``cu_seqlens``), ``jsd`` and ``rescore`` (re-scoring for MRTPO
through a vLLM backend's prompt_logprobs). With the ``train`` extra (PyTorch): ``losses``
(verl's policy loss and its variants, Proximal KL), ``policy`` (token log-probabilities of
a causal LM), ``torchdata`` (``ShardIterableDataset``) and ``rescore_torch`` (exact
re-scoring from full logits); ``vision`` (with Pillow) rebuilds a vision-language
sample's ``pixel_values`` from its stored images with the model's own processor.
``integrations.trl`` (with the ``trl`` extra) lets TRL's ``GRPOTrainer`` train from
recorded samples and pushes its weights to vLLM, fenced.

MRTPO and Proximal KL are implemented from the reading of their published abstracts given
in Turnstile's method notes; their modules say so.
"""

from turnstile.train.advantages import (
    gdpo_advantages,
    gdpo_reward_advantages,
    grpo_advantages,
    mrtpo_batch,
    mrtpo_token_advantages,
    mrtpo_token_weights,
)
from turnstile.train.batches import (
    TrainSample,
    assign_gdpo,
    assign_grpo,
    assign_mrtpo,
    pack_batch,
    pad_batch,
)
from turnstile.train.dataset import GroupCollector, Position, ShardFollower, iter_groups

__all__ = [
    "GroupCollector",
    "Position",
    "ShardFollower",
    "TrainSample",
    "assign_gdpo",
    "assign_grpo",
    "assign_mrtpo",
    "gdpo_advantages",
    "gdpo_reward_advantages",
    "grpo_advantages",
    "iter_groups",
    "mrtpo_batch",
    "mrtpo_token_advantages",
    "mrtpo_token_weights",
    "pack_batch",
    "pad_batch",
]
