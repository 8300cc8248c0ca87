"""SMP v2 config keys: their types and defaults, reading a dict or JSON file, and checking
each key (and the degrees together) before anything collective happens."""
from __future__ import annotations

import json
import os
from typing import Any, Dict, Union

from megatron_smp.config import CP_COMM_TYPES, ConfigError, ParallelConfig, not_supported

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
    from megatron_smp.smp.v1_config import translate_v1_keys

    user, v1_settings = translate_v1_keys(_read_config(config))
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
    if (values["hybrid_shard_degree"] >= 1
            and values["context_parallel_degree"] > values["hybrid_shard_degree"]):
        # The reference: context_parallel_degree <= hybrid_shard_degree (a shard group holds
        # whole context-parallel groups); 0 means every dp x cp rank, which always does.
        raise ConfigError(
            f"smp config: context_parallel_degree ({values['context_parallel_degree']}) must be "
            f"<= hybrid_shard_degree ({values['hybrid_shard_degree']})"
        )
    # SMP v1 settings (see smp.v1_config), normalised; {} for a v2 config.
    values["v1"] = v1_settings
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
    if values["v1"]:
        from megatron_smp.smp.v1_config import check_v1_layout

        tp, pp = values["tensor_parallel_degree"], values["pipeline_parallel_degree"]
        check_v1_layout(values["v1"], {"T": tp, "P": pp, "D": world_size // (tp * pp)})
    return given, values, parallel_config
