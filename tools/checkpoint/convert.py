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
    python tools/checkpoint/convert.py --model-type gptj --loader smp_v1 --saver hf \
        --load-dir v1/checkpoint.pt --hf-config v1/ --save-dir hf/gptj   # SMP v1's smp.save file
    python tools/checkpoint/convert.py --model-type llama --loader megatron_smp --saver hf \
        --load-dir ckpt/lora --save-dir hf/merged --peft-dir hf/adapter  # a --lora-rank run:
                                        # the merged HF model, and the PEFT adapter directory

Every loader -- HF safetensors, megatron_smp, Megatron-LM (torch_dist, or legacy per-rank
files, memory-mapped) and SMP v1 (its file memory-mapped) -- feeds every saver (hf,
megatron_smp, megatron) one layer at a time (see `streaming`: peak memory about a layer plus
the embedding, whatever the model's size; a vocabulary table and its tied head held once);
the HF output is sharded as save_pretrained shards it (--max-shard-size). Read whole, then
written a tensor at a time: LoRA exports, pytorch_model.bin, MXFP4 experts, multimodal
Gemma 3, megatron_smp's "torch" format.
A Megatron-LM checkpoint saved without `args` takes its model shape from the tensors and from
Megatron's flags given here (--num-attention-heads, --num-query-groups, --swiglu, ...).
Framework checkpoints hold global tensors and reshard when loaded, so the target sizes are
only validated against the model shape and recorded as the intended layout. Every conversion
checks the input's names and shapes, maps the result back to compare with the input bit for
bit, and re-reads what it wrote; any difference is an error, never a warning.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import sys
from typing import Dict, List, Optional, Sequence

import torch
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron_smp.config import ConfigError, TransformerConfig  # noqa: E402
from tools.checkpoint.common import (  # noqa: E402
    MODEL_TYPES,
    compare_state_dicts,
    family_for,
    listing,
)
from tools.checkpoint.hf_format import (  # noqa: E402
    HFStream,
    framework_from_hf_state_dict,
    hf_state_dict_from_framework,
    quantize_hf_experts,
    read_hf_checkpoint,
    write_hf_checkpoint,
    write_hf_checkpoint_streaming,
)
from tools.checkpoint.megatron_format import (  # noqa: E402
    add_shape_arguments,
    open_megatron_checkpoint,
    read_megatron_checkpoint,
    write_megatron_checkpoint,
    write_megatron_checkpoint_streaming,
)
from tools.checkpoint.smp_format import (  # noqa: E402
    open_smp_checkpoint,
    read_smp_checkpoint,
    write_smp_checkpoint,
    write_smp_checkpoint_streaming,
)
from tools.checkpoint.streaming import Producer, groups, parse_size  # noqa: E402
from tools.checkpoint.smp_v1_format import (  # noqa: E402
    open_smp_v1_stream,
    read_smp_v1_checkpoint,
)

# "megatron": Megatron-LM's checkpoints (read: torch_dist or legacy torch; written: legacy).
FORMATS = ("hf", "megatron_smp", "megatron")
# "smp_v1": the full-model file SMP v1's smp.save(..., partial=False) wrote (read only).
LOADERS = FORMATS + ("smp_v1",)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--model-type", required=True, choices=sorted(MODEL_TYPES))
    parser.add_argument("--loader", required=True, choices=LOADERS)
    parser.add_argument("--saver", required=True, choices=FORMATS)
    parser.add_argument("--load-dir", required=True,
                        help="the checkpoint directory (--loader smp_v1: the file smp.save "
                        "wrote, or a directory holding it)")
    parser.add_argument("--hf-config", default=None,
                        help="--loader smp_v1: the model's Hugging Face config.json (or its "
                        "directory); default: config.json beside the checkpoint file")
    parser.add_argument("--save-dir", required=True)
    parser.add_argument("--target-tensor-parallel-size", type=int, default=None,
                        help="TP size: written (megatron saver) or intended (megatron_smp saver)")
    parser.add_argument("--target-pipeline-parallel-size", type=int, default=None,
                        help="PP size: written (megatron saver) or intended (megatron_smp saver)")
    parser.add_argument("--peft-dir", default=None,
                        help="--loader megatron_smp of a --lora-rank run: also write its LoRA "
                        "adapters as a PEFT adapter directory (adapter_config.json + "
                        "adapter_model.safetensors, for peft.PeftModel.from_pretrained on "
                        "the base HF model); the saver always gets the adapters merged into "
                        "the base weights")
    parser.add_argument("--pretrained-checkpoint", default=None,
                        help="--loader megatron_smp of a small LoRA checkpoint (adapters only): "
                        "its base model's checkpoint directory; default: the base it records")
    parser.add_argument("--mxfp4-experts", action="store_true",
                        help="--saver hf, gpt_oss: store the expert projections in MXFP4 "
                        "(*_blocks + *_scales, as the published checkpoints; lossy) instead "
                        "of the model's dtype")
    parser.add_argument("--max-shard-size", default="50GB",
                        help="--saver hf: the largest safetensors file, as save_pretrained's "
                        "max_shard_size (5GB, 500MB or bytes; 1 GB = 10^9 bytes): a model "
                        "larger than it is written as model-0000k-of-0000n.safetensors with "
                        "model.safetensors.index.json (default: 50GB, save_pretrained's)")
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


def _return_freed_memory() -> None:
    """glibc raises its mmap threshold after each large free (up to 32 MiB), after which
    tensors of a layer's size come from the heap, whose freed memory is seldom given back to
    the system: a conversion that frees each layer after writing it would still grow by about
    a layer at a time. A fixed threshold keeps every tensor's memory a mapping of its own,
    unmapped when it is freed."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 64 << 10)  # M_MMAP_THRESHOLD, 64 KiB
    except (OSError, AttributeError):  # not glibc
        pass


def convert(args: argparse.Namespace) -> None:
    family = family_for(args.model_type)
    _return_freed_memory()
    if args.hf_config is not None and args.loader != "smp_v1":
        raise ConfigError("--hf-config gives the model's shape to --loader smp_v1 only; the "
                          f"{args.loader} loader reads it from the checkpoint")
    if args.loader != "smp_v1" and not os.path.isdir(args.load_dir):
        raise ConfigError(f"--load-dir {args.load_dir} does not exist")
    _check_save_dir(args.save_dir, args.load_dir)
    targets = (args.target_tensor_parallel_size, args.target_pipeline_parallel_size)
    if args.saver == "hf" and targets != (None, None):
        raise ConfigError("--target-*-parallel-size apply to --saver megatron_smp / megatron")
    if args.peft_dir is not None and args.loader != "megatron_smp":
        raise ConfigError("--peft-dir exports the LoRA adapters of a megatron_smp checkpoint "
                          "(--loader megatron_smp)")
    if args.pretrained_checkpoint is not None and args.loader != "megatron_smp":
        raise ConfigError("--pretrained-checkpoint names the base of a megatron_smp LoRA "
                          "checkpoint (--loader megatron_smp)")
    if args.mxfp4_experts and (args.saver != "hf" or family != "gpt_oss"):
        raise ConfigError("--mxfp4-experts writes a gpt-oss HF checkpoint's experts in MXFP4: "
                          "it needs --saver hf and --model-type gpt_oss")

    if args.max_shard_size != "50GB" and args.saver != "hf":
        raise ConfigError("--max-shard-size sizes the safetensors files of --saver hf")
    max_shard_size = parse_size(args.max_shard_size)
    stream = _open_stream(args)
    if stream is not None:
        _write_stream(args, stream, targets, max_shard_size)
        return
    source_hf_config: Optional[Dict] = None
    iteration = None
    if args.loader in ("hf", "smp_v1"):
        if args.loader == "hf":
            hf_config, config, hf_sd = read_hf_checkpoint(args.load_dir, family, args.model_type)
        else:
            hf_config, config, hf_sd = read_smp_v1_checkpoint(args.load_dir, family,
                                                               args.model_type, args.hf_config)
        model = framework_from_hf_state_dict(family, config, hf_sd)
        # The mapping must be invertible on this very input.
        compare_state_dicts(hf_sd, hf_state_dict_from_framework(family, config, model),
                            f"mapping {args.load_dir} to the framework and back")
        source_hf_config = hf_config.to_diff_dict()
    elif args.loader == "megatron":
        config, model, iteration = read_megatron_checkpoint(args.load_dir, family,
                                                            args.model_type, args)
    else:
        config, model, common = read_smp_checkpoint(args.load_dir, family, args.model_type,
                                                    pretrained=args.pretrained_checkpoint)
        conversion = common["config"].get("conversion") or {}
        source_hf_config = conversion.get("hf_config")
        iteration = common.get("iteration")
        model = _export_lora(args, config, model, common)

    if args.saver == "hf":
        write_hf_checkpoint(args.save_dir, family, config, model, source_hf_config,
                            max_shard_size)
        if args.mxfp4_experts:
            quantize_hf_experts(args.save_dir)
    elif args.saver == "megatron":
        tp, pp = (t or 1 for t in targets)
        validate_target_layout(config, tp, pp)
        write_megatron_checkpoint(args.save_dir, config, model, tp, pp, iteration)
    else:
        tp, pp = (t or 1 for t in targets)
        validate_target_layout(config, tp, pp)
        write_smp_checkpoint(args.save_dir, config, model,
                             _conversion(args, source_hf_config, tp, pp), iteration)
    _report(args, model)


def _conversion(args: argparse.Namespace, source_hf_config: Optional[Dict], tp: int,
                pp: int) -> Dict:
    """What a megatron_smp checkpoint records of its conversion (common.json)."""
    return {
        "loader": args.loader,
        "model_type": args.model_type,
        "source": os.path.abspath(args.load_dir),
        "hf_config": source_hf_config,
        "target_layout": {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp},
    }


def _report(args: argparse.Namespace, model: Dict[str, torch.Tensor]) -> None:
    print(f"converted {args.load_dir} ({args.loader}) -> {args.save_dir} ({args.saver}): "
          f"{args.model_type}, {len(model)} tensors, "
          f"{sum(t.numel() for t in model.values()):,} parameters, verified")


class _Stream:
    """A checkpoint read a group (a layer, or a tensor outside the layers) at a time: its
    TransformerConfig, its framework tensors as meta tensors (checkpoint form), a `Producer`
    of them, the source's HF config (or None) and its iteration (or None)."""

    def __init__(self, config, meta, producer, source_hf_config=None, iteration=None) -> None:
        self.config, self.meta, self.producer = config, meta, producer
        self.source_hf_config, self.iteration = source_hf_config, iteration

    def read(self, names: List[str]) -> Dict[str, torch.Tensor]:
        return {name: self.producer(name) for name in names}


def _open_stream(args: argparse.Namespace) -> Optional[_Stream]:
    """The --load-dir checkpoint as a `_Stream`, or None for what is read whole: HF's
    pytorch_model.bin, MXFP4 or multimodal checkpoints (`HFStream.of`), a LoRA run's or a
    "torch"-format megatron_smp checkpoint (`open_smp_checkpoint`), an SMP v1 file whose
    translation needs the values (`open_smp_v1_stream`)."""
    family = family_for(args.model_type)
    if args.loader == "hf":
        hf = HFStream.of(args.load_dir, family, args.model_type)
        if hf is None:
            return None
        return _Stream(hf.config, hf.meta, Producer(hf.groups()), hf.hf_config.to_diff_dict())
    if args.loader == "smp_v1":
        v1 = open_smp_v1_stream(args.load_dir, family, args.model_type, args.hf_config)
        if v1 is None:
            return None
        return _Stream(v1.config, v1.meta, Producer(v1.groups()), v1.hf_config.to_diff_dict())
    if args.loader == "megatron":
        config, meta, read, iteration = open_megatron_checkpoint(args.load_dir, family,
                                                                 args.model_type, args)
        return _Stream(config, meta, Producer(read(names) for names in groups(meta)),
                       None, iteration)
    if args.peft_dir is not None or args.pretrained_checkpoint is not None:
        return None
    opened = open_smp_checkpoint(args.load_dir, family, args.model_type)
    if opened is None:
        return None
    config, common, meta, read = opened
    return _Stream(config, meta, Producer(read(names) for names in groups(meta)),
                   (common["config"].get("conversion") or {}).get("hf_config"),
                   common.get("iteration"))


def _write_stream(args: argparse.Namespace, stream: _Stream, targets,
                  max_shard_size: int) -> None:
    """Write `stream` with the --saver's streaming writer: each group's tensors are asked for
    when the writer comes to them, so only about a group is in memory."""
    family = family_for(args.model_type)
    if args.saver == "hf":
        write_hf_checkpoint_streaming(args.save_dir, family, stream.config, stream.meta,
                                      stream.read, stream.source_hf_config, max_shard_size)
        if args.mxfp4_experts:
            quantize_hf_experts(args.save_dir)
    else:
        tp, pp = (t or 1 for t in targets)
        validate_target_layout(stream.config, tp, pp)
        if args.saver == "megatron":
            write_megatron_checkpoint_streaming(args.save_dir, stream.config, stream.meta,
                                                stream.read, tp, pp, stream.iteration)
        else:
            write_smp_checkpoint_streaming(
                args.save_dir, stream.config, stream.meta, stream.producer,
                _conversion(args, stream.source_hf_config, tp, pp), stream.iteration)
    stream.producer.drain()
    if stream.producer.held:
        raise ConfigError(f"the conversion produced tensors the model does not have: "
                          f"{listing(sorted(stream.producer.held))}")
    _report(args, stream.meta)


def _export_lora(args: argparse.Namespace, config: TransformerConfig,
                 model: Dict[str, torch.Tensor], common: Dict) -> Dict[str, torch.Tensor]:
    """A --lora-rank run's checkpoint: write the PEFT directory (--peft-dir) and return the
    model with the adapters merged into the base (W + alpha / r * B A), which the saver
    writes. A checkpoint without adapters is returned as it is."""
    from megatron_smp.models.hf.peft import lora_to_peft, save_peft_adapter
    from megatron_smp.tensor_parallel.lora import merge_lora

    adapters = sorted(name for name in model if ".lora.lora_" in name)
    if not adapters:
        if args.peft_dir is not None:
            raise ConfigError(f"--peft-dir: {args.load_dir} holds no LoRA adapters (it was not "
                              "saved by a --lora-rank run)")
        return model
    training = common["config"].get("training") or {}
    rank, alpha = training.get("lora_rank"), training.get("lora_alpha")
    targets = training.get("lora_target_modules")
    if not rank or alpha is None or not targets:
        raise ConfigError(f"{args.load_dir} holds LoRA adapters but its common.json has no "
                          "lora_rank / lora_alpha / lora_target_modules")
    if args.peft_dir is not None:
        _check_save_dir(args.peft_dir, args.load_dir)
        from safetensors.torch import load_file

        save_peft_adapter(args.peft_dir, model, config, rank, alpha,
                          training.get("lora_dropout", 0.0), targets,
                          base_model_name_or_path=(common["config"].get("conversion") or {})
                          .get("source"))
        compare_state_dicts(lora_to_peft(model, config, targets),
                            load_file(os.path.join(args.peft_dir, "adapter_model.safetensors")),
                            f"re-reading {args.peft_dir}")
        print(f"wrote the PEFT adapter directory {args.peft_dir}: rank {rank}, alpha {alpha}, "
              f"{len(adapters)} adapter tensors of {', '.join(targets)}")
    print(f"merging the LoRA adapters (rank {rank}, alpha {alpha}) into the base weights")
    return merge_lora(model, alpha, rank)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Returns the exit status: 0, or 2 after printing what is wrong and what would work."""
    from megatron_smp.cli import CONFIG_ERROR_STATUS, print_error

    args = build_parser().parse_args(argv)
    try:
        convert(args)
    except ConfigError as error:  # CheckpointError is one too
        print_error(str(error))
        return CONFIG_ERROR_STATUS
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__: List[str] = ["main", "convert", "build_parser", "validate_target_layout"]
