"""Checkpoints: the one home of saving and loading, in four layers (imports point down).

    loop.py            the training loop's checkpoints of a run: what `pretrain` saves and
                       restores (model, optimizer, scheduler, progress, RNG) and when
                       (save / load / prepare_async_save / wait_for_staging / poll /
                       finalize); Megatron's checkpoint flags; Megatron-LM checkpoints on load
    sharded_state.py   model and optimizer state as sharded views in the global (TP=1,
    rng.py             one-stage) form, so a checkpoint loads at any layout; RNG states
    megatron_lm.py     Megatron-LM's own formats (megatron-core torch_dist, legacy
                       mp_rank_XX files), read and written in our global names
    iterations.py      iteration checkpoints on disk: iter_NNNNNNN directories, the tracker
                       file, publishing by rename, the "torch_dist" and "torch" formats
    engine/            the distributed-checkpoint engine, SMP v2's save / async_save / load on
                       PyTorch DCP (knows no model or training): storage.py (files, per-item
                       CRC-32s, safe unpickling), sharded_tensor.py (ShardedTensorView),
                       saver.py, loader.py, async_queue.py (background writes and their
                       finalisation), agreement.py (errors raised on every rank)

`megatron_smp.smp.distributed.checkpoint` re-exports the engine under SMP v2's module names.
What this package exports is the iteration layer's, for a loop of one's own:

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
from megatron_smp.checkpointing.engine import (
    CheckpointError,
    maybe_finalize_async_calls,
    sharded_state_dict,
    wait_for_staging,
)
from megatron_smp.checkpointing.iterations import (
    CHECKPOINT_FORMATS,
    COMMON_FILENAME,
    STAGING_SUFFIX,
    TRACKER_FILENAME,
    checkpoint_dir,
    complete_iterations,
    SavedCheckpoint,
    load_checkpoint,
    prepare_async_staging,
    read_saved_checkpoint,
    read_tracker,
    save_checkpoint,
    tracker_path,
    wait_for_deletions,
)
from megatron_smp.checkpointing.rng import get_rng_state, set_rng_state

__all__ = [
    "save_checkpoint",
    "prepare_async_staging",
    "load_checkpoint",
    "read_saved_checkpoint",
    "SavedCheckpoint",
    "maybe_finalize_async_calls",
    "wait_for_staging",
    "read_tracker",
    "complete_iterations",
    "checkpoint_dir",
    "tracker_path",
    "wait_for_deletions",
    "get_rng_state",
    "set_rng_state",
    "sharded_state_dict",
    "CheckpointError",
    "CHECKPOINT_FORMATS",
    "TRACKER_FILENAME",
    "COMMON_FILENAME",
    "STAGING_SUFFIX",
]
