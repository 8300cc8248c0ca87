"""Megatron-LM main's own functional-test configs (d98e8a64dd; gpt and moe, inference tests left
out: 219), their MODEL_ARGS kept as test data in
tests/fixtures/megatron_main_configs/model_args.yaml, through argument parsing and validation
at a world size their layout fits. Each parses and validates, or is refused with a ConfigError
naming one of its flags, for a reason listed here: Megatron-LM's own on this hardware (FP8,
CUDA graphs, Transformer Engine or ModelOpt), or a capability not built here. A sample, one
per family of flags, shrunk to a tiny model on --mock-data, trains a real step on CPU."""
import os
import sys

import pytest
import yaml

from megatron_smp.config import ConfigError
from megatron_smp.training.arguments import parse_args, validate_configs
from megatron_smp.training.arguments.flags import (
    NEEDS_NVIDIA_FLAGS,
    NOT_SUPPORTED_YET_FLAGS,
    _LOW_PRECISION_FLAGS,
    _NOT_SUPPORTED_YET_VALUES,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))
from megatron_flag_audit import config_argv  # noqa: E402

with open(os.path.join(ROOT, "tests", "fixtures", "megatron_main_configs",
                       "model_args.yaml")) as _handle:
    CONFIGS = yaml.safe_load(_handle)

# The world sizes Megatron-LM runs these on (1 node of 8 GPUs, or more), and the model-parallel
# size times a power of 2.
WORLD_SIZES = (8, 16, 32, 64, 128, 256)


def argv_of(model_args):
    """The argv Megatron-LM's launcher gives (its ${...} filled, paths never read)."""
    return config_argv(model_args)


def outcome(model_args):
    """("ok", world size) or ("refused", message)."""
    try:
        configs = parse_args(argv_of(model_args))
    except ConfigError as error:
        return "refused", str(error)
    configs.model.vocab_size = configs.model.vocab_size or 1024
    parallel = configs.parallel
    model_parallel = (parallel.tensor_model_parallel_size * parallel.pipeline_model_parallel_size
                      * parallel.context_parallel_size)
    errors = []
    for world_size in sorted(set(WORLD_SIZES) | {model_parallel << k for k in range(6)}):
        try:
            validate_configs(configs, world_size=world_size)
            return "ok", world_size
        except ConfigError as error:
            errors.append(str(error))
    # At no world size: the error of a listed combination if one came up, else the first.
    listed = [e for e in errors if any(e.startswith(start) for start in NOT_BUILT_COMBINATIONS)]
    return "refused", (listed or errors)[0]


# Combinations refused at validation as not built here: {the error's start: what}.
NOT_BUILT_COMBINATIONS = {
    "--expert-tensor-parallel-size": "experts split over more TP ranks than the dense layers",
    "--async-save writes from a background thread over a gloo": "--async-save on NCCL without "
                                                                "gloo process groups",
}


def refusal_kind(message, model_args):
    """Why a config is refused: the flag named, and "hardware" (Megatron-LM refuses it too
    without NVIDIA GPUs and libraries) or "not built"."""
    given = {str(flag) for flag in model_args}
    for start in NOT_BUILT_COMBINATIONS:
        if message.startswith(start):
            return start.split()[0], "not built"
    for flag in sorted(given, key=len, reverse=True):
        if not message.startswith(flag):
            continue
        if flag in NEEDS_NVIDIA_FLAGS or flag in _LOW_PRECISION_FLAGS or \
                flag.startswith(("--fp8-", "--fp4-")):
            return flag, "hardware"
        if flag == "--wandb-project" and "not installed" in message:
            return flag, "library"  # as in Megatron-LM: wandb must be installed
        if flag in NOT_SUPPORTED_YET_FLAGS or any(flag == key for key, _ in
                                                  _NOT_SUPPORTED_YET_VALUES):
            return flag, "not built"
    raise AssertionError(f"refused for an unlisted reason: {message}")


def test_all_219_configs_parse_and_validate_or_are_refused_with_a_reason(monkeypatch):
    # The configs' ENV_VARS (left out of the test data) set this for --deterministic-mode.
    monkeypatch.setenv("NCCL_ALGO", "Ring")
    assert len(CONFIGS) == 219
    results = {name: outcome(args) for name, args in CONFIGS.items()}
    refused = {}
    for name, (kind, detail) in results.items():
        if kind == "refused":
            flag, why = refusal_kind(detail, CONFIGS[name])
            refused.setdefault(why, {}).setdefault(flag, []).append(name)
    ok = [name for name, (kind, _) in results.items() if kind == "ok"]
    counts = {why: sum(map(len, flags.values())) for why, flags in refused.items()}
    # Measured: 191 validate (193 where wandb is installed); 17 are refused as Megatron-LM
    # refuses them without NVIDIA GPUs and libraries (FP8, CUDA graphs, TP comm overlap,
    # fine-grained offloading, ModelOpt), 2 for want of wandb (as there); 9 need what is not
    # built here (options of Megatron-LM's own RL loop, hierarchical CP, ...).
    assert (len(ok) + counts.get("library", 0), counts.get("hardware", 0),
            counts.get("not built", 0)) == (193, 17, 9), (
        {why: {flag: len(names) for flag, names in flags.items()}
         for why, flags in refused.items()})


# One config per family of flags, run for real: the flags as the config gives them, but a tiny
# model on --mock-data at one process (the layout, data, checkpoint and logging destinations
# dropped; --bf16 / --fp16 kept off on CPU).
SAMPLES = (
    "gpt/gpt3_mcore_te_tp1_pp1_mup",                           # muP
    "gpt/gpt3_mcore_te_tp1_pp4_vp1_decoupled_lr",              # schedule flags
    "gpt/gpt3_mcore_te_tp2_pp1_gdn",                           # Gated DeltaNet hybrid
    "moe/gpt3_mcore_te_tp1_pp1_te_4experts_groupedGEMM_op_fuser",  # MoE, TE op fuser
    "moe/gpt3_moe_mcore_te_ep8_resume_torch_dist_dist_muon",   # Muon, layer-wise layout
)
_DROPPED = ("--data-path", "--data-cache-path", "--vocab-file", "--merge-file", "--split",
            "--tokenizer-type", "--tokenizer-model", "--load", "--save",
            "--wandb-project", "--wandb-exp-name", "--wandb-save-dir", "--save-interval",
            "--tensor-model-parallel-size", "--pipeline-model-parallel-size",
            "--context-parallel-size", "--expert-model-parallel-size",
            "--expert-tensor-parallel-size", "--num-layers-per-virtual-pipeline-stage",
            "--virtual-pipeline-model-parallel-size", "--decoder-first-pipeline-num-layers",
            "--decoder-last-pipeline-num-layers", "--sequence-parallel", "--bf16", "--fp16",
            "--distributed-backend", "--deterministic-mode", "--ckpt-format",
            "--use-checkpoint-args", "--exit-interval", "--num-workers", "--num-experts",
            "--moe-ffn-hidden-size", "--moe-router-topk", "--num-query-groups", "--kv-channels",
            "--ffn-hidden-size", "--hybrid-layer-pattern", "--hybrid-override-pattern")
_TINY = {"--num-layers": "2", "--hidden-size": "64", "--num-attention-heads": "4",
         "--seq-length": "32", "--max-position-embeddings": "32", "--micro-batch-size": "2",
         "--global-batch-size": "4", "--train-iters": "2", "--eval-iters": "1",
         "--eval-interval": "1000", "--lr-warmup-fraction": None, "--lr-warmup-iters": "1",
         "--lr-decay-iters": "2", "--log-interval": "1"}


def shrunk(model_args, tensorboard_dir):
    args = {flag: value for flag, value in model_args.items() if flag not in _DROPPED}
    if "--tensorboard-dir" in args:
        args["--tensorboard-dir"] = tensorboard_dir
    for flag, value in _TINY.items():
        args.pop(flag, None)
        if value is not None:
            args[flag] = value
    if "--num-experts" in model_args:
        args.update({"--num-experts": "4", "--moe-router-topk": "2",
                     "--moe-ffn-hidden-size": "64"})
    if "--group-query-attention" in model_args:
        args["--num-query-groups"] = "2"
    return argv_of(args) + ["--mock-data", "--tokenizer-type", "NullTokenizer",
                            "--vocab-size", "1000"]


def _steps(rank, world_size, runs):
    from megatron_smp.training import pretrain
    from pretrain_gpt import forward_step, model_provider, train_valid_test_datasets_provider

    return [[result.train_losses[i]["lm loss"] for i in sorted(result.train_losses)]
            for result in (pretrain(train_valid_test_datasets_provider, model_provider,
                                    forward_step, argv=argv) for argv in runs)]


def test_a_sample_of_configs_trains_a_step_on_cpu(monkeypatch, tmp_path):
    from megatron_smp.testing import run_distributed

    monkeypatch.setenv("NCCL_ALGO", "Ring")
    runs = [shrunk(CONFIGS[name], str(tmp_path / f"tb{index}"))
            for index, name in enumerate(SAMPLES)]
    (losses,) = run_distributed(_steps, 1, args=(runs,), timeout=300)
    for name, per_iteration in zip(SAMPLES, losses):
        # Two iterations from a random init over 1000 tokens: about ln(1000) = 6.9.
        assert len(per_iteration) == 2 and all(5.5 < loss < 8.5 for loss in per_iteration), (
            name, per_iteration)
