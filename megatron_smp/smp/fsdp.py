"""SMP v2's FSDP step on FSDP2: `fully_shard` with the `hybrid_shard_degree`, offloading and
FSDP keys of `init`."""
from __future__ import annotations

from typing import Optional

import torch

from megatron_smp.config import ConfigError
from megatron_smp.smp.state import init, is_initialized, state
from megatron_smp.smp.torch_fsdp import mark_states_synced


def _sync_from_rank0_tp_group(parallel_state):
    """A `before_shard(unit)` that copies each unsharded parameter and buffer of a unit from
    the rank of rank 0's TP group with this rank's TP rank (FSDP's `sync_module_states`)."""
    group = parallel_state.dp_cp_group
    source = min(parallel_state.group_ranks["dp_cp"])
    if source >= parallel_state.tp_size:
        raise ConfigError(
            "fully_shard(sync_module_states=True) copies weights from rank 0's tensor-parallel "
            f"group, but this rank's replicas start at rank {source}: use "
            "pipeline_parallel_degree 1"
        )
    what = "fully_shard(sync_module_states=True)"

    def before_shard(unit: torch.nn.Module) -> None:
        from megatron_smp.smp.torch_fsdp import broadcast_module_states

        if parallel_state.ep_size == 1:
            broadcast_module_states(unit, group, what=what)
            return
        # Experts from the first rank holding the same experts, the rest from rank 0's.
        broadcast_module_states(unit, group, what=what, experts=False)
        broadcast_module_states(unit, parallel_state.expert_dp_group, what=what, experts=True)

    return before_shard


def fully_shard(
    model: torch.nn.Module,
    *,
    mixed_precision: Optional[torch.dtype] = None,
    reshard_after_forward: bool = True,
    param_init_fn=None,
    activation_checkpointing: bool = False,
    activation_offloading: bool = False,
    forward_prefetch: int = 0,
    backward_prefetch: int = 1,
    cpu_offload: bool = False,
    sync_module_states: bool = False,
) -> torch.nn.Module:
    """Shard a `transform`ed model with FSDP2 as the `init` keys say (SMP v2's FSDP step).

    * `hybrid_shard_degree`: 0 shards over all data x context-parallel ranks, 1 replicates,
      N shards within groups of N ranks and replicates across them (on a 2-D mesh).
    * `allow_empty_shards`: either value shards as PyTorch does (a trailing rank may hold an
      empty shard; our checkpoints save and load those), see `smp.torch_fsdp`.
    * `fsdp_cache_flush_warnings`: warn when the CUDA allocator flushed its cache in a step.
    * `activation_offloading` (with checkpointing): `sm_activation_offloading` true moves each
      checkpointed layer's saved inputs to host memory, at most `activation_loading_horizon`
      layers loaded back at once; false uses torch's own `offload_wrapper` (every saved
      tensor to host, no horizon).
    `mixed_precision`: the compute dtype (bf16) over fp32 sharded params, fp32 reduction.
    `param_init_fn`: `DelayedParamIniter(model).get_param_init_fn()` for a meta model.
    MoE models (`expert_parallel_degree`): each layer's experts are an FSDP2 unit of their
      own over the ranks holding the same experts (see `distributed.fsdp`); the script's
      `finalize_model_grads` and the optimizer treat them as our training loop does.
    `sync_module_states`: every rank takes the weights of the rank of rank 0's TP group with
      its TP rank (experts: of the first rank holding the same experts), unit by unit before
      sharding (needed after
      `transform(load_state_dict_from_rank0=True)` when there are data-parallel replicas;
      meta models elsewhere are materialised by `param_init_fn` first, default
      `DelayedParamIniter`).
    Returns the sharded model (the same object, or torch's offload wrapper around it).
    """
    from megatron_smp.distributed.activation_offload import ActivationOffloader
    from megatron_smp.distributed.fsdp import fully_shard_model

    if not is_initialized():
        init()
    from megatron_smp.smp.torch_fsdp import check_rank0_loading

    parallel_state = state.parallel_state
    check_rank0_loading(model, sync_module_states, state,
                        "pass sync_module_states=True to fully_shard so the other "
                        "data-parallel ranks get them")
    before_shard = None
    if sync_module_states:
        before_shard = _sync_from_rank0_tp_group(parallel_state)
        if param_init_fn is None:
            from megatron_smp.distributed.delayed_init import DelayedParamIniter

            param_init_fn = DelayedParamIniter(model).get_param_init_fn()
    offloader = None
    native_offload = False
    if activation_offloading:
        if state.sm_activation_offloading:
            offloader = ActivationOffloader(state.activation_loading_horizon)
        else:
            native_offload = True
    model = fully_shard_model(
        model, parallel_state, param_dtype=mixed_precision,
        reshard_after_forward=reshard_after_forward, offload_params=cpu_offload,
        forward_prefetch=forward_prefetch, backward_prefetch=backward_prefetch,
        param_init_fn=param_init_fn,
        activation_checkpointing=activation_checkpointing or activation_offloading,
        activation_offloader=offloader,
        cache_flush_warnings=state.fsdp_cache_flush_warnings, before_shard=before_shard,
    )
    model.activation_offloader = offloader
    if sync_module_states:
        mark_states_synced(model)
    if native_offload:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import offload_wrapper

        model = offload_wrapper(model)
    return model
