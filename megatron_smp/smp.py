"""The SageMaker model parallelism v2 surface: `init`, `is_initialized`, `state`, `transform`.

    import megatron_smp as smp
    smp.init({"tensor_parallel_degree": 2, "random_seed": 7})     # or a JSON file path
    model = smp.transform(hf_model)        # GPT-2, Llama, Mistral, GPT-NeoX causal LMs
    logits = model(input_ids)              # [b, s, vocab], equal to hf_model(input_ids).logits

`init` builds the framework's `ParallelState` (torchrun/SLURM launch, or a plain single
process); `transform` converts the HF model's config and weights through the family's
adapter in `models.hf` and returns a tensor-parallel `GPTModel` holding the same weights.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Dict, Optional, Union

import torch
import torch.distributed as dist

from megatron_smp.config import (
    CP_COMM_TYPES, ConfigError, ParallelConfig, TransformerConfig, not_supported,
)
from megatron_smp.distributed.checkpoint.agreement import collective_device
from megatron_smp.parallel_state import ParallelState, build_parallel_state, launcher_world_size

# key: (type, default). SMP v2's documented keys first, then ours. Defaults follow the
# reference.
_SMP_KEYS: Dict[str, tuple] = {
    "hybrid_shard_degree": (int, 0),
    "sm_activation_offloading": (bool, True),
    "activation_loading_horizon": (int, 2),
    "fsdp_cache_flush_warnings": (bool, True),
    "allow_empty_shards": (bool, False),
    "tensor_parallel_degree": (int, 1),
    "context_parallel_degree": (int, 1),
    "expert_parallel_degree": (int, 1),
    "random_seed": (int, 12345),
    "cp_comm_type": (str, "p2p"),
    "pipeline_parallel_degree": (int, 1),
    "shard_optimizer_state": (bool, False),
}

# Keys whose capability does not exist yet: giving them at all is an error (their defaults
# describe what happens without them).
_NOT_SUPPORTED_YET_KEYS: Dict[str, str] = {}

# Keys read by `smp.fully_shard` in a script of the user's own; the training scripts
# (--smp-config) do not take them.
FSDP_SCRIPT_KEYS = ("sm_activation_offloading", "activation_loading_horizon",
                    "fsdp_cache_flush_warnings", "allow_empty_shards")

# How ParallelConfig validation names its fields for SMP users.
SMP_NAMES = {
    "tensor_model_parallel_size": "tensor_parallel_degree",
    "pipeline_model_parallel_size": "pipeline_parallel_degree",
    "context_parallel_size": "context_parallel_degree",
    "expert_model_parallel_size": "expert_parallel_degree",
    "hybrid_shard_degree": "hybrid_shard_degree",
}


class SMPState:
    """`smp.state`: ranks and groups of the job (None/defaults until `init`)."""

    def __init__(self) -> None:
        self.parallel_state: Optional[ParallelState] = None
        self.config: Dict[str, Any] = {}
        self.rank = 0
        self.world_size = 1
        self.local_rank = 0
        self.tensor_parallel_degree = 1
        self.tp_rank = 0
        self.tp_process_group = None
        self.rep_rank_process_group = None
        self.hybrid_shard_degree = 0
        self.context_parallel_degree = 1
        self.expert_parallel_degree = 1
        self.pipeline_parallel_degree = 1
        self.random_seed = _SMP_KEYS["random_seed"][1]

    @property
    def tp_size(self) -> int:
        """Alias of `tensor_parallel_degree`."""
        return self.tensor_parallel_degree

    def __repr__(self) -> str:
        return (
            f"SMPState(rank={self.rank}/{self.world_size}, tp={self.tp_rank}/{self.tp_size}, "
            f"hybrid_shard_degree={self.hybrid_shard_degree})"
        )


state = SMPState()
_initialized = False


def _read_config(config: Union[None, str, os.PathLike, Dict[str, Any]]) -> Dict[str, Any]:
    if config is None:
        return {}
    if isinstance(config, (str, os.PathLike)):
        try:
            with open(config) as handle:
                config = json.load(handle)
        except FileNotFoundError:
            raise ConfigError(f"smp.init: config file {str(config)!r} does not exist") from None
        except json.JSONDecodeError as error:
            raise ConfigError(
                f"smp.init: config file {str(config)!r} is not JSON: {error}"
            ) from None
    if not isinstance(config, dict):
        raise ConfigError(
            f"smp.init: config must be a dict or a JSON file path, got {type(config)}"
        )
    return dict(config)


def read_smp_keys(config: Union[None, str, os.PathLike, Dict[str, Any]]) -> tuple:
    """Read SMP v2 keys and check each on its own: (keys the user set, all values with
    defaults). Unknown keys, wrong types and keys of capabilities that do not exist yet are a
    ConfigError naming the key; the degrees are checked together by `ParallelConfig.validate`.
    """
    user = _read_config(config)
    unknown = sorted(set(user) - set(_SMP_KEYS))
    if unknown:
        raise ConfigError(
            f"smp config: unknown config key(s) {unknown}; known keys are {sorted(_SMP_KEYS)}"
        )
    values = {key: default for key, (_, default) in _SMP_KEYS.items()}
    for key, value in user.items():
        kind = _SMP_KEYS[key][0]
        # bool is an int subclass: reject it for integer keys, and ints for boolean keys.
        if kind is bool and not isinstance(value, bool):
            raise ConfigError(f"smp config: {key} must be true or false, got {value!r}")
        if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
            raise ConfigError(f"smp config: {key} must be an integer, got {value!r}")
        if kind is str and not isinstance(value, str):
            raise ConfigError(f"smp config: {key} must be a string, got {value!r}")
        if key == "cp_comm_type" and value not in CP_COMM_TYPES:
            raise ConfigError(
                f"smp config: cp_comm_type must be one of {', '.join(CP_COMM_TYPES)}, got "
                f"{value!r}"
            )
        if key in _NOT_SUPPORTED_YET_KEYS:
            raise not_supported(f"smp config key {key}", _NOT_SUPPORTED_YET_KEYS[key])
        values[key] = value
    if values["activation_loading_horizon"] < 1:
        raise ConfigError(
            "smp config: activation_loading_horizon must be a positive integer, got "
            f"{values['activation_loading_horizon']}"
        )
    return set(user), values


def _parallel_config(values: Dict[str, Any]) -> ParallelConfig:
    return ParallelConfig(
        tensor_model_parallel_size=values["tensor_parallel_degree"],
        pipeline_model_parallel_size=values["pipeline_parallel_degree"],
        context_parallel_size=values["context_parallel_degree"],
        expert_model_parallel_size=values["expert_parallel_degree"],
        hybrid_shard_degree=values["hybrid_shard_degree"],
    )


def parse_smp_config(
    config: Union[None, str, os.PathLike, Dict[str, Any]], world_size: int
) -> tuple:
    """Read and validate SMP v2 keys: (keys the user set, all values with defaults,
    the ParallelConfig they describe). Raises ConfigError naming the key."""
    given, values = read_smp_keys(config)
    parallel_config = _parallel_config(values)
    parallel_config.check_supported(SMP_NAMES)
    parallel_config.validate(world_size, names=SMP_NAMES)
    return given, values, parallel_config


def init(config: Union[None, str, os.PathLike, Dict[str, Any]] = None) -> None:
    """Initialise SMP from a dict or JSON file of SMP v2 keys (see `_SMP_KEYS`).

    Validates everything before the first collective (ConfigError on every rank), builds the
    ParallelState, seeds the default and tensor-parallel RNG streams from `random_seed`, and
    fills `smp.state`. Calling it again re-initialises with the new config.

    `shard_optimizer_state` is honoured by the training scripts (`--smp-config`); a script
    of its own that calls `init` builds the optimizer itself, so there it is an error.
    """
    global _initialized
    from megatron_smp.tensor_parallel.random import model_parallel_seed

    _, values, parallel_config = parse_smp_config(config, launcher_world_size())
    if values["shard_optimizer_state"]:
        raise ConfigError(
            "smp.init: shard_optimizer_state only applies to the training scripts' optimizer "
            "(pretrain_gpt.py --smp-config); in your own script build it with "
            "megatron_smp.optimizer.get_megatron_optimizer(OptimizerConfig("
            "use_distributed_optimizer=True), ...)"
        )
    parallel_state = build_parallel_state(parallel_config)
    model_parallel_seed(values["random_seed"], parallel_state)

    state.parallel_state = parallel_state
    state.config = values
    state.rank = parallel_state.rank
    state.world_size = parallel_state.world_size
    state.local_rank = int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", 0)))
    state.tensor_parallel_degree = parallel_state.tp_size
    state.tp_rank = parallel_state.tp_rank
    state.tp_process_group = parallel_state.tp_group
    # Ranks holding the same TP shard (data- and context-parallel replicas).
    state.rep_rank_process_group = parallel_state.dp_cp_group
    state.hybrid_shard_degree = values["hybrid_shard_degree"]
    state.context_parallel_degree = values["context_parallel_degree"]
    state.expert_parallel_degree = values["expert_parallel_degree"]
    state.pipeline_parallel_degree = values["pipeline_parallel_degree"]
    state.random_seed = values["random_seed"]
    for key in ("sm_activation_offloading", "activation_loading_horizon",
                "fsdp_cache_flush_warnings", "allow_empty_shards", "cp_comm_type"):
        setattr(state, key, values[key])
    _initialized = True


def is_initialized() -> bool:
    return _initialized


# transform ---------------------------------------------------------------------------------------


class TransformedModel(torch.nn.Module):
    """What `transform` returns: the tensor-parallel `GPTModel` (`.module`) behind the HF
    calling convention.

    forward(input_ids [b, s], attention_mask=None, position_ids=None, labels=None)
      * attention_mask: HF-style [b, s] (1 = token, 0 = padding), or our bool [b, 1, s, s]
        (True = masked); None = causal.
      * returns full logits [b, s, vocab] (gathered over TP, padding columns sliced off), or
        with `labels` the per-token loss [b, s] (fp32, labels aligned with positions: pass
        the already-shifted targets).
    """

    def __init__(self, module: torch.nn.Module, family: str) -> None:
        super().__init__()
        self.module = module
        self.family = family
        self.config: TransformerConfig = module.config

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
        labels: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        from megatron_smp.models.gpt import gather_full_logits

        seq_length = input_ids.shape[1]
        mask = _causal_mask_from_padding(attention_mask, seq_length)
        parallel_state = self.module.state
        if parallel_state.cp_size > 1:
            # This rank's share of the sequence in, the whole sequence's outputs back.
            from megatron_smp.context_parallel import (
                gather_from_context_parallel, get_batch_on_this_cp_rank,
            )

            local = get_batch_on_this_cp_rank(
                {"tokens": input_ids, "position_ids": position_ids, "attention_mask": mask,
                 "labels": labels}, parallel_state.cp_size, parallel_state.cp_rank,
            )
            output = self.module(local["tokens"], position_ids=local["position_ids"],
                                 attention_mask=local["attention_mask"], labels=local["labels"])
            output = gather_from_context_parallel(output, parallel_state.cp_group)
        else:
            output = self.module(input_ids, position_ids=position_ids, attention_mask=mask,
                                 labels=labels)
        if labels is not None:
            return output
        return gather_full_logits(output, self.module.state, self.config.vocab_size)


def _causal_mask_from_padding(attention_mask: Optional[torch.Tensor], seq_length: int):
    if attention_mask is None or attention_mask.dim() == 4:
        return attention_mask
    keep = attention_mask.bool()
    if bool(keep.all()):
        return None  # plain causal: SDPA's fused causal path
    future = torch.ones(seq_length, seq_length, dtype=torch.bool, device=keep.device).triu(1)
    return future[None, None] | ~keep[:, None, None, :]


def _has_meta(module: torch.nn.Module) -> bool:
    return any(t.is_meta for t in list(module.parameters()) + list(module.buffers()))


def _broadcast_state_dict(full: Optional[Dict[str, torch.Tensor]], src: int, group,
                          device: torch.device) -> Dict[str, torch.Tensor]:
    """Broadcast a state dict from global rank `src` over `group` (metadata, then tensors)."""
    meta = [None]
    if dist.get_rank() == src:
        meta = [[(name, tuple(t.shape), t.dtype) for name, t in full.items()]]
    dist.broadcast_object_list(meta, src=src, group=group)
    out = {}
    for name, shape, dtype in meta[0]:
        if dist.get_rank() == src:
            tensor = full[name].to(device).contiguous()
        else:
            tensor = torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(tensor, src=src, group=group)
        out[name] = tensor.cpu()
    return out


@dataclasses.dataclass
class MoEConfig:
    """SMP v2's `torch.sagemaker.moe.moe_config.MoEConfig`, passed as `transform(model,
    config=MoEConfig(...))` for a Mixtral / Qwen2-MoE model. Fields map onto Megatron's:

    * moe_load_balancing: "aux_loss" | "sinkhorn" | "none" -> --moe-router-load-balancing-type;
      "balanced" is top-k routing with every expert capped at its even share of the tokens
      (--moe-expert-capacity-factor 1.0, tokens beyond it dropped by probability);
    * moe_aux_loss_coeff: the auxiliary loss's coefficient, used with "aux_loss" only;
    * moe_z_loss_coeff: --moe-z-loss-coeff (0 disables the z-loss);
    * moe_all_to_all_dispatcher: --moe-token-dispatcher-type alltoall (else allgather);
    * random_seed: the seed the transformed model's own initialisation draws from (the
      weights are the HF model's unless it is on the meta device);
    * smp_moe=False (HF's own MoE blocks) and global_token_shuffle=True are not supported:
      transform always builds the framework's expert-parallel layers, and dropless routing
      makes a shuffle change nothing but the traffic.
    """

    smp_moe: bool = True
    random_seed: int = 12345
    moe_load_balancing: str = "sinkhorn"
    global_token_shuffle: bool = False
    moe_all_to_all_dispatcher: bool = True
    moe_aux_loss_coeff: float = 0.001
    moe_z_loss_coeff: float = 0.001

    def transformer_overrides(self) -> Dict[str, Any]:
        """TransformerConfig fields these settings set; ConfigError for values that cannot
        work, naming the field."""
        balancing = {"aux_loss": "aux_loss", "sinkhorn": "sinkhorn", "none": "none",
                     "balanced": "none"}
        if self.moe_load_balancing not in balancing:
            raise ConfigError(
                f"MoEConfig.moe_load_balancing must be one of {sorted(balancing)}, got "
                f"{self.moe_load_balancing!r}"
            )
        if not self.smp_moe:
            raise not_supported("MoEConfig(smp_moe=False)", "Hugging Face's own MoE blocks "
                                "inside transform (it always builds expert-parallel layers)")
        if self.global_token_shuffle:
            raise not_supported("MoEConfig(global_token_shuffle=True)", "token shuffling "
                                "across expert-parallel ranks")
        for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
            if getattr(self, name) < 0:
                raise ConfigError(f"MoEConfig.{name} must be >= 0, got {getattr(self, name)}")
        overrides = {
            "moe_router_load_balancing_type": balancing[self.moe_load_balancing],
            "moe_aux_loss_coeff": (self.moe_aux_loss_coeff
                                   if self.moe_load_balancing == "aux_loss" else 0.0),
            "moe_z_loss_coeff": self.moe_z_loss_coeff or None,
            "moe_token_dispatcher_type": "alltoall" if self.moe_all_to_all_dispatcher
            else "allgather",
        }
        if self.moe_load_balancing == "balanced":
            overrides.update(moe_expert_capacity_factor=1.0, moe_token_drop_policy="probs")
        return overrides


def transform(
    model: torch.nn.Module,
    device: Optional[torch.device] = None,
    dtype: Optional[torch.dtype] = None,
    config: Union[None, Dict[str, Any], MoEConfig] = None,
    load_state_dict_from_rank0: bool = False,
    cp_comm_type: Optional[str] = None,
) -> TransformedModel:
    """Convert an HF GPT2LMHeadModel / LlamaForCausalLM / MistralForCausalLM /
    GPTNeoXForCausalLM into the framework's tensor-parallel implementation.

    * The weights are the HF model's, sharded over `smp.state.tp_process_group`. With
      `load_state_dict_from_rank0`, rank 0's weights are broadcast over rank 0's TP group
      (other ranks' HF models may be random or on the meta device); other TP groups load
      their own HF model's weights, or keep a fresh init when those are on the meta device.
    * `config`: TransformerConfig fields to override (e.g. {"sequence_parallel": True}), or
      for a Mixtral / Qwen2-MoE model an SMP `MoEConfig`. MoE models are split over
      `expert_parallel_degree` (each rank holds E / ep experts) as well as TP.
    * `dtype` / `device`: of the new model (default: the HF model's dtype, `state.device`).
    * `cp_comm_type`: context parallelism's attention ("p2p", "all_gather", "a2a"; default
      the `init` key). With context_parallel_degree > 1 the model takes and returns whole
      sequences; inside, each rank of the CP group runs its share (chunks i and 2N-1-i), and
      the parameters' grads of the CP ranks add up to the whole-sequence grads.
    """
    from megatron_smp.models.gpt import GPTModel
    from megatron_smp.models.hf import family_of, get_adapter
    from megatron_smp.models.sharding import expert_parallel_shard, shard_state_dict
    from megatron_smp.transformer.utils import init_rng_scope

    if not _initialized:
        init()
    parallel_state = state.parallel_state
    if parallel_state.pp_size > 1:
        raise ConfigError(
            "transform supports tensor, context (and data) parallelism; "
            "pipeline_parallel_degree must be 1 here"
        )
    adapter = get_adapter(model)
    family = family_of(model)
    transformer_config = adapter.config_from_hf(model.config)
    moe_config = config if isinstance(config, MoEConfig) else None
    if moe_config is not None:
        if transformer_config.num_moe_experts is None:
            raise ConfigError(
                f"transform(config=MoEConfig(...)): {type(model).__name__} has no experts; "
                "pass a dict of TransformerConfig overrides for a dense model"
            )
        config = moe_config.transformer_overrides()
    overrides = dict(config or {})
    unknown = sorted(k for k in overrides if not hasattr(transformer_config, k))
    if unknown:
        raise ConfigError(f"transform: unknown transformer config key(s) {unknown}")
    if dtype is None:
        source = next(model.parameters(), None)
        dtype = source.dtype if source is not None and source.is_floating_point() else torch.float32
    overrides.setdefault("cp_comm_type", cp_comm_type or state.config.get("cp_comm_type", "p2p"))
    overrides.setdefault("params_dtype", dtype)
    overrides.setdefault("bf16", dtype == torch.bfloat16)
    overrides.setdefault("fp16", dtype == torch.float16)
    transformer_config = transformer_config.replace(**overrides)
    device = torch.device(device) if device is not None else parallel_state.device
    outside_rank0_tp_group = 0 not in parallel_state.group_ranks["tp"]
    if _has_meta(model) and (not load_state_dict_from_rank0 or outside_rank0_tp_group):
        # Delayed initialisation: the transformed model stays on the meta device too, and
        # DelayedParamIniter materialises it shard by shard (see smp.fully_shard); with
        # load_state_dict_from_rank0, fully_shard(sync_module_states=True) then gives these
        # ranks rank 0's TP group's weights.
        device = torch.device("meta")

    seed = moe_config.random_seed if moe_config is not None else None
    with init_rng_scope(seed):
        module = GPTModel(transformer_config, parallel_state, device=device)
    module.train(model.training)

    full = None
    if load_state_dict_from_rank0:
        tp_ranks = parallel_state.group_ranks["tp"]
        if 0 in tp_ranks:
            if state.rank == 0:
                if _has_meta(model):
                    raise ConfigError(
                        "transform(load_state_dict_from_rank0=True): rank 0's model has "
                        "parameters on the meta device; rank 0 must hold real weights"
                    )
                full = adapter.from_hf(model.state_dict(), transformer_config)
            full = _broadcast_state_dict(
                full, 0, parallel_state.tp_group, collective_device(parallel_state.tp_group)
            )
        elif not _has_meta(model):
            full = adapter.from_hf(model.state_dict(), transformer_config)
    elif not _has_meta(model):
        full = adapter.from_hf(model.state_dict(), transformer_config)

    if full is not None:
        shard = shard_state_dict(
            full, transformer_config, parallel_state.tp_size, parallel_state.tp_rank
        )
        if transformer_config.num_moe_experts is not None:
            shard = expert_parallel_shard(shard, transformer_config.num_moe_experts,
                                          parallel_state.ep_size, parallel_state.ep_rank)
        module.load_state_dict(shard, strict=True)

    transformed = TransformedModel(module, family)
    transformed.loaded_from_rank0 = load_state_dict_from_rank0
    return transformed


def _sync_from_rank0_tp_group(parallel_state):
    """A `before_shard(unit)` that copies each unsharded parameter and buffer of a unit from
    the rank of rank 0's TP group with this rank's TP rank (FSDP's `sync_module_states`)."""
    import torch.distributed as dist

    group = parallel_state.dp_cp_group
    source = min(parallel_state.group_ranks["dp_cp"])
    if source >= parallel_state.tp_size:
        raise ConfigError(
            "fully_shard(sync_module_states=True) copies weights from rank 0's tensor-parallel "
            f"group, but this rank's replicas start at rank {source}: use "
            "pipeline_parallel_degree 1 and expert_parallel_degree 1"
        )

    def before_shard(unit: torch.nn.Module) -> None:
        from torch.distributed.tensor import DTensor

        tensors = [t for t in list(unit.parameters()) + list(unit.buffers())
                   if not isinstance(t, DTensor)]
        if any(t.is_meta for t in tensors):
            raise ConfigError(
                "fully_shard(sync_module_states=True): a module is still on the meta device "
                "when its weights are copied; pass param_init_fn="
                "DelayedParamIniter(model).get_param_init_fn()"
            )
        for tensor in tensors:
            dist.broadcast(tensor.data, source, group=group)

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
    * `allow_empty_shards`: false refuses a parameter some shard rank would hold none of.
    * `fsdp_cache_flush_warnings`: warn when the CUDA allocator flushed its cache in a step.
    * `activation_offloading` (with checkpointing): `sm_activation_offloading` true moves each
      checkpointed layer's saved inputs to host memory, at most `activation_loading_horizon`
      layers loaded back at once; false uses torch's own `offload_wrapper` (every saved
      tensor to host, no horizon).
    `mixed_precision`: the compute dtype (bf16) over fp32 sharded params, fp32 reduction.
    `param_init_fn`: `DelayedParamIniter(model).get_param_init_fn()` for a meta model.
    `sync_module_states`: every rank takes the weights of the rank of rank 0's TP group with
      its TP rank, unit by unit before sharding (needed after
      `transform(load_state_dict_from_rank0=True)` when there are data-parallel replicas;
      meta models elsewhere are materialised by `param_init_fn` first, default
      `DelayedParamIniter`).
    Returns the sharded model (the same object, or torch's offload wrapper around it).
    """
    from megatron_smp.distributed.activation_offload import ActivationOffloader
    from megatron_smp.distributed.fsdp import fully_shard_model

    if not _initialized:
        init()
    parallel_state = state.parallel_state
    before_shard = None
    if sync_module_states:
        before_shard = _sync_from_rank0_tp_group(parallel_state)
        if param_init_fn is None:
            from megatron_smp.distributed.delayed_init import DelayedParamIniter

            param_init_fn = DelayedParamIniter(model).get_param_init_fn()
    elif getattr(model, "loaded_from_rank0", False) and parallel_state.dp_cp_size > 1:
        raise ConfigError(
            "the model was transformed with load_state_dict_from_rank0=True, so only rank 0's "
            "tensor-parallel group holds its weights: pass sync_module_states=True to "
            "fully_shard so the other data-parallel ranks get them"
        )
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
        allow_empty_shards=state.allow_empty_shards, param_init_fn=param_init_fn,
        activation_checkpointing=activation_checkpointing or activation_offloading,
        activation_offloader=offloader,
        cache_flush_warnings=state.fsdp_cache_flush_warnings, before_shard=before_shard,
    )
    model.activation_offloader = offloader
    if native_offload:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import offload_wrapper

        model = offload_wrapper(model)
    return model


__all__ = ["init", "is_initialized", "state", "transform", "TransformedModel", "SMPState",
           "MoEConfig", "fully_shard"]
