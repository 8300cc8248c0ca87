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

MoE experts (`transformer.moe.experts`) run their projections on tokens the dispatcher has
already gathered and leave the output as TP partial sums it reduces: their adapters do no
communication (column: h = A x, then this rank's rows of B; row: this rank's columns of A,
then the whole B on the partial h), and the whole matrix (A of fc1, B of fc2) has a partial
gradient at TP > 1, summed over TP like a norm weight's. They are expert parameters
(reduced over the expert-data-parallel group, stored under the global expert index).

Initialisation does not depend on the layout. Each adapter draws its A under its own CPU
seed (`init_rng_scope`): `derive_seed(seed of the layer it sits in, crc32 of its name inside
that layer)`, the layer's seed being the model's (`init_seed_parts`: the run's seed and the
global layer number) and the name carrying the global expert index (`.local_experts.<g>.`).
A is drawn whole and split like the base weight, so TP shards are slices of the TP=1 matrix,
and a pipeline stage or EP rank draws exactly the single-process adapters of its layers.
"""
from __future__ import annotations

import contextlib
import math
import zlib
from typing import Dict, Iterable, List, Optional

import torch
import torch.nn.functional as F

from megatron_smp.config import ConfigError
from megatron_smp.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron_smp.tensor_parallel.random import (
    EXPERT_PARALLEL_RNG, derive_seed, dropout, get_rng_tracker, init_rng_scope,
)
from megatron_smp.tensor_parallel.utils import (
    mark_expert_param, set_tensor_model_parallel_attributes,
)

LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


def _kaiming_uniform(tensor: torch.Tensor) -> None:
    # PEFT's (and nn.Linear's) default for lora_A.
    torch.nn.init.kaiming_uniform_(tensor, a=math.sqrt(5))


class LoRAAdapter(torch.nn.Module):
    """The adapter of one parallel linear layer (`parallel_mode` "column" or "row");
    forward(x) gives the term to add to the layer's output (after its TP reduction for a row
    layer, before any gather for a column layer; for an `expert` layer, on the expert's
    gathered tokens, a TP partial sum for a row layer).

    A [r, in] (split like the weight's columns for a row layer) is drawn under `init_seed`
    (the CPU generator as it is when None) by `reset_parameters`, B is zero. Built on the
    meta device it stays empty until delayed initialisation replays `reset_parameters`."""

    # Delayed initialisation may call reset_parameters: it draws what the constructor drew.
    REPLAYS_CONSTRUCTOR_INIT = True

    def __init__(self, layer, parallel_mode: str, rank: int, alpha: float,
                 dropout: float, init_seed: Optional[int] = None, expert: bool = False) -> None:
        super().__init__()
        self.parallel_mode = parallel_mode
        self.rank = int(rank)
        self.scale = float(alpha) / float(rank)
        self.dropout = float(dropout)
        self.enabled = True  # False inside `adapters_disabled`: the base layer alone
        self.init_seed = init_seed
        self.expert = expert
        self.tp_group = layer.tp_group
        self.tp_size = layer.tp_size
        self.sequence_parallel = layer.sequence_parallel and not expert
        # A's whole shape and its split (dim, stride, tp rank, tp size) for _draw_master_slice.
        self.master_shape = (self.rank, layer.input_size)
        device, dtype = layer.weight.device, layer.weight.dtype
        # The whole matrix of an expert adapter sees TP partial gradients (see the docstring).
        partial_whole = self.sequence_parallel or (expert and self.tp_size > 1)
        if parallel_mode == "column":
            self.a_split = (0, 1, 0, 1)
            self.lora_A = torch.nn.Parameter(torch.empty(
                self.master_shape, device=device, dtype=dtype))
            self.lora_B = torch.nn.Parameter(torch.empty(
                layer.output_size_per_partition, rank, device=device, dtype=dtype))
            set_tensor_model_parallel_attributes(self.lora_B, True, 0, layer.stride)
            # Each SP rank sees its own slice of the sequence: A's gradient is partial.
            self.lora_A.sequence_parallel = partial_whole
        else:
            self.a_split = (1, layer.stride, layer.tp_rank, layer.tp_size)
            self.lora_A = torch.nn.Parameter(torch.empty(
                self.rank, layer.input_size_per_partition, device=device, dtype=dtype))
            set_tensor_model_parallel_attributes(self.lora_A, True, 1, layer.stride)
            self.lora_B = torch.nn.Parameter(torch.empty(
                layer.output_size, rank, device=device, dtype=dtype))
            self.lora_B.sequence_parallel = partial_whole
        if device.type != "meta":
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """A: PEFT's kaiming-uniform, the whole matrix drawn on the CPU under `init_seed`,
        this rank's slice kept; B: zeros (training starts from the base model)."""
        from megatron_smp.tensor_parallel.layers import _draw_master_slice

        with init_rng_scope(self.init_seed):
            a = _draw_master_slice(self.master_shape, _kaiming_uniform, *self.a_split)
        self.lora_A.copy_(a)
        self.lora_B.zero_()

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and self.dropout > 0.0):
            return x
        if self.expert:
            # Each expert-parallel and TP rank holds other tokens or activations: the expert
            # stream, as for everything inside Megatron's expert regions.
            with get_rng_tracker().fork(EXPERT_PARALLEL_RNG):
                return dropout(x, self.dropout)
        if self.parallel_mode == "row" or self.sequence_parallel:
            # Each TP rank holds different activations: draw from the TP-rank stream.
            with get_rng_tracker().fork():
                return dropout(x, self.dropout)
        return dropout(x, self.dropout)  # replicated: the same mask

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.linear(self._dropout(x), self.lora_A)
        if not self.expert:  # an expert's adapter communicates nothing (module docstring)
            h = self._communicate(h)
        return F.linear(h, self.lora_B) * self.scale

    def _communicate(self, h: torch.Tensor) -> torch.Tensor:
        if self.parallel_mode == "column":
            if self.sequence_parallel:
                # B is split by output rows: the gradient of h is partial on each rank.
                return gather_from_sequence_parallel_region(h, self.tp_group, True)
            return copy_to_tensor_model_parallel_region(h, self.tp_group)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(h, self.tp_group)
        return reduce_from_tensor_model_parallel_region(h, self.tp_group)

    def extra_repr(self) -> str:
        return (f"{self.parallel_mode}{', expert' if self.expert else ''}, rank={self.rank}, "
                f"scale={self.scale}, dropout={self.dropout}")


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


def _seeded_parts(model: torch.nn.Module) -> List[tuple]:
    """(part, CPU seed) of the model's separately seeded parts (GPTModel's
    `init_seed_parts`: the layers by global number, MTP layers, ...); for another model, the
    whole model under one seed drawn from the CPU generator."""
    for module in model.modules():
        init_seed_parts = getattr(module, "init_seed_parts", None)
        if callable(init_seed_parts):
            return init_seed_parts()
    return [(model, int(torch.randint(0, 2**62, (1,)).item()))]


def adapter_seeds(model: torch.nn.Module, layers: Iterable[torch.nn.Module]) -> Dict[int, int]:
    """{id(layer): the CPU seed its adapter's A is drawn under} for `layers` of `model`:
    `derive_seed(seed of the part holding it, crc32 of its name in the part)`, an expert's
    name with its global index (`expert_checkpoint_rename`), so the seed does not depend on
    the layout (which stage builds the layer, which EP rank holds the expert)."""
    wanted = {id(layer) for layer in layers}
    seeds: Dict[int, int] = {}
    for part, part_seed in _seeded_parts(model):
        for name, module in part.named_modules():
            if id(module) not in wanted or id(module) in seeds:
                continue
            key = "." + name
            rename = getattr(module.weight, "expert_checkpoint_rename", None)
            if rename is not None:
                key = key.replace(*rename)
            seeds[id(module)] = derive_seed(part_seed, zlib.crc32(key.encode()))
    missing = wanted - set(seeds)
    if missing:
        raise ConfigError(f"LoRA: {len(missing)} target layer(s) lie outside the model's "
                          "seeded parts (init_seed_parts), so their adapters have no seed")
    return seeds


def apply_lora(model: torch.nn.Module, rank: int, alpha: float, dropout: float,
               target_modules: Iterable[str]) -> List[str]:
    """Attach adapters to the target layers of `model` and freeze everything else; returns
    the names of the adapted layers. Each adapter starts from the same values at every
    parallel layout (`adapter_seeds`); on a meta-device model they are drawn when delayed
    initialisation materialises it."""
    from megatron_smp.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    targets = check_lora_flags(rank, alpha, dropout, target_modules)
    for param in model.parameters():
        param.requires_grad_(False)
    found = []
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
                "column- or row-parallel linear layer; drop it from the targets"
            )
        found.append((name, module, mode))
    seeds = adapter_seeds(model, [module for _, module, _ in found])
    for name, module, mode in found:
        rename = getattr(module.weight, "expert_checkpoint_rename", None)
        module.lora = LoRAAdapter(module, mode, rank, alpha, dropout,
                                  init_seed=seeds[id(module)], expert=rename is not None)
        if rename is not None:
            for param in module.lora.parameters():
                mark_expert_param(param, *rename)
    return [name for name, _, _ in found]


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


__all__ = ["LORA_TARGETS", "LoRAAdapter", "adapter_seeds", "adapters_disabled", "apply_lora",
           "check_lora_flags", "merge_lora"]
