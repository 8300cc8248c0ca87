"""torch.sagemaker.distributed.checkpoint.state_dict_saver: DCP save, asynchronous save and its
finalisation, on the framework's checkpoint engine."""
from megatron_smp.checkpointing.engine.async_queue import maybe_finalize_async_calls
from megatron_smp.checkpointing.engine.saver import (
    PyTorchDistSaveShardedStrategy, async_save, save,
)

__all__ = ["save", "async_save", "maybe_finalize_async_calls", "PyTorchDistSaveShardedStrategy"]
