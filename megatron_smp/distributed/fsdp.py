"""Sharded data parallelism on PyTorch FSDP2 (`fully_shard`), SMP v2's `hybrid_shard_degree`.

    model = GPTModel(config, state)                    # or smp.transform(hf_model)
    model = fully_shard_model(model, state, param_dtype=torch.bfloat16)

Every transformer layer is one FSDP2 unit (its params all-gathered together before its
forward and backward, its grads reduce-scattered together), the rest of the model (embedding,
final norm, output layer) is the root unit. The units are sharded over `state.fsdp_mesh`:
all data x context-parallel ranks (full sharding, `hybrid_shard_degree` 0), or groups of
`hybrid_shard_degree` ranks with replicas across the groups (HSDP on a 2-D mesh). A MoE
layer's routed experts are a unit of their own inside their layer's, sharded over the ranks
holding the same experts (`state.expert_fsdp_mesh`, torchtitan's layout), their grads divided
as our DDP divides expert grads (see `_fully_shard_experts`); the router and shared experts
stay in the layer's unit.

Tensor parallelism stays inside: our TP layers hold plain TP-local tensors and run their own
collectives, so FSDP shards each TP-local tensor over the data-parallel mesh only (the
"2-D" layout of torchtitan without DTensor TP). Grads of TP-replicated params used on
sequence-parallel activations are still partial per TP rank after FSDP's reduce-scatter;
`finalize_model_grads` sums them over TP on the local shards (every TP rank holds the same
rows of them).

FSDP2 replaces each parameter by a new `nn.Parameter(DTensor)`; the attributes our layers
set on parameters (`tensor_model_parallel`, `partition_dim`, `sequence_parallel`,
`shared`, ...) are copied onto the sharded parameters, which the optimizer, the grad norm
and the checkpoints read.

Mixed precision is FSDP2's policy: the sharded params stay fp32 (they are the optimizer's
main params), are cast to `param_dtype` (bf16) when gathered, and grads are reduced in fp32.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Callable, Dict, List, Optional

import torch
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor

from megatron_smp.config import ConfigError
# (Defined beside the meta-device initialiser, which needs them too; re-exported here.)
from megatron_smp.distributed.delayed_init import (  # noqa: F401
    META_DEVICE_PROVIDER_ERROR,
    DelayedParamIniter,
    language_model,
    provider_accepts_device,
)

# Attributes of our parameters that FSDP2's new sharded parameters must keep.
_PARAM_ATTRIBUTES = (
    "tensor_model_parallel", "partition_dim", "partition_stride", "sequence_parallel",
    "allreduce", "shared", "shared_embedding", "expert_checkpoint_rename", "qkv_split_shapes",
    "tensor_parallel_coords",
)


def transformer_layers(model: torch.nn.Module) -> List[torch.nn.Module]:
    """The decoder layers of the GPTModel inside `model`, in order."""
    return list(language_model(model).decoder.layers)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a view sharing its storage), or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def shard_row_offset(tensor: torch.Tensor) -> int:
    """First dim-0 row (of the unsharded, TP-local tensor) held by this rank's shard of an
    FSDP2 DTensor; 0 for a plain tensor. FSDP2 splits dim 0 as `torch.chunk` does."""
    if not isinstance(tensor, DTensor):
        return 0
    from torch.distributed.tensor.placement_types import Shard

    mesh = tensor.device_mesh
    offset = 0
    rows = tensor.shape[0]
    for dim, placement in enumerate(tensor.placements):
        if isinstance(placement, Shard):
            if placement.dim != 0:
                raise ValueError(f"FSDP2 shard on dim {placement.dim}; expected dim 0")
            size = mesh.size(dim)
            chunk = -(-rows // size)  # torch.chunk's ceil split
            offset += min(chunk * mesh.get_local_rank(dim), rows)
            rows = max(0, min(chunk, rows - chunk * mesh.get_local_rank(dim)))
    return offset


def _param_attributes(module: torch.nn.Module) -> Dict[str, dict]:
    attributes = {}
    for name, param in module.named_parameters():
        kept = {key: getattr(param, key) for key in _PARAM_ATTRIBUTES if hasattr(param, key)}
        if kept:
            attributes[name] = kept
    return attributes


def _restore_param_attributes(module: torch.nn.Module, attributes: Dict[str, dict]) -> None:
    for name, param in module.named_parameters():
        for key, value in attributes.get(name, {}).items():
            setattr(param, key, value)


def mixed_precision_policy(param_dtype: Optional[torch.dtype],
                           reduce_dtype: torch.dtype = torch.float32) -> MixedPrecisionPolicy:
    """bf16/fp16 compute over fp32 sharded params, grads reduced in `reduce_dtype` (fp32;
    bf16 with --grad-reduce-in-bf16). param_dtype None: all fp32."""
    if param_dtype is None or param_dtype == torch.float32:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)


def fully_shard_model(
    model: torch.nn.Module,
    state,
    *,
    param_dtype: Optional[torch.dtype] = None,
    reshard_after_forward: bool = True,
    offload_params: bool = False,
    forward_prefetch: int = 0,
    backward_prefetch: int = 1,
    param_init_fn: Optional[Callable[[torch.nn.Module], None]] = None,
    activation_checkpointing: bool = False,
    activation_offloader=None,
    cache_flush_warnings: bool = False,
    layers: Optional[List[torch.nn.Module]] = None,
    reduce_dtype: torch.dtype = torch.float32,
    before_shard: Optional[Callable[[torch.nn.Module], None]] = None,
) -> torch.nn.Module:
    """Apply FSDP2 to `model` in place (each layer, then the root); returns `model`.

    * `param_dtype`: compute dtype of the gathered params (bf16), params stay fp32.
    * `reshard_after_forward`: free each layer's gathered params after its forward (ZeRO-3)
      or keep them until backward (ZeRO-2 like). The root always keeps them: its backward
      starts right after its forward.
    * `offload_params`: FSDP2's CPUOffloadPolicy (sharded params, grads and optimizer state
      in host memory).
    * `forward_prefetch` / `backward_prefetch`: how many layers ahead to all-gather
      (FSDP2's `set_modules_to_forward_prefetch` / `..._backward_prefetch`; FSDP2 itself
      prefetches one layer in backward).
    * `param_init_fn(unit)`: materialise a unit built on the meta device (delayed
      initialisation, see `distributed.delayed_init.DelayedParamIniter`). Each layer is
      materialised and sharded before the next, so a rank never holds more than one
      unsharded layer besides its shards.
    * `activation_checkpointing` / `activation_offloader`: recompute each layer in backward
      (and move its saved inputs to host memory), see `distributed.activation_offload`.
    * `cache_flush_warnings`: SMP's `fsdp_cache_flush_warnings` (`CacheFlushMonitor`,
      checked at each forward of the root, i.e. once per microbatch).
    * `layers`: the units (default: the GPTModel's decoder layers).
    * `before_shard(unit)`: called on every rank for each unit once it is materialised, just
      before it is sharded (e.g. `smp.fully_shard`'s `sync_module_states` broadcast).

    The shard group is `state.fsdp_mesh` (`hybrid_shard_degree`); a parameter with fewer
    dim-0 rows than shard ranks leaves trailing ranks an empty shard, as in PyTorch (SMP's
    `allow_empty_shards` either way, see `smp.torch_fsdp`).
    """
    from megatron_smp.distributed.activation_offload import apply_activation_checkpointing
    from megatron_smp.distributed.param_and_grad_buffer import (
        map_large_host_allocations,
        release_freed_host_memory,
    )

    if state.cp_size > 1:
        raise ConfigError(
            "FSDP2 with context parallelism is not validated yet; use context_parallel_degree "
            "1, or our DDP (--context-parallel-size without --use-torch-fsdp2)"
        )
    if state.pp_size > 1:
        raise ConfigError(
            "FSDP2 (--use-torch-fsdp2 / hybrid_shard_degree) does not combine with pipeline "
            "parallelism here; use --pipeline-model-parallel-size 1, or our DDP with "
            "--use-distributed-optimizer"
        )
    first_units: List[torch.nn.Module] = []
    last_units: List[torch.nn.Module] = []
    if layers is None:
        layers = transformer_layers(model)
        first_units, last_units = _embedding_and_output_units(model)
    if activation_checkpointing or activation_offloader is not None:
        layers = apply_activation_checkpointing(model, layers, activation_offloader)
    mesh = state.fsdp_mesh
    common = dict(
        mesh=mesh,
        mp_policy=mixed_precision_policy(param_dtype, reduce_dtype),
        offload_policy=CPUOffloadPolicy() if offload_params else OffloadPolicy(),
    )
    if torch.device(state.device).type == "cpu":
        map_large_host_allocations()
    units = first_units + list(layers) + last_units + [model]
    for unit in units:
        if param_init_fn is not None and _has_meta_params(unit):
            param_init_fn(unit)
        if _has_meta_params(unit) and param_init_fn is None and unit is model:
            # A model left on meta by the caller: FSDP would shard meta tensors silently.
            raise ConfigError(
                "fully_shard_model: the model has parameters on the meta device and no "
                "param_init_fn; pass DelayedParamIniter(model).get_param_init_fn()"
            )
        if before_shard is not None:
            before_shard(unit)
        for experts in expert_units(unit):
            _fully_shard_experts(experts, state, reshard_after_forward, common)
        attributes = _param_attributes(unit)
        # The root and the output layer keep their params from forward to backward: their
        # backward starts right after their forward.
        keep = unit is model or unit in last_units
        fully_shard(unit, reshard_after_forward=reshard_after_forward and not keep, **common)
        _restore_param_attributes(unit, attributes)
        if param_init_fn is not None:
            # The unit's unsharded tensors were just freed; glibc would keep them resident
            # between the shards (fragmented heap), so the peak would grow with every unit.
            release_freed_host_memory()
    _set_prefetch(layers, forward_prefetch, backward_prefetch)
    if torch.device(state.device).type == "cpu":
        _release_host_memory_between_units(units)
    if cache_flush_warnings:
        monitor = CacheFlushMonitor(state.device)
        model.cache_flush_monitor = monitor

        def check_before_forward(module, args) -> None:  # a returned value would replace args
            monitor.check()

        model.register_forward_pre_hook(check_before_forward)
    return model


def expert_units(module: torch.nn.Module) -> List[torch.nn.Module]:
    """The modules under `module` holding one MoE layer's routed experts (`MoEExperts`): the
    outermost submodules whose parameters are all expert parameters, not sharded yet. Their
    own forward must run (it does: the MoE layer calls its experts), so FSDP2 gathers their
    weights around it."""
    from megatron_smp.tensor_parallel.utils import is_expert_param

    found: List[torch.nn.Module] = []

    def visit(sub: torch.nn.Module) -> None:
        if sub is not module and isinstance(sub, FSDPModule):
            return  # a unit already: its parameters are sharded
        params = list(sub.parameters())
        if sub is not module and params and all(is_expert_param(p) for p in params):
            found.append(sub)
            return
        for child in sub.children():
            visit(child)

    visit(module)
    return found


def _fully_shard_experts(experts: torch.nn.Module, state, reshard_after_forward: bool,
                         common: dict) -> None:
    """One MoE layer's experts as an FSDP2 unit of their own, sharded over the ranks holding
    the same experts (`state.expert_fsdp_mesh`: the expert-data-parallel group, or its shard
    groups under hybrid sharding), so their grads reduce over exactly those ranks.

    Each rank's experts already saw the tokens of its whole expert-parallel group, so the
    sum over the expert-data-parallel ranks is ep times the sum a dense param sees per
    expert-data-parallel rank; dividing it by dp x cp (the dense params' average) gives the
    same scaling as our DDP (and as one process). The sum is asked for explicitly
    (`set_force_sum_reduction_for_comms`) where the divisor differs from the shard group's
    size: FSDP2 would otherwise use a pre-multiplied sum, which gloo does not have."""
    mesh = state.expert_fsdp_mesh
    attributes = _param_attributes(experts)
    fully_shard(experts, reshard_after_forward=reshard_after_forward,
                **dict(common, mesh=mesh))
    _restore_param_attributes(experts, attributes)
    factor = state.dp_cp_size
    shard_size = mesh.size(mesh.ndim - 1)
    if factor != mesh.size():
        experts.set_gradient_divide_factor(float(factor))
        # (One rank per shard group: FSDP2 copies the grad and divides it by the factor
        # itself, and a forced sum would divide it a second time.)
        if shard_size > 1 and factor != shard_size:
            experts.set_force_sum_reduction_for_comms(True)


def _embedding_and_output_units(model: torch.nn.Module):
    """([input embedding], [output layer]) of an untied GPTModel, each an FSDP unit of its own
    (torchtitan's layout), so the root holds only the final norm and neither vocabulary-sized
    weight stays gathered through the whole step. With tied weights both stay in the root."""
    lm = language_model(model)
    if lm.share_embeddings_and_output_weights:
        return [], []
    first = [lm.embedding] if getattr(lm, "embedding", None) is not None else []
    last = [lm.output_layer] if getattr(lm, "output_layer", None) is not None else []
    return first, last


def _release_host_memory_between_units(units: List[torch.nn.Module]) -> None:
    """On the CPU, return freed heap pages to the OS around each unit's forward and backward.

    Each unit's all-gather output, unsharded params, unsharded grads and reduce-scatter input
    are freed after use, but glibc keeps them resident in its heaps (fragmented between the
    longer-lived shards and activations), so without this the peak RSS grew with every unit
    and step: at DP=2 (8 layers, 42M fp32 params, built on meta) about 1000 MiB above the
    baseline against 319 MiB of params + grads + Adam state, 664 MiB with it."""
    from megatron_smp.distributed.param_and_grad_buffer import release_freed_host_memory

    def before_forward(module, args) -> None:  # a returned value would replace args
        release_freed_host_memory()

    def after_forward(module, args, output) -> None:
        # After FSDP2's own post-forward (registered first): the gathered params are freed.
        release_freed_host_memory()
        outputs = output if isinstance(output, (tuple, list)) else (output,)
        for tensor in outputs:
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                # Runs once the unit after this one has finished its backward (its
                # post-backward reduce-scatter produced this grad) and its buffers are freed.
                tensor.register_hook(lambda grad: release_freed_host_memory())

    for unit in units:
        unit.register_forward_pre_hook(before_forward)
        unit.register_forward_hook(after_forward)


def _has_meta_params(module: torch.nn.Module) -> bool:
    return any(p.is_meta for p in module.parameters())


def _set_prefetch(layers: List[torch.nn.Module], forward: int, backward: int) -> None:
    if forward < 0 or backward < 0:
        raise ConfigError("FSDP prefetch distances must be >= 0")
    for index, layer in enumerate(layers):
        if forward:
            layer.set_modules_to_forward_prefetch(list(layers[index + 1 : index + 1 + forward]))
        if backward > 1:
            earlier = layers[max(0, index - backward) : index]
            layer.set_modules_to_backward_prefetch(list(reversed(earlier)))


class CacheFlushMonitor:
    """SMP's `fsdp_cache_flush_warnings`: warn when the CUDA caching allocator had to free its
    cache and retry an allocation (`num_alloc_retries` grew) during a step, which stalls
    every rank. Devices without a caching allocator (CPU) have nothing to flush."""

    def __init__(self, device: torch.device, stats_fn: Optional[Callable[[], dict]] = None):
        self.device = device
        if stats_fn is None and device.type == "cuda":
            stats_fn = lambda: torch.cuda.memory_stats(device)  # noqa: E731
        self.stats_fn = stats_fn
        self.retries = self._read()
        self.warnings = 0

    def _read(self) -> int:
        if self.stats_fn is None:
            return 0
        return int(self.stats_fn().get("num_alloc_retries", 0))

    def check(self) -> int:
        """New cache flushes since the last check (warned about once per check)."""
        retries = self._read()
        new = retries - self.retries
        self.retries = retries
        if new > 0:
            self.warnings += 1
            warnings.warn(
                f"{new} CUDA caching-allocator flush(es) during the last step: memory is "
                "nearly full and allocations stall; lower the micro-batch size, enable "
                "activation checkpointing/offloading, or shard over more ranks",
                RuntimeWarning,
            )
        return new


class FullyShardedDataParallel(torch.nn.Module):
    """The training loop's FSDP2 chunk: the same interface as our DDP wrapper.

    forward(*args) is the model's. Grads are reduce-scattered during backward, once per
    microbatch into the sharded `.grad` (accumulation happens on shards: gathering unsharded
    grads over microbatches would cost the memory sharding saves), so `no_sync()` has nothing
    to defer and `finish_grad_sync()` nothing to wait for (FSDP2's root post-backward waits).
    """

    def __init__(self, module: torch.nn.Module, state, *, param_dtype=None,
                 reshard_after_forward: bool = True, config=None, **kwargs) -> None:
        super().__init__()
        self.module = fully_shard_model(module, state, param_dtype=param_dtype,
                                        reshard_after_forward=reshard_after_forward, **kwargs)
        self.state = state
        # The dtype layers compute in (None: fp32); fp16 gets loss scaling (get_megatron_optimizer).
        self.param_dtype = param_dtype
        # The OptimizerConfig, as our DDP wrapper's `config` (forward steps read e.g.
        # calculate_per_token_loss from it).
        self.config = config

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        yield

    def finish_grad_sync(self) -> None:
        pass

    def zero_grad_buffer(self) -> None:
        self.module.zero_grad(set_to_none=True)

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True):
        return self.module.load_state_dict(state_dict, strict=strict)


def validate_fsdp_configs(configs) -> None:
    """The training scripts' FSDP2 settings (pure; on every rank before any collective):
    what --use-torch-fsdp2 cannot be combined with, and hybrid_shard_degree >= 2 without it."""
    parallel, optimizer = configs.parallel, configs.optimizer
    names = getattr(configs, "setting_names", {}) or {}
    hybrid = names.get("hybrid_shard_degree", "hybrid_shard_degree (--smp-config)")
    if not parallel.use_torch_fsdp2:
        if parallel.hybrid_shard_degree >= 2:
            raise ConfigError(
                f"{hybrid} = {parallel.hybrid_shard_degree} shards the model with FSDP2: add "
                "--use-torch-fsdp2 (or use 0/1 with --use-distributed-optimizer to shard only "
                "the optimizer state)"
            )
        if not parallel.torch_fsdp2_reshard_after_forward:
            raise ConfigError("--no-torch-fsdp2-reshard-after-forward needs --use-torch-fsdp2")
        return
    conflicts = [
        (parallel.pipeline_model_parallel_size > 1, "--pipeline-model-parallel-size > 1",
         "FSDP2 wraps one model chunk here; pipeline stages need our DDP"),
        (optimizer.use_distributed_optimizer, "--use-distributed-optimizer",
         "FSDP2 already shards optimizer state; drop one of them"),
        (optimizer.overlap_param_gather, "--overlap-param-gather",
         "FSDP2 prefetches its all-gathers itself"),
        (optimizer.overlap_grad_reduce, "--overlap-grad-reduce",
         "FSDP2 always overlaps its reduce-scatters with backward"),
        (optimizer.ddp_bucket_size is not None, "--ddp-bucket-size",
         "FSDP2 reduces one layer per collective"),
        (optimizer.ddp_average_in_collective, "--ddp-average-in-collective",
         "FSDP2 always averages in its reduce-scatter"),
        (configs.checkpoint.ckpt_format != "torch_dist", "--ckpt-format torch",
         "FSDP2 checkpoints are distributed (torch_dist)"),
        # Built (the shard groups span dp x cp) but not yet tested against one process.
        (parallel.context_parallel_size > 1, "--context-parallel-size > 1",
         "not validated yet; use our DDP for context parallelism"),
        (configs.model.recompute_granularity == "full", "--recompute-granularity full",
         "not validated yet; smp.fully_shard(activation_checkpointing=True) checkpoints "
         "each FSDP2 layer"),
    ]
    for conflict, flag, why in conflicts:
        if conflict:
            raise ConfigError(f"--use-torch-fsdp2 does not combine with {flag}: {why}")


def build_fsdp_model_chunk(model_provider: Callable, configs, state) -> FullyShardedDataParallel:
    """The training loop's model under --use-torch-fsdp2: built in fp32 (FSDP2's sharded
    params are the optimizer's main params), gathered in the run's bf16 for compute.

    A provider that forwards `device=` to GPTModel (pretrain_gpt's does, through **stage)
    builds on the meta device and each unit is materialised by DelayedParamIniter just
    before it is sharded: a rank never holds the whole model, and the values equal the eager
    model's for the same seed. Other providers build eagerly (an error with
    --init-model-with-meta-device, which asks for the meta device)."""
    import dataclasses

    params_dtype = configs.model.params_dtype
    fp32_configs = dataclasses.replace(
        configs, model=dataclasses.replace(configs.model, params_dtype=torch.float32)
    )
    meta = configs.parallel.init_model_with_meta_device
    if meta and not provider_accepts_device(model_provider):
        raise ConfigError(META_DEVICE_PROVIDER_ERROR)
    if provider_accepts_device(model_provider):
        chunk = model_provider(fp32_configs, state, pre_process=True, post_process=True,
                               device=torch.device("meta"))
        initer = DelayedParamIniter(chunk, device=state.device)
        param_init_fn = initer.get_param_init_fn()
        check = initer.validate_params_and_buffers_inited()
    else:
        chunk = model_provider(fp32_configs, state, pre_process=True, post_process=True)
        chunk.to(state.device)
        param_init_fn, check = None, contextlib.nullcontext()
    with check:
        return FullyShardedDataParallel(
            chunk, state, config=configs.optimizer,
            param_dtype=None if params_dtype == torch.float32 else params_dtype,
            reshard_after_forward=configs.parallel.torch_fsdp2_reshard_after_forward,
            param_init_fn=param_init_fn,
            # --grad-reduce-in-bf16 (Megatron-FSDP honours it too): reduce-scatter in bf16.
            reduce_dtype=(torch.float32 if configs.optimizer.accumulate_allreduce_grads_in_fp32
                          else params_dtype),
        )


def is_fsdp_model(model: torch.nn.Module) -> bool:
    return any(isinstance(m, FSDPModule) for m in model.modules())


__all__ = [
    "FullyShardedDataParallel",
    "CacheFlushMonitor",
    "fully_shard_model",
    "mixed_precision_policy",
    "language_model",
    "transformer_layers",
    "local_tensor",
    "shard_row_offset",
    "is_fsdp_model",
    "expert_units",
    "validate_fsdp_configs",
    "build_fsdp_model_chunk",
]
