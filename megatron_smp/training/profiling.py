"""Megatron's --profile: a trace of iterations --profile-step-start .. --profile-step-end.

With --use-pytorch-profiler, torch.profiler records 1-based iterations start .. end-1 (labelled
"ProfilerStep#<iteration>" in a run that starts at iteration 0; one warm-up iteration before
them is profiled but dropped) and writes a Chrome/TensorBoard trace into --tensorboard-dir,
exactly as Megatron-LM's schedule does. Without it, Megatron's NVIDIA Nsight Systems capture:
the CUDA profiler API is started before iteration start+1 and stopped after iteration end, with
NVTX ranges (run under `nsys profile --capture-range=cudaProfilerApi`); CUDA only.

--record-memory-history (CUDA only): the last rank records the caching allocator's history
and pickles `torch.cuda.memory._snapshot()` to --memory-snapshot-path after the run's first
iteration and every --log-interval iterations (open it at pytorch.org/memory_viz).
"""
from __future__ import annotations

import torch

from megatron_smp.config import ConfigError, TrainingConfig


def validate_profiling(training: TrainingConfig, cuda_available: bool) -> None:
    """ConfigError for profiling flags that cannot work (pure; every rank)."""
    if training.use_pytorch_profiler and not training.profile:
        raise ConfigError("--use-pytorch-profiler chooses how --profile records: add --profile")
    if training.record_memory_history and not cuda_available:
        raise ConfigError("--record-memory-history records the CUDA caching allocator and needs "
                          "a CUDA device; on CPU, --log-memory-to-tensorboard logs the resident "
                          "set instead")
    if not training.profile:
        return
    if not 0 <= training.profile_step_start < training.profile_step_end:
        raise ConfigError(
            f"--profile-step-start ({training.profile_step_start}) must be >= 0 and below "
            f"--profile-step-end ({training.profile_step_end})")
    if training.use_pytorch_profiler and not training.tensorboard_dir:
        raise ConfigError("--profile --use-pytorch-profiler writes its trace into "
                          "--tensorboard-dir: add --tensorboard-dir DIR")
    if not training.use_pytorch_profiler and not cuda_available:
        raise ConfigError("--profile without --use-pytorch-profiler drives NVIDIA Nsight Systems "
                          "through the CUDA profiler API and needs a CUDA device: add "
                          "--use-pytorch-profiler for a torch.profiler trace")


class StepProfiler:
    """Calls around each training iteration; does nothing on ranks not in --profile-ranks.

    `first_iteration`: the iteration the run resumes from (0 for a fresh run), so the window
    stays on the same global iterations after --load.
    """

    def __init__(self, training: TrainingConfig, rank: int, device: torch.device,
                 first_iteration: int, is_last_rank: bool = False):
        self.training = training
        self.enabled = training.profile and rank in training.profile_ranks
        self._profiler = None
        self._nvtx = None
        self._first_iteration = first_iteration
        self._memory_history = (training.record_memory_history and is_last_rank
                                and device.type == "cuda")
        if self._memory_history:
            torch.cuda.memory._record_memory_history(max_entries=100000)
        if not self.enabled or not training.use_pytorch_profiler:
            return
        start, end = training.profile_step_start, training.profile_step_end
        schedule = torch.profiler.schedule(wait=max(start - 1, 0), warmup=1 if start > 0 else 0,
                                           active=end - start, repeat=1)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profiler = torch.profiler.profile(
            activities=activities,
            schedule=lambda step: schedule(step + first_iteration),
            on_trace_ready=torch.profiler.tensorboard_trace_handler(training.tensorboard_dir),
            record_shapes=True,
            with_stack=True,
        )
        self._profiler.start()

    def before_iteration(self, iteration: int) -> None:
        """`iteration`: iterations finished so far."""
        if not self.enabled:
            return
        if self._profiler is not None:
            self._profiler.step()
        elif iteration == self.training.profile_step_start:
            torch.cuda.profiler.start()
            self._nvtx = torch.autograd.profiler.emit_nvtx(record_shapes=True)
            self._nvtx.__enter__()

    def after_iteration(self, iteration: int) -> None:
        """`iteration`: iterations finished, this one included."""
        if self.enabled and iteration == self.training.profile_step_end:
            self.close()
        if self._memory_history and (iteration % self.training.log_interval == 0
                                     or iteration == self._first_iteration + 1):
            import pickle

            with open(self.training.memory_snapshot_path, "wb") as handle:
                pickle.dump(torch.cuda.memory._snapshot(), handle)

    def close(self) -> None:
        """Stop (writing what was recorded); the run may end before --profile-step-end."""
        if self._profiler is not None:
            self._profiler.stop()
            self._profiler = None
        if self._nvtx is not None:
            torch.cuda.profiler.stop()
            self._nvtx.__exit__(None, None, None)
            self._nvtx = None
        self.enabled = False


__all__ = ["StepProfiler", "validate_profiling"]
