"""Token log-probabilities of a PyTorch causal language model, aligned with ``input_ids``.

``token_logprobs(model, batch)`` returns ``logp[b, t] = log pi(input_ids[b, t] | input_ids[b,
:t])`` (position 0, which has no context, is 0), the layout of ``behavior_logprobs`` and of
the losses in ``turnstile.train.losses``. ``model`` is any callable returning an object with
``.logits`` (e.g. a ``transformers`` ``AutoModelForCausalLM``) or a logits tensor.
"""

from __future__ import annotations

from typing import Any

import torch


def _logits(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
) -> torch.Tensor:
    kwargs: dict[str, Any] = {"input_ids": input_ids}
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask
    if position_ids is not None:
        kwargs["position_ids"] = position_ids
    out = model(**kwargs)
    logits: torch.Tensor = out.logits if hasattr(out, "logits") else out
    return logits


def next_token_logprobs(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """``(B, T, V)`` log-softmax of the distribution of token ``t`` (index 0: uniform 0)."""
    logp = torch.log_softmax(_logits(model, input_ids, attention_mask, position_ids).float(), -1)
    first = torch.zeros_like(logp[:, :1])
    return torch.cat([first, logp[:, :-1]], dim=1)


def token_logprobs(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """``(B, T)`` log-probability of each input token given the ones before it."""
    logits = _logits(model, input_ids, attention_mask, position_ids).float()
    logp = torch.log_softmax(logits[:, :-1], -1)
    picked = logp.gather(-1, input_ids[:, 1:, None].long()).squeeze(-1)
    return torch.cat([torch.zeros_like(picked[:, :1]), picked], dim=1)
