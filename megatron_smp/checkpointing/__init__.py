"""Training-facing checkpoints (iteration directories, tracker file, RNG states).

The engine underneath is `megatron_smp.distributed.checkpoint` (DCP with resharding). In a
training loop:

    state_dict = {"model": sharded_state_dict(model, state), "optimizer": ..., "args": {...}}
    save_checkpoint(iteration, state_dict, cfg.save, state, async_save=cfg.async_save,
                    config=all_configs, ckpt_format=cfg.ckpt_format, save_rng=not cfg.no_save_rng)
    prepare_async_staging(state_dict)            # once state exists: warm the staging memory
    wait_for_staging()                           # with stage_in_background=True: before
                                                 # the tensors are next modified (step)
    maybe_finalize_async_calls(blocking=False)   # every iteration, on every rank (collective)
    maybe_finalize_async_calls(blocking=True)    # before exit / destroy_process_group: an
                                                 # unfinalised save is written but never current
    iteration = load_checkpoint(state_dict, cfg.load, state, load_rng=not cfg.no_load_rng)
"""
from megatron_smp.checkpointing.checkpointing import (
    CHECKPOINT_FORMATS,
    COMMON_FILENAME,
    STAGING_SUFFIX,
    TRACKER_FILENAME,
    checkpoint_dir,
    complete_iterations,
    load_checkpoint,
    prepare_async_staging,
    read_tracker,
    save_checkpoint,
    tracker_path,
)
from megatron_smp.checkpointing.rng import get_rng_state, set_rng_state
from megatron_smp.distributed.checkpoint import (
    CheckpointError,
    maybe_finalize_async_calls,
    sharded_state_dict,
    wait_for_staging,
)

__all__ = [
    "save_checkpoint",
    "prepare_async_staging",
    "load_checkpoint",
    "maybe_finalize_async_calls",
    "wait_for_staging",
    "read_tracker",
    "complete_iterations",
    "checkpoint_dir",
    "tracker_path",
    "get_rng_state",
    "set_rng_state",
    "sharded_state_dict",
    "CheckpointError",
    "CHECKPOINT_FORMATS",
    "TRACKER_FILENAME",
    "COMMON_FILENAME",
    "STAGING_SUFFIX",
]
