"""The training loop: `Trainer.train(data, logger, forward_step= | loss_fn=)` runs it (every
mode that trains through the Trainer: pretraining, SFT, DPO). Megatron's train(): the step,
its log line and scalars every --log-interval, evaluations every --eval-interval, weight-hash
checks, saves every --save-interval (and where --rampup-batch-size changes the batch), the
exit conditions, then the last save and Megatron's evaluations after training.
"""
from __future__ import annotations

import gc
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch

from megatron_smp.training.logging import ProgressLog, Timer, TrainingLogger, flops_per_iteration
from megatron_smp.training.profiling import StepProfiler
from megatron_smp.training.run_control import check_weight_hashes


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


def _to_host(values: Optional[Dict[str, torch.Tensor]]) -> Optional[Dict[str, float]]:
    """Evaluation losses as floats (one host read; evaluations are not per step)."""
    if values is None:
        return None
    return dict(zip(values, torch.stack([v.double() for v in values.values()]).tolist())
                if values else {})


@dataclass
class TrainingData:
    """The run's data: the training iterator (from the consumed samples on), the cyclic
    validation iterator and the test loader (None with --eval-iters 0)."""

    train: Iterator
    valid: Optional[Iterator]
    test_loader: Any
    datasets: tuple  # (train, validation, test)


@dataclass
class LoopHooks:
    """What a training mode adds to the loop (each optional; pretraining, SFT and DPO need
    none of them):

    * `batches()` -> (data iterator, microbatches): where each step's global batch comes
      from, instead of the training data (RL's rollout batches);
    * `log_values(step)` -> {name: value}: the step's values logged beside its losses (the
      log line and the scalars), e.g. rollout metrics and times;
    * `evaluate(final)` -> log lines: the mode's own evaluation every --eval-interval
      (final=False) and after training (final=True), instead of the validation and test
      losses;
    * `save()`: the checkpoint with the mode's own state (it calls `Trainer.save`).
    """

    batches: Optional[Callable[[], Any]] = None
    log_values: Optional[Callable[[Any], Dict[str, float]]] = None
    evaluate: Optional[Callable[[bool], List[str]]] = None
    save: Optional[Callable[[], None]] = None


class TrainingLoop:
    """The loop over a Trainer (`Trainer.train`): when to log, evaluate, check weights, save
    and stop (Megatron's train()). Each step runs `forward_step` (Megatron's
    `forward_step(data_iterator, model) -> (output, loss_func)`) or `loss_fn(output, batch)`
    (the Trainer's forward step around it); a mode's own data per step comes through
    `Trainer.step_data`."""

    def __init__(self, trainer, data: TrainingData, logger: TrainingLogger, start_time: float,
                 forward_step: Optional[Callable] = None,
                 loss_fn: Optional[Callable] = None, hooks: Optional[LoopHooks] = None) -> None:
        configs, state = trainer.configs, trainer.state
        self.trainer, self.data, self.logger = trainer, data, logger
        # One of the two (Trainer.train_step checks): how a microbatch becomes a loss.
        self.step_fn = {"forward_step": forward_step, "loss_fn": loss_fn}
        self.hooks = hooks or LoopHooks()
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

    def _save(self) -> None:
        (self.hooks.save or self.trainer.save)()

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
            if self.hooks.batches is not None:
                batches, count = self.hooks.batches()
                step = trainer.train_step(batches, num_microbatches=count, **self.step_fn)
            else:
                step = trainer.train_step(self.data.train, **self.step_fn)
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
            self._save()

    def _log(self, step) -> None:
        """The step's scalars, and Megatron's log line every --log-interval iterations."""
        trainer, training = self.trainer, self.training
        iteration, pending = trainer.iteration, trainer.pending_losses
        lr = trainer.optimizer.param_groups[0]["lr"]
        loss_scale = trainer.optimizer.get_loss_scale()[0]  # a device tensor, read when logged
        params_norm = trainer.optimizer.get_params_norm() if training.log_params_norm else None
        extra = self.hooks.log_values(step) if self.hooks.log_values is not None else {}
        self.logger.iteration_scalars(iteration, lr, step.global_batch_size, step.losses,
                                      loss_scale, step.grad_norm, step.num_zeros_in_grad,
                                      params_norm, {**step.per_layer, **extra})
        self.interval_iters += 1
        if iteration % training.log_interval != 0 and iteration != training.train_iters:
            return
        pending.read()
        elapsed = self.timer.stop() / self.interval_iters
        averaged = {k: v / self.interval_iters for k, v in pending.interval_sums.items()}
        averaged.update(extra)  # the mode's values: this iteration's
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

    def _after_step(self, step, hash_interval: Optional[int]) -> bool:
        """Weight hashes, evaluation, saves, garbage collection and the exit check after an
        iteration; True when the run stops here."""
        trainer, training = self.trainer, self.training
        iteration = trainer.iteration
        if hash_interval is not None and iteration % hash_interval == 0:
            check_weight_hashes(trainer.model, trainer.state, iteration)
            self.timer.start()
        if training.eval_interval and iteration % training.eval_interval == 0 and (
                self.hooks.evaluate is not None or self.data.valid is not None):
            if self.hooks.evaluate is not None:
                self.result.log_lines += self.hooks.evaluate(False)
            else:
                self._evaluate_during_training()
            self.timer.start()
        if self._saving(iteration):
            self._save()
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
                                      **self.step_fn,
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
            self._save()
        if result.exit_reason is None:
            if self.hooks.evaluate is not None:
                result.log_lines += self.hooks.evaluate(True)
            else:
                self._final_evaluation()
        if self.checkpointing:
            trainer.finalize_saves()
        self.logger.close()
        if trainer.resilience is not None:
            trainer.resilience.close()
        if trainer.replicas is not None:
            trainer.replicas.close()
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
                                           **self.step_fn,
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
