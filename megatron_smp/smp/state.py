"""`megatron_smp.smp.state` (torch.sagemaker's `state`) and `init` / `is_initialized`.

`megatron_smp.smp.state` is the `SMPState` object (as `torch.sagemaker.state` is); this
module, which defines it, stays importable by name (`from megatron_smp.smp.state import
SMPState`).
"""
from __future__ import annotations

import os
from typing import Any, Dict, Optional, Union

from megatron_smp.config import ConfigError
from megatron_smp.parallel_state import ParallelState, create_parallel_state, launcher_world_size
from megatron_smp.smp.keys import _SMP_KEYS, parse_smp_config


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


def init(config: Union[None, str, os.PathLike, Dict[str, Any]] = None) -> None:
    """Initialise SMP from a dict or JSON file of SMP v2 keys (see `_SMP_KEYS`).

    Validates everything before the first collective (ConfigError on every rank), builds the
    ParallelState, seeds the default and tensor-parallel RNG streams from `random_seed`, and
    fills `smp.state`. Calling it again re-initialises with the new config.

    From then on torch's own FSDP entry points (FullyShardedDataParallel, fully_shard,
    offload_wrapper) follow the keys: see `smp.torch_fsdp`. SMP v1 keys are mapped or refused
    by `smp.v1_config`.

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
    pipeline_only = sorted(set(values["v1"]) & {"microbatches", "pipeline"})
    if pipeline_only:
        raise ConfigError(
            f"smp.init: SMP v1 key(s) {pipeline_only} configure v1's pipeline; SMP v2 scripts "
            "have none (transform needs pipeline_parallel_degree 1): accumulate gradients in "
            "your script, or train with pretrain_gpt.py --smp-config, which maps them to its "
            "microbatches and --pipeline-schedule"
        )
    parallel_state = create_parallel_state(parallel_config)
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
    # torch's own FSDP entry points follow these keys from now on (see smp.torch_fsdp).
    from megatron_smp.smp.torch_fsdp import install

    install(lambda: state if is_initialized() else None)


def is_initialized() -> bool:
    return _initialized


def is_initialized() -> bool:
    """Whether `init` has run in this process."""
    return _initialized
