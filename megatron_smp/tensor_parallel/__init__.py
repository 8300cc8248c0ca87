"""Tensor parallelism: communication mappings, parallel layers, vocab-parallel loss, RNG."""
from megatron_smp.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_smp.tensor_parallel.layers import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from megatron_smp.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megatron_smp.tensor_parallel.random import (
    DATA_PARALLEL_RNG,
    EXPERT_PARALLEL_RNG,
    MODEL_PARALLEL_RNG,
    RNGStatesTracker,
    checkpoint,
    dropout,
    get_rng_tracker,
    model_parallel_seed,
)
from megatron_smp.tensor_parallel.utils import (
    divide,
    init_method_normal,
    output_init_method,
    hidden_init_method,
    param_is_not_tensor_parallel_duplicate,
    scaled_init_method_normal,
    set_defaults_if_not_set_tensor_model_parallel_attributes,
    set_tensor_model_parallel_attributes,
)

__all__ = [
    "ColumnParallelLinear",
    "ReplicatedLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "copy_to_tensor_model_parallel_region",
    "gather_from_sequence_parallel_region",
    "gather_from_tensor_model_parallel_region",
    "reduce_from_tensor_model_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tensor_model_parallel_region",
    "vocab_parallel_cross_entropy",
    "DATA_PARALLEL_RNG",
    "EXPERT_PARALLEL_RNG",
    "MODEL_PARALLEL_RNG",
    "RNGStatesTracker",
    "checkpoint",
    "dropout",
    "get_rng_tracker",
    "model_parallel_seed",
    "divide",
    "init_method_normal",
    "param_is_not_tensor_parallel_duplicate",
    "output_init_method",
    "hidden_init_method",
    "scaled_init_method_normal",
    "set_defaults_if_not_set_tensor_model_parallel_attributes",
    "set_tensor_model_parallel_attributes",
]
