"""Low-rank adapters (LoRA) on the column- and row-parallel linear layers.

`apply_lora(model, rank, alpha, dropout, target_modules)` attaches an adapter to every
ColumnParallelLinear / RowParallelLinear whose name ends in one of `target_modules`
(Megatron-Bridge's names: linear_qkv, linear_proj, linear_fc1, linear_fc2) and freezes every
other parameter. The layer adds `alpha / rank * B(A(dropout(x)))` to its output, as PEFT does
(A: kaiming-uniform, B: zeros, so training starts from the base model).

Sharding under TP follows the base weight:
  * column-parallel W [out/tp, in]: A [r, in] whole on every rank, B [out/tp, r] split like
    W's rows (same stride, so the fused [gate; up] and q/k/v groups stay aligned);
  * row-parallel W [out, in/tp]: A [r, in/tp] split like W's columns, B [out, r] whole; the
    partial A x is summed over TP before B (reduce-scattered with sequence parallelism).
Whole (replicated) adapter weights whose gradient is partial under sequence parallelism are
marked `sequence_parallel`, so finalize_model_grads all-reduces them like the norm weights.
"""
from __future__ import annotations

import contextlib

import math
from typing import Iterable, List

import torch
import torch.nn.functional as F

from megatron_smp.config import ConfigError
from megatron_smp.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron_smp.tensor_parallel.random import dropout, get_rng_tracker
from megatron_smp.tensor_parallel.utils import set_tensor_model_parallel_attributes

LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


def _kaiming_uniform(tensor: torch.Tensor) -> None:
    # PEFT's (and nn.Linear's) default for lora_A.
    torch.nn.init.kaiming_uniform_(tensor, a=math.sqrt(5))


class LoRAAdapter(torch.nn.Module):
    """The adapter of one parallel linear layer (`parallel_mode` "column" or "row");
    forward(x) gives the term to add to the layer's output (after its TP reduction for a row
    layer, before any gather for a column layer)."""

    def __init__(self, layer, parallel_mode: str, rank: int, alpha: float,
                 dropout: float) -> None:
        super().__init__()
        from megatron_smp.tensor_parallel.layers import _draw_master_slice

        self.parallel_mode = parallel_mode
        self.rank = int(rank)
        self.scale = float(alpha) / float(rank)
        self.dropout = float(dropout)
        self.enabled = True  # False inside `adapters_disabled`: the base layer alone
        self.tp_group = layer.tp_group
        self.tp_size = layer.tp_size
        self.sequence_parallel = layer.sequence_parallel
        device, dtype = layer.weight.device, layer.weight.dtype
        if parallel_mode == "column":
            a = _draw_master_slice((rank, layer.input_size), _kaiming_uniform, 0, 1, 0, 1)
            self.lora_A = torch.nn.Parameter(a.to(device=device, dtype=dtype))
            self.lora_B = torch.nn.Parameter(torch.zeros(
                layer.output_size_per_partition, rank, device=device, dtype=dtype))
            set_tensor_model_parallel_attributes(self.lora_B, True, 0, layer.stride)
            # Each SP rank sees its own slice of the sequence: A's gradient is partial.
            self.lora_A.sequence_parallel = self.sequence_parallel
        else:
            a = _draw_master_slice((rank, layer.input_size), _kaiming_uniform, 1, layer.stride,
                                   layer.tp_rank, layer.tp_size)
            self.lora_A = torch.nn.Parameter(a.to(device=device, dtype=dtype))
            set_tensor_model_parallel_attributes(self.lora_A, True, 1, layer.stride)
            self.lora_B = torch.nn.Parameter(torch.zeros(
                layer.output_size, rank, device=device, dtype=dtype))
            self.lora_B.sequence_parallel = self.sequence_parallel

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and self.dropout > 0.0):
            return x
        if self.parallel_mode == "row" or self.sequence_parallel:
            # Each TP rank holds different activations: draw from the TP-rank stream.
            with get_rng_tracker().fork():
                return dropout(x, self.dropout)
        return dropout(x, self.dropout)  # replicated: the same mask

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.linear(self._dropout(x), self.lora_A)
        if self.parallel_mode == "column":
            if self.sequence_parallel:
                # B is split by output rows: the gradient of h is partial on each rank.
                h = gather_from_sequence_parallel_region(h, self.tp_group, True)
            else:
                h = copy_to_tensor_model_parallel_region(h, self.tp_group)
        elif self.sequence_parallel:
            h = reduce_scatter_to_sequence_parallel_region(h, self.tp_group)
        else:
            h = reduce_from_tensor_model_parallel_region(h, self.tp_group)
        return F.linear(h, self.lora_B) * self.scale

    def extra_repr(self) -> str:
        return (f"{self.parallel_mode}, rank={self.rank}, scale={self.scale}, "
                f"dropout={self.dropout}")


def check_lora_flags(rank: int, alpha: float, dropout: float,
                     target_modules: Iterable[str]) -> List[str]:
    """The --lora-* flags' errors (before anything is built); returns the targets."""
    targets = list(target_modules)
    if rank < 1:
        raise ConfigError(f"--lora-rank must be >= 1, got {rank}")
    if alpha <= 0:
        raise ConfigError(f"--lora-alpha must be positive, got {alpha}")
    if not 0.0 <= dropout < 1.0:
        raise ConfigError(f"--lora-dropout must be in [0, 1), got {dropout}")
    unknown = sorted(set(targets) - set(LORA_TARGETS))
    if unknown or not targets:
        raise ConfigError(f"--lora-target-modules {unknown or targets}: choose from "
                          f"{', '.join(LORA_TARGETS)}")
    return targets


def apply_lora(model: torch.nn.Module, rank: int, alpha: float, dropout: float,
               target_modules: Iterable[str]) -> List[str]:
    """Attach adapters to the target layers of `model` and freeze everything else; returns
    the names of the adapted layers."""
    from megatron_smp.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    targets = check_lora_flags(rank, alpha, dropout, target_modules)
    for param in model.parameters():
        param.requires_grad_(False)
    adapted = []
    for name, module in list(model.named_modules()):
        leaf = name.rsplit(".", 1)[-1]
        if leaf not in targets:
            continue
        if isinstance(module, ColumnParallelLinear) and not module.gather_output:
            mode = "column"
        elif isinstance(module, RowParallelLinear):
            mode = "row"
        else:
            raise ConfigError(
                f"--lora-target-modules {leaf}: {name} is a {type(module).__name__}, not a "
                "column- or row-parallel linear layer (e.g. grouped MoE experts); drop it from "
                "the targets"
            )
        module.lora = LoRAAdapter(module, mode, rank, alpha, dropout)
        adapted.append(name)
    return adapted


@contextlib.contextmanager
def adapters_disabled(model):
    """Within the block every LoRA adapter of `model` (a module or a list of chunks) is off:
    the base model's outputs, with no second copy of it (DPO's reference model)."""
    modules = model if isinstance(model, (list, tuple)) else [model]
    adapters = [m for chunk in modules for m in chunk.modules() if isinstance(m, LoRAAdapter)]
    for adapter in adapters:
        adapter.enabled = False
    try:
        yield adapters
    finally:
        for adapter in adapters:
            adapter.enabled = True


def merge_lora(state_dict, alpha: float, rank: int):
    """A copy of a full (TP=1) state dict with every adapter merged into its base weight,
    `W + alpha / rank * B @ A`, and the adapter tensors dropped: the fine-tuned model as a
    plain one (what `adapter.to_hf` exports). Our B rows follow W's rows in every layout
    (fused q/k/v groups, [gate; up]), so the merge needs no knowledge of the layer."""
    scale = float(alpha) / float(rank)
    merged = {key: value for key, value in state_dict.items() if ".lora.lora_" not in key}
    for key, a in state_dict.items():
        if not key.endswith(".lora.lora_A"):
            continue
        layer = key[: -len(".lora.lora_A")]
        b = state_dict[layer + ".lora.lora_B"]
        weight = merged[layer + ".weight"]
        delta = (b.float() @ a.float()) * scale
        merged[layer + ".weight"] = (weight.float() + delta).to(weight.dtype)
    return merged


__all__ = ["LORA_TARGETS", "LoRAAdapter", "adapters_disabled", "apply_lora", "check_lora_flags",
           "merge_lora"]
