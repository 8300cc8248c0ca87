"""Convert checkpoints between Hugging Face and megatron_smp (Megatron's convert.py flags).

    python tools/checkpoint/convert.py --model-type llama --loader hf --saver megatron_smp \
        --load-dir hf/llama-7b --save-dir ckpt/llama-7b \
        --target-tensor-parallel-size 2 --target-pipeline-parallel-size 2
    python pretrain_llama.py ... --load ckpt/llama-7b --finetune     # at any TP/PP/DP layout
    python tools/checkpoint/convert.py --model-type llama --loader megatron_smp --saver hf \
        --load-dir ckpt/trained --save-dir hf/trained                # from_pretrained-loadable
    python tools/checkpoint/convert.py --model-type llama --loader megatron --saver hf \
        --load-dir megatron/ckpt --save-dir hf/llama    # Megatron-LM torch_dist or legacy
    python tools/checkpoint/convert.py --model-type llama --loader megatron_smp --saver megatron \
        --load-dir ckpt/trained --save-dir megatron/back \
        --target-tensor-parallel-size 2                 # Megatron-LM's legacy format, TP=2

A loader gives (TransformerConfig, full model tensors in checkpoint form); a saver writes them.
A Megatron-LM checkpoint saved without `args` takes its model shape from the tensors and from
Megatron's flags given here (--num-attention-heads, --num-query-groups, --swiglu, ...).
Framework checkpoints hold global tensors and reshard when loaded, so the target sizes are
only validated against the model shape and recorded as the intended layout. Every conversion
checks the input's names and shapes, maps the result back to compare with the input bit for
bit, and re-reads what it wrote; any difference is an error, never a warning.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Dict, List, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron_smp.config import ConfigError, TransformerConfig  # noqa: E402
from tools.checkpoint.common import MODEL_TYPES, compare_state_dicts, family_for  # noqa: E402
from tools.checkpoint.hf_format import (  # noqa: E402
    framework_from_hf_state_dict,
    hf_state_dict_from_framework,
    quantize_hf_experts,
    read_hf_checkpoint,
    write_hf_checkpoint,
)
from tools.checkpoint.megatron_format import (  # noqa: E402
    add_shape_arguments,
    read_megatron_checkpoint,
    write_megatron_checkpoint,
)
from tools.checkpoint.smp_format import read_smp_checkpoint, write_smp_checkpoint  # noqa: E402

# "megatron": Megatron-LM's checkpoints (read: torch_dist or legacy torch; written: legacy).
FORMATS = ("hf", "megatron_smp", "megatron")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--model-type", required=True, choices=sorted(MODEL_TYPES))
    parser.add_argument("--loader", required=True, choices=FORMATS)
    parser.add_argument("--saver", required=True, choices=FORMATS)
    parser.add_argument("--load-dir", required=True)
    parser.add_argument("--save-dir", required=True)
    parser.add_argument("--target-tensor-parallel-size", type=int, default=None,
                        help="TP size: written (megatron saver) or intended (megatron_smp saver)")
    parser.add_argument("--target-pipeline-parallel-size", type=int, default=None,
                        help="PP size: written (megatron saver) or intended (megatron_smp saver)")
    parser.add_argument("--mxfp4-experts", action="store_true",
                        help="--saver hf, gpt_oss: store the expert projections in MXFP4 "
                        "(*_blocks + *_scales, as the published checkpoints; lossy) instead "
                        "of the model's dtype")
    add_shape_arguments(parser)
    return parser


def validate_target_layout(config: TransformerConfig, tp: int, pp: int) -> None:
    """The model must split over `tp` tensor- and `pp` pipeline-parallel ranks."""
    if tp < 1 or pp < 1:
        raise ConfigError("--target-tensor/pipeline-parallel-size must be >= 1")
    for what, value in (("num_attention_heads", config.num_attention_heads),
                        ("num_query_groups", config.num_query_groups),
                        ("ffn_hidden_size", config.ffn_hidden_size)):
        if value % tp:
            raise ConfigError(
                f"--target-tensor-parallel-size {tp} does not divide the model's {what} "
                f"({value}); use a divisor of {what}"
            )
    if config.num_layers % pp:
        raise ConfigError(
            f"--target-pipeline-parallel-size {pp} does not divide num_layers "
            f"({config.num_layers}); use a divisor of {config.num_layers}"
        )


def _check_save_dir(save_dir: str, load_dir: str) -> None:
    if os.path.abspath(save_dir) == os.path.abspath(load_dir):
        raise ConfigError("--save-dir must differ from --load-dir")
    if os.path.isdir(save_dir) and os.listdir(save_dir):
        raise ConfigError(
            f"--save-dir {save_dir} is not empty ({sorted(os.listdir(save_dir))[:5]}); give a "
            "new or empty directory so no stale file mixes with the converted checkpoint"
        )


def convert(args: argparse.Namespace) -> None:
    family = family_for(args.model_type)
    if not os.path.isdir(args.load_dir):
        raise ConfigError(f"--load-dir {args.load_dir} does not exist")
    _check_save_dir(args.save_dir, args.load_dir)
    targets = (args.target_tensor_parallel_size, args.target_pipeline_parallel_size)
    if args.saver == "hf" and targets != (None, None):
        raise ConfigError("--target-*-parallel-size apply to --saver megatron_smp / megatron")
    if args.mxfp4_experts and (args.saver != "hf" or family != "gpt_oss"):
        raise ConfigError("--mxfp4-experts writes a gpt-oss HF checkpoint's experts in MXFP4: "
                          "it needs --saver hf and --model-type gpt_oss")

    source_hf_config: Optional[Dict] = None
    iteration = None
    if args.loader == "hf":
        hf_config, config, hf_sd = read_hf_checkpoint(args.load_dir, family, args.model_type)
        model = framework_from_hf_state_dict(family, config, hf_sd)
        # The mapping must be invertible on this very input.
        compare_state_dicts(hf_sd, hf_state_dict_from_framework(family, config, model),
                            f"mapping {args.load_dir} to the framework and back")
        source_hf_config = hf_config.to_diff_dict()
    elif args.loader == "megatron":
        config, model, iteration = read_megatron_checkpoint(args.load_dir, family,
                                                            args.model_type, args)
    else:
        config, model, common = read_smp_checkpoint(args.load_dir, family, args.model_type)
        conversion = common["config"].get("conversion") or {}
        source_hf_config = conversion.get("hf_config")
        iteration = common.get("iteration")

    if args.saver == "hf":
        write_hf_checkpoint(args.save_dir, family, config, model, source_hf_config)
        if args.mxfp4_experts:
            quantize_hf_experts(args.save_dir)
    elif args.saver == "megatron":
        tp, pp = (t or 1 for t in targets)
        validate_target_layout(config, tp, pp)
        write_megatron_checkpoint(args.save_dir, config, model, tp, pp, iteration)
    else:
        tp, pp = (t or 1 for t in targets)
        validate_target_layout(config, tp, pp)
        conversion = {
            "loader": args.loader,
            "model_type": args.model_type,
            "source": os.path.abspath(args.load_dir),
            "hf_config": source_hf_config,
            "target_layout": {"tensor_model_parallel_size": tp,
                              "pipeline_model_parallel_size": pp},
        }
        write_smp_checkpoint(args.save_dir, config, model, conversion, iteration)
    print(f"converted {args.load_dir} ({args.loader}) -> {args.save_dir} ({args.saver}): "
          f"{args.model_type}, {len(model)} tensors, "
          f"{sum(t.numel() for t in model.values()):,} parameters, verified")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Returns the exit status: 0, or 1 after printing what is wrong and what would work."""
    args = build_parser().parse_args(argv)
    try:
        convert(args)
    except ConfigError as error:  # CheckpointError is one too
        print(f"convert.py: error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__: List[str] = ["main", "convert", "build_parser", "validate_target_layout"]
