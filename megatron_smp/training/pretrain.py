"""The training loop: `pretrain(...)` wires config, parallel state, model, optimizer, data.

Entry scripts (pretrain_gpt.py, pretrain_llama.py) define three functions and call it:

    model_provider(configs, state, pre_process=True, post_process=True, **stage) -> nn.Module
    train_valid_test_datasets_provider(train_val_test_num_samples, configs, tokenizer)
        -> (train_ds, valid_ds, test_ds)
    forward_step(data_iterator, model) -> (output_tensor, loss_func)
"""
from __future__ import annotations

import datetime
import gc
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_smp.config import ConfigError
from megatron_smp.parallel_state import ParallelState, build_parallel_state
from megatron_smp.pipeline_parallel.schedules import (
    ScheduleHooks, get_forward_backward_func, schedule_name,
)
from megatron_smp.training.arguments import Configs, parse_args, validate_configs
from megatron_smp.training.compile import compile_transformer_layers
from megatron_smp.training.logging import (
    ProgressLog, Timer, TrainingLogger, flops_per_iteration, print_error, set_logging_level,
)
from megatron_smp.training.num_microbatches import NumMicrobatchesCalculator
from megatron_smp.training.optimizer_param_scheduler import OptimizerParamScheduler
from megatron_smp.training.profiling import StepProfiler
from megatron_smp.training.result_validation import (
    ReplayIterator,
    ResultValidator,
    validation_enabled,
)
from megatron_smp.training.run_control import (
    ExitConditions, apply_deterministic_mode, check_weight_hashes, data_worker_init_fn,
)
from megatron_smp.training.step_agreement import agree_on_step, loss_keys
from megatron_smp.training.wandb_logger import init_wandb


@dataclass
class TrainingResult:
    """What a run produced: per-iteration training losses and validation losses."""

    train_losses: Dict[int, Dict[str, float]] = field(default_factory=dict)
    valid_losses: Dict[int, Dict[str, float]] = field(default_factory=dict)
    skipped_iterations: int = 0
    iteration: int = 0
    consumed_train_samples: int = 0
    log_lines: List[str] = field(default_factory=list)
    # Megatron's evaluations after the last iteration (absent when a run exits early).
    final_valid_losses: Dict[str, float] = field(default_factory=dict)
    test_losses: Dict[str, float] = field(default_factory=dict)
    exit_reason: Optional[str] = None  # why training stopped before --train-iters


class _PendingLosses:
    """Each iteration's losses stay on the device until they are needed on the host -- the
    log line, a checkpoint's nan-iteration count, the end of training -- and are then read
    with one host sync for all of them (Megatron, too, reads its losses at the log interval).
    `read()` fills `result.train_losses` and counts NaN/Inf iterations into the run."""

    def __init__(self, result: "TrainingResult") -> None:
        self.result = result
        self.entries: List[Any] = []  # (iteration, keys, [keys] tensor)
        self.nan_iterations = 0
        self.interval_sums: Dict[str, float] = {}  # since the last log line

    def add(self, iteration: int, losses: Dict[str, torch.Tensor]) -> None:
        keys = list(losses)
        values = (torch.stack([v.reshape(()).double() for v in losses.values()]) if keys
                  else None)
        self.entries.append((iteration, keys, values))

    def read(self) -> List[Dict[str, float]]:
        """The pending iterations' losses, in order (one host sync)."""
        if not self.entries:
            return []
        tensors = [values for _, _, values in self.entries if values is not None]
        flat = torch.cat(tensors).tolist() if tensors else []
        out, position = [], 0
        for iteration, keys, _ in self.entries:
            losses = dict(zip(keys, flat[position:position + len(keys)]))
            position += len(keys)
            if any(math.isnan(v) or math.isinf(v) for v in losses.values()):
                self.nan_iterations += 1
            self.result.train_losses[iteration] = losses
            for key, value in losses.items():
                self.interval_sums[key] = self.interval_sums.get(key, 0.0) + value
            out.append(losses)
        self.entries = []
        return out


def _cyclic(loader) -> Iterator:
    while True:
        for batch in loader:
            yield batch


class _Run:
    """State of one training run (kept small: everything is built in `pretrain`)."""

    def __init__(self, configs: Configs, state: ParallelState):
        self.configs = configs
        self.state = state
        self.model: List[torch.nn.Module] = []
        self.optimizer = None
        self.scheduler: Optional[OptimizerParamScheduler] = None
        self.iteration = 0
        self.consumed_train_samples = 0
        self.skipped_iterations = 0
        self.pending_losses: Optional[_PendingLosses] = None
        self._nan_iterations = 0
        self.validator = None  # result_validation.ResultValidator (--rerun-mode)
        self.exits = None  # run_control.ExitConditions
        self.progress_log = None  # logging.ProgressLog (--log-progress), told of each save
        # A post-training mode's seam (post_training.dpo_training): `step_data(run,
        # data_iterator, num_microbatches)` gives the iterator a global batch's schedule reads
        # (e.g. the batches with their reference log-probs); `pipeline_loss_keys` the reported
        # keys under pipeline parallelism.
        self.step_data: Optional[Callable] = None
        self.pipeline_loss_keys = PIPELINE_LOSS_KEYS

    @property
    def nan_iterations(self) -> int:
        """Iterations with a NaN/Inf loss; reading it reads the pending losses first."""
        pending = self.pending_losses
        if pending is not None:
            pending.read()
            return self._nan_iterations + pending.nan_iterations
        return self._nan_iterations

    @nan_iterations.setter
    def nan_iterations(self, value: int) -> None:
        pending = self.pending_losses
        if pending is not None:
            pending.read()
            pending.nan_iterations = 0
        self._nan_iterations = value


def build_model_chunks(
    model_provider: Callable, configs: Configs, state: ParallelState
) -> List[torch.nn.Module]:
    """This rank's model chunk(s), on the device, wrapped for data parallelism: our DDP, or
    FSDP2 with --use-torch-fsdp2. With --init-model-with-meta-device each chunk is built on
    the meta device and materialised on the device (the same values)."""
    from megatron_smp.distributed import DistributedDataParallel

    if configs.parallel.use_torch_fsdp2:
        from megatron_smp.distributed.fsdp import build_fsdp_model_chunk

        if configs.training.torch_compile:
            raise ConfigError("--torch-compile is not supported with --use-torch-fsdp2 yet; "
                              "drop one of them")

        return [build_fsdp_model_chunk(model_provider, configs, state)]
    meta = configs.parallel.init_model_with_meta_device
    if meta:
        from megatron_smp.distributed.delayed_init import materialize_meta_model
        from megatron_smp.distributed.fsdp import (
            META_DEVICE_PROVIDER_ERROR,
            provider_accepts_device,
        )

        if not provider_accepts_device(model_provider):
            raise ConfigError(META_DEVICE_PROVIDER_ERROR)
    provider_kwargs = {"device": torch.device("meta")} if meta else {}
    if state.pp_size > 1:
        from megatron_smp.pipeline_parallel.stages import build_pipeline_model_chunks

        raw_chunks = build_pipeline_model_chunks(model_provider, configs, state,
                                                 **provider_kwargs)
    else:
        raw_chunks = [model_provider(configs, state, pre_process=True, post_process=True,
                                     **provider_kwargs)]
    chunks = []
    for chunk in raw_chunks:
        if meta:
            materialize_meta_model(chunk, state.device)
        chunk.to(state.device)
        if configs.training.lora_rank:
            from megatron_smp.tensor_parallel.lora import apply_lora

            # Before DDP: only the adapters get grad buffers and optimizer state.
            apply_lora(chunk, configs.training.lora_rank, configs.training.lora_alpha,
                       configs.training.lora_dropout, configs.training.lora_target_modules)
        if configs.training.torch_compile:
            # torchtitan's order: compile after TP and recompute wrapping, before DP.
            compile_transformer_layers(chunk, configs.training.torch_compile)
        chunks.append(DistributedDataParallel(chunk, configs.optimizer, state))
    return chunks


def _schedule_hooks(run: _Run) -> ScheduleHooks:
    optimizer = run.optimizer
    model = run.model

    # One no_sync per chunk, so each virtual-pipeline chunk launches its reduction during its
    # own last backward (one shared context could not release chunks one at a time).
    no_sync = model[0].no_sync if len(model) == 1 else [chunk.no_sync for chunk in model]

    return ScheduleHooks(
        grad_scale_func=optimizer.scale_loss,
        no_sync_func=no_sync,
        finalize_model_grads_func=lambda chunks: _finalize(chunks, run),
    )


def _finalize(chunks, run: _Run) -> None:
    """After the last backward: the grad reductions, then the aux-loss-free expert-bias update
    (Megatron does both in finalize_model_grads)."""
    from megatron_smp.distributed import finalize_model_grads
    from megatron_smp.transformer.moe import reset_global_aux_loss, update_expert_bias

    finalize_model_grads(chunks, run.state)
    update_expert_bias(chunks, run.configs.model, run.state)
    reset_global_aux_loss(chunks)


def _run_schedule(run: _Run, forward_step_func: Callable, data_iterator,
                  num_microbatches: int, forward_only: bool) -> List[Dict[str, torch.Tensor]]:
    """One global batch through this layout's schedule; the per-microbatch loss reports."""
    configs = run.configs
    if run.step_data is not None:
        data_iterator = run.step_data(run, data_iterator, num_microbatches)
    forward_backward = get_forward_backward_func(
        run.state.pp_size, schedule_name(configs.training.pipeline_schedule, len(run.model))
    )
    return forward_backward(
        forward_step_func=forward_step_func,
        data_iterator=data_iterator,
        model=run.model,
        num_microbatches=num_microbatches,
        seq_length=configs.training.seq_length,
        micro_batch_size=configs.training.micro_batch_size,
        forward_only=forward_only,
        hooks=None if forward_only else _schedule_hooks(run),
    )


def empty_unused_memory(run: _Run, level: int) -> None:
    """Megatron's --empty-unused-memory-level: return the CUDA caching allocator's unused
    blocks when the flag is at least `level` (nothing to return on other devices)."""
    if run.configs.training.empty_unused_memory_level >= level and run.state.device.type == "cuda":
        torch.cuda.empty_cache()


def _forward_backward(run: _Run, forward_step_func: Callable, data_iterator,
                      num_microbatches: int) -> List[Dict[str, torch.Tensor]]:
    """Zeroed grads, then the global batch's forward and backward; the loss reports."""
    from megatron_smp.models.multi_token_prediction import set_mtp_loss_scale
    from megatron_smp.transformer.moe import set_aux_loss_scale

    # Zeroes each chunk's grad buffer (zero_grad_buffer) and the main params' grads: once,
    # the buffers are the size of the model.
    run.optimizer.zero_grad()
    # MoE auxiliary losses and the MTP loss enter backward scaled like each microbatch's lm
    # loss. A device tensor: a float() here would wait for the device before every forward.
    aux_scale = run.optimizer.get_loss_scale()[0] * run.state.cp_size / num_microbatches
    set_aux_loss_scale(run.model, aux_scale)
    set_mtp_loss_scale(run.model, aux_scale)
    reports = _run_schedule(run, forward_step_func, data_iterator, num_microbatches, False)
    if run.validator is not None and run.configs.parallel.use_torch_fsdp2:
        run.validator.check_sharded_grads(run.model)
    return reports


def _build_validator(run: _Run):
    """--check-for-nan-in-loss-and-grad's checker (None when off), hooked into each DDP
    bucket's grad reduction."""
    configs, state = run.configs, run.state
    if not validation_enabled(configs.training, configs.model.fp16, configs.optimizer.loss_scale):
        return None

    def log(message: str, every_rank: bool = False) -> None:
        if every_rank or state.rank == 0:
            print(message, flush=True)

    validator = ResultValidator(configs.training.rerun_mode, state, log)
    for chunk in run.model:
        for buffer in getattr(chunk, "param_and_grad_buffers", []):
            buffer.grad_check = validator.check_grads
    return validator


# Losses the pipeline's stages share (the stages before the last see no reports).
PIPELINE_LOSS_KEYS = ("lm loss",)


def _agree(run: _Run, reports, num_microbatches: int):
    """The step's agreement (`step_agreement`): the NaN/Inf checks, the exit conditions, the
    per-token loss's token count and the logged losses in one all-reduce. Returns (the
    agreed host values by name, the losses as device tensors)."""
    from megatron_smp.training.per_token_loss import local_token_count

    rank_counts, replica_sums = {}, {}
    if run.validator is not None:
        checks = run.validator.local_counts()
        if checks is not None:
            rank_counts["checks"] = checks
    exit_flags = run.exits.local_flags() if run.exits is not None else None
    if exit_flags is not None:
        rank_counts["exit"] = exit_flags
    if run.configs.optimizer.calculate_per_token_loss:
        replica_sums["tokens"] = local_token_count(reports, run.state.device)
    keys = loss_keys(reports, run.pipeline_loss_keys, run.state)
    return agree_on_step(run.state, reports, keys, rank_counts, replica_sums)


def train_step(run: _Run, forward_step_func: Callable, data_iterator, num_microbatches: int):
    """One iteration: forward and backward, the ranks' agreement, the optimizer step.
    Returns (losses: {key: 0-dim device tensor}, the agreed exit flags or None,
    update_successful, grad_norm, num_zeros_in_grad)."""
    validator = run.validator
    if validator is not None:
        # --check-for-nan-in-loss-and-grad: losses checked as computed, grads as reduced;
        # the ranks agree after the backward, before anything is updated.
        forward_step_func = validator.wrap(forward_step_func)
        validator.start_iteration(run.iteration + 1, data_iterator)
    reports = _forward_backward(run, forward_step_func, data_iterator, num_microbatches)
    agreed, losses = _agree(run, reports, num_microbatches)
    if validator is not None:
        def rerun():
            reports[:] = _forward_backward(run, forward_step_func, data_iterator,
                                           num_microbatches)
        validator.finish_step(run, data_iterator, rerun, agreed.get("checks"))
    if run.configs.optimizer.calculate_per_token_loss:
        from megatron_smp.training.per_token_loss import scale_grads_to_per_token_mean

        scale_grads_to_per_token_mean(run.model, agreed["tokens"][0], run.state,
                                      num_microbatches)
    empty_unused_memory(run, 1)
    if run.configs.checkpoint.async_save:
        from megatron_smp.checkpointing.loop import wait_for_staging

        # The last --async-save may still be copying params and optimizer state to CPU
        # memory; step() is the first thing to modify them.
        wait_for_staging(run)
    update_successful, grad_norm, num_zeros_in_grad = run.optimizer.step()
    empty_unused_memory(run, 2)
    return losses, agreed.get("exit"), update_successful, grad_norm, num_zeros_in_grad


def evaluate(run: _Run, forward_step_func: Callable, data_iterator, eval_iters: int,
             num_microbatches: int) -> Optional[Dict[str, float]]:
    """Mean losses of `eval_iters` global batches; None when the run went past
    --exit-duration-in-mins meanwhile (Megatron abandons the evaluation; the exit check after
    the iteration then saves and stops)."""
    for chunk in run.model:
        chunk.eval()
    all_reports: Optional[List[Dict[str, torch.Tensor]]] = []
    for _ in range(eval_iters):
        all_reports += _run_schedule(run, forward_step_func, data_iterator, num_microbatches,
                                     True)
        empty_unused_memory(run, 1)
        if run.exits is not None and run.exits.out_of_time():
            if run.state.rank == 0:
                print("Exiting during evaluation, timelimit reached", flush=True)
            all_reports = None
            break
    for chunk in run.model:
        chunk.train()
    if all_reports is None:
        return None
    keys = loss_keys(all_reports, run.pipeline_loss_keys, run.state)
    return agree_on_step(run.state, all_reports, keys)[1]


def _to_host(values: Optional[Dict[str, torch.Tensor]]) -> Optional[Dict[str, float]]:
    """Evaluation losses as floats (one host read; evaluations are not per step)."""
    if values is None:
        return None
    return dict(zip(values, torch.stack([v.double() for v in values.values()]).tolist())
                if values else {})


def _final_evaluation(run: _Run, forward_step_func: Callable, valid_iter, test_loader,
                      num_microbatches: int, logger: TrainingLogger,
                      result: TrainingResult) -> None:
    """Megatron's evaluations "after training is done": --eval-iters batches of the
    validation set (continuing where training's evaluations stopped) and of the test set."""
    training = run.configs.training
    if training.eval_iters <= 0:
        return
    for dataset, iterator in (("validation", valid_iter),
                              ("test", None if test_loader is None else iter(test_loader))):
        if iterator is None:
            continue
        losses = evaluate(run, forward_step_func, iterator, training.eval_iters, num_microbatches)
        if losses is None:
            return
        losses = _to_host(losses)
        setattr(result, "final_valid_losses" if dataset == "validation" else "test_losses",
                losses)
        result.log_lines.append(logger.validation_line(
            "validation", run.iteration, losses, dataset=dataset,
            to_scalars=not training.skip_train))


def dataset_num_samples(training, global_batch_size: int) -> List[int]:
    """[train, valid, test] samples the datasets must provide (tools/prepare_cache.py asks
    the same). `training.train_iters` is the run's length after --train-samples."""
    # Megatron sizes the validation set for every evaluation of the run (one with
    # --skip-train); a different size reshuffles it, so it is matched exactly.
    eval_runs = 1 if training.skip_train else training.train_iters // training.eval_interval + 1
    return [
        training.train_samples or training.train_iters * global_batch_size,
        eval_runs * training.eval_iters * global_batch_size,
        training.eval_iters * global_batch_size,
    ]


def _report_memory(configs: Configs, model_provider: Callable) -> None:
    """--report-memory: rank 0 prints the planner's per-rank table. Runs before the process
    group exists (the planner counts inside a fake one); the other ranks go on to wait for
    rank 0 in the rendezvous."""
    from megatron_smp.parallel_state import launcher_rank, launcher_world_size
    from megatron_smp.training.memory_planner import check_model_provider, estimate_memory

    check_model_provider(model_provider)  # on every rank, before any collective
    if launcher_rank() != 0:
        return
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    report = estimate_memory(configs, launcher_world_size(), model_provider, device_type)
    print(report.table(), flush=True)


def pretrain(
    train_valid_test_datasets_provider: Callable,
    model_provider: Callable,
    forward_step_func: Callable,
    extra_args_provider: Optional[Callable] = None,
    args_defaults: Optional[Dict[str, Any]] = None,
    argv: Optional[Sequence[str]] = None,
    run_hook: Optional[Callable[[_Run], None]] = None,
) -> TrainingResult:
    """Parse flags, build everything, train, evaluate; returns the losses (on every rank).
    `run_hook(run)` is called once the model, optimizer and checkpoint are in place, before
    the datasets are built (a post-training mode's setup)."""
    from megatron_smp.data import build_pretraining_data_loader, build_tokenizer
    from megatron_smp.optimizer import get_megatron_optimizer
    from megatron_smp.tensor_parallel.random import model_parallel_seed
    from megatron_smp.models.multi_token_prediction import mtp_metrics
    from megatron_smp.transformer.moe import moe_metrics

    start_time = time.time()  # the origin of --exit-duration-in-mins
    configs = parse_args(argv, extra_args_provider, args_defaults)
    set_logging_level(configs.training)
    # The tokenizer is local work (no collective): build it first, so the one validation
    # below sees the real vocabulary, and a bad configuration fails on every rank before the
    # first collective.
    tokenizer = build_tokenizer(configs.data)
    configs.model.vocab_size = tokenizer.vocab_size
    validate_configs(configs)
    if configs.training.report_memory:
        _report_memory(configs, model_provider)
    timeout = datetime.timedelta(minutes=configs.parallel.distributed_timeout_minutes)
    state = build_parallel_state(configs.parallel, timeout=timeout)
    training = configs.training
    if training.deterministic_mode:
        apply_deterministic_mode(state.device)
    exits = ExitConditions(training, state.device, start_time)
    model_parallel_seed(training.seed, state)

    run = _Run(configs, state)
    run.exits = exits
    run.model = build_model_chunks(model_provider, configs, state)
    run.optimizer = get_megatron_optimizer(configs.optimizer, run.model, state)
    run.validator = _build_validator(run)
    # --rampup-batch-size changes the global batch (and the microbatches per step) as samples
    # are consumed; --train-samples gives the length in samples (Megatron's update_train_iters).
    batch_sizes = NumMicrobatchesCalculator(training, state.dp_size)
    training.train_iters = batch_sizes.train_iters(training.train_iters, training.train_samples)
    run.scheduler = OptimizerParamScheduler(
        run.optimizer, configs.optimizer, training.train_iters,
        train_samples=training.train_samples, global_batch_size=batch_sizes.global_batch_size,
    )

    num_microbatches = batch_sizes.num_microbatches_at(0)
    global_batch_size = batch_sizes.global_batch_size

    checkpointing = None
    loading = configs.checkpoint.load or configs.checkpoint.pretrained_checkpoint
    if loading or configs.checkpoint.save:
        from megatron_smp.checkpointing import loop as checkpointing_module

        checkpointing = checkpointing_module
        if loading:
            checkpointing.load(run, tokenizer)
    num_microbatches = batch_sizes.num_microbatches_at(run.consumed_train_samples)
    if run_hook is not None:
        run_hook(run)

    num_samples = dataset_num_samples(training, global_batch_size)
    train_ds, valid_ds, test_ds = train_valid_test_datasets_provider(num_samples, configs, tokenizer)

    def loader(dataset, consumed):
        if dataset is None:
            return None
        return build_pretraining_data_loader(
            dataset, consumed, training.micro_batch_size, state.dp_rank, state.dp_size,
            configs.data.num_workers, worker_init_fn=data_worker_init_fn(training),
        )

    train_iter = iter(loader(train_ds, run.consumed_train_samples))
    if run.validator is not None and run.validator.mode == "validate_results":
        train_iter = ReplayIterator(train_iter)  # an iteration can be rerun on its batches
    # --eval-iters 0 evaluates nothing (Megatron's do_valid / do_test): its splits are not
    # read, and may hold less than one sample.
    valid_loader = loader(valid_ds, 0) if training.eval_iters > 0 else None
    valid_iter = _cyclic(valid_loader) if valid_loader is not None else None

    is_logging_rank = state.rank == state.world_size - 1
    wandb = (init_wandb(training, configs.checkpoint.save, configs.to_dict())
             if is_logging_rank else None)
    logger = TrainingLogger(is_logging_rank, training, state.device, wandb=wandb,
                            world_size=state.world_size)
    for split, dataset in zip(("train", "validation", "test"), (train_ds, valid_ds, test_ds)):
        # --sft packs conversations: report what the packing pays for padding.
        if getattr(dataset, "efficiency", None) is not None:
            logger.print(f" > --sft {split}: {dataset.sequence_ids.size} conversations in "
                         f"{len(dataset.packs)} packs, packing efficiency "
                         f"{dataset.efficiency:.4f} (tokens used / tokens paid)")
    profiler = StepProfiler(training, state.rank, state.device, run.iteration, is_logging_rank)
    if training.log_progress:
        run.progress_log = ProgressLog(
            configs.checkpoint.save, state.world_size, state.rank,
            flops_per_iteration(configs.model, training.seq_length, 1,
                                configs.model.padded_vocab_size(state.tp_size)),
            training.seq_length, run.consumed_train_samples, start_time)
        run.progress_log.job_started()
    result = TrainingResult()
    padded_vocab_size = configs.model.padded_vocab_size(state.tp_size)
    timer = Timer(state.device)
    interval_iters = 0
    run.pending_losses = pending = _PendingLosses(result)

    if training.manual_gc:
        # Megatron's --manual-gc: no automatic collections in the middle of a step.
        gc.disable()
        gc.collect()
    hash_interval = training.check_weight_hash_across_dp_replicas_interval
    if hash_interval is not None and not training.skip_train:
        check_weight_hashes(run.model, state, run.iteration)
    timer.start()
    start_iteration = run.iteration
    while run.iteration < training.train_iters and not training.skip_train:
        profiler.before_iteration(run.iteration)
        previous_num_microbatches = num_microbatches
        num_microbatches = batch_sizes.num_microbatches_at(run.consumed_train_samples)
        global_batch_size = num_microbatches * training.micro_batch_size * state.dp_size
        save_interval = configs.checkpoint.save_interval
        if (num_microbatches != previous_num_microbatches and checkpointing is not None
                and configs.checkpoint.save
                and not (save_interval and run.iteration % save_interval == 0)):
            # Megatron saves where --rampup-batch-size changes the batch size (unless this
            # iteration was just saved).
            checkpointing.save(run)
        losses, exit_flags, update_successful, grad_norm, num_zeros_in_grad = train_step(
            run, forward_step_func, train_iter, num_microbatches
        )
        run.iteration += 1
        profiler.after_iteration(run.iteration)
        if checkpointing is not None and run.iteration == start_iteration + 1:
            checkpointing.prepare_async_save(run)  # --async-save: the optimizer state exists
        run.consumed_train_samples += global_batch_size
        if update_successful:
            run.scheduler.step(global_batch_size)
        else:
            run.skipped_iterations += 1
        # load_balancing_loss / z_loss of MoE models (Megatron's log fields).
        metrics = moe_metrics(run.model, configs.model, state, num_microbatches,
                              per_layer=training.moe_per_layer_logging)
        # --moe-per-layer-logging's values go to TensorBoard / W&B only, as in Megatron.
        per_layer = {key: metrics.pop(key) for key in list(metrics) if key.startswith("moe/")}
        losses.update(metrics)
        # Each multi-token-prediction depth's loss (Megatron's "mtp_1 loss", ...).
        losses.update(mtp_metrics(run.model, configs.model, state, num_microbatches))
        pending.add(run.iteration, losses)  # read on the host at the log line
        lr = run.optimizer.param_groups[0]["lr"]
        loss_scale = run.optimizer.get_loss_scale()[0]  # a device tensor, read when logged
        params_norm = run.optimizer.get_params_norm() if training.log_params_norm else None
        logger.iteration_scalars(run.iteration, lr, global_batch_size, losses, loss_scale,
                                 grad_norm, num_zeros_in_grad, params_norm, per_layer)
        interval_iters += 1

        if run.iteration % training.log_interval == 0 or run.iteration == training.train_iters:
            pending.read()
            loss_scale = float(loss_scale)
            elapsed = timer.stop() / interval_iters
            averaged = {k: v / interval_iters for k, v in pending.interval_sums.items()}
            tokens_per_second = global_batch_size * training.seq_length / elapsed
            # This iteration's batch, as Megatron counts it (batch ramp-up changes it).
            flops = flops_per_iteration(configs.model, training.seq_length, global_batch_size,
                                        padded_vocab_size)
            line = logger.training_line(
                run.iteration, run.consumed_train_samples, elapsed * 1000.0, lr,
                global_batch_size, averaged, loss_scale, grad_norm, num_zeros_in_grad,
                run.skipped_iterations, run.nan_iterations,
                tokens_per_second, flops / elapsed / 1e12 / state.world_size,
                params_norm=params_norm,
            )
            result.log_lines.append(line)
            pending.interval_sums, interval_iters = {}, 0
            timer.start()

        if hash_interval is not None and run.iteration % hash_interval == 0:
            check_weight_hashes(run.model, state, run.iteration)
            timer.start()
        if valid_iter is not None and training.eval_interval and (
            run.iteration % training.eval_interval == 0
        ):
            if training.manual_gc and training.manual_gc_eval:
                gc.collect()
            valid = evaluate(run, forward_step_func, valid_iter, training.eval_iters,
                             num_microbatches)
            if training.manual_gc and training.manual_gc_eval:
                gc.collect()
            if valid is not None:
                valid = _to_host(valid)
                result.valid_losses[run.iteration] = valid
                result.log_lines.append(logger.validation_line("validation", run.iteration,
                                                               valid))
            timer.start()

        if checkpointing is not None and configs.checkpoint.save_interval and (
            run.iteration % configs.checkpoint.save_interval == 0
        ):
            checkpointing.save(run)
            timer.start()
        if checkpointing is not None:
            checkpointing.poll(run)  # publishes asynchronous saves that every rank finished
        if training.manual_gc and training.manual_gc_interval and (
            run.iteration % training.manual_gc_interval == 0
        ):
            gc.collect()
        result.exit_reason = exits.reason_to_exit(run.iteration, exit_flags)
        if result.exit_reason is not None:
            logger.print(result.exit_reason)
            break
    profiler.close()
    exits.close()
    pending.read()

    # An early exit saves too (Megatron saves on every exit condition), then skips the
    # evaluations below.
    if checkpointing is not None and configs.checkpoint.save and not training.skip_train and (
        not configs.checkpoint.save_interval
        or run.iteration % configs.checkpoint.save_interval != 0
    ):
        checkpointing.save(run)
    if result.exit_reason is None:
        _final_evaluation(run, forward_step_func, valid_iter,
                          loader(test_ds, 0) if training.eval_iters > 0 else None,
                          num_microbatches, logger, result)
    if checkpointing is not None:
        checkpointing.finalize(run)
    logger.close()
    if training.manual_gc:
        gc.enable()
    result.skipped_iterations = run.skipped_iterations
    result.iteration = run.iteration
    result.consumed_train_samples = run.consumed_train_samples
    return result


_CONFIG_ERROR_GRACE_S = 3.0


def main(entry: Callable[[], Any]) -> None:
    """Run an entry script's `pretrain(...)`, turning configuration errors into one clear
    message (printed by rank 0) and a non-zero exit on every rank."""
    try:
        entry()
    except ConfigError as exc:
        from megatron_smp.parallel_state import launcher_rank

        if launcher_rank() == 0:
            print_error(str(exc))
            sys.stderr.flush()
        else:
            # torchrun stops the other workers as soon as one exits: give rank 0 the time to
            # print the message before this rank's exit makes the agent terminate it.
            time.sleep(_CONFIG_ERROR_GRACE_S)
        if dist.is_initialized():
            dist.destroy_process_group()
        sys.exit(1)
    if dist.is_initialized():
        dist.destroy_process_group()
