"""The training loop's checkpoints: what a run saves and restores, and when (the top layer of
`megatron_smp.checkpointing`). Every function takes a `record.CheckpointRecord` -- the parts
a run checkpoints and its progress counters -- never the run itself:

    checkpointing.load(record)           # before the data loaders: restores the model,
                                         # optimizer, scheduler, progress counters and RNG
    checkpointing.save(record)           # at --save-interval and at the end
    checkpointing.prepare_async_save(record)  # after the first step: warms --async-save's memory
    checkpointing.wait_for_staging(record)  # in train_step, before optimizer.step()
    checkpointing.poll(record)           # every iteration: publishes finished async saves
    checkpointing.finalize(record)       # at exit: waits for the last async save (and the
                                         # deletions of --save-retain-interval)

A checkpoint holds (see megatron_smp.checkpointing.sharded_state for the tensors' form)

    model                  {global parameter name: tensor in its TP=1 shape}
    optimizer              {"state": {name: {fp32_param, exp_avg, exp_avg_sq, step}},
                            "grad_scaler": {...}}   (absent from model-only checkpoints)
    opt_param_scheduler    the scheduler's position and shape (lr, min lr, warm-up and decay
                           iterations, decay style), compared with the flags on load
    iteration, consumed_train_samples, skipped_iterations, nan_iterations
    rng_state              per rank, written by the engine

"torch_dist" checkpoints load at any tensor / pipeline / data-parallel layout, with or
without the distributed optimizer; "torch" ones (a file per rank) only at the saving layout.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any, Callable, Dict, List, Optional, Set

import torch
import torch.distributed as dist

from megatron_smp.checkpointing import (
    COMMON_FILENAME,
    CheckpointError,
    SavedCheckpoint,
    checkpoint_dir,
    complete_iterations,
    load_checkpoint,
    maybe_finalize_async_calls,
    prepare_async_staging,
    read_saved_checkpoint,
    read_tracker,
    save_checkpoint,
    tracker_path,
    wait_for_deletions,
)
from megatron_smp.checkpointing.record import (
    PROGRESS_KEYS,
    CheckpointRecord,
    LoraBase,
    Progress,
)
from megatron_smp.checkpointing.sharded_state import (
    finish_optimizer_load,
    model_sharded_state_dict,
    optimizer_sharded_state_dict,
)
from megatron_smp.checkpointing.megatron_lm import (
    CHECKPOINT_VERSION,
    LEGACY_FILENAME,
    args_from_config,
    config_fields_from_args,
    describe,
    extra_state_names,
    find_megatron_checkpoint,
    read_args,
    read_model,
    trim_vocab_rows,
)
from megatron_smp.config import FUNCTION_FIELDS, ConfigError, TransformerConfig
from megatron_smp.checkpointing.engine.agreement import (
    collective_device,
    is_distributed,
    raise_if_any_rank_failed,
)
from megatron_smp.checkpointing.engine.async_queue import DEFAULT_ASYNC_QUEUE
from megatron_smp.config.errors import format_listing

# common.json's config key naming the base checkpoint of a small LoRA checkpoint:
# {"load": absolute directory, "iteration": N}; its "model" holds only the adapters.
LORA_BASE_KEY = "lora_base"
# Megatron's --dist-ckpt-strictness values (megatron.core.dist_checkpointing StrictHandling).
STRICTNESS_CHOICES = ("assume_ok_unexpected", "log_unexpected", "log_all", "raise_unexpected",
                      "raise_all", "return_unexpected", "return_all", "ignore_all")
# TransformerConfig fields that belong to the run rather than to the model a checkpoint holds:
# precision, dropout, initialisation, recomputation,
# sequence parallelism, kernels and the MoE / MTP training knobs. --use-checkpoint-args takes
# every other field from the checkpoint (a field added later is architecture unless listed).
RUN_FIELDS = frozenset((
    "fp16", "bf16", "params_dtype", "hidden_dropout", "attention_dropout",
    "init_method_std", "use_scaled_init_method", "embedding_init_method_std",
    "init_method_xavier_uniform", "gradient_accumulation_fusion",
    "sequence_parallel", "recompute_granularity", "recompute_method", "recompute_num_layers",
    "recompute_modules", "cp_comm_type", "packed_attention", "moe_router_bias_update_rate",
    "moe_router_dtype", "moe_router_load_balancing_type", "moe_aux_loss_coeff",
    "moe_z_loss_coeff", "moe_input_jitter_eps", "moe_token_dispatcher_type",
    "moe_expert_capacity_factor", "moe_pad_expert_input_to_capacity", "moe_token_drop_policy",
    "moe_grouped_gemm", "mtp_loss_scaling_factor", "mamba_chunk_size", "linear_chunk_size",
))
CHECKPOINT_ARGS_FIELDS = tuple(field.name for field in dataclasses.fields(TransformerConfig)
                               if field.name not in RUN_FIELDS)


def model_vocab_size(saved: int, tokenizer_vocab_size: int) -> int:
    """The model's vocabulary: the tokenizer's, or a checkpoint's larger one (restored by
    --use-checkpoint-args). Hugging Face models often have more embedding rows than their
    tokenizer has ids (Qwen2.5: 152,064 for 151,665); the extra rows are kept, so the logits
    and greedy choices are the checkpoint's own."""
    return max(saved or 0, tokenizer_vocab_size)


def check_checkpoint_flags(config) -> None:
    """Checkpoint flags that contradict each other (pure; before any collective)."""
    retain = config.save_retain_interval
    if retain is not None:
        # Megatron-LM asserts both (validate_args).
        if retain <= 0:
            raise ConfigError(f"--save-retain-interval must be positive, got {retain}")
        if config.save and config.save_interval and retain % config.save_interval:
            raise ConfigError(
                f"--save-retain-interval {retain} must be a multiple of --save-interval "
                f"{config.save_interval} (the retained checkpoints are among those saved)")
    if config.dist_ckpt_optim_fully_reshardable and config.ckpt_format == "torch":
        raise ConfigError(
            "--dist-ckpt-optim-fully-reshardable asks for an optimizer state that loads at any "
            "TP/PP/DP layout; --ckpt-format torch writes one file per rank, loadable only at "
            "the saving layout. Use --ckpt-format torch_dist (always fully reshardable here)"
        )


def checkpoint_model_fields(load_dir: Optional[str],
                            pretrained: Optional[str] = None) -> Dict[str, Any]:
    """--use-checkpoint-args: the model fields saved with the checkpoint in `load_dir`
    (Megatron-LM's pickled args, or our common.json's model config); those of
    --pretrained-checkpoint `pretrained` when --load holds no checkpoint yet."""
    if pretrained and not (load_dir and (os.path.isfile(tracker_path(load_dir))
                                         or find_megatron_checkpoint(load_dir) is not None)):
        load_dir = pretrained
    if not load_dir:
        raise ConfigError("--use-checkpoint-args reads the model shape from the --load "
                          "checkpoint: add --load DIR")
    megatron = find_megatron_checkpoint(load_dir)
    if megatron is not None:
        args = read_args(megatron)
        if args is None:
            raise ConfigError(f"--use-checkpoint-args: {describe(megatron)} was saved without "
                              "args; give the model flags instead")
        fields = config_fields_from_args(args)
    else:
        if not os.path.isfile(tracker_path(load_dir)):
            raise ConfigError(f"--use-checkpoint-args: --load {load_dir} holds no checkpoint "
                              f"({os.path.basename(tracker_path(load_dir))} is missing)")
        path = os.path.join(checkpoint_dir(load_dir, read_tracker(load_dir)), COMMON_FILENAME)
        with open(path) as handle:
            fields = (json.load(handle).get("config") or {}).get("model")
        if not isinstance(fields, dict):
            raise ConfigError(f"--use-checkpoint-args: {path} holds no model config")
        if isinstance(fields.get("window_size"), list):
            fields["window_size"] = tuple(fields["window_size"])
    return {name: fields[name] for name in CHECKPOINT_ARGS_FIELDS if name in fields}


def check_key_mismatch(strictness: str, unexpected: List[str], missing: List[str],
                       where: str) -> List[str]:
    """Megatron's --dist-ckpt-strictness on load. `unexpected`: the model has them, the
    checkpoint not (they keep their initial values unless that raises); `missing`: the
    checkpoint has them, the model not. Raises, or returns the warnings to print."""
    if unexpected and strictness in ("assume_ok_unexpected", "raise_unexpected", "raise_all"):
        raise CheckpointError(
            f"{where} lacks tensors the model has: {format_listing(unexpected)}; check the "
            "model flags, or keep their initial values with --dist-ckpt-strictness "
            "log_unexpected (or ignore_all)")
    if missing and strictness == "raise_all":
        raise CheckpointError(
            f"{where} holds tensors the model lacks: {format_listing(missing)}; check the "
            "model flags, or skip them with --dist-ckpt-strictness log_all (or "
            "assume_ok_unexpected)")
    warnings = []
    if unexpected and strictness != "ignore_all":
        warnings.append(f"WARNING: {where} lacks {format_listing(unexpected)}: they keep "
                        f"their initial values (--dist-ckpt-strictness {strictness})")
    if missing and strictness in ("log_all", "return_all"):
        warnings.append(f"WARNING: {where} holds {format_listing(missing)}, which the model "
                        f"lacks: not loaded (--dist-ckpt-strictness {strictness})")
    return warnings



def _print_rank_0(record: CheckpointRecord, message: str) -> None:
    if record.state.rank == 0:
        print(message, flush=True)


def _is_adapter(name: str) -> bool:
    return ".lora.lora_" in name


def _state_dict(record: CheckpointRecord, tied_copies: bool, optimizer: bool, scheduler: bool,
                progress: bool) -> Dict[str, Any]:
    vocab_size = record.configs.model.vocab_size
    state_dict: Dict[str, Any] = {
        "model": model_sharded_state_dict(record.model, record.state, vocab_size, tied_copies)
    }
    if optimizer:
        state_dict["optimizer"] = optimizer_sharded_state_dict(
            record.optimizer, record.model, record.state, vocab_size, tied_copies
        )
    if scheduler:
        state_dict["opt_param_scheduler"] = record.scheduler.state_dict()
    if progress:
        state_dict.update(record.progress.as_dict())
    return state_dict


def _saved_state_dict(record: CheckpointRecord) -> Dict[str, Any]:
    """What a save writes (and --async-save stages)."""
    config = record.configs.checkpoint
    # DCP writes a key once, so the tied output copy (equal to the embedding) is left out; a
    # "torch" file holds exactly what its rank loads back.
    return _state_dict(record, tied_copies=config.ckpt_format == "torch",
                       optimizer=not config.no_save_optim, scheduler=True, progress=True)


# -- saving -----------------------------------------------------------------------------------


def save(record: CheckpointRecord) -> None:
    """Save iteration `record.iteration` to --save (collective). With --async-save, returns
    at once: the copy to CPU memory runs in the background until `wait_for_staging`, the write
    after it; an earlier async save is finished first."""
    config = record.configs.checkpoint
    if config.async_save:
        maybe_finalize_async_calls(blocking=True)
    # With --overlap-param-gather, the last step's all-gathers may still be writing params:
    # finish them now, so nothing but the next optimizer.step() modifies the saved tensors
    # (the next forward's pre-hooks then find no gather in flight).
    for chunk in record.model:
        if hasattr(chunk, "finish_param_sync"):
            chunk.finish_param_sync()
    start = time.perf_counter()
    state_dict = _saved_state_dict(record)
    saved_config = record.configs.to_dict()
    if record.configs.training.lora_rank and record.lora_base is not None:
        # A small checkpoint: the adapters (the only trainable tensors), their optimizer
        # state, scheduler, progress and RNG; the frozen base is named, not copied.
        state_dict["model"] = {name: view for name, view in state_dict["model"].items()
                               if _is_adapter(name)}
        saved_config[LORA_BASE_KEY] = {"load": record.lora_base[0],
                                       "iteration": record.lora_base[1]}
    if record.validates_results and record.rerun is not None:
        # --rerun-mode validate_results: the resumed job first reruns this iteration.
        (state_dict["rerun_iteration"], state_dict["rerun_device"],
         state_dict["rerun_injected"]) = map(int, record.rerun)
    save_checkpoint(
        record.iteration, state_dict, config.save, record.state,
        async_save=config.async_save,
        config=saved_config,
        ckpt_format=config.ckpt_format,
        save_rng=not config.no_save_rng,
        stage_in_background=config.async_save,
        # (Not for a small LoRA checkpoint: the legacy files would copy the whole model.)
        extra_files=(_megatron_legacy_files(record)
                     if config.ckpt_format == "torch" and LORA_BASE_KEY not in saved_config
                     else None),
        fully_parallel=config.ckpt_fully_parallel_save,
        writer_backend="gloo" if record.configs.parallel.use_gloo_process_groups else None,
        retain_interval=config.save_retain_interval,
    )
    how = "scheduled for an asynchronous write" if config.async_save else "saved"
    _print_rank_0(record, f"checkpoint of iteration {record.iteration} {how} to {config.save} "
                          f"in {time.perf_counter() - start:.2f} s")
    if record.on_saved is not None:  # --log-progress
        record.on_saved(record.iteration, record.progress.consumed_train_samples,
                        config.async_save)


def _megatron_legacy_files(record: CheckpointRecord) -> Dict[str, Any]:
    """--ckpt-format torch: besides our per-rank files (exact resume), the model in Megatron-LM's
    legacy layout, written by the first data-/context-parallel replica of each TP x PP (x EP)
    rank: mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt with args, iteration and the TP-local,
    stage-local state dict (our names are Megatron's). No optimizer or RNG states in it: it
    loads in Megatron-LM, or back here, with --finetune / --no-load-optim --no-load-rng."""
    state = record.state
    # The first dp x cp member of each expert-parallel group (ep ranks are consecutive there):
    # dp_rank = cp_rank = 0 without experts.
    if state.dp_cp_rank >= state.ep_size:
        return {}
    name = f"mp_rank_{state.tp_rank:02d}"
    if state.pp_size > 1:
        name += f"_{state.pp_rank:03d}"
    if state.ep_size > 1:
        name += f"_{state.ep_rank:03d}"
    args = args_from_config(record.configs.model, state.tp_size, state.pp_size,
                            record.iteration)
    args.consumed_train_samples = int(record.progress.consumed_train_samples)
    content: Dict[str, Any] = {"args": args, "checkpoint_version": CHECKPOINT_VERSION,
                               "iteration": int(record.iteration)}
    for index, chunk in enumerate(record.model):
        local = {key: tensor for key, tensor in chunk.state_dict().items()
                 if isinstance(tensor, torch.Tensor)}
        local.update({key: None for key in extra_state_names(list(local))})
        content["model" if len(record.model) == 1 else f"model{index}"] = local
    return {os.path.join(name, LEGACY_FILENAME): content}


def prepare_async_save(record: CheckpointRecord) -> None:
    """--async-save: allocate and write the CPU memory the saves stage into, in the
    background, so that the first save copies as fast as the later ones (local; once the
    optimizer state exists, i.e. after the first step, and before the first save)."""
    config = record.configs.checkpoint
    if config.async_save and config.save:
        prepare_async_staging(_saved_state_dict(record), config.ckpt_format)


def wait_for_staging(record: CheckpointRecord) -> None:
    """Block until an --async-save has copied the state to CPU memory (collective once per
    save, a no-op otherwise). Call it before anything modifies params or optimizer state:
    forward and backward do not, `optimizer.step()` does. A failed copy is raised on every
    rank."""
    if (not record.configs.checkpoint.async_save
            or not DEFAULT_ASYNC_QUEUE.has_unchecked_staging()):
        return
    error = None
    try:
        DEFAULT_ASYNC_QUEUE.wait_for_staging()
    except CheckpointError as caught:
        error = caught
    raise_if_any_rank_failed(error, None, "copying the checkpoint to CPU memory")


def poll(record: CheckpointRecord) -> None:
    """Publish asynchronous saves every rank has finished writing (collective, cheap)."""
    if record.configs.checkpoint.async_save:
        maybe_finalize_async_calls(blocking=False)


def finalize(record: CheckpointRecord) -> None:
    """Wait for the last asynchronous save and publish it (collective), and for the deletion
    of checkpoints --save-retain-interval does not keep."""
    if record.configs.checkpoint.async_save:
        maybe_finalize_async_calls(blocking=True)
    wait_for_deletions()


# -- what is on disk --------------------------------------------------------------------------


def _all_ranks_agree(flag: bool) -> bool:
    """True when `flag` holds on every rank (collective)."""
    if not is_distributed():
        return flag
    value = torch.tensor([1 if flag else 0], dtype=torch.int64, device=collective_device(None))
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item())


@dataclasses.dataclass(frozen=True)
class _SavedContents:
    """What a checkpoint holds, as far as a load must know before reading it."""

    top_level_keys: Optional[Set[str]]  # None: cannot tell at this layout
    has_adapters: bool  # LoRA adapter tensors among the model's


def _saved_contents(saved: SavedCheckpoint, state) -> _SavedContents:
    """From the DCP metadata already read ("torch_dist"), or this rank's file memory-mapped
    ("torch"; a missing file -- another layout -- is reported by the loader, which names
    both layouts). Collective for "torch"."""
    if saved.ckpt_format == "torch_dist":
        keys = saved.metadata.state_dict_metadata
        return _SavedContents({key.split(".", 1)[0] for key in keys},
                              any(_is_adapter(key) for key in keys))
    file = saved.rank_file(state.rank)
    found = os.path.isfile(file)
    payload = (torch.load(file, map_location="cpu", mmap=True, weights_only=True) if found
               else None)
    agreed = _all_ranks_agree(found)
    return _SavedContents(
        set(payload) if agreed else None,
        payload is None or any(_is_adapter(key) for key in payload.get("model", {})))


def _recorded_base(config: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    base = config.get(LORA_BASE_KEY)
    return base if isinstance(base, dict) else None


def recorded_lora_base(path: str) -> Optional[Dict[str, Any]]:
    """The base a small LoRA checkpoint at `path` (an iter_* directory) records, or None for
    any other checkpoint."""
    try:
        with open(os.path.join(path, COMMON_FILENAME)) as handle:
            return _recorded_base(json.load(handle).get("config") or {})
    except (OSError, ValueError, AttributeError):
        return None  # the engine reports an unreadable common.json when it loads


def resolve_lora_base(path: str, pretrained: Optional[str],
                      recorded: Optional[Dict[str, Any]] = None) -> LoraBase:
    """(directory, iteration) of the base model under the small LoRA checkpoint at `path`:
    --pretrained-checkpoint when given (its latest iteration), else the recorded base
    (`recorded`, when the caller has read it, else read from `path`). Pure (file reads
    only), so every rank raises alike before any collective."""
    if pretrained:
        if not os.path.isfile(tracker_path(pretrained)):
            raise CheckpointError(
                f"--pretrained-checkpoint {pretrained} holds no checkpoint "
                f"({os.path.basename(tracker_path(pretrained))} is missing)")
        base_dir, iteration, how = pretrained, read_tracker(pretrained), "--pretrained-checkpoint"
    else:
        recorded = (recorded if recorded is not None else recorded_lora_base(path)) or {}
        base_dir, iteration = recorded.get("load"), recorded.get("iteration")
        how = f"the base recorded in {path}"
        if not base_dir or iteration is None:
            raise CheckpointError(
                f"{path} holds only LoRA adapters and records no base model; name the base "
                "checkpoint with --pretrained-checkpoint DIR")
    base_path = checkpoint_dir(base_dir, int(iteration))
    if not os.path.isfile(os.path.join(base_path, COMMON_FILENAME)):
        raise CheckpointError(
            f"{path} holds only LoRA adapters; their base model ({how}: {base_dir}, iteration "
            f"{iteration}) is missing: give the base checkpoint with --pretrained-checkpoint DIR")
    if recorded_lora_base(base_path) is not None:
        raise CheckpointError(
            f"{how} {base_path} is itself a small LoRA checkpoint (adapters only); give the "
            "base model's checkpoint with --pretrained-checkpoint DIR")
    return os.path.abspath(base_dir), int(iteration)


def check_architecture_matches(path: str, model_config) -> None:
    """Compare the saved model config (common.json) with this run's; raise naming every
    field that differs. Checkpoints without a saved model config are not checked."""
    try:
        with open(os.path.join(path, COMMON_FILENAME)) as handle:
            saved = (json.load(handle).get("config") or {}).get("model") or {}
    except (OSError, ValueError, AttributeError):
        return  # the engine reports an unreadable common.json when it loads
    _check_architecture(saved, path, model_config)


def _check_architecture(saved: Dict[str, Any], path: str, model_config) -> None:
    """`check_architecture_matches` over the saved model config `saved` (already read)."""
    # Compared in their JSON form: a tuple (window_size) is saved as a list.
    differences = [
        f"{name}: checkpoint {saved[name]!r} vs flags {getattr(model_config, name)!r}"
        for name in FUNCTION_FIELDS
        if name in saved and saved[name] != json.loads(json.dumps(getattr(model_config, name)))
    ]
    if differences:
        raise CheckpointError(
            f"checkpoint {path} was trained with a different model architecture; change the "
            "flags to match it: " + "; ".join(differences)
        )


def _check_format(config, found: str, where: str) -> None:
    """Megatron's rule: --ckpt-format torch loads legacy per-rank files only, unless
    --auto-detect-ckpt-format (torch_dist, the default, detects the format itself)."""
    if config.ckpt_format == "torch" and found != "torch" and not config.auto_detect_ckpt_format:
        raise CheckpointError(
            f"{where} is in the {found!r} format but --ckpt-format is torch; add "
            "--auto-detect-ckpt-format (or --ckpt-format torch_dist) to load it")


# -- loading ----------------------------------------------------------------------------------


def load_model_weights(model, configs, state, directory: str, iteration: int,
                       include: Optional[Callable[[str], bool]] = None):
    """Load the model tensors (those whose checkpoint name `include` accepts, default all) of
    the checkpoint in `directory` at `iteration` into `model` (this rank's chunks, wrapped or
    not; collective). Returns the checkpoint's SavedCheckpoint."""
    saved = read_saved_checkpoint(directory, state, iteration)
    _check_format(configs.checkpoint, saved.ckpt_format, saved.path)
    _check_architecture(saved.config.get("model") or {}, saved.path, configs.model)
    views = {name: view for name, view in model_sharded_state_dict(
        model, state, configs.model.vocab_size, True).items()
        if include is None or include(name)}
    load_checkpoint({"model": views}, directory, state, iteration, load_rng=False,
                    saved=saved)
    return saved


def _load_lora_base(record: CheckpointRecord, base_dir: str, iteration: int) -> None:
    """Load the frozen base weights of a LoRA run (every model tensor but the adapters)
    from `base_dir` at `iteration` (collective), and remember it as the base that this run's
    checkpoints record."""
    saved = load_model_weights(record.model, record.configs, record.state, base_dir, iteration,
                               include=lambda name: not _is_adapter(name))
    record.lora_base = (os.path.abspath(base_dir), int(iteration))
    _print_rank_0(record, f"loaded the LoRA base model {saved.path}")


def _find_iteration(record: CheckpointRecord) -> Optional[int]:
    """The iteration to resume from, or None (with a warning) when --load holds none."""
    load_dir = record.configs.checkpoint.load
    if record.configs.checkpoint.ckpt_step is not None:  # Megatron's --ckpt-step
        return record.configs.checkpoint.ckpt_step
    if _all_ranks_agree(os.path.isfile(tracker_path(load_dir))):
        return read_tracker(load_dir)
    if not os.path.isdir(load_dir):
        why = "does not exist"
    else:
        found = complete_iterations(load_dir)
        why = f"has no {os.path.basename(tracker_path(load_dir))}" + (
            f" (complete checkpoints there: {found})" if found else " and holds no checkpoint"
        )
    if record.configs.checkpoint.exit_on_missing_checkpoint:
        raise CheckpointError(f"--exit-on-missing-checkpoint is set but no checkpoint was "
                              f"found: --load directory {load_dir} {why}")
    if record.configs.checkpoint.pretrained_checkpoint:
        _print_rank_0(record, f"--load directory {load_dir} {why}: the LoRA adapters start "
                              "fresh over --pretrained-checkpoint")
    else:
        _print_rank_0(record, f"WARNING: --load directory {load_dir} {why}; training starts "
                              "from scratch")
    return None


def _owner(name: str):
    """The part of the model a parameter belongs to: (layer, expert) or its top module."""
    parts = name.split(".")
    if name.startswith("decoder.layers."):
        expert = parts[parts.index("local_experts") + 1] if "local_experts" in parts else None
        return int(parts[2]), expert
    return ".".join(parts[:2]) if parts[0] == "decoder" else parts[0]


def _check_megatron_flags(config, where: str, found_format: str) -> None:
    """What loading a Megatron-LM checkpoint needs of the flags (pure: every rank raises
    alike, before any collective)."""
    _check_format(config, found_format, where)
    if not config.finetune and not config.no_load_optim:
        raise CheckpointError(
            f"{where}: Megatron-LM's optimizer state does not map onto megatron_smp's; add "
            "--finetune (its weights, from iteration 0) or --no-load-optim (its weights and "
            "iteration, a fresh optimizer)")
    if not config.finetune and not config.no_load_rng:
        raise CheckpointError(f"{where}: Megatron-LM's RNG states are not restored here; add "
                              "--no-load-rng (or --finetune)")


def _check_megatron_args(args, model_config, where: str) -> None:
    """The saved Megatron args' model shape against the flags (pure)."""
    if args is None:
        return
    saved = config_fields_from_args(args)
    differing = [f"{name}: checkpoint {saved[name]!r} vs flags "
                 f"{getattr(model_config, name)!r}" for name in CHECKPOINT_ARGS_FIELDS
                 if name in saved and saved[name] != getattr(model_config, name)]
    if differing:
        raise CheckpointError(
            f"{where} was trained with a different model; change the flags to match it "
            f"or add --use-checkpoint-args: {'; '.join(differing)}")


def _load_megatron(record: CheckpointRecord, checkpoint) -> None:
    """Restore a Megatron-LM checkpoint's weights (any TP/PP layout of ours), and with
    --no-load-optim its iteration and consumed samples. Every error is raised on every rank
    alike (each reads the same files) before any collective."""
    config = record.configs.checkpoint
    _check_megatron_flags(config, describe(checkpoint), checkpoint.ckpt_format)
    start = time.perf_counter()
    args = _load_megatron_model(record.model, record.state, record.configs, checkpoint,
                                lambda line: _print_rank_0(record, line))
    record.optimizer.reload_model_params()  # fp32 main copies from the loaded weights
    if not config.finetune:
        record.progress = dataclasses.replace(
            record.progress, iteration=checkpoint.iteration,
            consumed_train_samples=int((args or {}).get("consumed_train_samples") or 0))
    _print_rank_0(record, f"loaded {describe(checkpoint)} in {time.perf_counter() - start:.2f} "
                          f"s; resuming at iteration {record.iteration}")


def _load_megatron_model(model, state, configs, checkpoint, log) -> Optional[Dict[str, Any]]:
    """Copy a Megatron-LM checkpoint's weights into this rank's part of `model` (its chunks)
    and return the saved args (None when it has none); `log(line)` prints warnings."""
    model_config = configs.model
    where = describe(checkpoint)
    args = read_args(checkpoint)
    _check_megatron_args(args, model_config, where)
    full = trim_vocab_rows(read_model(checkpoint, model_config), model_config.vocab_size,
                           where)
    views = model_sharded_state_dict(model, state, model_config.vocab_size)
    wrong = [f"{name}: checkpoint {list(full[name].shape)} vs model "
             f"{list(view.global_shape)}" for name, view in views.items()
             if name in full and full[name].shape != view.global_shape]
    if wrong:
        raise CheckpointError(f"{where} does not fit the model: {'; '.join(wrong)}")
    # This rank judges only the checkpoint tensors of the parts it holds (its layers, experts,
    # embedding or final norm): the other stages' and experts' are not "missing".
    held = {_owner(name) for name in views}
    missing = sorted(name for name in set(full) - set(views) if _owner(name) in held)
    for line in check_key_mismatch(configs.checkpoint.dist_ckpt_strictness,
                                   sorted(set(views) - set(full)), missing, where):
        log(line)
    with torch.no_grad():
        for name, view in views.items():
            if name in full:
                for offsets, local in view.chunks:
                    index = tuple(slice(o, o + n) for o, n in zip(offsets, local.shape))
                    local.copy_(full[name][index])
    return args


def load_inference_weights(model, state, configs) -> Optional[str]:
    """--load's model weights only, for inference (collective): a Megatron-LM checkpoint
    (torch_dist or legacy, detected) or ours (its latest iteration; "torch_dist" at any
    layout), checked against --ckpt-format as training checks them. `model`: this rank's
    chunks. Returns what was loaded, or None when --load holds no checkpoint."""
    config = configs.checkpoint
    megatron = find_megatron_checkpoint(config.load)
    if megatron is not None:
        where = describe(megatron)
        _check_format(config, megatron.ckpt_format, where)
        _load_megatron_model(model, state, configs, megatron,
                             lambda line: print(line, flush=True) if state.rank == 0 else None)
        return where
    if not _all_ranks_agree(os.path.isfile(tracker_path(config.load))):
        return None
    return load_model_weights(model, configs, state, config.load,
                              read_tracker(config.load)).path


@dataclasses.dataclass(frozen=True)
class _LoadPlan:
    """What one load restores, decided from the flags and what the checkpoint holds."""

    optimizer: bool
    scheduler: bool
    progress: bool
    rng: bool
    rerun: bool  # the saved --rerun-mode validate_results position
    rerun_injected: bool  # ... and whether its error was injected (--error-injection-rate)
    base: Optional[LoraBase]  # a small LoRA checkpoint's base, loaded first
    adapters_fresh: bool  # --lora-rank over a checkpoint without adapters


def _plan_load(record: CheckpointRecord, saved: SavedCheckpoint) -> _LoadPlan:
    """Check the checkpoint against the flags and decide what to load (every rank alike;
    collective only for a "torch" checkpoint's file listing)."""
    config, path = record.configs.checkpoint, saved.path
    lora = bool(record.configs.training.lora_rank)
    _check_format(config, saved.ckpt_format, path)
    recorded = _recorded_base(saved.config)
    if recorded is not None and not lora:
        raise CheckpointError(
            f"checkpoint {path} holds only the LoRA adapters of a --lora-rank run (base: "
            f"{recorded.get('load')}); resume it with the --lora-* flags it was trained with, "
            "or export it with tools/checkpoint/convert.py --loader megatron_smp (--peft-dir)")
    contents = _saved_contents(saved, record.state)
    has_adapters = lora and contents.has_adapters
    if lora and config.pretrained_checkpoint and not has_adapters:
        raise CheckpointError(
            f"--load checkpoint {path} has no LoRA adapters and --pretrained-checkpoint names a "
            "base too; give the base once (--pretrained-checkpoint BASE --load ADAPTERS_DIR)")
    base = None
    if lora and (recorded is not None or config.pretrained_checkpoint):
        base = resolve_lora_base(path, config.pretrained_checkpoint, recorded or {})
    _check_architecture(saved.config.get("model") or {}, path, record.configs.model)
    keys = contents.top_level_keys
    load_optimizer = not (config.no_load_optim or config.finetune)
    if load_optimizer and keys is not None and "optimizer" not in keys:
        raise CheckpointError(
            f"checkpoint {path} holds no optimizer state (a model-only checkpoint, e.g. a "
            "converted one); add --no-load-optim to train from its weights with a fresh "
            "optimizer, or --finetune to also restart at iteration 0"
        )
    if lora and not has_adapters and load_optimizer:
        raise CheckpointError(
            f"checkpoint {path} has no LoRA adapters, so its optimizer state is the full "
            "model's; add --finetune (or --no-load-optim) to fine-tune it with --lora-rank")
    load_progress = not config.finetune and (keys is None or "iteration" in keys)
    return _LoadPlan(
        optimizer=load_optimizer,
        scheduler=load_optimizer and (keys is None or "opt_param_scheduler" in keys),
        progress=load_progress,
        rng=not (config.no_load_rng or config.finetune) and (keys is None or "rng_state" in keys),
        rerun=(load_progress and record.validates_results and keys is not None
               and "rerun_iteration" in keys),
        rerun_injected=(load_progress and record.validates_results and keys is not None
                        and "rerun_injected" in keys),
        base=base, adapters_fresh=lora and not has_adapters)


def _load_template(record: CheckpointRecord, plan: _LoadPlan, path: str) -> Dict[str, Any]:
    """The sharded state dict the load fills."""
    state_dict = _state_dict(record, tied_copies=True, optimizer=plan.optimizer,
                             scheduler=plan.scheduler, progress=plan.progress)
    if plan.base is not None:
        state_dict["model"] = {name: view for name, view in state_dict["model"].items()
                               if _is_adapter(name)}
    if plan.adapters_fresh:
        # --lora-rank on a base checkpoint: the base loads, the adapters keep their
        # initialisation (B = 0: training starts from the base model).
        adapters = [name for name in state_dict["model"] if _is_adapter(name)]
        for name in adapters:
            del state_dict["model"][name]
        _print_rank_0(record, f"checkpoint {path} has no LoRA adapters: loading the base, the "
                              f"{len(adapters)} adapter tensors start from their initialisation")
    if plan.rerun:
        state_dict["rerun_iteration"] = 0
        state_dict["rerun_device"] = 0
    if plan.rerun_injected:
        state_dict["rerun_injected"] = 0
    return state_dict


def _apply_loaded(record: CheckpointRecord, plan: _LoadPlan, state_dict: Dict[str, Any],
                  saved: SavedCheckpoint) -> None:
    """After the tensors are in place: the optimizer's fp32 copies, the scheduler, the
    progress counters, the rerun position and the LoRA base into the record."""
    config = record.configs.checkpoint
    if record.configs.training.lora_rank and plan.base is None:
        # A base checkpoint, or a whole (older) LoRA one: its weights are this run's base.
        record.lora_base = (os.path.abspath(saved.load_dir), int(saved.iteration))
    if plan.rerun:
        record.rerun = (int(state_dict["rerun_iteration"]), int(state_dict["rerun_device"]),
                        int(state_dict.get("rerun_injected", 0)))
    if plan.optimizer:
        finish_optimizer_load(record.optimizer, state_dict["optimizer"])
    else:
        record.optimizer.reload_model_params()  # fp32 main copies from the loaded weights
    if "opt_param_scheduler" in state_dict:
        # Raises on every rank alike (the saved values are the same everywhere) and after the
        # last collective of the load, so no rank is left waiting.
        resolved = record.scheduler.load_state_dict(
            state_dict["opt_param_scheduler"],
            override_opt_param_scheduler=config.override_opt_param_scheduler,
            use_checkpoint_opt_param_scheduler=config.use_checkpoint_opt_param_scheduler,
        )
        for line in resolved:
            _print_rank_0(record, f"learning-rate schedule: {line}")
    if plan.progress:
        record.progress = Progress(**{key: int(state_dict[key]) for key in PROGRESS_KEYS})


def load(record: CheckpointRecord) -> None:
    """Restore --load into the record (collective): model always; optimizer, grad scaler and
    scheduler unless --no-load-optim / --finetune; progress counters unless --finetune;
    RNG states unless --no-load-rng / --finetune (and only at the saving layout). A
    Megatron-LM checkpoint (torch_dist or legacy) is detected and read as such. common.json
    and the DCP metadata are read once (`read_saved_checkpoint`)."""
    config = record.configs.checkpoint
    record.lora_base = None
    megatron = find_megatron_checkpoint(config.load) if config.load else None
    if megatron is not None:
        if config.pretrained_checkpoint:
            raise CheckpointError(
                f"--load {config.load} is a Megatron-LM checkpoint and --pretrained-checkpoint "
                "names a base too; give the base once")
        if config.ckpt_step not in (None, megatron.iteration):
            raise CheckpointError(
                f"--ckpt-step {config.ckpt_step}: --load {config.load} is a Megatron-LM "
                f"checkpoint, read at the iteration its tracker names ({megatron.iteration}) "
                "here; drop --ckpt-step, or point the tracker at that iteration")
        _load_megatron(record, megatron)
        return
    iteration = _find_iteration(record) if config.load else None
    if iteration is None:
        if config.pretrained_checkpoint:  # a LoRA run's start: the base, fresh adapters
            _load_lora_base(record, *resolve_lora_base("", config.pretrained_checkpoint))
            record.optimizer.reload_model_params()
        return
    start = time.perf_counter()
    saved = read_saved_checkpoint(config.load, record.state, iteration)
    plan = _plan_load(record, saved)
    state_dict = _load_template(record, plan, saved.path)
    if plan.base is not None:
        _load_lora_base(record, *plan.base)
    load_checkpoint(state_dict, config.load, record.state, saved.iteration, load_rng=plan.rng,
                    saved=saved)
    _apply_loaded(record, plan, state_dict, saved)
    _print_rank_0(record, f"loaded checkpoint {saved.path} in {time.perf_counter() - start:.2f}"
                          f" s; resuming at iteration {record.iteration}")


__all__ = ["save", "load", "load_model_weights", "load_inference_weights", "prepare_async_save",
           "wait_for_staging", "poll", "finalize", "PROGRESS_KEYS", "CheckpointRecord",
           "Progress"]
