"""Routing maths shared by the router and the tests: top-k with capacity, Sinkhorn, the
load-balancing and z losses, and the autograd trick that adds those losses to backward.

Tokens are rows: logits / probs / routing maps are [num_tokens, num_experts]. With sequence
parallelism each tensor-parallel rank routes its own sequence shard, so the losses are
written as *partial sums*: each rank's value is its share, and the ranks' values add up to
the loss of the whole sequence (their gradients too). Nothing here communicates except the
token counts, which are summed over `sequence_group`.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.distributed as dist

from megatron_smp.tensor_parallel.mappings import ProcessGroup, group_size


class MoEAuxLossAutoScaler(torch.autograd.Function):
    """Identity on `output`; backward also sends `scale` as the gradient of `aux_loss`.

    The auxiliary losses are not part of the language-model loss the schedule calls
    backward on; attaching them to an activation makes them enter backward exactly where
    that activation does (any pipeline stage, any microbatch). `scale` is a 0-dim tensor
    the training loop fills with loss_scale / num_microbatches, so the aux-loss gradient is
    scaled like the main loss's.
    """

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor, scale: torch.Tensor):
        ctx.save_for_backward(aux_loss)
        # Read at backward time (not saved): the loop may set it between steps.
        ctx.scale = scale
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (aux_loss,) = ctx.saved_tensors
        scale = ctx.scale.to(device=aux_loss.device, dtype=aux_loss.dtype)
        return grad_output, torch.ones_like(aux_loss) * scale, None


def reduce_token_counts(counts: torch.Tensor, sequence_group: ProcessGroup) -> torch.Tensor:
    """Sum per-expert token counts [..., E] over the ranks sharing one sequence (no grad)."""
    if group_size(sequence_group) == 1:
        return counts
    counts = counts.clone()
    dist.all_reduce(counts, group=sequence_group)
    return counts


def switch_load_balancing_loss(
    probs: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    total_num_tokens: int,
    topk: int,
    coeff: float,
) -> torch.Tensor:
    """Switch-Transformer load balancing, Megatron's normalisation:
    coeff * E / (topk * T^2) * sum_e (sum_t probs[t, e]) * tokens_per_expert[e].

    probs [T_local, E] fp32 softmax scores of this rank's tokens; tokens_per_expert [E] and
    total_num_tokens T over the whole sequence partition. This rank's value is its partial
    sum (the ranks' values add up to the loss). Hugging Face's `load_balancing_loss_func`
    equals topk * this / coeff.
    """
    num_experts = probs.shape[-1]
    scale = num_experts * coeff / (topk * total_num_tokens * total_num_tokens)
    return (probs.sum(dim=0) * tokens_per_expert.to(probs.dtype)).sum() * scale


def sequence_load_balancing_loss(
    probs: torch.Tensor,
    routing_map: torch.Tensor,
    seq_length: int,
    topk: int,
    coeff: float,
    sequence_group: ProcessGroup = None,
) -> torch.Tensor:
    """The load-balancing loss per sequence, averaged over the batch (DeepSeek-V2's
    sequence-wise auxiliary loss).

    probs [s_local, b, E] fp32 scores, routing_map [s_local, b, E]; `seq_length` is the
    whole sequence (s_local x sequence-group size). Partial sum over the sequence group.
    """
    num_experts = probs.shape[-1]
    counts = reduce_token_counts(routing_map.sum(dim=0).to(probs.dtype), sequence_group)
    fraction = counts * (num_experts / (seq_length * topk))  # [b, E]
    mean_probs = probs.sum(dim=0) / seq_length  # [b, E], this rank's share
    return (fraction * mean_probs).sum(dim=-1).mean() * coeff


def z_loss(logits: torch.Tensor, coeff: float, num_partitions: int = 1) -> torch.Tensor:
    """ST-MoE router z-loss coeff * mean_t logsumexp(logits_t)^2, as this rank's share of
    the mean over `num_partitions` equal sequence shards. logits [T_local, E]."""
    return torch.logsumexp(logits.float(), dim=-1).square().mean() * (coeff / num_partitions)


def sinkhorn(cost: torch.Tensor, tol: float = 1e-4) -> torch.Tensor:
    """Sinkhorn-Knopp normalisation of exp(cost) [T, E] towards uniform row and column sums
    (balanced token-to-expert assignment)."""
    cost = torch.exp(cost)
    d0 = torch.ones(cost.size(0), device=cost.device, dtype=cost.dtype)
    d1 = torch.ones(cost.size(1), device=cost.device, dtype=cost.dtype)
    eps = 1e-8
    error = 1e9
    d1_old = d1
    while error > tol:
        d0 = (1 / d0.size(0)) * 1 / (torch.sum(d1 * cost, 1) + eps)
        d1 = (1 / d1.size(0)) * 1 / (torch.sum(d0.unsqueeze(1) * cost, 0) + eps)
        error = torch.mean(torch.abs(d1_old - d1))
        d1_old = d1
    return d1 * cost * d0.unsqueeze(1)


def expert_capacity(num_tokens: int, num_experts: int, topk: int, capacity_factor: float) -> int:
    """Tokens one expert may take: ceil(T * topk / E * capacity_factor) (Megatron's)."""
    return math.ceil(num_tokens * topk / num_experts * capacity_factor)


def group_limited_topk(
    scores: torch.Tensor, topk: int, num_groups: int, group_topk: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Top-k restricted to `group_topk` of `num_groups` equal expert groups (DeepSeek-V3's
    node-limited routing). scores [T, E] -> (values [T, k], indices [T, k]).

    A group's score is the sum of its topk // group_topk highest scores (Megatron's; with
    DeepSeek-V3's 8 of 4 groups that is HF's top-2 sum); experts outside the chosen groups
    are masked to -inf before the final top-k.
    """
    num_tokens, num_experts = scores.shape
    grouped = scores.view(num_tokens, num_groups, num_experts // num_groups)
    group_scores = grouped.topk(topk // group_topk, dim=-1).values.sum(dim=-1)
    chosen = torch.topk(group_scores, k=group_topk, dim=-1, sorted=False).indices
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, chosen, True)
    expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(num_tokens, num_experts)
    return torch.topk(scores.masked_fill(~expert_mask, float("-inf")), k=topk, dim=-1)


def topk_routing(
    logits: torch.Tensor,
    topk: int,
    pre_softmax: bool = False,
    score_function: str = "softmax",
    expert_bias: Optional[torch.Tensor] = None,
    num_groups: Optional[int] = None,
    group_topk: Optional[int] = None,
    scaling_factor: Optional[float] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Top-k of the router logits [T, E] -> (probs [T, E] fp32, zero off the map,
    routing_map [T, E] bool). Megatron's `topk_routing_with_score_function`.

    softmax (default): softmax over the k chosen logits (Mixtral); `pre_softmax`: softmax over
    all experts, then the k largest probabilities, not renormalised (Qwen-MoE).
    sigmoid (DeepSeek-V3), sqrtsoftplus (Megatron-LM main): per-expert scores; the choice is
    made on scores + `expert_bias` (the
    aux-loss-free bias steers the choice only), the chosen unbiased scores are renormalised
    to sum to 1 when k > 1. With `num_groups` the choice is group-limited
    (`group_limited_topk`); `scaling_factor` multiplies the final probs.
    """
    def choose(scores):
        if num_groups:
            return group_limited_topk(scores, topk, num_groups, group_topk)
        return torch.topk(scores, k=topk, dim=-1)

    if score_function in BOUNDED_SCORE_FUNCTIONS:
        scores = bounded_scores(logits, score_function).to(logits.dtype)
        if expert_bias is not None:
            _, top_indices = choose(scores + expert_bias.to(scores.dtype))
            top_probs = torch.gather(scores, 1, top_indices)
        else:
            top_probs, top_indices = choose(scores)
        if topk > 1:
            top_probs = top_probs / (top_probs.sum(dim=-1, keepdim=True) + 1e-20)
    elif pre_softmax:
        scores = torch.softmax(logits.float(), dim=-1).to(logits.dtype)
        top_probs, top_indices = choose(scores)
    else:
        top_logits, top_indices = choose(logits)
        top_probs = torch.softmax(top_logits.float(), dim=-1).to(logits.dtype)
    if scaling_factor:
        top_probs = top_probs * scaling_factor
    probs = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
    probs = probs.scatter(1, top_indices, top_probs.float())
    routing_map = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
    routing_map = routing_map.scatter(1, top_indices, True)
    return probs, routing_map


def scores_for_aux_loss(logits: torch.Tensor, score_function: str = "softmax") -> torch.Tensor:
    """The fp32 scores [T, E] the load-balancing losses see: softmax, or sigmoid normalised
    over the experts (DeepSeek-V3's sequence-wise loss; Megatron's
    `compute_routing_scores_for_aux_loss`). Neither bias nor groups enter."""
    if score_function in BOUNDED_SCORE_FUNCTIONS:
        scores = bounded_scores(logits, score_function)
        return scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    return torch.softmax(logits.float(), dim=-1)


# Per-expert scores taken before top-k and renormalised over the chosen (DeepSeek-V3's
# sigmoid; Megatron-LM main's sqrtsoftplus, sqrt(softplus(x))).
BOUNDED_SCORE_FUNCTIONS = ("sigmoid", "sqrtsoftplus")


def bounded_scores(logits: torch.Tensor, score_function: str) -> torch.Tensor:
    """fp32 [T, E] scores of a BOUNDED_SCORE_FUNCTIONS function."""
    if score_function == "sigmoid":
        return torch.sigmoid(logits.float())
    return torch.nn.functional.softplus(logits.float()).sqrt()


def updated_expert_bias(
    tokens_per_expert: torch.Tensor, expert_bias: torch.Tensor, update_rate: float
) -> torch.Tensor:
    """bias + rate * sign(mean count - count) per expert (arXiv 2408.15664; Megatron's
    `get_updated_expert_bias` after its all-reduce). tokens_per_expert / expert_bias
    [..., E], the counts already summed over every replica."""
    counts = tokens_per_expert.float()
    offset = counts.mean(dim=-1, keepdim=True) - counts
    return expert_bias + torch.sign(offset).to(expert_bias.dtype) * update_rate


def apply_capacity(
    probs: torch.Tensor,
    routing_map: torch.Tensor,
    topk: int,
    capacity_factor: float,
    drop_policy: str = "probs",
    pad_to_capacity: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Keep at most `expert_capacity` tokens per expert. probs / routing_map [T, E].

    `drop_policy` "probs" keeps each expert's tokens of highest probability, "position" its
    earliest tokens. With `pad_to_capacity` every expert gets exactly `capacity` rows: the
    kept tokens, then other tokens (earliest first under "position") with probability 0.
    """
    num_tokens, num_experts = probs.shape
    capacity = expert_capacity(num_tokens, num_experts, topk, capacity_factor)
    if capacity >= num_tokens:
        keep = torch.ones_like(routing_map)
    else:
        if drop_policy == "probs":
            # Routed tokens have probability > 0, so they rank before unrouted ones.
            ranking = probs
        else:
            # Routed tokens first, each group in sequence order.
            position = torch.arange(num_tokens, device=probs.device, dtype=torch.float32)
            ranking = -(position[:, None] + (~routing_map).float() * num_tokens)
        _, kept = torch.topk(ranking, k=capacity, dim=0)
        keep = torch.zeros_like(routing_map).scatter(0, kept, True)
    final_map = keep if pad_to_capacity else routing_map & keep
    return probs * final_map, final_map


__all__ = [
    "MoEAuxLossAutoScaler",
    "reduce_token_counts",
    "switch_load_balancing_loss",
    "sequence_load_balancing_loss",
    "z_loss",
    "sinkhorn",
    "expert_capacity",
    "group_limited_topk",
    "topk_routing",
    "scores_for_aux_loss",
    "updated_expert_bias",
    "apply_capacity",
]
