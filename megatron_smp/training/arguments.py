"""Megatron's command-line flags, mapped onto the typed config dataclasses.

Each flag is declared once in `_FLAGS` with the config section and field it fills, so the
argparse layer and the dataclasses cannot drift apart. Flag names are Megatron-LM's, so
users' existing pretraining shell scripts run unchanged; flags that only select a Megatron
implementation detail (fusions, legacy model paths) are accepted and ignored.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from megatron_smp.config import (
    CheckpointConfig,
    ConfigError,
    DataConfig,
    OptimizerConfig,
    ParallelConfig,
    TrainingConfig,
    TransformerConfig,
)

_SECTIONS = {
    "model": TransformerConfig,
    "parallel": ParallelConfig,
    "optimizer": OptimizerConfig,
    "training": TrainingConfig,
    "data": DataConfig,
    "checkpoint": CheckpointConfig,
}


@dataclass
class _Flag:
    flag: str
    section: Optional[str]  # None: an argument that is not a config field (post-processed)
    field: Optional[str]
    kwargs: Dict[str, Any]


def _f(flag: str, section: Optional[str], field: Optional[str] = None, **kwargs) -> _Flag:
    if field is None and section is not None:
        field = flag.lstrip("-").replace("-", "_")
    return _Flag(flag, section, field, kwargs)


def _int_pair(text: str):
    """'4095,0' or '(4095, 0)' -> (4095, 0), Megatron's --window-size syntax."""
    parts = text.strip().strip("()").split(",")
    try:
        if len(parts) != 2:
            raise ValueError
        return tuple(int(part) for part in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected two integers LEFT,RIGHT, got {text!r}")


_CHOICES_POSITION = ["learned_absolute", "rope", "alibi", "none"]

_FLAGS: List[_Flag] = [
    # Model shape.
    _f("--num-layers", "model", type=int, required=True),
    _f("--hidden-size", "model", type=int, required=True),
    _f("--ffn-hidden-size", "model", type=int),
    _f("--num-attention-heads", "model", type=int, required=True),
    _f("--kv-channels", "model", type=int),
    _f("--group-query-attention", None, "group_query_attention", action="store_true"),
    _f("--num-query-groups", None, "num_query_groups", type=int),
    _f("--max-position-embeddings", "model", type=int),
    _f("--make-vocab-size-divisible-by", "model", type=int, default=128),
    _f("--normalization", "model", choices=["LayerNorm", "RMSNorm"], default="LayerNorm"),
    _f("--norm-epsilon", "model", "layernorm_epsilon", type=float, default=1e-5),
    _f("--swiglu", None, "swiglu", action="store_true"),
    _f("--openai-gelu", None, "openai_gelu", action="store_true"),
    _f("--position-embedding-type", "model", choices=_CHOICES_POSITION,
       default="learned_absolute"),
    _f("--use-rotary-position-embeddings", None, "use_rotary_position_embeddings",
       action="store_true"),
    _f("--rotary-base", "model", type=float, default=10000.0),
    _f("--rotary-percent", "model", type=float, default=1.0),
    _f("--use-parallel-residual", "model", "parallel_residual", action="store_true"),
    _f("--window-size", "model", type=_int_pair, metavar="LEFT,RIGHT",
       help="sliding-window attention: query i sees keys i-LEFT..i+RIGHT (Mistral's "
       "sliding_window W is W-1,0)"),
    _f("--untie-embeddings-and-output-weights", "model", action="store_true"),
    _f("--hidden-dropout", "model", type=float, default=0.1),
    _f("--attention-dropout", "model", type=float, default=0.1),
    _f("--disable-bias-linear", None, "disable_bias_linear", action="store_true"),
    _f("--add-qkv-bias", "model", action="store_true"),
    _f("--init-method-std", "model", type=float, default=0.02),
    _f("--apply-query-key-layer-scaling", "model", action="store_true"),
    _f("--recompute-granularity", "model", choices=["full", "selective"]),
    _f("--recompute-method", "model", choices=["uniform", "block"]),
    _f("--recompute-num-layers", "model", type=int),
    _f("--num-experts", "model", "num_moe_experts", type=int, default=0),
    _f("--moe-router-topk", "model", type=int, default=2),
    # Parallelism.
    _f("--tensor-model-parallel-size", "parallel", type=int, default=1),
    _f("--pipeline-model-parallel-size", "parallel", type=int, default=1),
    _f("--context-parallel-size", "parallel", type=int, default=1),
    _f("--expert-model-parallel-size", "parallel", type=int, default=1),
    _f("--virtual-pipeline-model-parallel-size", "parallel", type=int),
    _f("--num-layers-per-virtual-pipeline-stage", None, "num_layers_per_virtual_pipeline_stage",
       type=int),
    _f("--decoder-first-pipeline-num-layers", None, "decoder_first_pipeline_num_layers", type=int),
    _f("--decoder-last-pipeline-num-layers", None, "decoder_last_pipeline_num_layers", type=int),
    _f("--sequence-parallel", "parallel", action="store_true"),
    _f("--pipeline-schedule", "training", choices=["simple", "interleaved"],
       default="interleaved"),
    _f("--pipeline-timeline", None, "pipeline_timeline"),  # Chrome trace per rank
    _f("--use-distributed-optimizer", "optimizer", action="store_true"),
    _f("--overlap-grad-reduce", "optimizer", action="store_true"),
    _f("--overlap-param-gather", "optimizer", action="store_true"),
    _f("--ddp-bucket-size", "optimizer", type=int),
    _f("--ddp-average-in-collective", "optimizer", action="store_true"),
    _f("--distributed-backend", None, "distributed_backend", choices=["nccl", "gloo"]),
    _f("--distributed-timeout-minutes", None, "distributed_timeout_minutes", type=int, default=10),
    _f("--smp-config", None, "smp_config", metavar="JSON",
       help="SMP v2 configuration (a JSON file or inline JSON object); its keys override "
       "the matching flags"),
    # Batch.
    _f("--micro-batch-size", "training", type=int, default=1),
    _f("--global-batch-size", "training", type=int),
    _f("--seq-length", "training", type=int, required=True),
    # Optimisation.
    _f("--optimizer", "optimizer", choices=["adam", "sgd"], default="adam"),
    _f("--lr", "optimizer", type=float, default=1e-4),
    _f("--min-lr", "optimizer", type=float, default=0.0),
    _f("--lr-decay-style", "optimizer", choices=["constant", "linear", "cosine"],
       default="linear"),
    _f("--lr-warmup-iters", "optimizer", type=int, default=0),
    _f("--lr-warmup-fraction", None, "lr_warmup_fraction", type=float),
    _f("--lr-decay-iters", "optimizer", type=int),
    _f("--weight-decay", "optimizer", type=float, default=0.01),
    _f("--clip-grad", "optimizer", type=float, default=1.0),
    _f("--adam-beta1", "optimizer", type=float, default=0.9),
    _f("--adam-beta2", "optimizer", type=float, default=0.999),
    _f("--adam-eps", "optimizer", type=float, default=1e-8),
    _f("--sgd-momentum", "optimizer", type=float, default=0.9),
    # Precision.
    _f("--fp16", None, "fp16", action="store_true"),
    _f("--bf16", None, "bf16", action="store_true"),
    _f("--loss-scale", "optimizer", type=float),
    _f("--initial-loss-scale", "optimizer", type=float, default=2.0**32),
    _f("--min-loss-scale", "optimizer", type=float, default=1.0),
    _f("--loss-scale-window", "optimizer", type=int, default=1000),
    _f("--hysteresis", "optimizer", type=int, default=2),
    # Run.
    _f("--train-iters", "training", type=int, required=True),
    _f("--seed", "training", type=int, default=1234),
    _f("--log-interval", "training", type=int, default=100),
    _f("--eval-interval", "training", type=int, default=1000),
    _f("--eval-iters", "training", type=int, default=100),
    _f("--tensorboard-dir", "training"),
    _f("--exit-interval", "training", type=int),
    # Data.
    _f("--data-path", "data", nargs="*", default=[]),
    _f("--split", "data", default="969,30,1"),
    _f("--mock-data", "data", action="store_true"),
    _f("--tokenizer-type", "data", default=None,
       choices=["NullTokenizer", "SentencePieceTokenizer", "GPTSentencePieceTokenizer",
                "Llama2Tokenizer", "HuggingFaceTokenizer", "GPT2BPETokenizer"]),
    _f("--tokenizer-model", "data"),
    _f("--vocab-file", "data"),
    _f("--merge-file", "data"),
    _f("--vocab-size", "data", type=int),
    _f("--reset-position-ids", "data", action="store_true"),
    _f("--reset-attention-mask", "data", action="store_true"),
    _f("--eod-mask-loss", "data", action="store_true"),
    _f("--num-workers", "data", type=int, default=0),
    _f("--data-cache-path", "data"),
    # Checkpoints.
    _f("--save", "checkpoint"),
    _f("--load", "checkpoint"),
    _f("--save-interval", "checkpoint", type=int),
    _f("--no-load-optim", "checkpoint", action="store_true"),
    _f("--no-load-rng", "checkpoint", action="store_true"),
    _f("--no-save-optim", "checkpoint", action="store_true"),
    _f("--no-save-rng", "checkpoint", action="store_true"),
    _f("--finetune", "checkpoint", action="store_true"),
    _f("--ckpt-format", "checkpoint", choices=["torch_dist", "torch"], default="torch_dist"),
    _f("--async-save", "checkpoint", action="store_true"),
    _f("--override-opt_param-scheduler", "checkpoint", "override_opt_param_scheduler",
       action="store_true"),
    _f("--use-checkpoint-opt_param-scheduler", "checkpoint",
       "use_checkpoint_opt_param_scheduler", action="store_true"),
]

# Flags of Megatron-LM that choose one of its implementation details (kernel fusions, legacy
# code paths, logging knobs). Accepted so existing scripts run; they change nothing here.
_IGNORED_SWITCHES = [
    "--use-flash-attn", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion",
    "--no-bias-swiglu-fusion", "--no-bias-dropout-fusion", "--no-rope-fusion",
    "--use-mcore-models", "--use-legacy-models", "--no-gradient-accumulation-fusion",
    "--use-cpu-initialization", "--no-async-tensor-model-parallel-allreduce",
    "--log-timers-to-tensorboard", "--log-validation-ppl-to-tensorboard",
    "--log-memory-to-tensorboard", "--log-throughput", "--log-params-norm",
    "--log-num-zeros-in-grad", "--accumulate-allreduce-grads-in-fp32",
    "--attention-softmax-in-fp32", "--no-query-key-layer-scaling", "--use-contiguous-buffers-in-local-ddp",
    "--manual-gc", "--no-create-attention-mask-in-dataloader", "--use-checkpoint-args",
    "--no-persist-layer-norm",
]
_IGNORED_VALUES = [
    "--transformer-impl", "--DDP-impl", "--timing-log-level", "--tensorboard-log-interval",
    "--attention-backend", "--manual-gc-interval", "--log-interval-memory",
    "--wandb-project", "--wandb-exp-name", "--tensorboard-queue-size",
]


def build_parser(extra_args_provider: Optional[Callable] = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="megatron_smp pretraining (Megatron-LM compatible flags)",
        allow_abbrev=False,
    )
    for spec in _FLAGS:
        dest = spec.field if spec.section is None else f"{spec.section}__{spec.field}"
        parser.add_argument(spec.flag, dest=dest, **spec.kwargs)
    for flag in _IGNORED_SWITCHES:
        parser.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
    for flag in _IGNORED_VALUES:
        parser.add_argument(flag, help=argparse.SUPPRESS)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser) or parser
    return parser


@dataclass
class Configs:
    """Everything one run needs, typed. `args` keeps the raw namespace for extra flags."""

    model: TransformerConfig
    parallel: ParallelConfig
    optimizer: OptimizerConfig
    training: TrainingConfig
    data: DataConfig
    checkpoint: CheckpointConfig
    args: argparse.Namespace
    extra: Dict[str, Any]

    def to_dict(self) -> Dict[str, Any]:
        """Plain-data view (for checkpoint metadata and logs)."""
        out = {}
        for name in _SECTIONS:
            section = dataclasses.asdict(getattr(self, name))
            out[name] = {k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in section.items()}
        return out


# SMP v2 key -> (config section, field) it sets when the user gives it.
_SMP_TO_FLAGS = {
    "tensor_parallel_degree": ("parallel", "tensor_model_parallel_size"),
    "pipeline_parallel_degree": ("parallel", "pipeline_model_parallel_size"),
    "context_parallel_degree": ("parallel", "context_parallel_size"),
    "expert_parallel_degree": ("parallel", "expert_model_parallel_size"),
    "hybrid_shard_degree": ("parallel", "hybrid_shard_degree"),
    "shard_optimizer_state": ("optimizer", "use_distributed_optimizer"),
    "random_seed": ("training", "seed"),
}


def _apply_smp_config(text: str, sections: Dict[str, Dict[str, Any]]) -> None:
    """Merge the keys of an SMP v2 JSON config over the parsed flags (validated by smp)."""
    import json

    from megatron_smp.parallel_state import launcher_world_size
    from megatron_smp.smp import parse_smp_config

    source: Any = text
    if text.lstrip().startswith("{"):
        try:
            source = json.loads(text)
        except json.JSONDecodeError as error:
            raise ConfigError(f"--smp-config is not valid JSON: {error}") from None
    given, values, _ = parse_smp_config(source, launcher_world_size())
    for key in given & set(_SMP_TO_FLAGS):
        section, name = _SMP_TO_FLAGS[key]
        sections[section][name] = values[key]


def parse_args(
    argv: Optional[Sequence[str]] = None,
    extra_args_provider: Optional[Callable] = None,
    args_defaults: Optional[Dict[str, Any]] = None,
) -> Configs:
    """Parse Megatron flags into `Configs`. Invalid values exit (argparse) or raise ConfigError.

    `args_defaults` maps flag destinations without dashes (e.g. "tokenizer_type") to defaults
    an entry script wants (Megatron's convention).
    """
    parser = build_parser(extra_args_provider)
    if args_defaults:
        by_field = {}
        for spec in _FLAGS:
            key = spec.flag.lstrip("-").replace("-", "_")
            by_field[key] = spec.field if spec.section is None else f"{spec.section}__{spec.field}"
        parser.set_defaults(**{by_field.get(k, k): v for k, v in args_defaults.items()})
    args = parser.parse_args(argv)

    sections: Dict[str, Dict[str, Any]] = {name: {} for name in _SECTIONS}
    for spec in _FLAGS:
        if spec.section is None:
            continue
        value = getattr(args, f"{spec.section}__{spec.field}")
        if value is not None:
            sections[spec.section][spec.field] = value

    model = sections["model"]
    training = sections["training"]
    data = sections["data"]
    if args.use_rotary_position_embeddings:
        model["position_embedding_type"] = "rope"
    if args.swiglu:
        model["gated_linear_unit"] = True
        model["activation"] = "silu"
        if model.get("ffn_hidden_size") is None:
            # Megatron's SwiGLU default: 2/3 of 4h (same parameter count), rounded to 64.
            model["ffn_hidden_size"] = int((4 * model["hidden_size"] * 2 / 3) / 64) * 64
    if args.openai_gelu:
        if args.swiglu:
            raise ConfigError("--openai-gelu and --swiglu are mutually exclusive; pick one")
        model["activation"] = "gelu_tanh"  # GPT-2's approximate GeLU ("gelu_new" in HF)
    if args.disable_bias_linear:
        model["add_bias_linear"] = False
    if args.group_query_attention:
        if args.num_query_groups is None:
            raise ConfigError("--group-query-attention needs --num-query-groups")
        model["num_query_groups"] = args.num_query_groups
    elif args.num_query_groups is not None:
        raise ConfigError("--num-query-groups is only used with --group-query-attention; add it")
    if model.get("max_position_embeddings") is None:
        model["max_position_embeddings"] = training["seq_length"]
    if args.fp16 and args.bf16:
        raise ConfigError("--fp16 and --bf16 are mutually exclusive; pick one")
    precision = {"fp16": args.fp16, "bf16": args.bf16}
    model.update(precision)
    model["params_dtype"] = (
        torch.float16 if args.fp16 else torch.bfloat16 if args.bf16 else torch.float32
    )
    sections["optimizer"].update(precision)
    model["sequence_parallel"] = sections["parallel"].get("sequence_parallel", False)
    # The vocabulary is known only once the tokenizer is built; filled in by pretrain.
    model.setdefault("vocab_size", data.get("vocab_size") or 0)

    extra: Dict[str, Any] = {}
    if args.smp_config:
        _apply_smp_config(args.smp_config, sections)

    if args.lr_warmup_fraction is not None:
        decay = sections["optimizer"].get("lr_decay_iters") or training["train_iters"]
        sections["optimizer"]["lr_warmup_iters"] = int(args.lr_warmup_fraction * decay)
    if sections["optimizer"].get("lr_decay_iters") is None:
        sections["optimizer"]["lr_decay_iters"] = training["train_iters"]

    built = {name: cls(**sections[name]) for name, cls in _SECTIONS.items()}
    configs = Configs(args=args, extra=extra, **built)
    configs.parallel.sequence_parallel = configs.model.sequence_parallel
    for name in (
        "num_layers_per_virtual_pipeline_stage",
        "decoder_first_pipeline_num_layers",
        "decoder_last_pipeline_num_layers",
        "distributed_backend",
        "distributed_timeout_minutes",
    ):
        extra[name] = getattr(args, name)
    validate_configs(configs)
    return configs


def validate_configs(configs: Configs, world_size: Optional[int] = None) -> None:
    """Check everything that can be checked before a process group exists.

    Runs identically on every rank, so a bad configuration fails everywhere at once.
    """
    from megatron_smp.parallel_state import launcher_world_size

    world_size = world_size or launcher_world_size()
    parallel = configs.parallel
    parallel.validate(world_size)
    tp_cp_pp = (
        parallel.tensor_model_parallel_size
        * parallel.context_parallel_size
        * parallel.pipeline_model_parallel_size
    )
    dp = world_size // tp_cp_pp
    configs.model.validate(parallel, configs.training.seq_length)
    configs.optimizer.validate()
    configs.training.num_microbatches(dp)
    if configs.training.micro_batch_size < 1:
        raise ConfigError("--micro-batch-size must be >= 1")
    if configs.training.train_iters < 1:
        raise ConfigError("--train-iters must be >= 1")
    data = configs.data
    if not data.mock_data and not data.data_path:
        raise ConfigError("give --data-path PREFIX [...] (a preprocessed dataset) or --mock-data")
    if configs.checkpoint.save_interval is not None and not configs.checkpoint.save:
        raise ConfigError("--save-interval needs --save DIR")


__all__ = ["Configs", "build_parser", "parse_args", "validate_configs"]
