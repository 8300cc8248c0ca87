"""PyTorch's own FSDP follows the SMP keys after `init`, as in SMP v2 (which hooks torch's FSDP
entry points when it initialises). `init` installs these hooks once; each reads `smp.state`
when it runs, so a script's `from torch.distributed.fsdp import ...` works whether it ran
before or after `init`, and before `init` (or after none) torch behaves as its own.

* FSDP1 `FullyShardedDataParallel(model, ...)` without `process_group` / `device_mesh`: the
  process group and sharding strategy come from the SMP keys (SMP v2's reference rules):
    - hybrid_shard_degree 0: the script's strategy (default FULL_SHARD) over every data x
      context-parallel rank (all ranks at TP=1: PyTorch's native behaviour), never across
      tensor-parallel peers; HYBRID_SHARD / _HYBRID_SHARD_ZERO2 there need a degree: error.
    - 1: NO_SHARD over the data x context-parallel ranks (any other explicit strategy is
      an error).
    - N >= 2: shard within groups of N of those ranks, replicate across the groups; an unset
      strategy becomes HYBRID_SHARD, HYBRID_SHARD / _HYBRID_SHARD_ZERO2 are kept, FULL_SHARD /
      SHARD_GRAD_OP only where N is every data x context-parallel rank.
  Nested units built by `auto_wrap_policy` inherit the root's resolved group.
  `sync_module_states=True` copies the weights of the first rank of the process group (and
  then across the replicas): after `transform(load_state_dict_from_rank0=True)` that is
  rank 0's TP group. We broadcast ourselves before FSDP flattens the model (torch's own
  broadcast refuses CPU tensors); meta modules are materialised first by `param_init_fn`
  (default `DelayedParamIniter`).
* FSDP2 `fully_shard(module)` without `mesh`: the mesh is `state.parallel_state.fsdp_mesh`
  (1-D over the data x context-parallel ranks, or 2-D replicate x shard for N >= 2;
  N = 1 replicates).
* Tensor and expert parallelism (any MoE family `transform` takes, and dense models with
  sequence parallelism): entering either entry point turns on the transformed model's own
  grad reductions (`smp.fsdp_grads`: sums over TP of the sequence-parallel params' grads,
  the experts' 1 / ep). At expert_parallel_degree > 1 the expert params shard over the ranks
  holding the same experts (`ParallelState.expert_fsdp_groups`: within this rank's shard
  group, replicated across the others): FSDP1 wraps every `MoEExperts` as a unit of its own
  on that group (`ExpertUnitsPolicy`, added to the script's auto_wrap_policy); FSDP2 gives
  them their own param group on `expert_fsdp_mesh` (fully_shard's per-parameter mesh).
  `sync_module_states` copies experts over those groups. hybrid_shard_degree and
  expert_parallel_degree must divide one another; transform(load_state_dict_from_rank0=True)
  at EP > 1 cannot give EP ranks other than 0 their experts: both are errors.
* `fsdp_cache_flush_warnings`: both roots check the CUDA allocator's flush count at each
  forward (`distributed.fsdp.CacheFlushMonitor`).
* `offload_wrapper(model)` (torch's) with `sm_activation_offloading` true: the model's
  transformer layers are checkpointed with our checkpoint (a torch `checkpoint_wrapper` the
  script applied is replaced) and their saved inputs offloaded by our `ActivationOffloader`
  with `activation_loading_horizon`; false keeps torch's `save_on_cpu` wrapper. Layers inside
  FSDP1 units are checkpointed inside them, and the recompute returns the weights' grads
  through the checkpoint's backward (`checkpoint(module=...)`): a nested backward that
  accumulated into FSDP1's flat parameter would fire its post-backward hook, which reshards
  it, and the next layer's recompute would see the sharded (possibly empty) views.
* `allow_empty_shards`: false is PyTorch's behaviour (uneven dim-0 chunks, a trailing rank may
  hold an empty shard), which is also what true asks for (empty shards allowed); SMP's true
  was a workaround inside its own sharding, which we do not have: both values shard alike.
"""
from __future__ import annotations

import inspect
import logging
from typing import Any, Callable, Dict, Optional

import torch
import torch.distributed as dist
from torch.distributed.fsdp.wrap import _Policy

from megatron_smp.config import ConfigError

logger = logging.getLogger(__name__)

_installed: Dict[str, Any] = {}
# Set by the default-mesh hook for the `_init_param_group` of the same fully_shard call.
_pending: Dict[str, bool] = {}
# id(expert mesh) -> (the mesh, its FSDPMeshInfo), see expert_shard_placement.
_expert_mesh_infos: Dict[int, tuple] = {}


# The SMP state the hooks follow, given by `install` (smp.state calls it from `init`, so this
# module never imports smp.state back).
_state_provider: Optional[Callable[[], Any]] = None


def _smp_state():
    return _state_provider() if _state_provider is not None else None


# FSDP1 ------------------------------------------------------------------------------------------


def resolve_fsdp1_arguments(arguments: Dict[str, Any], state) -> Dict[str, Any]:
    """The SMP keys' process group and sharding strategy for an FSDP1 root's arguments (a
    dict of FullyShardedDataParallel.__init__'s parameters; a new dict is returned)."""
    from torch.distributed.fsdp import ShardingStrategy as S

    parallel_state = state.parallel_state
    if parallel_state.ep_size > 1:
        parallel_state.check_expert_fsdp_layout()
    if parallel_state.pp_size > 1:
        raise ConfigError(
            "torch's FSDP with pipeline_parallel_degree > 1 is not supported; use 1"
        )
    degree = state.hybrid_shard_degree
    strategy = arguments.get("sharding_strategy")
    dp_cp = parallel_state.dp_cp_size
    hybrid = (S.HYBRID_SHARD, S._HYBRID_SHARD_ZERO2)
    out = dict(arguments)
    if degree == 0:
        if strategy in hybrid:
            raise ConfigError(
                f"FullyShardedDataParallel(sharding_strategy={strategy.name}) with "
                "hybrid_shard_degree 0: set the SMP key hybrid_shard_degree to the size of the "
                "shard groups"
            )
        out["process_group"] = parallel_state.dp_cp_group
        out["sharding_strategy"] = strategy or S.FULL_SHARD
    elif degree == 1:
        if strategy not in (None, S.NO_SHARD):
            raise ConfigError(
                f"FullyShardedDataParallel(sharding_strategy={strategy.name}) with "
                "hybrid_shard_degree 1 (which means NO_SHARD): drop sharding_strategy, or set "
                "hybrid_shard_degree 0 / N"
            )
        out["process_group"] = parallel_state.dp_cp_group
        out["sharding_strategy"] = S.NO_SHARD
    else:
        strategy = strategy or S.HYBRID_SHARD
        if strategy in hybrid:
            out["process_group"] = (parallel_state.fsdp_shard_group,
                                    parallel_state.groups["fsdp_replicate"])
        elif strategy in (S.FULL_SHARD, S.SHARD_GRAD_OP) and degree == dp_cp:
            out["process_group"] = parallel_state.dp_cp_group
        else:
            raise ConfigError(
                f"FullyShardedDataParallel(sharding_strategy={strategy.name}) with "
                f"hybrid_shard_degree {degree}: shard groups of {degree} of the {dp_cp} "
                "data-parallel ranks need HYBRID_SHARD or _HYBRID_SHARD_ZERO2 (or no "
                "sharding_strategy)"
            )
        out["sharding_strategy"] = strategy
    return out


def broadcast_module_states(module: torch.nn.Module, group,
                            what: str = "sync_module_states", experts: Optional[bool] = None
                            ) -> None:
    """Copy every unsharded parameter and buffer of `module` from the first rank of `group`
    (FSDP's `sync_module_states`); tensors an inner FSDP2 unit already sharded are skipped.
    `experts` True / False: only the expert params / all but them."""
    from torch.distributed.tensor import DTensor

    from megatron_smp.tensor_parallel.utils import is_expert_param

    tensors = [t for t in list(module.parameters()) + list(module.buffers())
               if not isinstance(t, DTensor)
               and (experts is None or is_expert_param(t) == experts)]
    if any(t.is_meta for t in tensors):
        raise ConfigError(
            f"{what}: a module is still on the meta device when its weights are copied; "
            "pass param_init_fn=DelayedParamIniter(model).get_param_init_fn()"
        )
    if group is None or dist.get_world_size(group) == 1:
        return
    source = dist.get_global_rank(group, 0)
    for tensor in tensors:
        dist.broadcast(tensor.data, source, group=group)


def has_expert_params(module: torch.nn.Module) -> bool:
    from megatron_smp.tensor_parallel.utils import is_expert_param

    return any(is_expert_param(p) for p in module.parameters())


def activate_grad_hooks(module: torch.nn.Module, state) -> None:
    """Turn on the grad reductions the transformed models in `module` carry for torch's
    FSDP (`smp.fsdp_grads`): sums over TP of sequence-parallel params' grads, the expert
    grads' 1 / ep. A model without them (a GPTModel built by hand) that needs them is an
    error: torch's FSDP would leave those grads partial or wrongly averaged."""
    from megatron_smp.smp.fsdp_grads import find_grad_hooks

    hooks = find_grad_hooks(module)
    parallel_state = state.parallel_state
    partial = parallel_state.tp_size > 1 and any(
        getattr(p, "sequence_parallel", False) for p in module.parameters())
    experts = parallel_state.ep_size > 1 and has_expert_params(module)
    if (partial or experts) and not hooks:
        what, other = (
            ("sequence-parallel params (norm weights, the router) would keep partial grads "
             "per TP rank", "smp.fully_shard or our DDP with "
             "megatron_smp.distributed.finalize_model_grads") if partial else
            ("expert params would be averaged over ranks holding different experts",
             "our DDP (it reduces experts over the expert-data-parallel group)"))
        raise ConfigError(
            f"torch's FullyShardedDataParallel / fully_shard on a model not returned by "
            f"smp.transform: its {what}; wrap the model smp.transform returns (it carries "
            f"those reductions), or use {other}"
        )
    for hook in hooks:
        hook.active = True


def _sync_module_states(module: torch.nn.Module, process_group, param_init_fn,
                        expert_group=None) -> None:
    if any(t.is_meta for t in list(module.parameters()) + list(module.buffers())):
        if param_init_fn is None:
            from megatron_smp.distributed.delayed_init import DelayedParamIniter

            param_init_fn = DelayedParamIniter(module).get_param_init_fn()
        param_init_fn(module)
    groups = process_group if isinstance(process_group, tuple) else (process_group,)
    if expert_group is None:
        for group in groups:  # within the shard group, then across the replicas
            broadcast_module_states(module, group)
        return
    # Expert parallelism: the experts from the first rank holding the same experts.
    for group in groups:
        broadcast_module_states(module, group, experts=False)
    expert_groups = expert_group if isinstance(expert_group, tuple) else (expert_group,)
    for group in expert_groups:
        broadcast_module_states(module, group, experts=True)


def mark_states_synced(module: torch.nn.Module) -> None:
    """After a sync_module_states broadcast every replica holds rank 0's weights: the
    transformed model no longer needs one."""
    for sub in module.modules():
        if getattr(sub, "loaded_from_rank0", False):
            sub.loaded_from_rank0 = False


def check_rank0_loading(module: torch.nn.Module, sync: bool, state, what: str) -> None:
    """Errors for a model `transform(load_state_dict_from_rank0=True)` built: at EP > 1 (no
    rank holds the other EP ranks' experts), and without `sync` when there are data-parallel
    replicas (`what`: how to sync)."""
    loaded = any(getattr(m, "loaded_from_rank0", False) for m in module.modules())
    if loaded and state.parallel_state.ep_size > 1 and has_expert_params(module):
        raise ConfigError(
            "transform(load_state_dict_from_rank0=True) with expert_parallel_degree > 1: rank "
            "0's tensor-parallel group holds only its own expert-parallel rank's experts, so "
            "no rank can give the others theirs; give every rank the Hugging Face weights and "
            "transform with load_state_dict_from_rank0=False"
        )
    if loaded and not sync and state.parallel_state.dp_cp_size > 1:
        raise ConfigError(
            "the model was transformed with load_state_dict_from_rank0=True, so only rank 0's "
            f"tensor-parallel group holds its weights: {what}"
        )


def _attach_cache_flush_monitor(module: torch.nn.Module, state) -> None:
    from megatron_smp.distributed.fsdp import CacheFlushMonitor

    if not state.fsdp_cache_flush_warnings or hasattr(module, "cache_flush_monitor"):
        return
    monitor = CacheFlushMonitor(state.parallel_state.device)
    module.cache_flush_monitor = monitor

    def check_before_forward(mod, args) -> None:  # a returned value would replace args
        monitor.check()

    module.register_forward_pre_hook(check_before_forward)


def expert_unit_arguments(strategy, state) -> Dict[str, Any]:
    """FSDP1 arguments of the expert units under the root's resolved strategy: the ranks
    holding the same experts (expert-data-parallel), or for HYBRID_SHARD /
    _HYBRID_SHARD_ZERO2 (their shard group, their replicas); a shard group of one rank
    (hybrid_shard_degree <= expert_parallel_degree) is NO_SHARD over the replicas (FSDP1
    would turn it into NO_SHARD over that one rank, reducing nothing)."""
    from torch.distributed.fsdp import ShardingStrategy as S

    parallel_state = state.parallel_state
    if strategy not in (S.HYBRID_SHARD, S._HYBRID_SHARD_ZERO2):
        return {"process_group": parallel_state.expert_dp_group}
    shard, replicate = parallel_state.expert_fsdp_groups
    if shard.size() == 1:
        return {"process_group": replicate, "sharding_strategy": S.NO_SHARD}
    return {"process_group": (shard, replicate)}


def _legacy_policy_targets(policy, root: torch.nn.Module, ignored_modules, stop) -> list:
    """The modules torch's `_recursive_wrap` would wrap with a legacy callable policy
    (`functools.partial(transformer_auto_wrap_policy, ...)`, size-based, ...): the same
    post-order walk and parameter counts. Modules in `stop` (the experts, units of their
    own) count as wrapped and are not entered."""
    ignored_params = {p for m in ignored_modules for p in m.parameters()}
    targets = []

    def visit(module, only_children: bool) -> int:
        nonwrapped = sum(p.numel() for p in module.parameters() if p not in ignored_params)
        if module in stop:
            return nonwrapped
        if not policy(module=module, recurse=True, nonwrapped_numel=nonwrapped):
            return 0
        wrapped = sum(visit(child, False) for child in module.children()
                      if child not in ignored_modules)
        if not only_children and policy(module=module, recurse=False,
                                        nonwrapped_numel=nonwrapped - wrapped):
            targets.append(module)
            return nonwrapped
        return wrapped

    visit(root, True)
    return targets


class ExpertUnitsPolicy(_Policy):
    """FSDP1's auto-wrap policy at expert_parallel_degree > 1: every `MoEExperts` is a unit
    of its own on the expert process group (`overrides`), beside the units of the script's
    own policy (a `_Policy` such as ModuleWrapPolicy, or a legacy callable such as
    `functools.partial(transformer_auto_wrap_policy, ...)`; None: only the experts). Units
    the script's policy puts inside an MoEExperts are dropped (their params belong to the
    experts' unit)."""

    def __init__(self, policy, overrides: Dict[str, Any]) -> None:
        self.policy = policy
        self.overrides = overrides

    def _run_policy(self, root_module, ignored_modules, root_kwargs):
        from megatron_smp.transformer.moe.experts import MoEExperts

        experts = [m for m in root_module.modules()
                   if isinstance(m, MoEExperts) and m not in ignored_modules]
        inside = {id(sub) for e in experts for sub in e.modules() if sub is not e}
        if isinstance(self.policy, _Policy):
            targets = self.policy._run_policy(root_module, ignored_modules, root_kwargs)
        elif self.policy is not None:
            targets = {m: dict(root_kwargs) for m in _legacy_policy_targets(
                self.policy, root_module, ignored_modules, set(experts))}
        else:
            targets = {}
        targets = {m: kwargs for m, kwargs in targets.items() if id(m) not in inside}
        for module in experts:
            kwargs = dict(targets.get(module, root_kwargs))
            kwargs.update(self.overrides)
            targets[module] = kwargs
        return targets


def _install_fsdp1() -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel

    original = FullyShardedDataParallel.__init__
    signature = inspect.signature(original)

    def __init__(self, *args, **kwargs):
        state = _smp_state()
        bound = signature.bind(self, *args, **kwargs)
        arguments = dict(bound.arguments)
        is_root = (arguments.get("process_group") is None
                   and arguments.get("device_mesh") is None)
        if state is None or not is_root:
            return original(*bound.args, **bound.kwargs)
        arguments = resolve_fsdp1_arguments(arguments, state)
        module = arguments["module"]
        activate_grad_hooks(module, state)
        sync = arguments.get("sync_module_states", False)
        check_rank0_loading(module, sync, state, "pass sync_module_states=True to "
                             "FullyShardedDataParallel so the other data-parallel ranks get them")
        expert_group = None
        if state.parallel_state.ep_size > 1 and has_expert_params(module):
            # Experts: FSDP units of their own over the ranks holding the same experts.
            overrides = expert_unit_arguments(arguments["sharding_strategy"], state)
            expert_group = overrides["process_group"]
            arguments["auto_wrap_policy"] = ExpertUnitsPolicy(
                arguments.get("auto_wrap_policy"), overrides)
        if sync:
            _sync_module_states(module, arguments["process_group"],
                                arguments.get("param_init_fn"), expert_group)
            mark_states_synced(module)
            arguments["sync_module_states"] = False
        group = arguments["process_group"]
        shard, replicas = (group if isinstance(group, tuple) else (group, None))
        logger.info(
            "smp: FullyShardedDataParallel %s over %d rank(s)%s (hybrid_shard_degree=%d, "
            "tensor_parallel_degree=%d)", arguments["sharding_strategy"].name, shard.size(),
            f", replicated over {replicas.size()}" if replicas is not None else "",
            state.hybrid_shard_degree, state.tensor_parallel_degree,
        )
        del arguments["self"]
        original(self, **arguments)
        _attach_cache_flush_monitor(self, state)

    __init__.__wrapped__ = original
    __init__.__doc__ = original.__doc__
    FullyShardedDataParallel.__init__ = __init__
    _installed["fsdp1"] = (FullyShardedDataParallel, original)


# FSDP2 ------------------------------------------------------------------------------------------


def _install_fsdp2() -> None:
    from torch.distributed.fsdp._fully_shard import _fully_shard as fully_shard_module
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    # fully_shard looks its default mesh up in its module's globals at each call.
    original_mesh = fully_shard_module._init_default_mesh

    def default_mesh(*args, **kwargs):
        state = _smp_state()
        if state is None:
            return original_mesh(*args, **kwargs)
        resolve_fsdp1_arguments({}, state)  # the same EP / PP checks
        _pending["default_mesh"] = True  # read by this fully_shard call's _init_param_group
        return state.parallel_state.fsdp_mesh

    fully_shard_module._init_default_mesh = default_mesh
    original_validate_module = fully_shard_module._validate_module

    def validate_module(*args, **kwargs):
        # The first thing fully_shard does: a call that failed after the default mesh must
        # not leave its mark for the next one (which may pass a mesh).
        _pending.clear()
        return original_validate_module(*args, **kwargs)

    fully_shard_module._validate_module = validate_module
    original_init_param_group = fully_shard_module._init_param_group

    def init_param_group(fsdp_state, params, modules, mesh_info, post_forward_mesh_info,
                         device, shard_placement_fn, *args, **kwargs):
        # Called once per fully_shard, after the mesh: on SMP's default mesh the transformed
        # model's grad hooks turn on, and expert params shard over their own mesh.
        default = _pending.pop("default_mesh", False)
        state = _smp_state()
        if default and state is not None:
            for module in modules:
                activate_grad_hooks(module, state)
            shard_placement_fn = expert_shard_placement(params, shard_placement_fn, state)
        return original_init_param_group(fsdp_state, params, modules, mesh_info,
                                         post_forward_mesh_info, device, shard_placement_fn,
                                         *args, **kwargs)

    fully_shard_module._init_param_group = init_param_group
    original_root_pre_forward = FSDPState._root_pre_forward

    def _root_pre_forward(self, module, args, kwargs):
        context = getattr(self, "_state_ctx", None)
        if context is not None and context.iter_forward_root is not None:
            # Not the root's forward (the root's pre-forward already ran this step).
            return original_root_pre_forward(self, module, args, kwargs)
        monitor = getattr(self, "_smp_cache_flush_monitor", None)
        if not getattr(self, "_smp_checked", False):
            self._smp_checked = True
            state = _smp_state()
            if state is not None:
                check_rank0_loading(
                    module, False, state, "torch's fully_shard has no sync_module_states: use "
                    "FullyShardedDataParallel(..., sync_module_states=True) or "
                    "tsm.fully_shard(model, sync_module_states=True)")
            if (state is not None and state.fsdp_cache_flush_warnings
                    and not hasattr(module, "cache_flush_monitor")):  # smp.fully_shard's
                from megatron_smp.distributed.fsdp import CacheFlushMonitor

                monitor = CacheFlushMonitor(state.parallel_state.device)
                self._smp_cache_flush_monitor = monitor
                module.cache_flush_monitor = monitor
        if monitor is not None:
            monitor.check()
        return original_root_pre_forward(self, module, args, kwargs)

    FSDPState._root_pre_forward = _root_pre_forward
    _installed["fsdp2"] = (fully_shard_module, original_mesh, original_validate_module,
                           original_init_param_group, FSDPState, original_root_pre_forward)


def expert_shard_placement(params, shard_placement_fn, state):
    """fully_shard's `shard_placement_fn` at expert_parallel_degree > 1: expert params on
    `expert_fsdp_mesh` (the ranks holding the same experts: a param group of their own,
    FSDP2's per-parameter mesh), the others as the script's function (or default) says."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
    from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info
    from torch.distributed.tensor import Shard

    from megatron_smp.tensor_parallel.utils import is_expert_param

    parallel_state = state.parallel_state
    if parallel_state.ep_size == 1 or not any(is_expert_param(p) for p in params):
        return shard_placement_fn
    mesh = parallel_state.expert_fsdp_mesh
    if id(mesh) not in _expert_mesh_infos:  # one FSDPMeshInfo per mesh: FSDP2 groups by it
        _expert_mesh_infos[id(mesh)] = (mesh, _get_mesh_info(mesh))
    mesh_info = _expert_mesh_infos[id(mesh)][1]

    def placement(param):
        chosen = shard_placement_fn(param) if shard_placement_fn is not None else None
        if not is_expert_param(param):
            return chosen
        if isinstance(chosen, ShardPlacementResult):
            raise ConfigError(
                "fully_shard(shard_placement_fn=...) gave an expert parameter a mesh of its "
                "own; at expert_parallel_degree > 1 SMP shards experts over the ranks holding "
                "the same experts: return a Shard (or None) for them"
            )
        return ShardPlacementResult(placement=chosen or Shard(0), mesh_info=mesh_info)

    return placement


# Activation offloading --------------------------------------------------------------------------


def _install_offload_wrapper() -> None:
    from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as wrappers

    original = wrappers.OffloadWrapper

    class OffloadWrapper(original):  # torch's name: scripts and tests may check it
        """torch's OffloadWrapper; with `sm_activation_offloading` (after `init`) the
        wrapped model's transformer layers are checkpointed and their inputs offloaded by
        our ActivationOffloader (horizon `activation_loading_horizon`) instead of
        `save_on_cpu` moving every saved tensor."""

        def __init__(self, mod: torch.nn.Module) -> None:
            super().__init__(mod)
            self.activation_offloader = None
            state = _smp_state()
            if state is None or not state.sm_activation_offloading:
                return
            from megatron_smp.distributed.activation_offload import (
                ActivationOffloader, apply_activation_checkpointing, bare_layer,
            )
            from megatron_smp.distributed.fsdp import language_model

            # The layers under any FSDP1 unit / torch checkpoint_wrapper the script put
            # around them: ours checkpoints them where they sit (inside the FSDP1 unit).
            layers = [bare_layer(layer) for layer in language_model(mod).decoder.layers]
            self.activation_offloader = ActivationOffloader(state.activation_loading_horizon)
            apply_activation_checkpointing(mod, layers, self.activation_offloader)

        def forward(self, *args, **kwargs):
            if self.activation_offloader is None:
                return super().forward(*args, **kwargs)
            return self._checkpoint_wrapped_module(*args, **kwargs)

    wrappers.OffloadWrapper = OffloadWrapper
    _installed["offload"] = (wrappers, original)


def install(state_provider: Callable[[], Any]) -> None:
    """Hook torch's FSDP1, FSDP2 and offload_wrapper entry points (once per process); the
    hooks follow the SMP state `state_provider()` returns (None before `init`)."""
    global _state_provider
    _state_provider = state_provider
    if _installed:
        return
    _install_fsdp1()
    _install_fsdp2()
    _install_offload_wrapper()


__all__ = ["install", "resolve_fsdp1_arguments", "broadcast_module_states",
           "activate_grad_hooks", "expert_unit_arguments", "ExpertUnitsPolicy",
           "expert_shard_placement", "has_expert_params"]
