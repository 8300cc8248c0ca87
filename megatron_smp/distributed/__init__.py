"""Data parallelism: contiguous param/grad buffers, bucketed and overlapped grad reduction."""
from megatron_smp.distributed.distributed_data_parallel import DistributedDataParallel
from megatron_smp.distributed.finalize_model_grads import (
    allreduce_embedding_grads,
    allreduce_sequence_parallel_grads,
    finalize_model_grads,
)
from megatron_smp.distributed.param_and_grad_buffer import (
    Bucket,
    ParamAndGradBuffer,
    balanced_bucket_boundaries,
)

__all__ = [
    "DistributedDataParallel",
    "ParamAndGradBuffer",
    "Bucket",
    "balanced_bucket_boundaries",
    "finalize_model_grads",
    "allreduce_sequence_parallel_grads",
    "allreduce_embedding_grads",
]
