"""GRPO-family policy losses and group-normalised advantages.

The loss types and their normalisations are those of TRL's `GRPOTrainer` (`loss_type`) and
verl's `core_algos` (`loss_agg_mode`):

| loss_type | ratio        | aggregation of the masked per-token terms                    | verl agg mode            |
| --------- | ------------ | ------------------------------------------------------------ | ------------------------ |
| grpo      | per token    | mean over each sequence's tokens, then mean over sequences   | seq-mean-token-mean      |
| dapo      | per token    | sum over all tokens / number of response tokens in the batch | token-mean               |
| dr_grpo   | per token    | sum over all tokens / (sequences x max completion length)    | seq-mean-token-sum-norm  |
| gspo      | per sequence | as grpo; the ratio is exp(mean token log-ratio) per sequence | seq-mean-token-mean      |

Every normaliser is a count over the *whole* batch (`num_tokens_in_batch`,
`num_sequences_in_batch`; by default the tensors' own), so the losses of the micro-batches and
data-parallel ranks of one step add up to the loss of the whole batch: a caller splitting a batch
passes the global counts and sums (never averages) the parts.
"""
from typing import Dict, Optional, Tuple

import torch

GRPO_LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "gspo")
SCALE_REWARDS = ("group", "batch", "none")


def _check_same_shape(reference: torch.Tensor, **tensors) -> None:
    for name, tensor in tensors.items():
        if tensor is not None and tensor.shape != reference.shape:
            raise ValueError(f"grpo_loss: {name} has shape {tuple(tensor.shape)}, expected "
                             f"{tuple(reference.shape)} (the shape of logps)")


def grpo_loss(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor,
              response_mask: torch.Tensor, *, loss_type: str = "grpo",
              clamp_eps_lower: float = 0.2, clamp_eps_upper: float = 0.2,
              ref_logps: Optional[torch.Tensor] = None, kl_beta: float = 0.0,
              entropies: Optional[torch.Tensor] = None, entropy_weight: float = 0.0,
              max_completion_length: Optional[int] = None,
              num_tokens_in_batch: Optional[float] = None,
              num_sequences_in_batch: Optional[float] = None,
              ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """The clipped-ratio policy loss of one batch of rollouts (to be minimised).

    Args:
        logps: [B, T] log-probs of the response tokens under the policy being trained (with grad).
        old_logps: [B, T] log-probs under the policy that sampled the rollouts (no grad).
        advantages: [B] one advantage per sequence, or [B, T] per token.
        response_mask: [B, T] 1 for response tokens that are trained, 0 for prompt and padding.
        loss_type: one of GRPO_LOSS_TYPES (see the module docstring).
        clamp_eps_lower / clamp_eps_upper: the ratio is clipped to [1 - lower, 1 + upper]
            (DAPO's "clip higher" sets upper > lower).
        ref_logps: [B, T] reference-policy log-probs; needed when kl_beta != 0.
        kl_beta: weight of the k3 estimator exp(ref - logp) - (ref - logp) - 1 of KL(pi || ref),
            added to each token's term before aggregation (TRL's `beta`).
        entropies: [B, T] entropy of the policy's full next-token distribution at each position
            (with grad); needed when entropy_weight != 0.
        entropy_weight: the bonus `entropy_weight * mean response-token entropy` is subtracted
            from the loss (TRL's `entropy_coef`, Megatron's `--grpo-entropy-term-weight`).
        max_completion_length: dr_grpo's constant per-sequence normaliser.
        num_tokens_in_batch: response tokens in the whole batch (dapo's normaliser, and the
            entropy bonus'); defaults to response_mask.sum().
        num_sequences_in_batch: sequences in the whole batch (grpo, gspo, dr_grpo); defaults to B.

    Returns:
        (loss, metrics): the scalar loss and detached scalar metrics over this batch's response
        tokens: `kl`, `entropy` (when given), `clip_ratio/low_mean`, `clip_ratio/high_mean`,
        `clip_ratio/region_mean` (TRL's names: tokens whose ratio is clipped on the side its
        advantage's sign makes active), `clip_fraction` (tokens whose ratio lies outside the
        clip range at all, Megatron's truncated-from-above/below counts) and `ratio_mean`.
    """
    if loss_type not in GRPO_LOSS_TYPES:
        raise ValueError(f"grpo_loss: unknown loss_type {loss_type!r}; choose one of "
                         f"{', '.join(GRPO_LOSS_TYPES)}")
    _check_same_shape(logps, old_logps=old_logps, response_mask=response_mask,
                      ref_logps=ref_logps, entropies=entropies)
    if kl_beta != 0.0 and ref_logps is None:
        raise ValueError("grpo_loss: kl_beta != 0 needs ref_logps (the reference policy's log-probs)")
    if entropy_weight != 0.0 and entropies is None:
        raise ValueError("grpo_loss: entropy_weight != 0 needs entropies (the policy's per-token "
                         "entropy, e.g. from token_entropy(logits))")
    if loss_type == "dr_grpo" and not max_completion_length:
        raise ValueError("grpo_loss: loss_type 'dr_grpo' needs max_completion_length (the constant "
                         "per-sequence token normaliser)")
    mask = response_mask.to(logps.dtype)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    advantages = advantages.to(logps.dtype)
    tokens_per_sequence = mask.sum(-1).clamp(min=1.0)

    log_ratio = logps - old_logps
    if loss_type == "gspo":
        # GSPO: one importance ratio per sequence, the geometric mean of its token ratios.
        log_ratio = ((log_ratio * mask).sum(-1) / tokens_per_sequence).unsqueeze(-1)
    ratio = torch.exp(log_ratio)
    clipped_ratio = ratio.clamp(1.0 - clamp_eps_lower, 1.0 + clamp_eps_upper)
    per_token_loss = -torch.min(ratio * advantages, clipped_ratio * advantages)

    if kl_beta != 0.0:
        ref_diff = ref_logps - logps
        per_token_kl = torch.exp(ref_diff) - ref_diff - 1.0
        per_token_loss = per_token_loss + kl_beta * per_token_kl

    num_sequences = float(num_sequences_in_batch if num_sequences_in_batch is not None
                          else logps.shape[0])
    num_tokens = (mask.sum().clamp(min=1.0) if num_tokens_in_batch is None
                  else torch.as_tensor(float(num_tokens_in_batch), dtype=logps.dtype))
    masked = per_token_loss * mask
    if loss_type in ("grpo", "gspo"):
        loss = (masked.sum(-1) / tokens_per_sequence).sum() / num_sequences
    elif loss_type == "dapo":
        loss = masked.sum() / num_tokens
    else:  # dr_grpo
        loss = masked.sum() / (num_sequences * max_completion_length)

    if entropy_weight != 0.0:
        loss = loss - entropy_weight * (entropies * mask).sum() / num_tokens

    metrics = _metrics(mask, ratio, advantages, clamp_eps_lower, clamp_eps_upper,
                       per_token_kl if kl_beta != 0.0 else None, entropies)
    return loss, metrics


@torch.no_grad()
def _metrics(mask, ratio, advantages, eps_lower, eps_upper, per_token_kl, entropies):
    count = mask.sum().clamp(min=1.0)

    def masked_mean(values):
        return (values.to(mask.dtype) * mask).sum() / count

    def ratio_level_mean(values):
        # A sequence-level ratio (gspo, [B, 1]) is averaged over sequences, as TRL logs it.
        if values.shape[-1] == 1:
            return values.to(mask.dtype).mean()
        return masked_mean(values)

    low = ratio < 1.0 - eps_lower
    high = ratio > 1.0 + eps_upper
    if advantages.shape[-1] != ratio.shape[-1]:
        advantages = advantages.expand(-1, ratio.shape[-1])
    metrics = {
        "clip_ratio/low_mean": ratio_level_mean(low & (advantages < 0)),
        "clip_ratio/high_mean": ratio_level_mean(high & (advantages > 0)),
        "clip_ratio/region_mean": ratio_level_mean((low & (advantages < 0)) | (high & (advantages > 0))),
        "clip_fraction": ratio_level_mean(low | high),
        "ratio_mean": ratio_level_mean(ratio),
    }
    if per_token_kl is not None:
        metrics["kl"] = masked_mean(per_token_kl)
    if entropies is not None:
        metrics["entropy"] = masked_mean(entropies)
    return metrics


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) at each position: [..., V] -> [...] (differentiable)."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    return -(log_probs.exp() * log_probs).sum(-1)


def group_advantages(rewards: torch.Tensor, scale_rewards: str = "group",
                     unbiased_std: bool = False, epsilon: float = 1e-4) -> torch.Tensor:
    """GRPO's group-normalised advantages: (r - mean of its group) / (std + epsilon).

    Args:
        rewards: [num_groups, group_size] one reward per completion, the completions of one
            prompt in one row.
        scale_rewards: "group" divides by each group's std (GRPO), "batch" by the whole batch's
            std, "none" does not divide (Dr. GRPO).
        unbiased_std: Bessel's correction in the std (TRL's `nanstd`); Megatron's
            `calculate_grpo_advantages` uses the population std (the default here).
        epsilon: added to the std (1e-4 in TRL and Megatron), so equal-reward groups get 0.

    Returns:
        [num_groups, group_size] advantages (float64 in, float64 out; else float32).
    """
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"group_advantages: scale_rewards {scale_rewards!r} is not one of "
                         f"{', '.join(SCALE_REWARDS)}")
    if rewards.dim() != 2:
        raise ValueError(f"group_advantages: rewards must be [num_groups, group_size], got shape "
                         f"{tuple(rewards.shape)}")
    rewards = rewards if rewards.dtype == torch.float64 else rewards.float()
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if scale_rewards == "none":
        return centred
    correction = 1 if unbiased_std else 0
    if scale_rewards == "group":
        std = rewards.std(dim=1, keepdim=True, correction=correction) if rewards.shape[1] > 1 \
            else torch.zeros_like(rewards[:, :1])
    else:
        std = rewards.std(correction=correction) if rewards.numel() > 1 \
            else torch.zeros((), dtype=rewards.dtype)
    return centred / (std + epsilon)


def groups_with_distinct_rewards(rewards: torch.Tensor) -> torch.Tensor:
    """DAPO's dynamic-sampling filter: [num_groups, group_size] -> [num_groups] bool, True for
    the groups whose rewards are not all equal (an all-equal group has zero advantage everywhere
    and only dilutes the batch; `--grpo-filter-groups-with-same-reward` drops it)."""
    if rewards.dim() != 2:
        raise ValueError(f"groups_with_distinct_rewards: rewards must be [num_groups, group_size], "
                         f"got shape {tuple(rewards.shape)}")
    return (rewards != rewards[:, :1]).any(dim=1)

