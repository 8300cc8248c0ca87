"""One training run as a typed object: pretraining, SFT and post-training drive it.

    trainer = Trainer.build(configs, model_provider)     # configs already validated
    trainer.load()                                        # --load / --pretrained-checkpoint
    step = trainer.train_step(batches, loss_fn=my_loss)   # one global batch, one update
    losses = trainer.evaluate(batches, eval_iters, loss_fn=my_loss)
    logprobs = trainer.compute_logprobs(batches)          # [b, s] per microbatch, no grad
    trainer.save(); trainer.finalize_saves()

A loss function sees what the model returns on the last pipeline stage -- the logits
[b, s, padded_vocab / tp] (this rank's vocabulary shard; the model runs without labels) --
and the microbatch (a dict of device tensors, this rank's share under context parallelism):

    def my_loss(logits, batch) -> (loss: 0-dim tensor, metrics: {name: tensor})

`metrics` values are reported per microbatch and averaged over the global batch the way
Megatron's pretrain_gpt reports its "lm loss" (a [sum, count] pair, or a tensor averaged over
microbatches). Megatron-style `forward_step(data_iterator, model) -> (output, loss_func)`
functions (the entry scripts') are accepted everywhere in place of a loss function.
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from megatron_smp.checkpointing.record import CheckpointRecord, LoraBase, Progress
from megatron_smp.config import ConfigError, Configs
from megatron_smp.parallel_state import ParallelState
from megatron_smp.pipeline_parallel.schedules import (
    ScheduleHooks, get_forward_backward_func, schedule_name,
)
from megatron_smp.training.logging import ProgressLog
from megatron_smp.training.num_microbatches import NumMicrobatchesCalculator
from megatron_smp.training.optimizer_param_scheduler import OptimizerParamScheduler
from megatron_smp.training.result_validation import (
    ResultValidator,
    nan_checks_enabled,
    validation_enabled,
)
from megatron_smp.training.run_control import ExitConditions
from megatron_smp.training.step_agreement import agree_on_step, loss_keys

# Losses the pipeline's stages share (the stages before the last see no reports).
PIPELINE_LOSS_KEYS = ("lm loss",)
LossFn = Callable[[torch.Tensor, Dict[str, torch.Tensor]],
                  Tuple[torch.Tensor, Dict[str, torch.Tensor]]]
ForwardStep = Callable[[Any, torch.nn.Module], Tuple[torch.Tensor, Callable]]


class PendingLosses:
    """Each iteration's losses stay on the device until they are needed on the host -- the
    log line, a checkpoint's nan-iteration count, the end of training -- and are then read
    with one host sync for all of them (Megatron, too, reads its losses at the log interval).
    `read()` fills `train_losses` and counts NaN/Inf iterations."""

    def __init__(self) -> None:
        self.train_losses: Dict[int, Dict[str, float]] = {}
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
            self.train_losses[iteration] = losses
            for key, value in losses.items():
                self.interval_sums[key] = self.interval_sums.get(key, 0.0) + value
            out.append(losses)
        self.entries = []
        return out


@dataclasses.dataclass
class StepResult:
    """One `train_step`: losses {key: 0-dim device tensor} (MoE / MTP metrics included),
    MoE's per-layer values (TensorBoard / W&B only), the agreed exit flags (None without
    exit conditions), whether the optimizer updated, the grad norm and zero count."""

    losses: Dict[str, torch.Tensor]
    per_layer: Dict[str, Any]
    exit_flags: Any
    update_successful: bool
    grad_norm: Any
    num_zeros_in_grad: Any
    global_batch_size: int
    num_microbatches: int


def build_model_chunks(
    model_provider: Callable, configs: Configs, state: ParallelState
) -> List[torch.nn.Module]:
    """This rank's model chunk(s), on the device, wrapped for data parallelism: our DDP, or
    FSDP2 with --use-torch-fsdp2. With --init-model-with-meta-device each chunk is built on
    the meta device and materialised on the device (the same values)."""
    if configs.parallel.use_torch_fsdp2:
        from megatron_smp.distributed.fsdp import build_fsdp_model_chunk

        return [build_fsdp_model_chunk(model_provider, configs, state)]
    meta = configs.parallel.init_model_with_meta_device
    if meta:
        from megatron_smp.distributed.delayed_init import (
            META_DEVICE_PROVIDER_ERROR, provider_accepts_device,
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
    return [_wrap_chunk(chunk, configs, state, meta) for chunk in raw_chunks]


def _wrap_chunk(chunk: torch.nn.Module, configs: Configs, state: ParallelState,
                meta: bool) -> torch.nn.Module:
    """One built chunk: materialised, on the device, LoRA, compile, then DDP."""
    from megatron_smp.distributed import DistributedDataParallel
    from megatron_smp.training.compile import compile_transformer_layers

    if meta:
        from megatron_smp.distributed.delayed_init import materialize_meta_model

        materialize_meta_model(chunk, state.device)
    chunk.to(state.device)
    training = configs.training
    if training.lora_rank:
        from megatron_smp.tensor_parallel.lora import apply_lora

        # Before DDP: only the adapters get grad buffers and optimizer state.
        apply_lora(chunk, training.lora_rank, training.lora_alpha, training.lora_dropout,
                   training.lora_target_modules)
    if training.torch_compile:
        # torchtitan's order: compile after TP and recompute wrapping, before DP.
        compile_transformer_layers(chunk, training.torch_compile)
    return DistributedDataParallel(chunk, configs.optimizer, state)


def empty_unused_memory(run, level: int) -> None:
    """Megatron's --empty-unused-memory-level: return the CUDA caching allocator's unused
    blocks when the flag is at least `level` (nothing to return on other devices). `run`:
    anything with `configs` and `state` (a Trainer)."""
    if run.configs.training.empty_unused_memory_level >= level and run.state.device.type == "cuda":
        torch.cuda.empty_cache()


def batch_on_device(data_iterator, state: ParallelState) -> Dict[str, torch.Tensor]:
    """The next microbatch on the device; with context parallelism this rank's share of each
    sequence (see `context_parallel.get_batch_on_this_cp_rank`)."""
    from megatron_smp.training.logprobs import split_batch_for_context_parallel

    batch = {key: value.to(state.device, non_blocking=True)
             for key, value in next(data_iterator).items()}
    return split_batch_for_context_parallel(batch, state)


def loss_fn_forward_step(loss_fn: LossFn, state: ParallelState) -> ForwardStep:
    """A schedule's forward step that runs the model on the next microbatch (its "tokens",
    "position_ids", "attention_mask", "document_ids"; never its labels, so the last stage
    returns logits [b, s, padded_vocab / tp]) and hands the output and the whole batch to
    `loss_fn(output, batch) -> (loss, metrics)`."""
    from megatron_smp.training.logprobs import model_outputs

    def forward_step(data_iterator, model):
        batch = batch_on_device(data_iterator, state) if data_iterator is not None else {}
        output = model_outputs(model, batch)
        return output, lambda output_tensor: loss_fn(output_tensor, batch)
    return forward_step


@dataclasses.dataclass
class Trainer:
    """A run's parts (model chunks, optimizer, scheduler), its progress counters and the
    services around a step (result validation, exit conditions, LoRA base, checkpoints)."""

    configs: Configs
    state: ParallelState
    model: List[torch.nn.Module]
    optimizer: Any  # megatron_smp.optimizer.MegatronOptimizer
    scheduler: OptimizerParamScheduler
    batch_sizes: NumMicrobatchesCalculator
    progress: Progress = dataclasses.field(default_factory=Progress)
    validator: Optional[ResultValidator] = None  # --check-for-nan-in-loss-and-grad
    exits: Optional[ExitConditions] = None
    lora_base: Optional[LoraBase] = None  # a LoRA run's frozen base checkpoint
    progress_log: Optional[ProgressLog] = None  # --log-progress, told of each save
    pending_losses: PendingLosses = dataclasses.field(default_factory=PendingLosses)
    # The metrics every pipeline stage reduces (the stages before the last see no reports,
    # so with pipeline parallelism only these keys of a loss function's metrics are kept).
    metric_keys: Tuple[str, ...] = PIPELINE_LOSS_KEYS
    # A post-training mode's seam (post_training.dpo_training): `step_data(trainer,
    # data_iterator, num_microbatches)` gives the iterator a global batch's schedule reads
    # (e.g. the batches with their reference log-probs, computed before the schedule).
    step_data: Optional[Callable] = None
    # --enable-ft-package / --log-straggler / --fault-injector-*: told of each step and save.
    resilience: Optional[Any] = None  # megatron_smp.resilience.Resilience
    # --fault-tolerance: this job is one replica group of several (torchft).
    replicas: Optional[Any] = None  # megatron_smp.resilience.replicas.ReplicaGroups

    # -- build ------------------------------------------------------------------------------

    @classmethod
    def build(cls, configs: Configs, model_provider: Callable,
              start_time: Optional[float] = None) -> "Trainer":
        """Parallel state, model chunks, optimizer, result checks and scheduler from
        validated `configs` (collective: creates the process groups). `start_time` is the
        origin of --exit-duration-in-mins (default: now)."""
        import datetime

        from megatron_smp.optimizer import get_megatron_optimizer
        from megatron_smp.parallel_state import create_parallel_state
        from megatron_smp.tensor_parallel.random import model_parallel_seed
        from megatron_smp.training.run_control import apply_deterministic_mode

        timeout = datetime.timedelta(minutes=configs.parallel.distributed_timeout_minutes)
        state = create_parallel_state(configs.parallel, timeout=timeout)
        training = configs.training
        if training.deterministic_mode:
            apply_deterministic_mode(state.device)
        exits = ExitConditions(training, state.device,
                               time.time() if start_time is None else start_time)
        model_parallel_seed(training.seed, state)
        model = build_model_chunks(model_provider, configs, state)
        optimizer = get_megatron_optimizer(configs.optimizer, model, state,
                                           mup_width_mult=configs.model.mup_width_mult)
        validator = _build_validator(configs, state, model)
        # --rampup-batch-size changes the global batch (and the microbatches per step) as
        # samples are consumed; --train-samples gives the length in samples (Megatron's
        # update_train_iters).
        batch_sizes = NumMicrobatchesCalculator(training, state.dp_size)
        train_iters = batch_sizes.train_iters(training.train_iters, training.train_samples)
        if train_iters != training.train_iters:
            # The run's configs with the derived length: a copy, the validated ones unchanged.
            training = dataclasses.replace(training, train_iters=train_iters)
            configs = dataclasses.replace(configs, training=training)
        scheduler = OptimizerParamScheduler(
            optimizer, configs.optimizer, training.train_iters,
            train_samples=training.train_samples,
            global_batch_size=batch_sizes.global_batch_size)
        from megatron_smp.resilience import build_resilience

        resilience = build_resilience(getattr(configs, "resilience", None), state,
                                      configs.checkpoint.save)
        trainer = cls(configs, state, model, optimizer, scheduler, batch_sizes,
                      validator=validator, exits=exits, resilience=resilience)
        resilience_config = getattr(configs, "resilience", None)
        if resilience_config is not None and resilience_config.fault_tolerance:
            from megatron_smp.resilience.replicas import ReplicaGroups

            trainer.replicas = ReplicaGroups(resilience_config, trainer)
        return trainer

    @property
    def iteration(self) -> int:
        return self.progress.iteration

    @property
    def nan_iterations(self) -> int:
        """Iterations with a NaN/Inf loss (reads the pending losses first)."""
        self._fold_pending_nans()
        return self.progress.nan_iterations

    def _fold_pending_nans(self) -> None:
        self.pending_losses.read()
        self.progress.nan_iterations += self.pending_losses.nan_iterations
        self.pending_losses.nan_iterations = 0

    def read_losses(self) -> Dict[int, Dict[str, float]]:
        """Every iteration's agreed losses and metrics so far, {iteration: {key: float}}
        (one host read for those still on the device)."""
        self.pending_losses.read()
        return self.pending_losses.train_losses

    def num_microbatches(self) -> int:
        """Microbatches per data-parallel rank in the next step (--rampup-batch-size)."""
        return self.batch_sizes.num_microbatches_at(self.progress.consumed_train_samples)

    # -- forward and backward ---------------------------------------------------------------

    def forward_backward(self, batch_iter, loss_fn: Optional[LossFn] = None,
                         forward_only: bool = False, num_microbatches: Optional[int] = None,
                         forward_step: Optional[ForwardStep] = None
                         ) -> List[Dict[str, torch.Tensor]]:
        """One global batch through this layout's pipeline schedule with `loss_fn` (or a
        Megatron-style `forward_step`); the per-microbatch metric reports (last stage; []
        elsewhere). Unless `forward_only`, grads are zeroed first and are ready (reduced)
        when it returns. `num_microbatches`: this call's count (default the next step's); an
        explicit count may change from call to call (see `agree_num_microbatches`)."""
        step = self._forward_step(loss_fn, forward_step)
        num_microbatches = self.agree_num_microbatches(num_microbatches)
        return self._forward_backward(step, batch_iter, num_microbatches, forward_only)

    def agree_num_microbatches(self, num_microbatches: Optional[int] = None) -> int:
        """The microbatches of one call: the next step's (--global-batch-size /
        --rampup-batch-size) when None; else `num_microbatches`, which may differ per call
        (an RL step's rollouts after DAPO's filter, packed into a varying number of rows) but
        must be the same on every rank: the pipeline stages and the expert-parallel all-to-alls
        run that many. One all-reduce checks it, so every rank raises the same ValueError for
        a count that differs over ranks or that this layout's schedule cannot run."""
        if num_microbatches is None:
            return self.num_microbatches()
        import operator

        import torch.distributed as dist

        try:
            local = operator.index(num_microbatches)
        except TypeError:
            local = 0  # not an integer: the error below, on every rank
        low = high = local
        if dist.is_initialized() and dist.get_world_size() > 1:
            bounds = torch.tensor([local, -local], dtype=torch.int64, device=self.state.device)
            dist.all_reduce(bounds, op=dist.ReduceOp.MAX)
            high, low = bounds.tolist()
            low = -low
        if low != high:
            raise ValueError(f"Trainer: num_microbatches differs over the ranks ({low} to "
                             f"{high}); every rank must run the same number of microbatches "
                             "in a step (pad the short ranks with empty microbatches)")
        if low < 1:
            raise ValueError(f"Trainer: num_microbatches must be a positive integer, got "
                             f"{num_microbatches!r}")
        pp = self.state.pp_size
        if len(self.model) > 1 and low % pp:
            raise ValueError(f"Trainer: {low} microbatches cannot run the interleaved "
                             f"virtual-pipeline schedule at --pipeline-model-parallel-size "
                             f"{pp}: give a multiple of {pp} (pad with empty microbatches)")
        return low

    def _forward_backward(self, step: ForwardStep, batch_iter, num_microbatches: int,
                          forward_only: bool) -> List[Dict[str, torch.Tensor]]:
        if forward_only:
            return self._schedule(step, batch_iter, num_microbatches, True)
        from megatron_smp.models.multi_token_prediction import set_mtp_loss_scale
        from megatron_smp.transformer.moe import set_aux_loss_scale

        # Zeroes each chunk's grad buffer (zero_grad_buffer) and the main params' grads: once,
        # the buffers are the size of the model.
        self.optimizer.zero_grad()
        # MoE auxiliary losses and the MTP loss enter backward scaled like each microbatch's
        # lm loss. A device tensor: a float() here would wait for the device before every
        # forward.
        aux_scale = self.optimizer.get_loss_scale()[0] * self.state.cp_size / num_microbatches
        set_aux_loss_scale(self.model, aux_scale)
        set_mtp_loss_scale(self.model, aux_scale)
        reports = self._schedule(step, batch_iter, num_microbatches, False)
        if self.validator is not None and self.configs.parallel.use_torch_fsdp2:
            self.validator.check_sharded_grads(self.model)
        return reports

    def _forward_step(self, loss_fn: Optional[LossFn],
                      forward_step: Optional[ForwardStep]) -> ForwardStep:
        if (loss_fn is None) == (forward_step is None):
            raise TypeError("give exactly one of loss_fn and forward_step")
        return forward_step or loss_fn_forward_step(loss_fn, self.state)

    def _schedule(self, forward_step: ForwardStep, data_iterator, num_microbatches: int,
                  forward_only: bool) -> List[Dict[str, torch.Tensor]]:
        """One global batch through this layout's schedule; the per-microbatch reports."""
        training = self.configs.training
        if self.step_data is not None:
            data_iterator = self.step_data(self, data_iterator, num_microbatches)
        name = schedule_name(training.pipeline_schedule, len(self.model))
        forward_backward = get_forward_backward_func(self.state.pp_size, name)
        extra = {}
        if name == "interleaved_1f1b" and self.state.pp_size > 1:
            extra["microbatch_group_size_per_vp_stage"] = (
                training.microbatch_group_size_per_vp_stage)
        return forward_backward(
            forward_step_func=forward_step, data_iterator=data_iterator, model=self.model,
            num_microbatches=num_microbatches, seq_length=training.seq_length,
            micro_batch_size=training.micro_batch_size, forward_only=forward_only,
            hooks=None if forward_only else self._schedule_hooks(), **extra)

    def _schedule_hooks(self) -> ScheduleHooks:
        model = self.model
        # One no_sync per chunk, so each virtual-pipeline chunk launches its reduction during
        # its own last backward (one shared context could not release chunks one at a time).
        no_sync = model[0].no_sync if len(model) == 1 else [chunk.no_sync for chunk in model]
        return ScheduleHooks(grad_scale_func=self.optimizer.scale_loss, no_sync_func=no_sync,
                             finalize_model_grads_func=self._finalize_grads)

    def _finalize_grads(self, chunks) -> None:
        """After the last backward: the grad reductions, then the aux-loss-free expert-bias
        update (Megatron does both in finalize_model_grads)."""
        from megatron_smp.distributed import finalize_model_grads
        from megatron_smp.transformer.moe import reset_global_aux_loss, update_expert_bias

        if self.resilience is not None:
            self.resilience.compute_finished()  # straggler timing, a "slow" fault
        finalize_model_grads(chunks, self.state)
        if self.replicas is not None:  # the mean over the replica groups in the quorum
            self.replicas.allreduce_grads(chunks)
        update_expert_bias(chunks, self.configs.model, self.state)
        reset_global_aux_loss(chunks)

    # -- one step ---------------------------------------------------------------------------

    def train_step(self, data_iterator, loss_fn: Optional[LossFn] = None,
                   forward_step: Optional[ForwardStep] = None,
                   num_microbatches: Optional[int] = None) -> StepResult:
        """One iteration: forward and backward, the ranks' agreement (NaN checks, exit
        conditions, per-token counts), the optimizer and scheduler steps, the progress
        counters; the losses are kept for the log (`pending_losses`). `num_microbatches`:
        this step's count when it is not --global-batch-size's (see
        `agree_num_microbatches`). Such a step still advances the learning-rate schedule and
        the consumed samples by one iteration of --global-batch-size, so a schedule over
        --train-iters does not depend on how the step's rows were padded or split; its
        StepResult.global_batch_size is the rows it ran."""
        if self.replicas is not None:  # the quorum; a group behind takes its peers' state
            data_iterator = self.replicas.start_step(data_iterator)
        if self.resilience is not None:
            self.resilience.before_step(self.iteration + 1)
        result = self._train_step(data_iterator, loss_fn, forward_step, num_microbatches)
        if self.resilience is not None:
            self.resilience.after_step(self.iteration)
        return result

    def _train_step(self, data_iterator, loss_fn, forward_step, num_microbatches) -> StepResult:
        scheduled = self.batch_sizes.global_batch_size_at(self.progress.consumed_train_samples)
        fixed_size = num_microbatches is None
        num_microbatches = self.agree_num_microbatches(num_microbatches)
        global_batch_size = (num_microbatches * self.configs.training.micro_batch_size
                             * self.state.dp_size)
        step = self._forward_step(loss_fn, forward_step)
        if self.validator is not None:
            # --check-for-nan-in-loss-and-grad: losses checked as computed, grads as reduced;
            # the ranks agree after the backward, before anything is updated.
            step = self.validator.wrap(step)
            self.validator.start_iteration(self.iteration + 1, data_iterator)
        reports = self._forward_backward(step, data_iterator, num_microbatches, False)
        agreed, losses = self._agree(reports)
        if self.validator is not None:
            def rerun():
                reports[:] = self._forward_backward(step, data_iterator, num_microbatches,
                                                    False)
            save = self._save_for_rerun if self.configs.checkpoint.save else None
            self.validator.finish_step(save, data_iterator, rerun, agreed.get("checks"))
        if self.configs.optimizer.calculate_per_token_loss:
            from megatron_smp.training.per_token_loss import scale_grads_to_per_token_mean

            scale_grads_to_per_token_mean(self.model, agreed["tokens"][0], self.state,
                                          num_microbatches)
        update_successful, grad_norm, num_zeros = self._optimizer_step()
        self._advance(update_successful, global_batch_size if fixed_size else scheduled)
        per_layer = self._add_model_metrics(losses, num_microbatches)
        self.pending_losses.add(self.iteration, losses)  # read on the host at the log line
        return StepResult(losses, per_layer, agreed.get("exit"), update_successful, grad_norm,
                          num_zeros, global_batch_size, num_microbatches)

    def _agree(self, reports) -> Tuple[Dict[str, Any], Dict[str, torch.Tensor]]:
        """The step's agreement (`step_agreement`): the NaN/Inf checks, the exit conditions,
        the per-token loss's token count and the logged losses in one all-reduce. Returns
        (the agreed host values by name, the losses as device tensors)."""
        from megatron_smp.training.per_token_loss import local_token_count

        rank_counts, replica_sums = {}, {}
        if self.validator is not None:
            checks = self.validator.local_counts()
            if checks is not None:
                rank_counts["checks"] = checks
        exit_flags = self.exits.local_flags() if self.exits is not None else None
        if exit_flags is not None:
            rank_counts["exit"] = exit_flags
        if self.configs.optimizer.calculate_per_token_loss:
            replica_sums["tokens"] = local_token_count(reports, self.state.device)
        keys = loss_keys(reports, self.metric_keys, self.state)
        return agree_on_step(self.state, reports, keys, rank_counts, replica_sums)

    def _optimizer_step(self):
        empty_unused_memory(self, 1)
        if self.configs.checkpoint.async_save:
            from megatron_smp.checkpointing import loop as checkpointing

            # The last --async-save may still be copying params and optimizer state to CPU
            # memory; step() is the first thing to modify them.
            checkpointing.wait_for_staging(self.checkpoint_record())
        if self.replicas is not None and not self.replicas.should_commit():
            return False, None, None  # a replica group failed during the step: no update
        result = self.optimizer.step()
        empty_unused_memory(self, 2)
        return result

    def _advance(self, update_successful: bool, global_batch_size: int) -> None:
        progress = self.progress
        progress.iteration += 1
        progress.consumed_train_samples += global_batch_size
        if update_successful:
            self.scheduler.step(global_batch_size)
        else:
            progress.skipped_iterations += 1

    def _add_model_metrics(self, losses: Dict[str, torch.Tensor],
                           num_microbatches: int) -> Dict[str, Any]:
        """MoE's load_balancing_loss / z_loss and each MTP depth's loss (Megatron's log
        fields) into `losses`; returns --moe-per-layer-logging's values (TensorBoard / W&B
        only, as in Megatron)."""
        from megatron_smp.models.multi_token_prediction import mtp_metrics
        from megatron_smp.transformer.moe import moe_metrics

        model, state = self.configs.model, self.state
        metrics = moe_metrics(self.model, model, state, num_microbatches,
                              per_layer=self.configs.training.moe_per_layer_logging)
        per_layer = {key: metrics.pop(key) for key in list(metrics) if key.startswith("moe/")}
        losses.update(metrics)
        losses.update(mtp_metrics(self.model, model, state, num_microbatches))
        return per_layer

    # -- the loop ---------------------------------------------------------------------------

    def train(self, data, logger, start_time: float,
              forward_step: Optional[ForwardStep] = None, loss_fn: Optional[LossFn] = None,
              hooks=None):
        """Megatron's train() over this Trainer (`training.loop.TrainingLoop`): steps until
        --train-iters or an exit condition, with the log line, evaluations, saves and the
        evaluations after training; each microbatch through `forward_step` or `loss_fn`.
        `data`: a `training.loop.TrainingData`; `hooks`: a `training.loop.LoopHooks` (what
        a mode adds); returns a `training.loop.TrainingResult`."""
        from megatron_smp.training.loop import TrainingLoop

        return TrainingLoop(self, data, logger, start_time, forward_step=forward_step,
                            loss_fn=loss_fn, hooks=hooks).run()

    # -- evaluation -------------------------------------------------------------------------

    def evaluate(self, data_iterator, eval_iters: int, loss_fn: Optional[LossFn] = None,
                 forward_step: Optional[ForwardStep] = None,
                 num_microbatches: Optional[int] = None) -> Optional[Dict[str, torch.Tensor]]:
        """Mean losses of `eval_iters` global batches (device tensors); None when the run
        went past --exit-duration-in-mins meanwhile (Megatron abandons the evaluation; the
        exit check after the iteration then saves and stops)."""
        step = self._forward_step(loss_fn, forward_step)
        num_microbatches = num_microbatches or self.num_microbatches()
        for chunk in self.model:
            chunk.eval()
        all_reports: Optional[List[Dict[str, torch.Tensor]]] = []
        for _ in range(eval_iters):
            all_reports += self._schedule(step, data_iterator, num_microbatches, True)
            empty_unused_memory(self, 1)
            if self.exits is not None and self.exits.out_of_time():
                if self.state.rank == 0:
                    print("Exiting during evaluation, timelimit reached", flush=True)
                all_reports = None
                break
        for chunk in self.model:
            chunk.train()
        if all_reports is None:
            return None
        keys = loss_keys(all_reports, self.metric_keys, self.state)
        return agree_on_step(self.state, all_reports, keys)[1]

    def compute_logprobs(self, batch_iter, num_microbatches: Optional[int] = None,
                         temperature: float = 1.0) -> List[torch.Tensor]:
        """Per-token log-probabilities [b, s] (fp32) of each of `num_microbatches` (default
        the next step's) microbatches' "labels" under the model, in eval mode and without
        grad (what a DPO reference or a GRPO old policy needs): the whole sequences, on every
        rank of the TP / CP / PP groups. `training.logprobs.logprobs_of_microbatches` does
        the work (the backend API's `compute_logprobs` too)."""
        from megatron_smp.training.logprobs import logprobs_of_microbatches

        count = num_microbatches or self.num_microbatches()
        microbatches = [next(batch_iter) for _ in range(count)]
        reports = logprobs_of_microbatches(
            self.model, microbatches, self.state, self.configs.model.vocab_size,
            pipeline_schedule=self.configs.training.pipeline_schedule, temperature=temperature)
        return [report["logprobs"] for report in reports]

    # -- checkpoints ------------------------------------------------------------------------

    def checkpoint_record(self) -> CheckpointRecord:
        """What a checkpoint of this run holds (`checkpointing.loop` reads nothing else)."""
        validator = self.validator
        rerun = None
        if validator is not None and validator.rerun_iteration:
            rerun = (validator.rerun_iteration, validator.rerun_device,
                     validator.rerun_injected)
        on_saved = self.progress_log.checkpoint_saved if self.progress_log is not None else None
        return CheckpointRecord(
            self.configs, self.state, self.model, self.optimizer, self.scheduler,
            self.progress, lora_base=self.lora_base, validates_results=validator is not None,
            rerun=rerun, on_saved=on_saved)

    def save(self) -> None:
        """Save this iteration to --save (collective; see `checkpointing.loop.save`)."""
        from megatron_smp.checkpointing import loop as checkpointing

        self._fold_pending_nans()
        with self._checkpointing():
            checkpointing.save(self.checkpoint_record())

    def load(self) -> None:
        """Restore --load / --pretrained-checkpoint (collective; see
        `checkpointing.loop.load`): parts in place, then the counters, the LoRA base and a
        pending rerun from the record."""
        from megatron_smp.checkpointing import loop as checkpointing

        record = self.checkpoint_record()
        checkpointing.load(record)
        self.progress, self.lora_base = record.progress, record.lora_base
        if record.rerun is not None and self.validator is not None:
            (self.validator.rerun_iteration, self.validator.rerun_device,
             self.validator.rerun_injected) = record.rerun

    def prepare_async_save(self) -> None:
        from megatron_smp.checkpointing import loop as checkpointing

        checkpointing.prepare_async_save(self.checkpoint_record())

    def poll_saves(self) -> None:
        """Publish asynchronous saves every rank has finished (collective)."""
        from megatron_smp.checkpointing import loop as checkpointing

        checkpointing.poll(self.checkpoint_record())

    def finalize_saves(self) -> None:
        """Wait for the last asynchronous save and publish it (collective)."""
        from megatron_smp.checkpointing import loop as checkpointing

        with self._checkpointing():
            checkpointing.finalize(self.checkpoint_record())

    def _checkpointing(self):
        """The watchdog's "checkpointing" section around a save (nothing without it)."""
        import contextlib

        return (self.resilience.checkpointing() if self.resilience is not None
                else contextlib.nullcontext())

    def _save_for_rerun(self) -> None:
        self.save()
        self.finalize_saves()


def _build_validator(configs: Configs, state: ParallelState,
                     model: List[torch.nn.Module]) -> Optional[ResultValidator]:
    """--check-for-nan-in-loss-and-grad's checker (None when off), hooked into each DDP
    bucket's grad reduction."""
    if not validation_enabled(configs.training, configs.model.fp16, configs.optimizer.loss_scale):
        return None

    def log(message: str, every_rank: bool = False) -> None:
        if every_rank or state.rank == 0:
            print(message, flush=True)

    training = configs.training
    validator = ResultValidator(
        training.rerun_mode, state, log,
        nan=nan_checks_enabled(training, configs.model.fp16, configs.optimizer.loss_scale),
        spiky_loss=training.check_for_spiky_loss, large_grads=training.check_for_large_grads,
        injection_rate=training.error_injection_rate,
        injection_type=training.error_injection_type)
    for chunk in model:
        for buffer in getattr(chunk, "param_and_grad_buffers", []):
            buffer.grad_check = validator.check_grads
    return validator


__all__ = ["Trainer", "StepResult", "PendingLosses", "build_model_chunks", "batch_on_device",
           "loss_fn_forward_step", "empty_unused_memory", "PIPELINE_LOSS_KEYS"]
