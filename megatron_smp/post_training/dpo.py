"""Direct Preference Optimization: TRL's loss types, their metrics, and the per-pair log-probs
of packed rows.

The formulas are TRL's (`DPOTrainer._compute_loss`, trl 1.16), by the same names:

    logratio_c = logp(chosen) - ref_logp(chosen), logratio_r likewise, d = logratio_c - logratio_r
    sigmoid   -logsigmoid(beta d)
    hinge     relu(1 - beta d)
    ipo       (logratio_c / n_c - logratio_r / n_r - 1 / (2 beta))^2     (n: response tokens)
    robust    (-(1 - eps) logsigmoid(beta d) + eps logsigmoid(-beta d)) / (1 - 2 eps)

each averaged over the pairs, plus `rpo_alpha` times the mean negative log-likelihood of the
chosen responses' tokens (TRL's `loss_type=[..., "sft"]`, `loss_weights=[1, rpo_alpha]`; the
`rpo_alpha` of earlier TRL releases). A sequence's log-prob is the sum over its response tokens.

Packed rows (`data.preference_dataset`) hold whole pairs: within a row, documents 2p and
2p + 1 are pair p's chosen and rejected sequence (prompt + response each); the loss mask is 1
on the response tokens only. A trailing padding document has no response tokens and pairs
with nothing.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from megatron_smp.config import ConfigError
from megatron_smp.config.post_training import (  # noqa: F401 (the config's home)
    DPO_LOSS_TYPES as LOSS_TYPES, DPO_REFERENCE_MODES as REFERENCE_MODES, DPOConfig,
)

# TRL's metric names, logged as they are (log line and TensorBoard).
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
           "logps/chosen", "logps/rejected")
LOSS_KEY = "dpo loss"


def dpo_losses(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor,
               ref_chosen_logps: torch.Tensor, ref_rejected_logps: torch.Tensor,
               config: DPOConfig, chosen_tokens: Optional[torch.Tensor] = None,
               rejected_tokens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per-pair loss [n] of `config.loss_type` from per-pair sequence log-probs [n] (fp32).
    `chosen_tokens` / `rejected_tokens` [n]: response tokens per sequence (the ipo loss)."""
    beta = config.beta
    chosen_logratios = chosen_logps - ref_chosen_logps
    rejected_logratios = rejected_logps - ref_rejected_logps
    delta = chosen_logratios - rejected_logratios
    if config.loss_type == "sigmoid":
        return -F.logsigmoid(beta * delta)
    if config.loss_type == "hinge":
        return torch.relu(1 - beta * delta)
    if config.loss_type == "ipo":
        if chosen_tokens is None or rejected_tokens is None:
            raise ValueError("the ipo loss needs the response token counts")
        ipo_delta = (chosen_logratios / chosen_tokens.clamp(min=1.0)
                     - rejected_logratios / rejected_tokens.clamp(min=1.0))
        return (ipo_delta - 1 / (2 * beta)) ** 2
    if config.loss_type == "robust":
        smoothing = config.label_smoothing
        clean = -(1 - smoothing) * F.logsigmoid(beta * delta)
        flipped = -smoothing * F.logsigmoid(-beta * delta)
        return (clean - flipped) / (1 - 2 * smoothing)
    raise ConfigError(f"--dpo-loss-type {config.loss_type!r}: choose from {', '.join(LOSS_TYPES)}")


def pair_sums(values: torch.Tensor, loss_mask: torch.Tensor, document_ids: torch.Tensor,
              num_documents: int, cp_group=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-document sums of `values` [b, s] over the loss-masked tokens, and the token counts,
    as [b, num_documents // 2, 2] (chosen, rejected) each. `document_ids` [b, s]: each token's
    document number in its row (this rank's tokens under context parallelism: the sums are
    then completed over `cp_group`, differentiably; the same on every CP rank)."""
    from megatron_smp.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    b = values.shape[0]
    mask = loss_mask.to(values.dtype)
    index = document_ids.long()
    sums = values.new_zeros(b, num_documents).scatter_add(1, index, values * mask)
    counts = mask.new_zeros(b, num_documents).scatter_add(1, index, mask)
    if cp_group is not None:
        # Forward all-reduce, backward identity: every CP rank computes the same loss from
        # the whole documents' sums, and each back-propagates into its own tokens.
        sums = reduce_from_tensor_model_parallel_region(sums, cp_group)
        counts = reduce_from_tensor_model_parallel_region(counts, cp_group)
    pairs = num_documents // 2
    return (sums[:, :2 * pairs].view(b, pairs, 2), counts[:, :2 * pairs].view(b, pairs, 2))


def dpo_loss_and_metrics(logps: torch.Tensor, ref_logps: torch.Tensor, counts: torch.Tensor,
                         config: DPOConfig) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """The mean loss over the valid pairs and TRL's six metrics plus the loss as [sum, count]
    reports (means over the global batch's pairs once summed over microbatches and ranks).

    logps, ref_logps, counts: [..., 2] per pair (chosen, rejected): the policy's and the
    reference's summed response log-probs, and the response tokens. A pair is valid when
    both sequences have response tokens (slots beyond a row's pairs have none).
    """
    logps, ref_logps, counts = (t.reshape(-1, 2) for t in (logps, ref_logps, counts))
    valid = ((counts[:, 0] > 0) & (counts[:, 1] > 0)).to(logps.dtype)
    num_pairs = valid.sum()
    denominator = num_pairs.clamp(min=1.0)
    chosen, rejected = logps[:, 0], logps[:, 1]
    losses = dpo_losses(chosen, rejected, ref_logps[:, 0], ref_logps[:, 1], config,
                        counts[:, 0], counts[:, 1])
    loss = (losses * valid).sum() / denominator
    if config.rpo_alpha is not None:
        # TRL's "sft" term: the mean NLL over every chosen response token of the batch.
        chosen_tokens = (counts[:, 0] * valid).sum().clamp(min=1.0)
        loss = loss + config.rpo_alpha * (-(chosen * valid).sum() / chosen_tokens)
    with torch.no_grad():
        chosen_rewards = config.beta * (chosen - ref_logps[:, 0]).detach()
        rejected_rewards = config.beta * (rejected - ref_logps[:, 1]).detach()
        values = {
            "rewards/chosen": chosen_rewards,
            "rewards/rejected": rejected_rewards,
            "rewards/accuracies": (chosen_rewards > rejected_rewards).to(logps.dtype),
            "rewards/margins": chosen_rewards - rejected_rewards,
            "logps/chosen": chosen.detach(),
            "logps/rejected": rejected.detach(),
        }
        reports = {key: torch.stack([(value * valid).sum(), num_pairs])
                   for key, value in values.items()}
        reports[LOSS_KEY] = torch.stack([loss.detach() * num_pairs, num_pairs])
    return loss, reports


__all__ = ["DPOConfig", "LOSS_TYPES", "METRICS", "LOSS_KEY", "REFERENCE_MODES", "dpo_losses",
           "pair_sums", "dpo_loss_and_metrics"]
