"""When a run stops early, and how it makes itself reproducible: Megatron's run-control flags.

    --exit-interval N          stop after the iteration that is a multiple of N (0: never)
    --exit-duration-in-mins M  stop once any rank has trained for more than M minutes (0: never,
                               as in Megatron), measured when the ranks agree after each
                               backward (and after each evaluation batch)
    --exit-signal-handler      stop at the end of the iteration in which any rank received
                               --exit-signal (SIGTERM: what SLURM sends before preemption)
                               by the end of its backward, when the ranks agree (a signal
                               that arrives later stops the run after the next iteration)
    --deterministic-mode       torch.use_deterministic_algorithms(True)
    --check-weight-hash-across-dp-replicas-interval N
                               every N iterations (and before the first), an error on every
                               rank unless all data-parallel replicas hold the same parameters

Each stop saves a checkpoint of the iteration just finished (with --save) and ends the run
without the final evaluation; the process then exits with code 0, as Megatron's does.
"""
from __future__ import annotations

import functools
import os
import signal
import time
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_smp.config import ConfigError, TrainingConfig

# Megatron's --deterministic-mode accepts only these NCCL all-reduce algorithms: the others
# (NVLS, CollNet with in-network reductions) may add in a different order from run to run.
_DETERMINISTIC_NCCL_ALGOS = ("Tree", "Ring", "CollnetDirect", "CollnetChain", "^NVLS")


def validate_run_control(training: TrainingConfig, use_flash_attn: bool, uses_nccl: bool,
                         sharded_params: bool = False) -> None:
    """ConfigError for run-control flags that cannot work (pure; every rank, before any
    collective). `uses_nccl`: the run will reduce over NCCL (a CUDA device);
    `sharded_params`: data-parallel ranks hold different shards (FSDP2)."""
    if training.exit_duration_in_mins is not None and training.exit_duration_in_mins < 0:
        raise ConfigError(f"--exit-duration-in-mins must be >= 0, got "
                          f"{training.exit_duration_in_mins}")
    if training.exit_interval is not None and training.exit_interval < 0:
        raise ConfigError(f"--exit-interval must be >= 0, got {training.exit_interval}")
    interval = training.check_weight_hash_across_dp_replicas_interval
    if interval is not None and interval < 1:
        raise ConfigError(f"--check-weight-hash-across-dp-replicas-interval must be >= 1, got "
                          f"{interval}")
    if interval is not None and sharded_params:
        raise ConfigError("--check-weight-hash-across-dp-replicas-interval compares replicated "
                          "parameters; with --use-torch-fsdp2 data-parallel ranks hold "
                          "different shards: drop one")
    if training.exit_signal != "SIGTERM" and not training.exit_signal_handler:
        raise ConfigError("--exit-signal chooses the signal of --exit-signal-handler: add it")
    if training.deterministic_mode:
        if use_flash_attn:
            raise ConfigError("--use-flash-attn cannot be used with --deterministic-mode (flash "
                              "attention's backward is not deterministic): drop one")
        if uses_nccl and os.environ.get("NCCL_ALGO") not in _DETERMINISTIC_NCCL_ALGOS:
            raise ConfigError(
                f"--deterministic-mode needs the environment variable NCCL_ALGO set to one of "
                f"{', '.join(_DETERMINISTIC_NCCL_ALGOS)} (got {os.environ.get('NCCL_ALGO')!r}),"
                " as Megatron-LM requires: NCCL's other algorithms reduce in varying order"
            )


def apply_deterministic_mode(device: torch.device) -> None:
    """Make every kernel deterministic, or raise where a non-deterministic one runs.

    On CUDA, cuBLAS also needs a fixed workspace (set before its first use; a value the user
    exported wins)."""
    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)


def check_weight_hashes(model_chunks, state, iteration: int) -> None:
    """Compare a SHA-1 of every parameter across the replicas that should hold it (dp x cp;
    expert-data-parallel for expert params); RuntimeError on every rank, naming the differing
    parameters, if any replica differs. Collective over the whole world."""
    import hashlib

    from megatron_smp.tensor_parallel.utils import is_expert_param

    for chunk in model_chunks:
        if hasattr(chunk, "finish_param_sync"):  # --overlap-param-gather may still write
            chunk.finish_param_sync()
    dense, expert = [], []
    for index, chunk in enumerate(model_chunks):
        for name, param in chunk.named_parameters():
            digest = hashlib.sha1(param.detach().float().cpu().numpy().tobytes()).digest()
            (expert if is_expert_param(param) else dense).append((f"chunk {index} {name}",
                                                                  digest))
    differing = []
    for entries, group in ((dense, state.dp_cp_group), (expert, state.expert_dp_group)):
        size = dist.get_world_size(group)
        if not entries or size == 1:
            continue
        local = torch.tensor([list(digest) for _, digest in entries], dtype=torch.uint8,
                             device=state.device)
        gathered = torch.empty((size * len(entries), local.shape[1]), dtype=torch.uint8,
                               device=state.device)
        dist.all_gather_into_tensor(gathered, local, group=group)
        replicas = gathered.view(size, len(entries), -1)
        bad = (replicas != replicas[0]).any(dim=2).any(dim=0).tolist()
        differing += [name for (name, _), wrong in zip(entries, bad) if wrong]
    # Replicas of other model-parallel positions must stop too, not wait in a collective.
    any_differ = torch.tensor([len(differing)], dtype=torch.int32, device=state.device)
    dist.all_reduce(any_differ, op=dist.ReduceOp.MAX)
    if any_differ.item():
        raise RuntimeError(
            f"Parameter hashes not matching across DP replicas after {iteration} iterations"
            + (f": {', '.join(differing)}" if differing else " (on other ranks)"))
    if state.rank == 0:
        print(f">>> Weight hashes match after {iteration} iterations...", flush=True)


class SignalFlag:
    """Records that `sig` arrived (the default action, usually termination, is replaced)
    until `release()` puts the previous handler back."""

    def __init__(self, sig: signal.Signals):
        self.sig = sig
        self.received = False
        self._previous = signal.signal(sig, self._handler)

    def _handler(self, signum, frame) -> None:
        self.received = True

    def release(self) -> None:
        if self._previous is not None:
            signal.signal(self.sig, self._previous)
            self._previous = None


def _record_signal_in_worker(signal_name: str, worker_id: int) -> None:
    SignalFlag(signal.Signals[signal_name])


def data_worker_init_fn(training: TrainingConfig) -> Optional[Callable[[int], None]]:
    """With --exit-signal-handler, DataLoader workers record --exit-signal instead of dying
    of it: SLURM signals every process of the job, and a dead worker would fail the main
    process's next batch before it could save (Megatron's worker_init_fn)."""
    if not training.exit_signal_handler:
        return None
    return functools.partial(_record_signal_in_worker, training.exit_signal)


class ExitConditions:
    """Decides after each iteration, identically on every rank, whether the run stops.

    `start_time`: when the run began (time.time()), the origin of --exit-duration-in-mins.
    """

    def __init__(self, training: TrainingConfig, device: torch.device,
                 start_time: Optional[float] = None):
        self.training = training
        self.device = device
        self.start_time = time.time() if start_time is None else start_time
        self.signal_flag = (SignalFlag(signal.Signals[training.exit_signal])
                            if training.exit_signal_handler else None)

    @property
    def needs_agreement(self) -> bool:
        """Whether a condition that any single rank can trigger is set (the signal handler,
        the duration): the ranks must then agree after every iteration."""
        return self.signal_flag is not None or bool(self.training.exit_duration_in_mins)

    def local_flags(self) -> Optional[torch.Tensor]:
        """(2,) float64 on the device, this rank's [received the signal, ran past the
        duration] as 0/1, for the step's agreement (`training.step_agreement`, where the ranks
        sum them); None when neither condition is set (the same on every rank)."""
        if not self.needs_agreement:
            return None
        training = self.training
        return torch.tensor([
            float(self.signal_flag is not None and self.signal_flag.received),
            float(bool(training.exit_duration_in_mins)
                  and (time.time() - self.start_time) / 60.0 > training.exit_duration_in_mins),
        ], dtype=torch.float64, device=self.device)

    def _agreed(self) -> tuple:
        """(any rank received the signal, any rank ran past the duration). One all-reduce,
        issued on every rank because the flags are the same everywhere."""
        local = self.local_flags()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(local)
        signalled, out_of_time = local.tolist()
        return signalled > 0, out_of_time > 0

    def out_of_time(self) -> bool:
        """Whether any rank has run past --exit-duration-in-mins (a collective when set)."""
        return bool(self.training.exit_duration_in_mins) and self._agreed()[1]

    def reason_to_exit(self, iteration: int,
                       agreed: Optional[Sequence[float]] = None) -> Optional[str]:
        """Why the run stops after `iteration` (a message for the log), or None. `agreed`:
        the sum over ranks of `local_flags()` taken in this iteration's step agreement (after
        its backward); without it the ranks agree here, in a collective of their own."""
        training = self.training
        if self.needs_agreement:
            if agreed is None:
                signalled, out_of_time = self._agreed()
            else:
                signalled, out_of_time = agreed[0] > 0, agreed[1] > 0
            if signalled:
                return f"exiting program after receiving {training.exit_signal}"
            if out_of_time:
                minutes = (time.time() - self.start_time) / 60.0
                return f"exiting program after {minutes:.2f} minutes"
        if training.exit_interval and iteration % training.exit_interval == 0:
            return f"exiting program at iteration {iteration}"
        return None

    def close(self) -> None:
        if self.signal_flag is not None:
            self.signal_flag.release()


__all__ = ["ExitConditions", "SignalFlag", "apply_deterministic_mode", "check_weight_hashes",
           "validate_run_control"]
