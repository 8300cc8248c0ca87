"""The pretraining driver: `pretrain(...)` parses and validates the flags once, builds a
`Trainer` (training/trainer.py: parallel state, model, optimizer, scheduler, checkpoints),
the data, and runs Megatron's loop over it (log lines, evaluations, saves, exits).

Entry scripts (pretrain_gpt.py, pretrain_llama.py) define three functions and call it:

    model_provider(configs, state, pre_process=True, post_process=True, **stage) -> nn.Module
    train_valid_test_datasets_provider(train_val_test_num_samples, configs, tokenizer)
        -> (train_ds, valid_ds, test_ds)
    forward_step(data_iterator, model) -> (output_tensor, loss_func)
"""
from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_smp.config import Configs
from megatron_smp.training.arguments import parse_args, validate_configs
from megatron_smp.training.logging import (
    ProgressLog, Timer, TrainingLogger, flops_per_iteration, set_logging_level,
)
from megatron_smp.training.profiling import StepProfiler
from megatron_smp.training.result_validation import ReplayIterator
from megatron_smp.training.run_control import check_weight_hashes, data_worker_init_fn
from megatron_smp.training.trainer import StepResult, Trainer
# Re-exported: callers import them from here (the loop's helpers before the Trainer).
from megatron_smp.training.trainer import build_model_chunks, empty_unused_memory  # noqa: F401
from megatron_smp.training.wandb_logger import init_wandb
from megatron_smp.checkpointing.loop import model_vocab_size
from megatron_smp.cli import run_entry


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


def _cyclic(loader) -> Iterator:
    while True:
        for batch in loader:
            yield batch


def _to_host(values: Optional[Dict[str, torch.Tensor]]) -> Optional[Dict[str, float]]:
    """Evaluation losses as floats (one host read; evaluations are not per step)."""
    if values is None:
        return None
    return dict(zip(values, torch.stack([v.double() for v in values.values()]).tolist())
                if values else {})


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


def build_configs(argv: Optional[Sequence[str]] = None,
                  extra_args_provider: Optional[Callable] = None,
                  args_defaults: Optional[Dict[str, Any]] = None,
                  model_provider: Optional[Callable] = None):
    """(configs, tokenizer): the flags parsed and validated once, with the tokenizer's
    vocabulary (--report-memory's table too, given the `model_provider`)."""
    from megatron_smp.data import build_tokenizer

    configs = parse_args(argv, extra_args_provider, args_defaults)
    set_logging_level(configs.training)
    # The tokenizer is local work (no collective): build it first, so the one validation
    # below sees the real vocabulary, and a bad configuration fails on every rank before the
    # first collective.
    tokenizer = build_tokenizer(configs.data)
    configs.model.vocab_size = model_vocab_size(configs.model.vocab_size, tokenizer.vocab_size)
    validate_configs(configs)
    if configs.training.report_memory and model_provider is not None:
        _report_memory(configs, model_provider)
    return configs, tokenizer


def training_logger(trainer: Trainer) -> TrainingLogger:
    """The run's log lines and scalars (TensorBoard, wandb), written by the last rank (the
    last pipeline stage's, as in Megatron)."""
    configs, state = trainer.configs, trainer.state
    is_logging_rank = state.rank == state.world_size - 1
    wandb = (init_wandb(configs.training, configs.checkpoint.save, configs.to_dict())
             if is_logging_rank else None)
    return TrainingLogger(is_logging_rank, configs.training, state.device, wandb=wandb,
                          world_size=state.world_size)


@dataclass
class _Data:
    """The run's data: the training iterator (from the consumed samples on), the cyclic
    validation iterator and the test loader (None with --eval-iters 0)."""

    train: Iterator
    valid: Optional[Iterator]
    test_loader: Any
    datasets: tuple  # (train, validation, test)


def _build_data(trainer: Trainer, provider: Callable, tokenizer) -> _Data:
    from megatron_smp.data import build_pretraining_data_loader

    configs, state, training = trainer.configs, trainer.state, trainer.configs.training
    num_samples = dataset_num_samples(training, trainer.batch_sizes.global_batch_size)
    train_ds, valid_ds, test_ds = provider(num_samples, configs, tokenizer)

    def loader(dataset, consumed):
        if dataset is None:
            return None
        return build_pretraining_data_loader(
            dataset, consumed, training.micro_batch_size, state.dp_rank, state.dp_size,
            configs.data.num_workers, worker_init_fn=data_worker_init_fn(training),
        )

    train = iter(loader(train_ds, trainer.progress.consumed_train_samples))
    if trainer.resilience is not None:
        train = trainer.resilience.data(train)  # the watchdog tells a rank waiting for data
    if trainer.validator is not None and trainer.validator.mode == "validate_results":
        train = ReplayIterator(train)  # an iteration can be rerun on its batches
    # --eval-iters 0 evaluates nothing (Megatron's do_valid / do_test): its splits are not
    # read, and may hold less than one sample.
    evaluating = training.eval_iters > 0
    valid_loader = loader(valid_ds, 0) if evaluating else None
    return _Data(train, _cyclic(valid_loader) if valid_loader is not None else None,
                 loader(test_ds, 0) if evaluating else None, (train_ds, valid_ds, test_ds))


def _report_packing(datasets, logger: TrainingLogger) -> None:
    """--sft packs conversations: report what the packing pays for padding."""
    for split, dataset in zip(("train", "validation", "test"), datasets):
        if getattr(dataset, "efficiency", None) is not None:
            logger.print(f" > --sft {split}: {dataset.sequence_ids.size} conversations in "
                         f"{len(dataset.packs)} packs, packing efficiency "
                         f"{dataset.efficiency:.4f} (tokens used / tokens paid)")


class _TrainingLoop:
    """`pretrain`'s loop over a Trainer: when to log, evaluate, check weights, save and stop
    (Megatron's train())."""

    def __init__(self, trainer: Trainer, forward_step: Callable, data: _Data,
                 logger: TrainingLogger, start_time: float) -> None:
        configs, state = trainer.configs, trainer.state
        self.trainer, self.forward_step, self.data, self.logger = (
            trainer, forward_step, data, logger)
        self.training, self.checkpoint = configs.training, configs.checkpoint
        is_logging_rank = state.rank == state.world_size - 1
        self.profiler = StepProfiler(self.training, state.rank, state.device, trainer.iteration,
                                     is_logging_rank)
        if self.training.log_progress:
            trainer.progress_log = ProgressLog(
                self.checkpoint.save, state.world_size, state.rank,
                flops_per_iteration(configs.model, self.training.seq_length, 1,
                                    configs.model.padded_vocab_size(state.tp_size)),
                self.training.seq_length, trainer.progress.consumed_train_samples, start_time)
            trainer.progress_log.job_started()
        self.checkpointing = bool(self.checkpoint.load or self.checkpoint.pretrained_checkpoint
                                  or self.checkpoint.save)
        self.result = TrainingResult(train_losses=trainer.pending_losses.train_losses)
        self.timer = Timer(state.device)
        self.interval_iters = 0
        self.num_microbatches = trainer.num_microbatches()

    def _saving(self, iteration: int) -> bool:
        interval = self.checkpoint.save_interval
        return bool(self.checkpoint.save and interval and iteration % interval == 0)

    def run(self) -> TrainingResult:
        trainer, training = self.trainer, self.training
        if training.manual_gc:
            # Megatron's --manual-gc: no automatic collections in the middle of a step.
            gc.disable()
            gc.collect()
        hash_interval = training.check_weight_hash_across_dp_replicas_interval
        if hash_interval is not None and not training.skip_train:
            check_weight_hashes(trainer.model, trainer.state, trainer.iteration)
        self.timer.start()
        start_iteration = trainer.iteration
        while trainer.iteration < training.train_iters and not training.skip_train:
            self.profiler.before_iteration(trainer.iteration)
            self._save_at_batch_size_change()
            step = trainer.train_step(self.data.train, forward_step=self.forward_step)
            self.num_microbatches = step.num_microbatches
            self.profiler.after_iteration(trainer.iteration)
            if self.checkpointing and trainer.iteration == start_iteration + 1:
                trainer.prepare_async_save()  # --async-save: the optimizer state exists
            self._log(step)
            if self._after_step(step, hash_interval):
                break
        self.profiler.close()
        trainer.exits.close()
        trainer.pending_losses.read()
        return self._finish()

    def _save_at_batch_size_change(self) -> None:
        """Megatron saves where --rampup-batch-size changes the batch size (unless this
        iteration was just saved)."""
        previous, self.num_microbatches = self.num_microbatches, self.trainer.num_microbatches()
        if (self.num_microbatches != previous and self.checkpointing and self.checkpoint.save
                and not self._saving(self.trainer.iteration)):
            self.trainer.save()

    def _log(self, step: StepResult) -> None:
        """The step's scalars, and Megatron's log line every --log-interval iterations."""
        trainer, training = self.trainer, self.training
        iteration, pending = trainer.iteration, trainer.pending_losses
        lr = trainer.optimizer.param_groups[0]["lr"]
        loss_scale = trainer.optimizer.get_loss_scale()[0]  # a device tensor, read when logged
        params_norm = trainer.optimizer.get_params_norm() if training.log_params_norm else None
        self.logger.iteration_scalars(iteration, lr, step.global_batch_size, step.losses,
                                      loss_scale, step.grad_norm, step.num_zeros_in_grad,
                                      params_norm, step.per_layer)
        self.interval_iters += 1
        if iteration % training.log_interval != 0 and iteration != training.train_iters:
            return
        pending.read()
        elapsed = self.timer.stop() / self.interval_iters
        averaged = {k: v / self.interval_iters for k, v in pending.interval_sums.items()}
        configs, state = trainer.configs, trainer.state
        # This iteration's batch, as Megatron counts it (batch ramp-up changes it).
        flops = flops_per_iteration(configs.model, training.seq_length, step.global_batch_size,
                                    configs.model.padded_vocab_size(state.tp_size))
        self.result.log_lines.append(self.logger.training_line(
            iteration, trainer.progress.consumed_train_samples, elapsed * 1000.0, lr,
            step.global_batch_size, averaged, float(loss_scale), step.grad_norm,
            step.num_zeros_in_grad, trainer.progress.skipped_iterations,
            trainer.nan_iterations,
            step.global_batch_size * training.seq_length / elapsed,
            flops / elapsed / 1e12 / state.world_size, params_norm=params_norm,
        ))
        if trainer.resilience is not None:  # --log-straggler's report (collective)
            trainer.resilience.log_interval(iteration, self._log_line, self.logger.add_scalar)
        pending.interval_sums, self.interval_iters = {}, 0
        self.timer.start()

    def _log_line(self, line: str) -> None:
        self.logger.print(line)
        self.result.log_lines.append(line)

    def _after_step(self, step: StepResult, hash_interval: Optional[int]) -> bool:
        """Weight hashes, evaluation, saves, garbage collection and the exit check after an
        iteration; True when the run stops here."""
        trainer, training = self.trainer, self.training
        iteration = trainer.iteration
        if hash_interval is not None and iteration % hash_interval == 0:
            check_weight_hashes(trainer.model, trainer.state, iteration)
            self.timer.start()
        if self.data.valid is not None and training.eval_interval and (
                iteration % training.eval_interval == 0):
            self._evaluate_during_training()
            self.timer.start()
        if self._saving(iteration):
            trainer.save()
            self.timer.start()
        if self.checkpointing:
            trainer.poll_saves()  # publishes asynchronous saves that every rank finished
        if training.manual_gc and training.manual_gc_interval and (
                iteration % training.manual_gc_interval == 0):
            gc.collect()
        self.result.exit_reason = trainer.exits.reason_to_exit(iteration, step.exit_flags)
        if self.result.exit_reason is not None:
            self.logger.print(self.result.exit_reason)
            return True
        return False

    def _evaluate_during_training(self) -> None:
        training, iteration = self.training, self.trainer.iteration
        if training.manual_gc and training.manual_gc_eval:
            gc.collect()
        valid = self.trainer.evaluate(self.data.valid, training.eval_iters,
                                      forward_step=self.forward_step,
                                      num_microbatches=self.num_microbatches)
        if training.manual_gc and training.manual_gc_eval:
            gc.collect()
        if valid is not None:
            valid = _to_host(valid)
            self.result.valid_losses[iteration] = valid
            self.result.log_lines.append(
                self.logger.validation_line("validation", iteration, valid))

    def _finish(self) -> TrainingResult:
        """The save at the end (an early exit saves too: Megatron saves on every exit
        condition), the final evaluations (not after an early exit), the counters."""
        trainer, training, result = self.trainer, self.training, self.result
        if (self.checkpointing and self.checkpoint.save and not training.skip_train
                and not self._saving(trainer.iteration)):
            trainer.save()
        if result.exit_reason is None:
            self._final_evaluation()
        if self.checkpointing:
            trainer.finalize_saves()
        self.logger.close()
        if trainer.resilience is not None:
            trainer.resilience.close()
        if training.manual_gc:
            gc.enable()
        result.skipped_iterations = trainer.progress.skipped_iterations
        result.iteration = trainer.iteration
        result.consumed_train_samples = trainer.progress.consumed_train_samples
        return result

    def _final_evaluation(self) -> None:
        """Megatron's evaluations "after training is done": --eval-iters batches of the
        validation set (continuing where training's evaluations stopped) and of the test
        set."""
        training, test_loader = self.training, self.data.test_loader
        if training.eval_iters <= 0:
            return
        for dataset, iterator in (("validation", self.data.valid),
                                  ("test", None if test_loader is None else iter(test_loader))):
            if iterator is None:
                continue
            losses = self.trainer.evaluate(iterator, training.eval_iters,
                                           forward_step=self.forward_step,
                                           num_microbatches=self.num_microbatches)
            if losses is None:
                return
            losses = _to_host(losses)
            if dataset == "validation":
                self.result.final_valid_losses = losses
            else:
                self.result.test_losses = losses
            self.result.log_lines.append(self.logger.validation_line(
                "validation", self.trainer.iteration, losses, dataset=dataset,
                to_scalars=not training.skip_train))


def pretrain(
    train_valid_test_datasets_provider: Callable,
    model_provider: Callable,
    forward_step_func: Callable,
    extra_args_provider: Optional[Callable] = None,
    args_defaults: Optional[Dict[str, Any]] = None,
    argv: Optional[Sequence[str]] = None,
    run_hook: Optional[Callable[[Trainer], None]] = None,
) -> TrainingResult:
    """Parse flags, build everything, train, evaluate; returns the losses (on every rank).
    `run_hook(trainer)` is called once the model, optimizer and checkpoint are in place,
    before the datasets are built (a post-training mode's setup, e.g. DPO's reference)."""
    start_time = time.time()  # the origin of --exit-duration-in-mins
    configs, tokenizer = build_configs(argv, extra_args_provider, args_defaults, model_provider)
    trainer = Trainer.build(configs, model_provider, start_time)
    if configs.checkpoint.load or configs.checkpoint.pretrained_checkpoint:
        trainer.load()
    if run_hook is not None:
        run_hook(trainer)
    data = _build_data(trainer, train_valid_test_datasets_provider, tokenizer)
    logger = training_logger(trainer)
    _report_packing(data.datasets, logger)
    return _TrainingLoop(trainer, forward_step_func, data, logger, start_time).run()


def main(entry: Callable[[], Any]) -> None:
    """Run an entry script's `pretrain(...)`: a configuration error ends as one clear message
    (printed by rank 0) and exit status 2 on every rank (see megatron_smp.cli)."""
    run_entry(entry)
