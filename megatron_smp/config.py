"""Typed configuration for every part of megatron_smp.

These dataclasses are the single source of truth; `training/arguments.py` maps
Megatron's command-line flags onto them and `smp.init` maps the SMP v2 JSON keys
onto them. This module imports nothing of ours.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Optional, Tuple

import torch


class ConfigError(ValueError):
    """A configuration that cannot work. The message names the flag and what would work."""


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


# What each not-yet-built capability is called in errors, so the user knows it is missing and
# not misconfigured.
NOT_SUPPORTED_YET = "is not supported yet (megatron_smp has no {what} yet); remove it"


def not_supported(setting: str, what: str) -> ConfigError:
    """The error for a setting whose capability does not exist yet (never silently ignored)."""
    return ConfigError(f"{setting} {NOT_SUPPORTED_YET.format(what=what)}")


# How validation messages name ParallelConfig fields: Megatron's flags by default; `smp.init`
# passes the SMP v2 keys instead so each user sees the name they wrote.
FLAG_NAMES = {
    "tensor_model_parallel_size": "--tensor-model-parallel-size",
    "pipeline_model_parallel_size": "--pipeline-model-parallel-size",
    "context_parallel_size": "--context-parallel-size",
    "expert_model_parallel_size": "--expert-model-parallel-size",
    "virtual_pipeline_model_parallel_size": "--virtual-pipeline-model-parallel-size",
    "hybrid_shard_degree": "hybrid_shard_degree (--smp-config)",
}


@dataclass
class ParallelConfig:
    """Degrees of every parallelism and the pipeline layout. World size = tp * cp * dp * pp
    (ep divides dp)."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    # None: derived from the world size at init.
    data_parallel_size: Optional[int] = None
    virtual_pipeline_model_parallel_size: Optional[int] = None
    # Alternative to the virtual size: layers per virtual stage (Megatron's flag).
    num_layers_per_virtual_pipeline_stage: Optional[int] = None
    # Uneven pipeline split: layers on the first / last stage, the rest split evenly.
    decoder_first_pipeline_num_layers: Optional[int] = None
    decoder_last_pipeline_num_layers: Optional[int] = None
    # Chrome trace of the pipeline schedule, one file per rank (PATH.rank<r>.json).
    pipeline_timeline: Optional[str] = None
    # SMP v2 sharded data parallelism: 0 (off) or 1 (NO_SHARD) replicate like plain data
    # parallelism; N >= 2 would shard within groups of N ranks, which needs FSDP.
    hybrid_shard_degree: int = 0
    distributed_backend: Optional[str] = None  # None: nccl with CUDA, else gloo
    distributed_timeout_minutes: int = 10

    def data_parallel_size_for(self, world_size: int) -> int:
        return world_size // (
            self.tensor_model_parallel_size
            * self.context_parallel_size
            * self.pipeline_model_parallel_size
        )

    def check_supported(self, names: Optional[dict] = None) -> None:
        """ConfigError for degrees whose capability does not exist yet. The process groups
        for cp/ep are built (ParallelState), but no layer uses them: a model or a training
        run asked for them would silently be something else."""
        name = dict(FLAG_NAMES, **(names or {}))
        if self.context_parallel_size > 1:
            raise not_supported(
                f"{name['context_parallel_size']} {self.context_parallel_size}",
                "context parallelism",
            )
        if self.expert_model_parallel_size > 1:
            raise not_supported(
                f"{name['expert_model_parallel_size']} {self.expert_model_parallel_size}",
                "mixture-of-experts layers",
            )
        if self.hybrid_shard_degree >= 2:
            raise not_supported(
                f"{name['hybrid_shard_degree']} = {self.hybrid_shard_degree}",
                "sharded data parallelism (FSDP); use 0 or 1, or the distributed optimizer "
                "(--use-distributed-optimizer / shard_optimizer_state) to shard optimizer state",
            )

    def validate(self, world_size: int, names: Optional[dict] = None) -> None:
        """Check the degrees against `world_size`. Pure: reads the config, never changes it.

        `names` maps field names to how the user spelled them (default: Megatron's flags).
        """
        name = dict(FLAG_NAMES, **(names or {}))
        for field_name in (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "context_parallel_size",
            "expert_model_parallel_size",
        ):
            value = getattr(self, field_name)
            _require(
                isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                f"{name[field_name]} must be a positive integer, got {value!r}",
            )
        _require(
            self.hybrid_shard_degree >= 0,
            f"{name['hybrid_shard_degree']} must be >= 0, got {self.hybrid_shard_degree}",
        )
        tp, cp, pp = (self.tensor_model_parallel_size, self.context_parallel_size,
                      self.pipeline_model_parallel_size)
        model_parallel = tp * cp * pp
        _require(
            world_size % model_parallel == 0,
            f"world size {world_size} is not divisible by {name['tensor_model_parallel_size']} "
            f"({tp}) x {name['context_parallel_size']} ({cp}) x "
            f"{name['pipeline_model_parallel_size']} ({pp}) = {model_parallel}; launch a "
            f"multiple of {model_parallel} processes or change the degrees",
        )
        data_parallel = world_size // model_parallel
        if self.data_parallel_size is not None:
            _require(
                self.data_parallel_size == data_parallel,
                f"world size {world_size} is not tp x cp x pp x dp: with tp={tp}, cp={cp}, "
                f"pp={pp} the data-parallel size must be {data_parallel}, not "
                f"{self.data_parallel_size}",
            )
        _require(
            data_parallel % self.expert_model_parallel_size == 0,
            f"{name['expert_model_parallel_size']} ({self.expert_model_parallel_size}) must "
            f"divide the data-parallel size ({data_parallel})",
        )
        if pp == 1:
            pipeline_only = {
                name["virtual_pipeline_model_parallel_size"]:
                    self.virtual_pipeline_model_parallel_size,
                "--num-layers-per-virtual-pipeline-stage":
                    self.num_layers_per_virtual_pipeline_stage,
                "--decoder-first-pipeline-num-layers": self.decoder_first_pipeline_num_layers,
                "--decoder-last-pipeline-num-layers": self.decoder_last_pipeline_num_layers,
                "--pipeline-timeline": self.pipeline_timeline,
            }
            given = [flag for flag, value in pipeline_only.items() if value is not None]
            _require(
                not given,
                f"{', '.join(given)} only apply with {name['pipeline_model_parallel_size']} "
                "> 1; drop them or add pipeline stages",
            )
        _require(
            self.distributed_backend in (None, "nccl", "gloo"),
            f"--distributed-backend must be nccl or gloo, got {self.distributed_backend!r}",
        )


# TransformerConfig fields that change the function a model computes without changing any
# tensor shape: weights trained under other values would load without error and be wrong.
FUNCTION_FIELDS = (
    "normalization", "layernorm_epsilon", "activation", "gated_linear_unit",
    "position_embedding_type", "rotary_base", "rotary_percent", "parallel_residual",
    "window_size",
)


@dataclass
class TransformerConfig:
    """Shape and numerics of a decoder-only transformer (GPT, Llama, Mistral, Mixtral).

    `vocab_size` is the tokenizer's true vocabulary; the embedding is padded to a multiple of
    `make_vocab_size_divisible_by * tensor_model_parallel_size` and the padded rows never
    take part in the loss or in returned logits.
    """

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int
    max_position_embeddings: int
    ffn_hidden_size: Optional[int] = None
    num_query_groups: Optional[int] = None  # None: multi-head attention (= num_attention_heads)
    # Head dim; None: hidden_size // num_attention_heads, which must then divide evenly. Set it
    # for models whose heads x head dim differs from hidden_size (Mistral-style head_dim).
    kv_channels: Optional[int] = None
    make_vocab_size_divisible_by: int = 128

    normalization: str = "LayerNorm"  # "LayerNorm" | "RMSNorm"
    layernorm_epsilon: float = 1e-5
    activation: str = "gelu"  # "gelu" | "gelu_tanh" | "silu" (with gated_linear_unit: SwiGLU)
    gated_linear_unit: bool = False
    position_embedding_type: str = "learned_absolute"  # "learned_absolute"|"rope"|"alibi"|"none"
    rotary_base: float = 10000.0
    rotary_percent: float = 1.0
    # GPT-NeoX: attention and MLP read the same input and add into one residual.
    parallel_residual: bool = False
    # Sliding-window attention (Mistral), flash-attention's convention: query i attends to
    # keys i - left .. i + right; left -1 = unbounded. A decoder needs right == 0. Mistral's
    # `sliding_window` W is (W - 1, 0). None: full causal attention.
    window_size: Optional[Tuple[int, int]] = None
    add_bias_linear: bool = True
    add_qkv_bias: bool = False  # Only used when add_bias_linear is False.
    untie_embeddings_and_output_weights: bool = False
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    init_method_std: float = 0.02
    # Megatron scales the init of output projections by 1/sqrt(2 * num_layers).
    use_scaled_init_method: bool = True

    params_dtype: torch.dtype = torch.float32
    fp16: bool = False
    bf16: bool = False
    sequence_parallel: bool = False

    # Memory.
    recompute_granularity: Optional[str] = None  # None | "full" | "selective"
    recompute_method: Optional[str] = None  # "uniform" | "block"
    recompute_num_layers: Optional[int] = None

    def __post_init__(self) -> None:
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if (self.kv_channels is None and self.num_attention_heads
                and self.hidden_size % self.num_attention_heads == 0):
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if self.window_size is not None:  # JSON (common.json, --smp-config) gives a list
            self.window_size = tuple(int(v) for v in self.window_size)

    def validate(self, parallel: ParallelConfig, seq_length: Optional[int] = None,
                 names: Optional[dict] = None) -> None:
        """Check the model against the parallel layout (and sequence length). Pure."""
        parallel.check_supported(names)
        tp = parallel.tensor_model_parallel_size
        _require(self.num_layers >= 1, f"--num-layers must be >= 1, got {self.num_layers}")
        _require(
            self.num_attention_heads >= 1,
            f"--num-attention-heads must be >= 1, got {self.num_attention_heads}",
        )
        _require(
            self.vocab_size >= 1,
            f"the vocabulary size must be >= 1, got {self.vocab_size} (it comes from the "
            "tokenizer; with --tokenizer-type NullTokenizer give --vocab-size)",
        )
        _require(
            self.kv_channels is None or self.kv_channels >= 1,
            f"--kv-channels must be >= 1, got {self.kv_channels}",
        )
        _require(
            self.hidden_size % self.num_attention_heads == 0 or self.kv_channels is not None,
            f"--hidden-size ({self.hidden_size}) must be divisible by --num-attention-heads "
            f"({self.num_attention_heads}), or set --kv-channels",
        )
        _require(
            self.num_attention_heads % tp == 0,
            f"--num-attention-heads ({self.num_attention_heads}) must be divisible by "
            f"--tensor-model-parallel-size ({tp})",
        )
        _require(
            self.num_attention_heads % self.num_query_groups == 0,
            f"--num-attention-heads ({self.num_attention_heads}) must be divisible by "
            f"--num-query-groups ({self.num_query_groups})",
        )
        _require(
            self.num_query_groups % tp == 0,
            f"--num-query-groups ({self.num_query_groups}) must be divisible by "
            f"--tensor-model-parallel-size ({tp})",
        )
        _require(
            self.ffn_hidden_size % tp == 0,
            f"--ffn-hidden-size ({self.ffn_hidden_size}) must be divisible by "
            f"--tensor-model-parallel-size ({tp})",
        )
        _require(
            self.normalization in ("LayerNorm", "RMSNorm"),
            f"--normalization must be LayerNorm or RMSNorm, got {self.normalization!r}",
        )
        _require(
            self.position_embedding_type in ("learned_absolute", "rope", "alibi", "none"),
            "--position-embedding-type must be one of learned_absolute, rope, alibi, none; got "
            f"{self.position_embedding_type!r}",
        )
        _require(
            not (self.fp16 and self.bf16), "--fp16 and --bf16 are mutually exclusive; pick one"
        )
        if self.window_size is not None:
            left, right = self.window_size
            _require(
                right == 0 and (left >= 0 or left == -1),
                f"--window-size {left},{right}: a decoder attends only to the past, so it must "
                "be LEFT,0 with LEFT >= 0 (or -1 for an unbounded window)",
            )
        if seq_length is not None:
            _require(
                self.position_embedding_type != "learned_absolute"
                or seq_length <= self.max_position_embeddings,
                f"--seq-length ({seq_length}) must not exceed --max-position-embeddings "
                f"({self.max_position_embeddings})",
            )
        if self.sequence_parallel and seq_length is not None:
            _require(
                seq_length % (tp * parallel.context_parallel_size) == 0,
                f"--seq-length ({seq_length}) must be divisible by tensor-model-parallel-size"
                f" x context-parallel-size ({tp * parallel.context_parallel_size}) with "
                "--sequence-parallel",
            )

    def padded_vocab_size(self, tensor_model_parallel_size: int) -> int:
        multiple = self.make_vocab_size_divisible_by * tensor_model_parallel_size
        return int(math.ceil(self.vocab_size / multiple) * multiple)

    def replace(self, **changes) -> "TransformerConfig":
        return dataclasses.replace(self, **changes)


@dataclass
class OptimizerConfig:
    optimizer: str = "adam"  # "adam" | "sgd"
    lr: float = 1e-4
    min_lr: float = 0.0
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.9
    clip_grad: float = 1.0
    lr_decay_style: str = "linear"  # "constant" | "linear" | "cosine"
    lr_warmup_iters: int = 0
    lr_decay_iters: Optional[int] = None
    fp16: bool = False
    bf16: bool = False
    use_distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    # fp16 loss scaling: None = dynamic.
    loss_scale: Optional[float] = None
    initial_loss_scale: float = 2.0**32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2
    ddp_bucket_size: Optional[int] = None
    ddp_average_in_collective: bool = False
    accumulate_allreduce_grads_in_fp32: bool = True
    # Count zero grad elements each step (returned by optimizer.step()).
    log_num_zeros_in_grad: bool = False

    def validate(self) -> None:
        _require(
            self.optimizer in ("adam", "sgd"),
            f"--optimizer must be adam or sgd, got {self.optimizer!r}",
        )
        _require(
            self.lr_decay_style in ("constant", "linear", "cosine"),
            f"--lr-decay-style must be constant, linear or cosine, got {self.lr_decay_style!r}",
        )
        _require(not (self.fp16 and self.bf16), "--fp16 and --bf16 are mutually exclusive")
        _require(
            not self.overlap_param_gather or self.use_distributed_optimizer,
            "--overlap-param-gather needs --use-distributed-optimizer",
        )


@dataclass
class TrainingConfig:
    micro_batch_size: int = 1
    global_batch_size: Optional[int] = None  # None: micro_batch_size * data-parallel size
    seq_length: int = 1024
    train_iters: int = 100
    seed: int = 1234
    log_interval: int = 10
    eval_interval: int = 1000
    eval_iters: int = 10
    tensorboard_dir: Optional[str] = None
    pipeline_schedule: str = "interleaved"  # SMP: "simple" | "interleaved"
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

    def num_microbatches(self, data_parallel_size: int) -> int:
        global_batch = self.global_batch_size or self.micro_batch_size * data_parallel_size
        per_step = self.micro_batch_size * data_parallel_size
        _require(
            global_batch % per_step == 0,
            f"--global-batch-size ({global_batch}) must be divisible by --micro-batch-size "
            f"({self.micro_batch_size}) x data-parallel size ({data_parallel_size}) = {per_step}",
        )
        return global_batch // per_step


@dataclass
class DataConfig:
    data_path: list = field(default_factory=list)  # Megatron's "[weight] prefix ..." list
    split: str = "969,30,1"
    mock_data: bool = False
    tokenizer_type: str = "NullTokenizer"
    tokenizer_model: Optional[str] = None
    vocab_file: Optional[str] = None
    merge_file: Optional[str] = None
    vocab_size: Optional[int] = None
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    num_workers: int = 0
    data_cache_path: Optional[str] = None
    # SentencePieceTokenizer: T5-style <extra_id_i> tokens appended to the vocabulary.
    vocab_extra_ids: int = 0


@dataclass
class CheckpointConfig:
    save: Optional[str] = None
    load: Optional[str] = None
    save_interval: Optional[int] = None
    no_load_optim: bool = False
    no_load_rng: bool = False
    finetune: bool = False
    ckpt_format: str = "torch_dist"  # "torch_dist" | "torch"
    async_save: bool = False
    # Megatron's --no-save-rng / --no-save-optim: leave those states out of saved checkpoints.
    no_save_rng: bool = False
    no_save_optim: bool = False
    # Megatron: a checkpoint's LR-schedule values that differ from the flags are an error
    # unless one of these says which side wins.
    override_opt_param_scheduler: bool = False  # the command line wins
    use_checkpoint_opt_param_scheduler: bool = False  # the checkpoint wins
