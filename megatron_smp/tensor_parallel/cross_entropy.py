"""Cross-entropy over logits split along the vocabulary, without gathering them.

Three small all-reduces over the tensor-parallel group replace a gather of [s, b, v]:
the max (for stability), the target logit and the sum of exponentials (plus, with label
smoothing, the sum of the logits).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megatron_smp.tensor_parallel.mappings import ProcessGroup, group_rank, group_size


def _all_reduce_(x: torch.Tensor, group: ProcessGroup, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, group, vocab_size, label_smoothing, inplace):
        local_vocab = vocab_parallel_logits.shape[-1]
        world = group_size(group)
        vocab_start = group_rank(group) * local_vocab
        global_vocab = local_vocab * world
        vocab_size = global_vocab if vocab_size is None else vocab_size
        if not 0 < vocab_size <= global_vocab:
            raise ValueError(
                f"vocab_size {vocab_size} must be in (0, {global_vocab}] (the padded vocabulary)"
            )
        # Columns of this shard that belong to the true vocabulary; the rest is padding.
        num_valid = max(0, min(local_vocab, vocab_size - vocab_start))

        # An fp32 tensor everything below works in place on: the caller's own logits when it
        # hands them over (`inplace`, fp32: Megatron's choice, one [s, b, v/tp] copy less),
        # else a fresh one.
        if vocab_parallel_logits.dtype != torch.float32:
            logits = vocab_parallel_logits.float()
        elif inplace:
            logits = vocab_parallel_logits.detach()
        else:
            logits = vocab_parallel_logits.clone()
        if num_valid < local_vocab:
            logits[..., num_valid:] = float("-inf")

        # Subtract the global max so exp() cannot overflow. A shard made only of padding has
        # a local max of -inf; the global max is finite because rank 0 holds real columns.
        logits_max = logits.amax(dim=-1)
        _all_reduce_(logits_max, group, dist.ReduceOp.MAX)
        logits.sub_(logits_max.unsqueeze(-1))

        # The target's logit lives on exactly one rank; the others contribute zero.
        target_outside = (target < vocab_start) | (target >= vocab_start + local_vocab)
        local_target = (target - vocab_start).masked_fill(target_outside, 0)
        predicted = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        predicted = predicted.masked_fill(target_outside, 0.0)
        _all_reduce_(predicted, group)

        if label_smoothing > 0.0:
            # sum_j log p_j over the true vocabulary = sum_j z_j - V log Z.
            sum_logits = logits[..., :num_valid].sum(dim=-1)
            _all_reduce_(sum_logits, group)

        exp_logits = logits.exp_()  # padding columns become exactly 0
        sum_exp = exp_logits.sum(dim=-1)
        _all_reduce_(sum_exp, group)
        log_sum_exp = sum_exp.log()
        loss = log_sum_exp - predicted
        if label_smoothing > 0.0:
            smooth_loss = log_sum_exp - sum_logits / vocab_size
            loss = (1.0 - label_smoothing) * loss + label_smoothing * smooth_loss

        softmax = exp_logits.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, target_outside, local_target)
        ctx.label_smoothing = label_smoothing
        ctx.vocab_size = vocab_size
        ctx.num_valid = num_valid
        ctx.input_dtype = vocab_parallel_logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, target_outside, local_target = ctx.saved_tensors
        # d loss / d z_j = p_j - (1 - eps) [j == target] - eps / V   (eps/V on true columns only)
        # Overwrite the saved softmax instead of allocating another [s, b, v/tp] fp32 tensor.
        # A second backward through the same graph (retain_graph) then fails loudly on the
        # version counter rather than silently reading a modified tensor.
        grad = softmax
        on_this_rank = (~target_outside).to(grad.dtype)
        grad.scatter_add_(
            -1,
            local_target.unsqueeze(-1),
            (-(1.0 - ctx.label_smoothing) * on_this_rank).unsqueeze(-1),
        )
        if ctx.label_smoothing > 0.0:
            grad[..., : ctx.num_valid].sub_(ctx.label_smoothing / ctx.vocab_size)
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.input_dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    group: ProcessGroup,
    vocab_size: Optional[int] = None,
    label_smoothing: float = 0.0,
    inplace: bool = False,
) -> torch.Tensor:
    """Per-token cross-entropy of logits split over the vocabulary.

    vocab_parallel_logits: [s, b, v/tp] (any leading shape), this rank's contiguous vocabulary
        shard; any dtype, computed in fp32.
    target: [s, b] global token ids (int64), all < vocab_size.
    vocab_size: the true vocabulary; columns at global index >= vocab_size (padding) are
        excluded as if their logit were -inf. None: every column counts.
    inplace: the logits are not read after this call (only the loss is), so fp32 logits are
        overwritten (with their softmax) instead of copied.
    Returns the loss [s, b] in fp32, equal to F.cross_entropy on the gathered, unpadded logits.
    """
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    return _VocabParallelCrossEntropy.apply(
        vocab_parallel_logits, target, group, vocab_size, float(label_smoothing), inplace
    )


def vocab_parallel_entropy(
    vocab_parallel_logits: torch.Tensor,
    group: ProcessGroup,
    vocab_size: Optional[int] = None,
) -> torch.Tensor:
    """Per-token entropy of the softmax of logits split over the vocabulary, in fp32, without
    gathering them: H = log Z - sum_j p_j z_j (z shifted by the global max), from two sums
    all-reduced over `group`. Differentiable (the sums' backward is the identity: every rank
    computes the same entropy from them).

    vocab_parallel_logits: [..., v/tp] this rank's contiguous vocabulary shard; columns at
        global index >= `vocab_size` (padding) are excluded. Returns [...] fp32.
    """
    from megatron_smp.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    logits = vocab_parallel_logits.float()
    local_vocab = logits.shape[-1]
    vocab_start = group_rank(group) * local_vocab
    if vocab_size is not None and vocab_start + local_vocab > vocab_size:
        keep = torch.arange(local_vocab, device=logits.device) < vocab_size - vocab_start
        logits = logits.masked_fill(~keep, float("-inf"))
    with torch.no_grad():
        logits_max = logits.amax(dim=-1)
        _all_reduce_(logits_max, group, dist.ReduceOp.MAX)
    shifted = logits - logits_max.unsqueeze(-1)
    exp_logits = shifted.exp()  # padding columns: exactly 0
    weighted = (exp_logits * shifted.masked_fill(exp_logits == 0, 0.0)).sum(dim=-1)
    sum_exp = reduce_from_tensor_model_parallel_region(exp_logits.sum(dim=-1), group)
    weighted = reduce_from_tensor_model_parallel_region(weighted, group)
    return sum_exp.log() - weighted / sum_exp


__all__ = ["vocab_parallel_cross_entropy", "vocab_parallel_entropy"]
