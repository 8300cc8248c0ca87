"""SMP v1 config keys (`smdistributed.modelparallel` "parameters") in an SMP v2 / our config.

Each v1 key either maps to its v2 key or our setting, with one log line saying so, or is a
ConfigError naming what replaces it. The estimator's wrapper ({"enabled": true, "parameters":
{...}}) is unwrapped.

  partitions                 -> pipeline_parallel_degree (v1's alias)
  pipeline_parallel_degree, tensor_parallel_degree, shard_optimizer_state: the same v2 keys
  microbatches               -> the training scripts' number of microbatches (global batch =
                                --micro-batch-size x data-parallel size x microbatches);
                                a script of your own accumulates gradients itself: error in init
  pipeline simple|interleaved -> --pipeline-schedule (GPipe | 1F1B); init: error, as above
  optimize speed|memory      -> sequence parallelism off|on (v1's "memory" distributes the
                                layer norms and keeps no duplicate activations over TP ranks)
  ddp                        -> data parallelism over the remaining ranks is always on; false is
                                an error when there are data-parallel replicas
  placement_strategy         -> accepted where it gives our rank layout (Megatron's: TP ranks
                                adjacent, then data parallel, then pipeline = v1's "PDT"); for
                                the degrees given, "cluster" (= "DPT") and "spread" (= "TPD")
                                are compared letter by letter over the degrees > 1
"""
from __future__ import annotations

import logging
from typing import Any, Dict, Tuple

from megatron_smp.config import ConfigError

logger = logging.getLogger("megatron_smp.smp")

# v1 keys handled here; their values land in the v2 values under these names.
V1_KEYS = ("partitions", "microbatches", "pipeline", "optimize", "ddp", "placement_strategy")

# v1 keys with no equivalent: the error names what replaces them.
V1_REPLACED: Dict[str, str] = {
    "auto_partition": "pipeline stages split the layers evenly (pipeline_parallel_degree in "
                      "the training scripts; --decoder-first/last-pipeline-num-layers)",
    "default_partition": "pipeline stages split the layers evenly (see auto_partition)",
    "active_microbatches": "the 1F1B schedule keeps at most pipeline_parallel_degree "
                           "microbatches in flight",
    "memory_weight": "pipeline stages split the layers evenly (see auto_partition)",
    "contiguous": "pipeline stages are contiguous layer ranges",
    "deterministic_server": "the schedules are static and deterministic",
    "horovod": "torch.distributed (FSDP / our DDP)",
    "fp16": "transform(dtype=torch.float16) or torch FSDP MixedPrecision",
    "bf16": "transform(dtype=torch.bfloat16) or torch FSDP MixedPrecision",
    "fp16_params": "transform(dtype=...)",
    "offload_activations": "sm_activation_offloading with torch's offload_wrapper",
    "delayed_parameter_initialization": "torch.sagemaker.delayed_param.DelayedParamIniter "
                                        "(megatron_smp.smp.delayed_param)",
    "sharded_data_parallel_degree": "hybrid_shard_degree",
    "sdp_reduce_bucket_size": "torch FSDP's own bucketing",
    "sdp_param_persistence_threshold": "torch FSDP's own bucketing",
    "sdp_max_live_parameters": "torch FSDP's forward_prefetch / limit_all_gathers",
    "sdp_hierarchical_allgather": "hybrid_shard_degree",
    "sdp_gradient_clipping": "torch.nn.utils.clip_grad_norm_ / FSDP's clip_grad_norm_",
    "prescaled_batch": "transform's model takes the same batch on every TP rank (v1's "
                       "prescaled_batch: true behaviour)",
    "skip_tracing": "nothing to skip: there is no tracing step",
}

_ORDER = "PDT"  # our rank layout in v1's notation: left-most varies slowest


def unwrap_estimator_options(config: Dict[str, Any]) -> Dict[str, Any]:
    """{"enabled": true, "parameters": {...}} (v1's estimator options) -> the parameters."""
    if "parameters" in config and set(config) <= {"enabled", "parameters"}:
        if config.get("enabled", True) is not True:
            raise ConfigError("smp config: the v1 options say enabled: false; pass the "
                              "parameters of an enabled configuration")
        logger.warning("smp: v1 estimator options: using their \"parameters\"")
        return dict(config["parameters"])
    return config


def translate_v1_keys(user: Dict[str, Any]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """Split a user config into (v2 keys, v1 settings). `partitions` becomes
    `pipeline_parallel_degree`; the other v1 keys are checked and returned normalised:
    microbatches (int), pipeline ("simple"|"interleaved"), sequence_parallel (bool, from
    optimize), ddp (bool), placement_strategy (a permutation of "DPT")."""
    user = unwrap_estimator_options(dict(user))
    for key in user:
        if key in V1_REPLACED:
            raise ConfigError(f"smp config: SMP v1 key {key!r} has no equivalent here; "
                              f"use {V1_REPLACED[key]}")
    v1 = {key: user.pop(key) for key in V1_KEYS if key in user}
    settings: Dict[str, Any] = {}
    if "partitions" in v1:
        partitions = v1["partitions"]
        given = user.get("pipeline_parallel_degree", partitions)
        if given != partitions:
            raise ConfigError(
                f"smp config: partitions ({partitions}) and pipeline_parallel_degree ({given}) "
                "disagree; partitions is v1's name for pipeline_parallel_degree: give one"
            )
        user["pipeline_parallel_degree"] = partitions
        logger.warning("smp: v1 key partitions=%r -> pipeline_parallel_degree", partitions)
    if "microbatches" in v1:
        count = v1["microbatches"]
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ConfigError(f"smp config: microbatches must be a positive integer, got {count!r}")
        settings["microbatches"] = count
    if "pipeline" in v1:
        if v1["pipeline"] not in ("simple", "interleaved"):
            raise ConfigError("smp config: pipeline must be \"simple\" or \"interleaved\", got "
                              f"{v1['pipeline']!r}")
        settings["pipeline"] = v1["pipeline"]
    if "optimize" in v1:
        if v1["optimize"] not in ("speed", "memory"):
            raise ConfigError("smp config: optimize must be \"speed\" or \"memory\", got "
                              f"{v1['optimize']!r}")
        settings["sequence_parallel"] = v1["optimize"] == "memory"
        logger.warning("smp: v1 key optimize=%r -> sequence parallelism %s", v1["optimize"],
                       "on" if settings["sequence_parallel"] else "off")
    if "ddp" in v1:
        if not isinstance(v1["ddp"], bool):
            raise ConfigError(f"smp config: ddp must be true or false, got {v1['ddp']!r}")
        settings["ddp"] = v1["ddp"]
    if "placement_strategy" in v1:
        value = v1["placement_strategy"]
        letters = {"cluster": "DPT", "spread": "TPD"}.get(value, value)
        if not isinstance(letters, str) or sorted(letters) != ["D", "P", "T"]:
            raise ConfigError(
                "smp config: placement_strategy must be \"cluster\", \"spread\" or a "
                f"permutation of \"DPT\", got {value!r}"
            )
        settings["placement_strategy"] = (value, letters)
    return user, settings


def check_v1_layout(settings: Dict[str, Any], sizes: Dict[str, int]) -> None:
    """The v1 settings that depend on the degrees: `ddp` false with data-parallel replicas,
    and a `placement_strategy` whose rank layout is not ours. `sizes`: {"D", "P", "T"}."""
    if settings.get("ddp") is False and sizes["D"] > 1:
        raise ConfigError(
            f"smp config: ddp false, but there are {sizes['D']} data-parallel replicas (v1 "
            "required ddp: true for hybrid model/data parallelism); drop the key"
        )
    if "ddp" in settings:
        logger.warning("smp: v1 key ddp=%r -> data parallelism over the %d replica(s) is always "
                       "on (torch FSDP in your script, our DDP in the training scripts)",
                       settings["ddp"], sizes["D"])
    if "placement_strategy" in settings:
        value, letters = settings["placement_strategy"]
        theirs = [letter for letter in letters if sizes[letter] > 1]
        ours = [letter for letter in _ORDER if sizes[letter] > 1]
        if theirs != ours:
            raise ConfigError(
                f"smp config: placement_strategy {value!r} ({letters}) places ranks "
                f"differently from ours for these degrees: ours is {_ORDER!r} (tensor-parallel "
                "ranks adjacent, then data parallel, then pipeline stages); use \"PDT\" or "
                "drop the key"
            )
        logger.warning("smp: v1 key placement_strategy=%r -> our rank layout (%s), the same "
                       "for these degrees", value, _ORDER)


__all__ = ["V1_KEYS", "V1_REPLACED", "translate_v1_keys", "check_v1_layout",
           "unwrap_estimator_options"]
