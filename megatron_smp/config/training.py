"""TrainingConfig: batch sizes, run length, LoRA, logging, run control and profiling."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from megatron_smp.config.errors import _require


@dataclass
class TrainingConfig:
    micro_batch_size: int = 1
    global_batch_size: Optional[int] = None  # None: micro_batch_size * data-parallel size
    seq_length: int = 1024
    # None with --train-samples: pretrain derives it (Megatron's update_train_iters).
    train_iters: Optional[int] = 100
    train_samples: Optional[int] = None
    # Megatron's --rampup-batch-size START INCREMENT SAMPLES: the global batch grows from
    # START by INCREMENT over SAMPLES consumed samples (training/num_microbatches.py).
    rampup_batch_size: Optional[List[int]] = None
    # Megatron-LM main's --step-batch-size-schedule "THRESHOLD:BS ...": the global batch is BS
    # from THRESHOLD consumed tokens on (K/M/B/T suffixes; training/num_microbatches.py).
    step_batch_size_schedule: Optional[str] = None
    seed: int = 1234
    # LoRA fine-tuning (Megatron-Bridge's names and defaults): --lora-rank > 0 attaches
    # adapters to --lora-target-modules and freezes the rest (tensor_parallel/lora.py).
    lora_rank: int = 0
    lora_alpha: float = 32.0
    lora_dropout: float = 0.0
    lora_target_modules: List[str] = field(
        default_factory=lambda: ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"])
    log_interval: int = 10
    eval_interval: int = 1000
    eval_iters: int = 10
    tensorboard_dir: Optional[str] = None
    pipeline_schedule: str = "interleaved"  # SMP: "simple" | "interleaved"
    # Megatron's --microbatch-group-size-per-virtual-pipeline-stage: the interleaved schedule
    # runs each model chunk on this many microbatches in turn (None: the pipeline size).
    microbatch_group_size_per_vp_stage: Optional[int] = None
    exit_interval: Optional[int] = None
    # Logging, as Megatron's flags of the same names.
    log_throughput: bool = False  # tokens/s and TFLOP/s/GPU in the log line
    log_timers_to_tensorboard: bool = False  # iteration-time scalar
    log_validation_ppl_to_tensorboard: bool = False  # "<loss> validation ppl" scalars
    log_memory_to_tensorboard: bool = False  # mem-* scalars (CUDA allocator, or RSS on CPU)
    tensorboard_log_interval: int = 1
    tensorboard_queue_size: int = 1000
    # Python's cyclic garbage collector off, run every `manual_gc_interval` iterations instead
    # (0: only at start and around evaluation), so collections do not stall random steps.
    manual_gc: bool = False
    manual_gc_interval: int = 0
    manual_gc_eval: bool = True  # collect before and after each evaluation
    # Megatron's --empty-unused-memory-level: hand the CUDA caching allocator's unused blocks
    # back after each training step's forward-backward and each evaluation step (>= 1), and
    # after the optimizer step too (2). A CPU run has no such cache.
    empty_unused_memory_level: int = 0
    # Run control, as Megatron's flags of the same names (training/run_control.py): each
    # exit condition saves a checkpoint (with --save) and ends the run without the final
    # evaluation.
    exit_duration_in_mins: Optional[int] = None
    exit_signal_handler: bool = False
    exit_signal: str = "SIGTERM"  # a signal.Signals name
    skip_train: bool = False  # evaluate validation and test sets only
    deterministic_mode: bool = False  # torch.use_deterministic_algorithms(True)
    # Megatron's result validation (training/result_validation.py): NaN/Inf in each loss and
    # each bucket's local grad norm stops the run, after an in-place rerun in
    # "validate_results" mode; "disabled" raises at once.
    check_for_nan_in_loss_and_grad: bool = True
    # Megatron's non-fatal checks: a loss (a bucket's local grad norm) at least 10x the largest
    # of the first 100 seen is rerun in place, reported, and training goes on.
    check_for_spiky_loss: bool = False
    check_for_large_grads: bool = False
    rerun_mode: str = "validate_results"
    # Megatron's --error-injection-rate / --error-injection-type (its RerunErrorInjector):
    # rehearsing the reruns above with injected errors (training/result_validation.py).
    error_injection_rate: int = 0
    error_injection_type: str = "transient_error"
    check_weight_hash_across_dp_replicas_interval: Optional[int] = None
    # torch.compile backend for each transformer layer (--torch-compile; None: eager).
    torch_compile: Optional[str] = None
    log_params_norm: bool = False  # " params norm:" field and params-norm scalar
    log_progress: bool = False  # <--save>/progress.txt: job starts, saves, throughput
    log_loss_scale_to_tensorboard: bool = True  # loss-scale scalar
    log_world_size_to_tensorboard: bool = False  # world-size scalar
    # Megatron's --moe-per-layer-logging: moe/<loss>_layer_<i> scalars per MoE layer.
    moe_per_layer_logging: bool = False
    logging_level: Optional[int] = None  # Python logging's root level (MEGATRON_LOGGING_LEVEL)
    # torch.profiler trace of iterations profile_step_start..profile_step_end-1 (Megatron's
    # --profile --use-pytorch-profiler) on the global ranks in profile_ranks.
    profile: bool = False
    use_pytorch_profiler: bool = False
    profile_step_start: int = 10
    profile_step_end: int = 12
    profile_ranks: list = field(default_factory=lambda: [0])
    # CUDA: the caching allocator's history, pickled to memory_snapshot_path by the last rank
    # at each --log-interval (torch.cuda.memory._snapshot(), for pytorch.org/memory_viz).
    record_memory_history: bool = False
    memory_snapshot_path: str = "snapshot.pickle"
    # --report-memory: rank 0 prints training/memory_planner.py's per-rank estimate first.
    report_memory: bool = False
    # Weights & Biases logging of the TensorBoard scalars on the last rank (wandb optional).
    wandb_project: Optional[str] = None
    wandb_exp_name: Optional[str] = None
    wandb_save_dir: Optional[str] = None
    wandb_entity: Optional[str] = None

    def num_microbatches(self, data_parallel_size: int) -> int:
        global_batch = self.global_batch_size or self.micro_batch_size * data_parallel_size
        per_step = self.micro_batch_size * data_parallel_size
        _require(
            global_batch % per_step == 0,
            f"--global-batch-size ({global_batch}) must be divisible by --micro-batch-size "
            f"({self.micro_batch_size}) x data-parallel size ({data_parallel_size}) = {per_step}",
        )
        return global_batch // per_step
