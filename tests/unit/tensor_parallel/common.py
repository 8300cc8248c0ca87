"""Helpers shared by the tensor-parallel tests (run inside run_distributed children)."""
import torch
import torch.distributed as dist

from megatron_smp.config import TransformerConfig


def tiny_config(**changes) -> TransformerConfig:
    config = TransformerConfig(
        num_layers=2,
        hidden_size=8,
        num_attention_heads=2,
        vocab_size=1000,  # not a multiple of 128: the table is padded to 1024
        max_position_embeddings=16,
        ffn_hidden_size=8,
    )
    return config.replace(**changes)


def gather_partitioned(tensor: torch.Tensor, group, dim: int, stride: int = 1) -> torch.Tensor:
    """Reassemble a tensor split over `group` along `dim` (with Megatron's stride layout:
    rank r holds chunks r, r + tp, ... of the stride * tp chunks)."""
    world = dist.get_world_size(group)
    parts = [torch.empty_like(tensor) for _ in range(world)]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    chunks = [part.chunk(stride, dim) for part in parts]
    return torch.cat([chunks[r][k] for k in range(stride) for r in range(world)], dim)


def gather_param(param: torch.Tensor, group) -> torch.Tensor:
    """The full tensor of a parameter as the TP=1 model holds it."""
    if not getattr(param, "tensor_model_parallel", False):
        return param
    return gather_partitioned(param, group, param.partition_dim, param.partition_stride)


def gather_param_grad(param: torch.Tensor, group) -> torch.Tensor:
    grad = param.grad
    if getattr(param, "sequence_parallel", False):
        # Computed from this rank's sequence shard only: the full gradient is the sum.
        grad = grad.clone()
        dist.all_reduce(grad, group=group)
    if not getattr(param, "tensor_model_parallel", False):
        return grad
    return gather_partitioned(grad, group, param.partition_dim, param.partition_stride)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest absolute difference, relative to the reference's scale when that exceeds 1."""
    assert a.shape == b.shape, (tuple(a.shape), tuple(b.shape))
    scale = max(1.0, b.detach().double().abs().max().item())
    return (a.detach().double() - b.detach().double()).abs().max().item() / scale
