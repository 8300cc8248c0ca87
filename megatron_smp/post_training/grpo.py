"""GRPO-family policy losses and group-normalised advantages.

The loss types and their normalisations are those of TRL's `GRPOTrainer` (`loss_type`) and
verl's `core_algos` (`loss_agg_mode`):

| loss_type | masked per-token terms aggregated as               | verl loss_agg_mode      |
| --------- | -------------------------------------------------- | ----------------------- |
| grpo      | mean over each sequence's tokens, then sequences   | seq-mean-token-mean     |
| dapo      | sum over all tokens / response tokens in the batch | token-mean              |
| dr_grpo   | sum over all tokens / (sequences x max length)     | seq-mean-token-sum-norm |
| gspo      | as grpo, with one ratio per sequence: exp(mean     | seq-mean-token-mean     |
|           | token log-ratio), GSPO's sequence-level ratio      |                         |

Every normaliser is a count over the *whole* batch (`num_tokens_in_batch`,
`num_sequences_in_batch`; by default the tensors' own), so the losses of the micro-batches and
data-parallel ranks of one step add up to the loss of the whole batch: a caller splitting a batch
passes the global counts and sums (never averages) the parts.
"""
from typing import Dict, Optional, Tuple

import torch

from megatron_smp.config.post_training import GRPO_LOSS_TYPES, SCALE_REWARDS  # noqa: F401


def _check_same_shape(reference: torch.Tensor, **tensors) -> None:
    for name, tensor in tensors.items():
        if tensor is not None and tensor.shape != reference.shape:
            raise ValueError(f"grpo_loss: {name} has shape {tuple(tensor.shape)}, expected "
                             f"{tuple(reference.shape)} (the shape of logps)")


def _check_options(loss_type, kl_beta, ref_logps, entropy_weight, entropies):
    if loss_type not in GRPO_LOSS_TYPES:
        raise ValueError(f"grpo_loss: unknown loss_type {loss_type!r}; choose one of "
                         f"{', '.join(GRPO_LOSS_TYPES)}")
    if kl_beta != 0.0 and ref_logps is None:
        raise ValueError("grpo_loss: kl_beta != 0 needs ref_logps (the reference policy's "
                         "log-probs)")
    if entropy_weight != 0.0 and entropies is None:
        raise ValueError("grpo_loss: entropy_weight != 0 needs entropies (the policy's per-token "
                         "entropy, e.g. from compute_logprobs(..., with_entropy=True))")


def loss_weights(loss_type: str, response_mask: torch.Tensor, sequence_ids: torch.Tensor,
                 num_sequences: float, num_tokens: float,
                 max_completion_length: Optional[int] = None,
                 tokens_per_sequence: Optional[torch.Tensor] = None) -> Dict[str, torch.Tensor]:
    """Per-token weights that turn a masked token sum into each aggregation of the module
    docstring, so the loss of any slice of a batch (a micro-batch, a packed row, a data- or
    context-parallel shard) is a plain weighted sum and the slices' losses add up.

    Args:
        response_mask: [...] 1 on trained response tokens.
        sequence_ids: [...] int, the rollout each token belongs to (any value off the mask).
        num_sequences / num_tokens: rollouts and response tokens in the whole batch.
        tokens_per_sequence: [num_rollouts] response tokens of each rollout, indexed by
            sequence_ids; counted from this slice when None (right when whole rollouts are in it).

    Returns:
        {"loss": weights of the policy term, "token_mean": mask / num_tokens (the entropy
        bonus and token metrics), "sequence_mean": mask / (|o_i| num_sequences)}.
    """
    mask = response_mask.to(torch.float64)
    if tokens_per_sequence is None:
        ids = torch.where(response_mask.bool(), sequence_ids.long(), 0)
        tokens_per_sequence = torch.zeros(int(ids.max()) + 1 if ids.numel() else 1,
                                          dtype=torch.float64).index_add_(0, ids.flatten(),
                                                                           mask.flatten())
    own_length = tokens_per_sequence.to(torch.float64).clamp(min=1.0)[
        torch.where(response_mask.bool(), sequence_ids.long(), 0)]
    weights = {"token_mean": mask / max(float(num_tokens), 1.0),
               "sequence_mean": mask / own_length / float(num_sequences)}
    if loss_type in ("grpo", "gspo"):
        weights["loss"] = weights["sequence_mean"]
    elif loss_type == "dapo":
        weights["loss"] = weights["token_mean"]
    else:
        if not max_completion_length:
            raise ValueError("grpo_loss: loss_type 'dr_grpo' needs max_completion_length (the "
                             "constant per-sequence token normaliser)")
        weights["loss"] = mask / (float(num_sequences) * max_completion_length)
    return weights


def grpo_loss(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor,
              response_mask: torch.Tensor, *, loss_type: str = "grpo",
              clamp_eps_lower: float = 0.2, clamp_eps_upper: float = 0.2,
              ref_logps: Optional[torch.Tensor] = None, kl_beta: float = 0.0,
              entropies: Optional[torch.Tensor] = None, entropy_weight: float = 0.0,
              max_completion_length: Optional[int] = None,
              num_tokens_in_batch: Optional[float] = None,
              num_sequences_in_batch: Optional[float] = None,
              ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """The clipped-ratio policy loss of one batch of rollouts, one rollout per row (to be
    minimised). Packed rows go through `weighted_grpo_loss` with `loss_weights`.

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
        For gspo the clip metrics are means over sequences, as TRL logs them.
    """
    _check_options(loss_type, kl_beta, ref_logps, entropy_weight, entropies)
    _check_same_shape(logps, old_logps=old_logps, response_mask=response_mask,
                      ref_logps=ref_logps, entropies=entropies)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    batch = logps.shape[0]
    sequence_ids = torch.arange(batch).unsqueeze(1).expand_as(logps)
    weights = loss_weights(
        loss_type, response_mask, sequence_ids,
        num_sequences=batch if num_sequences_in_batch is None else num_sequences_in_batch,
        num_tokens=(response_mask.sum().item() if num_tokens_in_batch is None
                    else num_tokens_in_batch),
        max_completion_length=max_completion_length)
    return weighted_grpo_loss(logps, old_logps, advantages.expand_as(logps), weights,
                              sequence_ids=sequence_ids, loss_type=loss_type,
                              clamp_eps_lower=clamp_eps_lower, clamp_eps_upper=clamp_eps_upper,
                              ref_logps=ref_logps, kl_beta=kl_beta, entropies=entropies,
                              entropy_weight=entropy_weight)


def weighted_grpo_loss(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor,
                       weights: Dict[str, torch.Tensor], *, sequence_ids: torch.Tensor,
                       loss_type: str = "grpo", clamp_eps_lower: float = 0.2,
                       clamp_eps_upper: float = 0.2, ref_logps: Optional[torch.Tensor] = None,
                       kl_beta: float = 0.0, entropies: Optional[torch.Tensor] = None,
                       entropy_weight: float = 0.0, sequence_group=None,
                       ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """`grpo_loss` over tokens in any layout (rows of single rollouts, packed rows, a shard):
    all tensors share one shape [...] (advantages per token), `weights` come from
    `loss_weights`. The loss and the metrics are weighted sums: those of the slices of a batch
    add up to the whole batch's. gspo's sequence ratio needs each rollout's tokens whole: when
    a rollout is split over ranks (context parallelism), `sequence_group` is the group of those
    ranks, and the per-sequence sums are all-reduced over it (gradients too).
    """
    _check_options(loss_type, kl_beta, ref_logps, entropy_weight, entropies)
    sequence_weights = weights["sequence_mean"].to(logps.dtype)
    log_ratio = logps - old_logps
    if loss_type == "gspo":
        # GSPO: one importance ratio per sequence, the geometric mean of its token ratios
        # (sequence_mean weights sum to 1 / num_sequences over each rollout's tokens).
        ids = sequence_ids.long().flatten()
        count = int(ids.max()) + 1 if ids.numel() else 1
        if sequence_group is not None:  # every rank sums into the same number of sequences
            count = torch.tensor([count], device=logps.device)
            torch.distributed.all_reduce(count, torch.distributed.ReduceOp.MAX,
                                         group=sequence_group)
            count = int(count.item())
        per_sequence = torch.zeros(count, dtype=logps.dtype, device=logps.device).index_add(
            0, ids, (log_ratio * sequence_weights).flatten())
        per_sequence_weight = torch.zeros_like(per_sequence).index_add(
            0, ids, sequence_weights.flatten())
        if sequence_group is not None:
            # A differentiable sum: the backward all-reduces the gradients as well, since every
            # rank's tokens of a sequence share its one ratio.
            from torch.distributed.nn.functional import all_reduce
            per_sequence = all_reduce(per_sequence, group=sequence_group)
            per_sequence_weight = all_reduce(per_sequence_weight, group=sequence_group)
        log_ratio = (per_sequence / per_sequence_weight.clamp(min=torch.finfo(
            logps.dtype).tiny))[ids].view_as(logps)
    ratio = torch.exp(log_ratio)
    clipped_ratio = ratio.clamp(1.0 - clamp_eps_lower, 1.0 + clamp_eps_upper)
    per_token_loss = -torch.min(ratio * advantages, clipped_ratio * advantages)
    per_token_kl = None
    if kl_beta != 0.0:
        ref_diff = ref_logps - logps
        per_token_kl = torch.exp(ref_diff) - ref_diff - 1.0
        per_token_loss = per_token_loss + kl_beta * per_token_kl
    token_weights = weights["token_mean"].to(logps.dtype)
    loss = (per_token_loss * weights["loss"].to(logps.dtype)).sum()
    if entropy_weight != 0.0:
        loss = loss - entropy_weight * (entropies * token_weights).sum()
    metrics = _metrics(sequence_weights if loss_type == "gspo" else token_weights, token_weights,
                       ratio, advantages, clamp_eps_lower, clamp_eps_upper, per_token_kl, entropies)
    return loss, metrics


@torch.no_grad()
def _metrics(ratio_weights, token_weights, ratio, advantages, eps_lower, eps_upper,
             per_token_kl, entropies):
    def mean(values, weights):
        return (values.to(weights.dtype) * weights).sum()

    low = (ratio < 1.0 - eps_lower) & (advantages < 0)
    high = (ratio > 1.0 + eps_upper) & (advantages > 0)
    outside = (ratio < 1.0 - eps_lower) | (ratio > 1.0 + eps_upper)
    metrics = {
        "clip_ratio/low_mean": mean(low, ratio_weights),
        "clip_ratio/high_mean": mean(high, ratio_weights),
        "clip_ratio/region_mean": mean(low | high, ratio_weights),
        "clip_fraction": mean(outside, ratio_weights),
        "ratio_mean": mean(ratio, ratio_weights),
    }
    if per_token_kl is not None:
        metrics["kl"] = mean(per_token_kl, token_weights)
    if entropies is not None:
        metrics["entropy"] = mean(entropies, token_weights)
    return metrics


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

