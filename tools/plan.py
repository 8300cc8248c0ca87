"""Plan a run before booking the GPUs: predicted step time, tokens/s and MFU per GPU.

For a layout on a cluster: the step time with its breakdown, tokens/s, model TFLOP/s and MFU
per GPU, its memory per GPU (the memory planner's) and whether it fits; with --search, every
layout that fits ranked by predicted tokens/s.

    python tools/plan.py --gpu h100-sxm --num-gpus 64 [--entry llama] <pretrain flags...>
    python tools/plan.py --gpu h100-sxm --num-gpus 64 --hf-config DIR --seq-length 8192 \\
        --global-batch-size 512 --bf16 --search [--top 5] [--json]

The pretrain flags are the entry script's (`--entry gpt`: pretrain_gpt.py's defaults, `llama`:
pretrain_llama.py's); the data flags may be left out (no data is read; give --vocab-size with
the default NullTokenizer). `--hf-config DIR` takes the model's shape from a Hugging Face
config.json (the flags then give the run: sequence length, batch, layout, precision,
recompute). `--gpu cpu --efficiency FILE` uses the constants `tools/bench/calibrate_planner.py`
measured on this machine. See megatron_smp/training/planner.py for the cost model.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tools"))

# The run-level fields of the model config the flags set even with --hf-config (the HF
# config gives the shape, the flags how it is trained).
RUN_FIELDS = ("params_dtype", "bf16", "fp16", "sequence_parallel", "recompute_granularity",
              "recompute_method", "recompute_num_layers", "recompute_modules",
              "moe_token_dispatcher_type", "moe_grouped_gemm", "moe_expert_capacity_factor",
              "moe_pad_expert_input_to_capacity", "cp_comm_type",
              "gradient_accumulation_fusion", "mtp_num_layers")


def build_parser() -> argparse.ArgumentParser:
    from megatron_smp.training.planner import GPUS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", choices=sorted(GPUS) + ["cpu"], default="h100-sxm",
                        help="accelerator preset (vendor figures in training/planner.py); "
                             "cpu: this machine, with --efficiency")
    parser.add_argument("--num-gpus", type=int, required=True,
                        help="GPUs of the run (the world size)")
    parser.add_argument("--gpus-per-node", type=int, default=None,
                        help="GPUs sharing NVLink; default: the preset's (8; GB200: 72)")
    parser.add_argument("--intra-node-bandwidth", type=float, default=None,
                        help="GB/s per GPU, one direction (NVLink); default: the preset's")
    parser.add_argument("--inter-node-bandwidth", type=float, default=None,
                        help="GB/s per GPU, one direction (InfiniBand / RoCE / EFA)")
    parser.add_argument("--intra-node-latency", type=float, default=None, help="microseconds")
    parser.add_argument("--inter-node-latency", type=float, default=None, help="microseconds")
    parser.add_argument("--fp8-format", choices=["e4m3", "hybrid"], default=None,
                        help="time the linear layers' GEMMs at the GPU's FP8 peak "
                             "(Transformer Engine); this repository trains in BF16")
    parser.add_argument("--tp-comm-overlap", action="store_true",
                        help="Megatron-LM's TP communication overlap (userbuffers) on GPU")
    parser.add_argument("--moe-imbalance", type=float, default=1.0,
                        help="busiest EP rank's routed tokens / the mean (1.0: balanced)")
    parser.add_argument("--attention-flops", choices=["causal", "full"], default="causal",
                        help="MFU's attention convention (Megatron-LM's formula: causal "
                             "since March 2025, full before)")
    parser.add_argument("--memory-fraction", type=float, default=0.95,
                        help="share of HBM a rank may fill (the rest: CUDA context, "
                             "allocator fragmentation, communication buffers)")
    parser.add_argument("--efficiency", default=None,
                        help="JSON of efficiency constants (calibrate_planner.py's output)")
    parser.add_argument("--hf-config", default=None,
                        help="a Hugging Face model directory (config.json): the model's shape")
    parser.add_argument("--entry", choices=["gpt", "llama"], default="gpt",
                        help="whose defaults the flags take: pretrain_gpt.py's or "
                             "pretrain_llama.py's")
    parser.add_argument("--search", action="store_true",
                        help="rank every layout that fits (TP, PP, VPP, CP, EP, DP, "
                             "micro-batch, recompute, distributed optimizer / FSDP2)")
    parser.add_argument("--top", type=int, default=10,
                        help="--search: layouts printed (0: every one that fits)")
    parser.add_argument("--json", action="store_true",
                        help="print the plan (or the ranked layouts) as JSON")
    return parser


def _hf_model_config(directory: str):
    from transformers import AutoConfig

    from megatron_smp.config import ConfigError
    from megatron_smp.models.hf import get_adapter

    if not os.path.exists(os.path.join(directory, "config.json")):
        raise ConfigError(f"--hf-config {directory}: no config.json there")
    hf_config = AutoConfig.from_pretrained(directory)
    return get_adapter(hf_config).config_from_hf(hf_config)


def load_configs(ours, pretrain_flags):
    """The run's `Configs` from the entry script's flags (and --hf-config's shape)."""
    from estimate_memory import entry_script

    from megatron_smp.data import build_tokenizer
    from megatron_smp.training.arguments import parse_args

    model_provider, defaults = entry_script(ours.entry)
    flags = list(pretrain_flags)
    data_flags = {"--mock-data", "--data-path", "--train-data-path", "--data-args-path",
                  "--per-split-data-args-path"}
    if not data_flags & set(flags):
        flags.append("--mock-data")
    if not {"--train-iters", "--train-samples"} & set(flags):
        flags += ["--train-iters", "1"]
    hf_model = None
    if ours.hf_config:
        hf_model = _hf_model_config(ours.hf_config)
        for flag, value in (("--num-layers", hf_model.num_layers),
                            ("--hidden-size", hf_model.hidden_size),
                            ("--num-attention-heads", hf_model.num_attention_heads),
                            ("--vocab-size", hf_model.vocab_size)):
            if flag in flags:
                from megatron_smp.config import ConfigError

                raise ConfigError(f"{flag}: --hf-config gives the model's shape; drop {flag}")
            flags += [flag, str(value)]
        defaults = dict(defaults, tokenizer_type="NullTokenizer")
    configs = parse_args(flags, None, defaults)
    if hf_model is not None:
        run = {name: getattr(configs.model, name) for name in RUN_FIELDS}
        if run["mtp_num_layers"] is None:
            run.pop("mtp_num_layers")
        configs.model = hf_model.replace(**run)
    else:
        configs.model.vocab_size = build_tokenizer(configs.data).vocab_size
    return configs, model_provider


def cluster_from(ours):
    from megatron_smp.config import ConfigError
    from megatron_smp.training.planner import GPUS, GPU_EFFICIENCY, Cluster, load_efficiency

    efficiency = load_efficiency(ours.efficiency) if ours.efficiency else GPU_EFFICIENCY
    if ours.gpu == "cpu":
        if not ours.efficiency:
            raise ConfigError("--gpu cpu needs --efficiency FILE (tools/bench/"
                              "calibrate_planner.py measures it on this machine)")
        from megatron_smp.training.planner import cpu_spec

        gpu = cpu_spec(ours.efficiency)
    else:
        gpu = GPUS[ours.gpu]
    for flag in ("num_gpus", "gpus_per_node"):
        value = getattr(ours, flag)
        if value is not None and value < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be >= 1, got {value}")

    def scaled(value, unit):
        return None if value is None else value * unit

    return Cluster(gpu, ours.num_gpus, gpus_per_node=ours.gpus_per_node,
                   intra_node_bandwidth=scaled(ours.intra_node_bandwidth, 1e9),
                   inter_node_bandwidth=scaled(ours.inter_node_bandwidth, 1e9),
                   intra_node_latency=scaled(ours.intra_node_latency, 1e-6),
                   inter_node_latency=scaled(ours.inter_node_latency, 1e-6),
                   efficiency=efficiency)


def main(argv=None) -> int:
    ours, pretrain_flags = build_parser().parse_known_args(argv)
    from megatron_smp.cli import CONFIG_ERROR_STATUS, print_error
    from megatron_smp.config import ConfigError
    from megatron_smp.training import planner
    from megatron_smp.training.arguments import validate_configs

    try:
        cluster = cluster_from(ours)
        configs, model_provider = load_configs(ours, pretrain_flags)
        options = planner.PlanOptions(
            precision="fp8" if ours.fp8_format else None,
            tp_comm_overlap=ours.tp_comm_overlap, moe_imbalance=ours.moe_imbalance,
            attention_flops=ours.attention_flops, memory_fraction=ours.memory_fraction)
        if ours.moe_imbalance < 1.0:
            raise ConfigError(f"--moe-imbalance {ours.moe_imbalance}: the busiest rank gets "
                              "at least the mean (>= 1.0)")
        if ours.search:
            results, candidates = planner.search(configs, cluster, model_provider, options,
                                                 top=ours.top)
        else:
            validate_configs(configs, cluster.num_gpus)
            results, candidates = [planner.predict(configs, cluster, model_provider,
                                                   options)], 1
    except ConfigError as exc:
        print_error(str(exc))
        return CONFIG_ERROR_STATUS
    if ours.json:
        print(json.dumps({"gpu": cluster.gpu.name, "num_gpus": cluster.num_gpus,
                          "candidates": candidates,
                          "plans": [r.to_dict() for r in results]}, indent=1))
    elif ours.search:
        print(f"{candidates} layouts predicted on {cluster.num_gpus} x {cluster.gpu.name}; "
              f"the fastest {len(results)} that fit (times in ms):")
        print(planner.format_table(results))
        if results:
            print("flags of #1: " + " ".join(results[0].layout.flags()))
    else:
        print(planner.format_prediction(results[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
