"""Megatron's result validation: --check-for-nan-in-loss-and-grad (on by default; off with
--no-check-for-nan-in-loss-and-grad, and off by itself for fp16 with dynamic loss scaling,
where inf/NaN grads are the loss scaler's signal), --check-for-spiky-loss and
--check-for-large-grads, under --rerun-mode.

The last two are Megatron's non-fatal checks (RerunStateMachine.is_unexpectedly_large, threshold
10): the first 100 finite values seen (losses; bucket grad norms, all buckets counting) set the
largest; from then on a value at least 10 times that is rejected. A rejection found by these
checks alone never stops the run: "disabled" logs it; "validate_results" reruns the iteration
in place, logs whether it reproduced, and goes on with the rerun's grads (Megatron's
continue_requested).

What is checked, as megatron-core 0.16.1: each microbatch's loss on the last pipeline stage
(NaN, Inf), and the L2 norm of each DDP bucket's local grads before the data-parallel
reduction (NaN, Inf; under FSDP2, of each rank's grad shards after torch's reduce-scatter).
The checks only queue device ops; the ranks agree on the outcome after the step's backward, in
the step's one all-reduce (`training.step_agreement`, shared with the exit conditions and the
logged losses) and its one host read.

--rerun-mode (Megatron's RerunStateMachine, default validate_results):

  disabled          a rejected result stops the run: every rank raises RuntimeError naming
                    the check, the iteration and how many ranks saw it (before the optimizer
                    step, so the weights are untouched).
  validate_results  the job's first iteration after a (re)start is not checked (Megatron
                    cannot checkpoint before the first optimizer step). A rejected result
                    reruns the iteration in place (RNG states restored, the same microbatches
                    replayed). Not reproduced: a possible transient error; the iteration's
                    starting point is saved (with --save) and the job exits with code 17.
                    Reproduced: the starting point is saved with the iteration to rerun and
                    the device it ran on, and the job exits with code 16 so the scheduler
                    resumes it, preferably elsewhere. The resumed job reruns that iteration
                    first: on the same node and device it exits 16 again without saving;
                    elsewhere it exits 17, with "Correct result (but possible Application
                    error)" if the result is reproduced there and "Possible persistent error!"
                    if not.
  report_stats      not supported (a clear error).

--error-injection-rate N / --error-injection-type (Megatron's RerunErrorInjector, for
rehearsing the above): under validate_results, after the first iteration, each check of an
iteration's first pass is rejected with probability 1/N on each rank (at most once per
iteration and rank). transient_error: the in-place rerun does not reproduce it (exit 17);
persistent_error and correct_result: it does (checkpoint, exit 16), and the resumed job's
rerun elsewhere reports "Possible persistent error!" or "Correct result" respectively.
"""
from __future__ import annotations

import collections
import os
import random
import zlib
from typing import Any, Callable, Iterator, List, Optional

import torch
import torch.distributed as dist

from megatron_smp.config import ConfigError

EXIT_CODE_RESUME_TO_DISAMBIGUATE = 16
EXIT_CODE_FAILED_ON_RESULT_VALIDATION = 17
RERUN_MODES = ("disabled", "validate_results", "report_stats")
# The checkpoint keys of a pending rerun (present only in checkpoints the rerun wrote).
RERUN_KEYS = ("rerun_iteration", "rerun_device", "rerun_injected")

# The checks, in the order of the counts the ranks all-reduce: four fatal, then two not.
MESSAGES = (
    "found NaN in local forward loss calculation",
    "found Inf in local forward loss calculation",
    "found NaN in local grad norm in backward pass before data-parallel communication "
    "collective",
    "found Inf in local grad norm in backward pass before data-parallel communication "
    "collective",
    "Spiky loss",
    "found unexpected large grads in backward pass before data-parallel communication "
    "collective",
    "injected error (--error-injection-rate)",
)
FATAL_CHECKS = 4
INJECTED_CHECK = 6  # fatal too
# Megatron's --error-injection-type values and how its RerunErrorInjector names them.
ERROR_INJECTION_TYPES = {"correct_result": "Expected result",
                         "transient_error": "Transient error",
                         "persistent_error": "Persistent error"}
# Megatron's is_unexpectedly_large: its threshold and how many values set the largest.
LARGE_VALUE_FACTOR = 10.0
LARGE_VALUE_SAMPLES = 100


def nan_checks_enabled(training, fp16: bool, loss_scale: Optional[float]) -> bool:
    """Whether the NaN/Inf checks run: the flag, unless fp16 with dynamic loss scaling."""
    return training.check_for_nan_in_loss_and_grad and not (fp16 and not loss_scale)


def validation_enabled(training, fp16: bool, loss_scale: Optional[float]) -> bool:
    """Whether any check runs."""
    return (nan_checks_enabled(training, fp16, loss_scale) or training.check_for_spiky_loss
            or training.check_for_large_grads)


def validate_result_flags(training) -> None:
    """ConfigError for a --rerun-mode that cannot work (pure; every rank)."""
    if training.rerun_mode not in RERUN_MODES:
        raise ConfigError(f"--rerun-mode must be one of {', '.join(RERUN_MODES)}, got "
                          f"{training.rerun_mode!r}")
    if training.rerun_mode == "report_stats":
        raise ConfigError("--rerun-mode report_stats (rerun every iteration to measure "
                          "non-determinism) is not supported yet; use validate_results (the "
                          "default) or disabled")
    if training.error_injection_rate < 0:
        raise ConfigError(f"--error-injection-rate must be >= 0, got "
                          f"{training.error_injection_rate}")
    if training.error_injection_rate and training.rerun_mode != "validate_results":
        raise ConfigError("--error-injection-rate injects errors into the reruns of --rerun-mode "
                          f"validate_results (Megatron-LM injects none under "
                          f"{training.rerun_mode}): use --rerun-mode validate_results, or drop "
                          "it")
    if training.error_injection_type not in ERROR_INJECTION_TYPES:
        raise ConfigError(f"--error-injection-type must be one of "
                          f"{', '.join(ERROR_INJECTION_TYPES)}, got "
                          f"{training.error_injection_type!r}")


def device_identity(device: torch.device) -> int:
    """A number for (node, device): where a reproduced result was found."""
    index = device.index if device.index is not None else 0
    return zlib.crc32(f"{os.uname()[1]}:{device.type}:{index}".encode())


class ReplayIterator:
    """Megatron's RerunDataIterator: remembers what this iteration took, to replay it."""

    def __init__(self, iterator: Iterator):
        self._iterator = iterator
        self._taken: List[Any] = []
        self._replay: collections.deque = collections.deque()

    def __iter__(self):
        return self

    def __next__(self):
        item = self._replay.popleft() if self._replay else next(self._iterator)
        self._taken.append(item)
        return item

    def advance(self) -> None:
        """A new iteration starts: forget what the last one took."""
        self._taken, self._replay = [], collections.deque()

    def rewind(self) -> None:
        """Hand this iteration's items out again, in order."""
        self._replay = collections.deque(self._taken + list(self._replay))
        self._taken = []


class ResultValidator:
    """One per run; `train_step` drives it (see the module docstring)."""

    def __init__(self, mode: str, state, log: Callable[[str], None], nan: bool = True,
                 spiky_loss: bool = False, large_grads: bool = False,
                 injection_rate: int = 0, injection_type: str = "transient_error"):
        self.mode = mode
        # Megatron's RerunErrorInjector (--error-injection-rate / --error-injection-type): each
        # check of the first pass of an iteration is rejected with probability 1/rate on each
        # rank (once per iteration); the in-place rerun reproduces it unless the type is
        # transient_error, and the resumed job's rerun reproduces it for correct_result only.
        self.injection_rate = injection_rate if mode == "validate_results" else 0
        self.injection_type = injection_type
        self._injected_call: Optional[int] = None
        self._rerunning = False
        self.rerun_injected = 0  # the pending rerun's first pass had an injected error
        self.nan, self.spiky_loss, self.large_grads = nan, spiky_loss, large_grads
        # is_unexpectedly_large's state per context (0 loss, 1 grads), on the device:
        # [finite values counted, their largest absolute value].
        self._largest = torch.zeros(2, 2, dtype=torch.float64, device=state.device)
        self.state = state
        self.log = log
        self.iteration = 0
        self.first_iteration_complete = False
        # validate_results: the iteration a resumed job must rerun first (0: none).
        self.rerun_iteration = 0
        self.rerun_device = 0
        self._records: List[torch.Tensor] = []
        self._active = True
        self.grads_after_reduction = False  # FSDP2: grad shards checked after reduce-scatter

    # -- the checks (device ops only) -------------------------------------------------------
    def wrap(self, forward_step_func: Callable) -> Callable:
        """The user's forward step with its loss checked."""
        def forward_step(data_iterator, model):
            output, loss_func = forward_step_func(data_iterator, model)

            def checked_loss_func(output_tensor):
                result = loss_func(output_tensor)
                self.check_loss(result[0])
                return result
            return output, checked_loss_func
        return forward_step

    def _record(self, value: torch.Tensor, first_check: int, large: Optional[int]) -> None:
        """Checks `first_check` (NaN) and the one after it (Inf) of MESSAGES on a scalar, and
        with `large` (0 loss, 1 grads) the unexpectedly-large check of that context."""
        if not self._active:  # (nor are the values counted, as in Megatron)
            return
        flags = torch.zeros(len(MESSAGES), dtype=torch.bool, device=value.device)
        if self.nan:
            flags[first_check] = value.isnan()
            flags[first_check + 1] = value.isinf()
        if large is not None:
            flags[FATAL_CHECKS + large] = self._unexpectedly_large(value, large)
        if self.injection_rate and self._inject(len(self._records)):
            flags[INJECTED_CHECK] = True
        self._records.append(flags)

    def _inject(self, call: int) -> bool:
        """Whether this iteration's check number `call` on this rank is rejected by the error
        injector (Megatron's maybe_inject / maybe_miscompare, see __init__)."""
        if self._rerunning:
            return call == self._injected_call and self.injection_type != "transient_error"
        if self.rerun_iteration and self.rerun_iteration == self.iteration:
            return (call == 0 and self.state.rank == 0 and bool(self.rerun_injected)
                    and self.injection_type == "correct_result")
        if not self.first_iteration_complete or self._injected_call is not None:
            return False
        rate = self.injection_rate
        if (random.randint(0, rate - 1) + self.state.rank) % rate:
            return False
        self._injected_call = call
        self.log(f"Injecting error type {ERROR_INJECTION_TYPES[self.injection_type]}",
                 every_rank=True)
        return True

    def _unexpectedly_large(self, value: torch.Tensor, context: int) -> torch.Tensor:
        """Megatron's is_unexpectedly_large as device ops: False while the first 100 finite
        values set the largest; then whether |value| >= 10 x that largest."""
        value = value.detach().to(self._largest.dtype).abs()
        count, largest = self._largest[context, 0], self._largest[context, 1]
        finite = value.isfinite()
        sampling = count < LARGE_VALUE_SAMPLES
        rejected = finite & ~sampling & (value >= largest * LARGE_VALUE_FACTOR)
        update = finite & sampling
        self._largest[context, 1] = torch.where(update, torch.maximum(largest, value), largest)
        self._largest[context, 0] = count + update.to(count.dtype)
        return rejected

    def check_loss(self, loss: torch.Tensor) -> None:
        self._record(loss.detach().float(), 0, 0 if self.spiky_loss else None)

    def check_grads(self, grads: torch.Tensor) -> None:
        """`grads`: a flat grad buffer (or a norm); checked through its L2 norm."""
        if self._active:
            self._record(grads.detach().float().norm(2), 2, 1 if self.large_grads else None)

    def check_sharded_grads(self, model_chunks) -> None:
        """FSDP2: the local shards of the reduced grads."""
        if not self._active:
            return
        self.grads_after_reduction = True
        for chunk in model_chunks:
            norms = []
            for param in chunk.parameters():
                grad = param.grad
                if grad is None:
                    continue
                grad = grad.to_local() if hasattr(grad, "to_local") else grad
                norms.append(grad.detach().float().norm(2))
            if norms:
                self.check_grads(torch.stack(norms))

    # -- one iteration ------------------------------------------------------------------------
    def start_iteration(self, iteration: int, data_iterator) -> None:
        """Before the first forward of `iteration` (1-based, the one about to run)."""
        from megatron_smp.checkpointing.rng import get_rng_state

        self.iteration = iteration
        self._records = []
        self._injected_call = None
        self._rng = None
        self._active = self.mode == "disabled" or self.first_iteration_complete or (
            self.rerun_iteration == iteration)
        if self.mode == "validate_results":
            self._rng = get_rng_state()
            if isinstance(data_iterator, ReplayIterator):
                data_iterator.advance()

    def _local(self) -> torch.Tensor:
        """[checks recorded, len(MESSAGES)] bool: this rank's records of the iteration."""
        device = self.state.device
        return (torch.stack(self._records).to(device) if self._records
                else torch.zeros(0, len(MESSAGES), dtype=torch.bool, device=device))

    def local_counts(self) -> Optional[torch.Tensor]:
        """(len(MESSAGES),) float on the device, 1 where this rank saw the check of MESSAGES
        fail this iteration (no host sync); None when the iteration is not checked (the same
        on every rank). The ranks sum them in the step's agreement (`training.step_agreement`)."""
        if not self._active:
            return None
        local = self._local()
        if not len(local):
            return torch.zeros(len(MESSAGES), dtype=torch.float32, device=self.state.device)
        return local.any(dim=0).float()

    def _rerun_differs(self, initial: torch.Tensor) -> bool:
        """Whether any rank's pattern of the rerun differs from its first pass: one
        all-reduce over all ranks (only after a rejected result)."""
        local = self._local()
        same = initial.shape == local.shape and bool(torch.equal(initial, local))
        differs = torch.tensor([0.0 if same else 1.0], device=self.state.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(differs)
        return differs.item() > 0

    def _messages(self):
        if not self.grads_after_reduction:
            return MESSAGES
        return MESSAGES[:2] + tuple(
            m.replace("before data-parallel communication collective",
                      "after the data-parallel reduce-scatter (FSDP2)") for m in MESSAGES[2:])

    def _describe(self, counts) -> str:
        return "; ".join(f"{message} on {int(n)} rank(s)"
                         for message, n in zip(self._messages(), counts) if n > 0)

    def _log_local(self, local: torch.Tensor) -> None:
        if len(local) and bool(local.any()):
            seen = [self._messages()[i] for i in range(len(MESSAGES))
                    if bool(local[:, i].any())]
            self.log(f"Rank {self.state.rank}, node {os.uname()[1]}, device {self.state.device}, "
                     f"iteration #{self.iteration}: unexpected result "
                     f"(message='{'; '.join(seen)}')", every_rank=True)

    def finish_step(self, save: Optional[Callable[[], None]], data_iterator,
                    rerun: Callable[[], Any],
                    counts: Optional[List[float]]):
        """After the step's backward (before the optimizer step), with `counts`: the ranks
        that saw each check fail (the sum of `local_counts()` over all ranks; None when the
        iteration is not checked). Returns when the step may go on; raises RuntimeError
        (disabled) or SystemExit(16|17) (validate_results)."""
        from megatron_smp.checkpointing.rng import set_rng_state

        if not self._active:
            self.first_iteration_complete = True
            return
        local = self._local()
        rejected = any(n > 0 for n in counts)
        from_checkpoint = self.mode == "validate_results" and self.rerun_iteration == self.iteration
        if not rejected and not from_checkpoint:
            self.first_iteration_complete = True
            return
        self._log_local(local)
        where = f"iteration {self.iteration}: {self._describe(counts)}"
        fatal = list(counts[:FATAL_CHECKS]) + [counts[INJECTED_CHECK]]
        if not from_checkpoint and not any(n > 0 for n in fatal):
            self._not_fatal(where, local, data_iterator, rerun)
            return
        if self.mode == "disabled":
            raise RuntimeError(
                f"{where} (Megatron's --check-for-nan-in-loss-and-grad, on by default; "
                "--no-check-for-nan-in-loss-and-grad turns it off, --rerun-mode "
                "validate_results reruns the iteration to tell a transient fault from a "
                "reproducible result)")
        if from_checkpoint:
            self._second_rerun(rejected, where)
        self.log(f"{where}. Need to rerun step to check reproducibility of initial result")
        initial = local
        set_rng_state(self._rng)
        if isinstance(data_iterator, ReplayIterator):
            data_iterator.rewind()
        self._records = []
        self._rerunning = True
        try:
            rerun()
        finally:
            self._rerunning = False
        differs = self._rerun_differs(initial)
        set_rng_state(self._rng)
        if differs:
            self.log("First rerun: unexpected result is not reproducible within the tolerance. "
                     "Possible transient error! Exiting now. A checkpoint at the last "
                     "iteration is being saved if further examination is needed")
            self._save_and_exit(save, EXIT_CODE_FAILED_ON_RESULT_VALIDATION, pending=False)
        self.log("First rerun: unexpected result is reproducible within the tolerance. Need to "
                 "rerun on a different GPU to verify correctness. Saving a checkpoint and "
                 "exiting now. Please resume the job from the checkpoint to rerun the last "
                 "iteration and establish a diagnostic")
        self._save_and_exit(save, EXIT_CODE_RESUME_TO_DISAMBIGUATE, pending=True)

    def _not_fatal(self, where: str, initial: torch.Tensor, data_iterator,
                   rerun: Callable[[], Any]) -> None:
        """Only the spiky-loss / large-grads checks rejected: logged ("disabled"), or rerun in
        place, logged and continued with the rerun's grads ("validate_results")."""
        from megatron_smp.checkpointing.rng import set_rng_state

        self.first_iteration_complete = True
        if self.mode == "disabled":
            self.log(f"WARNING: {where} (unexpected result; training goes on)")
            return
        self.log(f"{where}. Need to rerun step to check reproducibility of initial result")
        set_rng_state(self._rng)
        if isinstance(data_iterator, ReplayIterator):
            data_iterator.rewind()
        self._records = []
        saved = self._largest.clone()
        rerun()
        self._largest = saved  # the rerun's values are the same samples, counted once
        if self._rerun_differs(initial):
            self.log("First rerun: unexpected result is not reproducible within the tolerance. "
                     "Possible transient error! Training goes on (a non-fatal check)")
        else:
            self.log("First rerun: unexpected result is reproducible within the tolerance. "
                     "Training goes on (a non-fatal check)")

    def _second_rerun(self, rejected: bool, where: str) -> None:
        """The resumed job's rerun of the iteration whose result was reproduced."""
        same_device = torch.tensor([float(device_identity(self.state.device)
                                          == self.rerun_device)], device=self.state.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(same_device, op=dist.ReduceOp.MAX)
        if same_device.item() > 0:
            self.log("Got rescheduled on the same GPU. Need to resume again from the same "
                     "checkpoint. Exiting now. Please resume the job from the same checkpoint "
                     "to rerun the last iteration and establish a diagnostic")
            raise SystemExit(EXIT_CODE_RESUME_TO_DISAMBIGUATE)
        if rejected:
            self.log(f"Second rerun: {where}: unexpected result is reproducible on a different "
                     "GPU, therefore it was likely correct. Correct result (but possible "
                     "Application error)")
        else:
            self.log(f"Second rerun (iteration {self.iteration}): unexpected result is not "
                     "reproducible on a different GPU, therefore was likely incorrect. "
                     "Possible persistent error!")
        self.log("Exiting now. A checkpoint at the last iteration already exists if further "
                 "examination is needed")
        raise SystemExit(EXIT_CODE_FAILED_ON_RESULT_VALIDATION)

    def _save_and_exit(self, save: Optional[Callable[[], None]], code: int,
                       pending: bool) -> None:
        """`save`: saves a checkpoint (with the rerun position, when `pending`) and waits for
        it; None without --save."""
        if save is not None:
            if pending:
                self.rerun_iteration = self.iteration
                self.rerun_device = device_identity(self.state.device)
                self.rerun_injected = int(self._injected_call is not None)
                if self.injection_rate and dist.is_initialized() and dist.get_world_size() > 1:
                    injected = torch.tensor([float(self.rerun_injected)],
                                            device=self.state.device)
                    dist.all_reduce(injected, op=dist.ReduceOp.MAX)
                    self.rerun_injected = int(injected.item())
            try:
                save()
            finally:
                self.rerun_iteration = self.rerun_device = self.rerun_injected = 0
        raise SystemExit(code)


__all__ = ["EXIT_CODE_FAILED_ON_RESULT_VALIDATION", "EXIT_CODE_RESUME_TO_DISAMBIGUATE",
           "ERROR_INJECTION_TYPES", "MESSAGES", "RERUN_KEYS", "RERUN_MODES", "ReplayIterator",
           "ResultValidator",
           "device_identity", "nan_checks_enabled", "validate_result_flags",
           "validation_enabled"]
