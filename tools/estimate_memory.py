"""Plan a run's memory before getting the machines: per-rank parameters, gradients, optimizer
state and activations for pretrain flags at a target world size, without allocating.

    python tools/estimate_memory.py --world-size 128 [--entry llama] <pretrain flags...>

`--entry gpt` (default) takes pretrain_gpt.py's defaults, `--entry llama` pretrain_llama.py's
(RMSNorm, SwiGLU, RoPE, untied output, no biases, no dropout). The data flags may be left out:
the planner reads no data (--mock-data is assumed; give --vocab-size with the default
NullTokenizer, or a local tokenizer). `--device cpu` models the CPU attention kernels (the math
path under attention dropout); the default models CUDA's fused kernels. See
megatron_smp/training/memory_planner.py for what is counted and what is modelled.
"""
from __future__ import annotations

import argparse
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def entry_script(name: str):
    """(model_provider, args_defaults) of pretrain_<name>.py."""
    if name == "llama":
        from pretrain_llama import LLAMA_DEFAULTS, model_provider

        return model_provider, dict(LLAMA_DEFAULTS, tokenizer_type="NullTokenizer")
    from pretrain_gpt import model_provider

    return model_provider, {}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--entry", choices=["gpt", "llama"], default="gpt")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ours, pretrain_flags = parser.parse_known_args(argv)
    from megatron_smp.cli import CONFIG_ERROR_STATUS, print_error
    from megatron_smp.config import ConfigError
    from megatron_smp.training.memory_planner import report_from_argv

    data_flags = {"--mock-data", "--data-path", "--train-data-path", "--data-args-path",
                  "--per-split-data-args-path"}
    if not data_flags & set(pretrain_flags):
        pretrain_flags = pretrain_flags + ["--mock-data"]
    if not {"--train-iters", "--train-samples"} & set(pretrain_flags):
        pretrain_flags = pretrain_flags + ["--train-iters", "1"]  # the length changes nothing
    model_provider, defaults = entry_script(ours.entry)
    try:
        report = report_from_argv(pretrain_flags, ours.world_size, model_provider, defaults,
                                  ours.device)
    except ConfigError as exc:
        print_error(str(exc))
        return CONFIG_ERROR_STATUS
    print(report.table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
