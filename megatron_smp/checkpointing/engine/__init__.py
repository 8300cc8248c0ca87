"""The distributed-checkpoint engine (the bottom layer of `megatron_smp.checkpointing`):
SMP v2's save / async_save / load on PyTorch DCP. It knows tensors and files, not models or
training.

    from megatron_smp.checkpointing import engine as dcp
    dcp.save(state_dict, checkpoint_id=path)                     # every rank writes its shards
    dcp.async_save(state_dict, checkpoint_id=path)               # returns after a CPU copy
    dcp.async_save(state_dict, checkpoint_id=path, stage_in_background=True)  # returns at once,
    dcp.wait_for_staging()                                       # ... until here (before step)
    dcp.prepare_staging(state_dict)                              # warm staging memory early
    dcp.maybe_finalize_async_calls(blocking=False)               # once per training step
    dcp.load(state_dict, checkpoint_id=path)                     # in place, resharding

Sharded tensors are described with `ShardedTensorView` (see sharded_tensor.py for why).
"""
from megatron_smp.checkpointing.engine.async_queue import (
    DEFAULT_ASYNC_QUEUE,
    AsyncCallsQueue,
    AsyncRequest,
    maybe_finalize_async_calls,
    wait_for_staging,
)
from megatron_smp.checkpointing.engine.sharded_tensor import (
    ShardedTensorView,
    flat_sharded_tensor,
    local_to_global_blocks,
    make_sharded_tensor,
    sharded_state_dict,
    tp_sharded_tensor,
)
from megatron_smp.checkpointing.engine.loader import (
    check_keys_against_checkpoint,
    load,
    read_checkpoint_metadata,
)
from megatron_smp.checkpointing.engine.saver import (
    async_save,
    prepare_staging,
    save,
    schedule_staged_write,
    stage_to_cpu,
)
from megatron_smp.checkpointing.engine.storage import (
    CheckpointError,
    SafeFileSystemReader,
    SafeLoadPlanner,
    read_dcp_metadata,
)

__all__ = [
    "save",
    "async_save",
    "maybe_finalize_async_calls",
    "wait_for_staging",
    "load",
    "AsyncCallsQueue",
    "AsyncRequest",
    "DEFAULT_ASYNC_QUEUE",
    "ShardedTensorView",
    "make_sharded_tensor",
    "local_to_global_blocks",
    "tp_sharded_tensor",
    "flat_sharded_tensor",
    "sharded_state_dict",
    "stage_to_cpu",
    "prepare_staging",
    "schedule_staged_write",
    "check_keys_against_checkpoint",
    "read_checkpoint_metadata",
    "read_dcp_metadata",
    "CheckpointError",
    "SafeFileSystemReader",
    "SafeLoadPlanner",
]
