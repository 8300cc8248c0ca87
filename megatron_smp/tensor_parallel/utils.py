"""Small helpers shared by the tensor-parallel layers: init methods and parameter attributes."""
from __future__ import annotations

import math
from typing import Callable, Optional, Tuple

import torch

InitMethod = Callable[[torch.Tensor], torch.Tensor]

# Attributes every tensor-parallel-aware consumer reads (optimizer, grad norm, checkpoints).
_TENSOR_PARALLEL_ATTRIBUTES = {
    "tensor_model_parallel": False,
    "partition_dim": -1,
    "partition_stride": 1,
}


def divide(numerator: int, denominator: int) -> int:
    """Exact integer division; a shape that does not split evenly is a configuration error."""
    if numerator % denominator != 0:
        raise ValueError(f"{numerator} is not divisible by {denominator}")
    return numerator // denominator


def init_method_normal(std: float) -> InitMethod:
    """In-place N(0, std) initialiser: `init(tensor)` fills `tensor` and returns it."""

    def init_(tensor: torch.Tensor) -> torch.Tensor:
        return torch.nn.init.normal_(tensor, mean=0.0, std=std)

    return init_


def scaled_init_method_normal(std: float, num_layers: int) -> InitMethod:
    """N(0, std / sqrt(2 * num_layers)), Megatron's init for the projections that write into
    the residual stream (two per layer), so the residual's variance does not grow with depth."""
    return init_method_normal(std / math.sqrt(2.0 * num_layers))


def xavier_uniform(tensor: torch.Tensor) -> torch.Tensor:
    """Megatron's --init-method-xavier-uniform: torch's Xavier-uniform (over the full master's
    shape here, drawn on the CPU)."""
    return torch.nn.init.xavier_uniform_(tensor)


def hidden_init_method(config) -> InitMethod:
    """The init of a hidden matrix (`config`: a TransformerConfig): N(0, init_method_std),
    divided by sqrt(width multiplier) with --use-mup (Megatron-LM main's muP); embeddings and
    an untied output layer keep N(0, init_method_std). --init-method-xavier-uniform: Xavier."""
    if getattr(config, "init_method_xavier_uniform", False):
        return xavier_uniform
    return init_method_normal(config.init_method_std / math.sqrt(config.mup_width_mult))


def output_init_method(config) -> InitMethod:
    """The init of a layer's output projection (`config`: a TransformerConfig): scaled by
    depth with use_scaled_init_method (Megatron's default), else the plain normal; with
    --use-mup also divided by sqrt(width multiplier)."""
    if getattr(config, "init_method_xavier_uniform", False):
        return xavier_uniform
    std = config.init_method_std / math.sqrt(config.mup_width_mult)
    if config.use_scaled_init_method:
        return scaled_init_method_normal(std, config.num_layers)
    return init_method_normal(std)


def set_tensor_model_parallel_attributes(
    tensor: torch.Tensor, is_parallel: bool, dim: int, stride: int
) -> None:
    """Mark `tensor` as split over tensor-parallel ranks along `dim` (or as replicated)."""
    tensor.tensor_model_parallel = is_parallel
    tensor.partition_dim = dim
    tensor.partition_stride = stride


def set_defaults_if_not_set_tensor_model_parallel_attributes(tensor: torch.Tensor) -> None:
    """Give a parameter that no layer marked the attributes of a replicated parameter."""
    for name, value in _TENSOR_PARALLEL_ATTRIBUTES.items():
        if not hasattr(tensor, name):
            setattr(tensor, name, value)


def copy_tensor_model_parallel_attributes(destination: torch.Tensor, source: torch.Tensor) -> None:
    for name in _TENSOR_PARALLEL_ATTRIBUTES:
        if hasattr(source, name):
            setattr(destination, name, getattr(source, name))


def mark_expert_param(param: torch.Tensor, local_name: str, global_name: str,
                      tp_coords: Optional[Tuple[int, int]] = None) -> None:
    """Mark `param` as one expert's (Megatron's `allreduce = False`): it differs across
    expert-parallel ranks, so its grad is reduced over the expert-data-parallel group and
    counted once per expert in norms. Checkpoints store it with `local_name` (a fragment of
    its module name, e.g. ".local_experts.0.") replaced by `global_name` (".local_experts.5.").
    `tp_coords`: (rank, size) of the group a split param is split over, when that is the
    expert-tensor-parallel group (see `tensor_parallel_coords`).
    """
    param.allreduce = False
    param.expert_checkpoint_rename = (local_name, global_name)
    if tp_coords is not None:
        param.tensor_parallel_coords = tp_coords


def tensor_parallel_coords(param: torch.Tensor, state) -> Tuple[int, int]:
    """(rank, size) of the group `param` is split over (or replicated across, for one that
    is not split): an expert's expert-tensor-parallel group, else the TP group."""
    return getattr(param, "tensor_parallel_coords", None) or (state.tp_rank, state.tp_size)


def is_expert_param(param: torch.Tensor) -> bool:
    """True for parameters of one expert (see `mark_expert_param`)."""
    return not getattr(param, "allreduce", True)


def is_muon_parameter(name: str, param: torch.nn.Parameter) -> bool:
    """Whether Muon steps `param`: 2-D hidden weights. Embeddings (word and position), the
    output layer, norms, biases and params marked `use_muon = False` go to the scalar
    optimizer (--muon-scalar-optimizer). Here, beside the other kinds of param, because the
    grad buffers' layout (layer-wise distributed optimizer) follows it too."""
    if param.dim() != 2 or not getattr(param, "use_muon", True):
        return False
    return "embedding" not in name and not name.endswith("output_layer.weight")


def param_is_not_tensor_parallel_duplicate(param: torch.Tensor, tp_rank: int) -> bool:
    """True when `param` should be counted on this rank in a norm over the model-parallel
    group: split parameters count on every rank, replicated ones only on tp rank 0 (an
    expert's: expert-tensor-parallel rank 0, see `tensor_parallel_coords`)."""
    coords = getattr(param, "tensor_parallel_coords", None)
    if coords is not None:
        tp_rank = coords[0]
    return bool(getattr(param, "tensor_model_parallel", False)) or tp_rank == 0


__all__ = [
    "divide",
    "init_method_normal",
    "scaled_init_method_normal",
    "set_tensor_model_parallel_attributes",
    "set_defaults_if_not_set_tensor_model_parallel_attributes",
    "copy_tensor_model_parallel_attributes",
    "param_is_not_tensor_parallel_duplicate",
    "mark_expert_param",
    "is_expert_param",
    "is_muon_parameter",
]
