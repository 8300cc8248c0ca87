"""The learning-rate schedule and the batch-size ramp-up against megatron-core 0.16.1.

tests/fixtures/megatron_schedule/megatron_schedule.json holds, for each case's flags, what
Megatron-LM's training loop does at DP=2, micro-batch 2: the number of iterations
(update_train_iters), and per iteration the global batch size, the consumed samples and the
learning rates of a default and a --decoupled-lr param group (make_megatron_schedule.py says
how it was made). Here the same flags go through our parse_args / validate_configs, the
NumMicrobatchesCalculator, get_param_groups and OptimizerParamScheduler, stepped as
pretrain's loop steps them.
"""
import json
import math
import os

import pytest
import torch

from megatron_smp.config import ConfigError, OptimizerConfig
from megatron_smp.optimizer import get_param_groups
from megatron_smp.training.arguments import parse_args, validate_configs
from megatron_smp.training.num_microbatches import NumMicrobatchesCalculator
from megatron_smp.training.optimizer_param_scheduler import OptimizerParamScheduler

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "..", "fixtures", "megatron_schedule",
                       "megatron_schedule.json")
with open(FIXTURE) as _handle:
    MEGATRON = json.load(_handle)
MODEL = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
         "--mock-data --micro-batch-size 2").split()


def parse(argv, world_size=2):
    configs = parse_args(MODEL + argv)
    configs.model.vocab_size = 1000
    validate_configs(configs, world_size=world_size)
    return configs


class _Optimizer:
    """Stands in for a MegatronOptimizer: the scheduler only writes its param_groups."""

    def __init__(self, groups):
        self.param_groups = groups


GPT_PARAMETER_SHAPES = {
    "embedding.word_embeddings.weight": (6, 4), "embedding.position_embeddings.weight": (5, 4),
    "decoder.linear.weight": (4, 4), "decoder.linear.bias": (4,), "output_layer.weight": (6, 4),
}


def module_with_parameters(shapes, init=torch.zeros):
    """A module whose parameters have the given dotted names (GPTModel's, here) and shapes."""
    model = torch.nn.Module()
    for name, shape in shapes.items():
        module = model
        *parents, leaf = name.split(".")
        for parent in parents:
            if not hasattr(module, parent):
                module.add_module(parent, torch.nn.Module())
            module = getattr(module, parent)
        module.register_parameter(leaf, torch.nn.Parameter(init(shape)))
    return model


@pytest.mark.parametrize("name", sorted(MEGATRON["cases"]))
def test_schedule_and_batch_sizes_equal_megatron(name):
    case = MEGATRON["cases"][name]
    configs = parse(case["flags"], world_size=MEGATRON["data_parallel_size"])
    training = configs.training
    batch_sizes = NumMicrobatchesCalculator(training, MEGATRON["data_parallel_size"])
    train_iters = batch_sizes.train_iters(training.train_iters, training.train_samples)
    assert train_iters == case["train_iters"]

    groups = get_param_groups([module_with_parameters(GPT_PARAMETER_SHAPES)],
                              configs.optimizer)
    # Default schedule first (the logged LR); the word embedding and output layer apart.
    assert [g["default_config"] for g in groups] == [True, True, False]
    assert [len(g["params"]) for g in groups] == [2, 1, 2]
    optimizer = _Optimizer(groups)
    scheduler = OptimizerParamScheduler(
        optimizer, configs.optimizer, train_iters, train_samples=training.train_samples,
        global_batch_size=batch_sizes.global_batch_size)
    assert scheduler.lr_warmup_steps == pytest.approx(case["lr_warmup_steps"], rel=1e-12)
    assert scheduler.lr_decay_steps == case["lr_decay_steps"]

    consumed = 0
    for expected in case["iterations"]:
        micro_batches = batch_sizes.num_microbatches_at(consumed)
        global_batch = micro_batches * training.micro_batch_size * MEGATRON["data_parallel_size"]
        scheduler.step(global_batch)
        consumed += global_batch
        assert global_batch == expected["global_batch_size"]
        assert consumed == expected["consumed_samples"]
        assert groups[0]["lr"] == pytest.approx(expected["lr"], rel=1e-12, abs=1e-15)
        assert groups[1]["lr"] == groups[0]["lr"]
        assert groups[2]["lr"] == pytest.approx(expected["decoupled_lr"], rel=1e-12, abs=1e-15)


def test_fixture_covers_every_decay_style_and_ramp():
    styles = set()
    for case in MEGATRON["cases"].values():
        flags = case["flags"]
        styles.add(flags[flags.index("--lr-decay-style") + 1])
        if "WSD" in flags:
            styles.add("WSD-" + (flags[flags.index("--lr-wsd-decay-style") + 1]
                                 if "--lr-wsd-decay-style" in flags else "exponential"))
    assert styles >= {"linear", "cosine", "inverse-square-root", "WSD-exponential",
                      "WSD-minus_sqrt", "WSD-cosine", "WSD-linear"}
    ramps = [c for c in MEGATRON["cases"].values() if "--rampup-batch-size" in c["flags"]]
    assert any(len({i["global_batch_size"] for i in c["iterations"]}) >= 3 for c in ramps)


def test_warmup_fraction_is_not_rounded_to_whole_iterations():
    # 0.15 of 12 iterations of 8 samples = 14.4 samples, 1.8 iterations (it used to be 1).
    configs = parse("--train-iters 12 --global-batch-size 8 --lr-warmup-fraction 0.15".split())
    scheduler = OptimizerParamScheduler(_Optimizer([{}]), configs.optimizer, 12,
                                        global_batch_size=8)
    scheduler.step(8)
    assert scheduler.optimizer.param_groups[0]["lr"] == pytest.approx(1e-4 * 8 / 14.4)


def test_resume_restores_the_position_in_samples():
    config = OptimizerConfig(lr=1.0, min_lr=0.0, lr_warmup_samples=10, lr_decay_samples=100,
                             lr_decay_style="cosine")
    first = OptimizerParamScheduler(_Optimizer([{}]), config, train_samples=100)
    for batch in (4, 4, 8):
        first.step(batch)
    second = OptimizerParamScheduler(_Optimizer([{}]), config, train_samples=100)
    assert second.load_state_dict(first.state_dict()) == []
    assert second.num_steps == 16
    expected = 0.5 * (math.cos(math.pi * (16 - 10) / 90) + 1.0)
    assert second.optimizer.param_groups[0]["lr"] == pytest.approx(expected)


@pytest.mark.parametrize("argv, message", [
    ("--train-iters 10 --train-samples 80", "one of --train-iters N or --train-samples N"),
    ("", "one of --train-iters N or --train-samples N"),
    ("--train-iters 10 --lr-warmup-samples 8", "--lr-warmup-samples count samples"),
    ("--train-samples 80 --lr-decay-iters 5", "--lr-decay-iters count iters"),
    ("--train-samples 80 --lr-decay-style WSD --lr-wsd-decay-iters 2",
     "--lr-wsd-decay-iters count iters"),
    ("--train-iters 10 --lr-warmup-iters 2 --lr-warmup-fraction 0.1",
     "one of --lr-warmup-fraction and --lr-warmup-iters"),
    ("--train-iters 10 --global-batch-size 8 --rampup-batch-size 4 4 16",
     "--rampup-batch-size counts samples"),
    ("--train-samples 80 --global-batch-size 8 --rampup-batch-size 4 3 16",
     "must be a positive multiple of INCREMENT"),
    ("--train-samples 80 --global-batch-size 8 --rampup-batch-size 8 4 16",
     "must be a positive multiple of INCREMENT"),
    ("--train-samples 80 --global-batch-size 12 --rampup-batch-size 6 6 16",
     "reaches a global batch of 6"),
    ("--train-samples 3 --global-batch-size 8", "--train-samples 3 is less than one iteration"),
    ("--train-iters 10 --lr-wsd-decay-iters 2", "add it (the decay style is 'linear')"),
    ("--train-iters 10 --decoupled-min-lr 1e-5", "add --decoupled-lr"),
    ("--train-iters 10 --recompute-activations --recompute-granularity full",
     "--recompute-activations is --recompute-granularity selective"),
])
def test_contradicting_flags_are_config_errors(argv, message):
    with pytest.raises(ConfigError) as info:
        parse(argv.split())
    assert message in str(info.value), str(info.value)


def test_wsd_needs_its_annealing_length():
    configs = parse("--train-iters 10 --lr-decay-style WSD".split())
    with pytest.raises(ConfigError, match="--lr-wsd-decay-iters N"):
        OptimizerParamScheduler(_Optimizer([{}]), configs.optimizer, 10)


def test_recompute_activations_is_selective_recompute():
    configs = parse("--train-iters 10 --recompute-activations".split())
    assert configs.model.recompute_granularity == "selective"
    assert parse("--train-iters 10".split()).model.recompute_granularity is None


@pytest.mark.parametrize("apply_wd", [False, True])
def test_apply_wd_to_qk_layernorm_decays_only_the_qk_norms(apply_wd):
    flags = "--train-iters 10 --qk-layernorm --weight-decay 0.1"
    configs = parse((flags + " --apply-wd-to-qk-layernorm" * apply_wd).split())
    prefix = "decoder.layers.0.self_attention."
    shapes = {**GPT_PARAMETER_SHAPES, prefix + "q_layernorm.weight": (8,),
              prefix + "k_layernorm.weight": (8,), "decoder.layers.0.input_layernorm.weight": (4,)}
    model = module_with_parameters(shapes)
    optimizer = _Optimizer(get_param_groups([model], configs.optimizer))
    OptimizerParamScheduler(optimizer, configs.optimizer, 10)
    decay_of = {id(p): g["weight_decay"] for g in optimizer.param_groups for p in g["params"]}
    decay = {name: decay_of[id(p)] for name, p in model.named_parameters()}
    qk_decay = 0.1 if apply_wd else 0.0
    assert decay[prefix + "q_layernorm.weight"] == decay[prefix + "k_layernorm.weight"] == qk_decay
    assert decay["decoder.layers.0.input_layernorm.weight"] == 0.0
    assert decay["decoder.linear.bias"] == 0.0 and decay["decoder.linear.weight"] == 0.1


def test_apply_wd_to_qk_layernorm_without_qk_layernorm_changes_nothing():
    """Accepted as Megatron-LM accepts it: no q/k norms, so the same decay for every param
    as without the flag (listed in the docs' ignored-flags table)."""
    decays = []
    for flags in ("", " --apply-wd-to-qk-layernorm"):
        configs = parse(("--train-iters 10 --weight-decay 0.1" + flags).split())
        model = module_with_parameters({**GPT_PARAMETER_SHAPES,
                                        "decoder.layers.0.input_layernorm.weight": (4,)})
        optimizer = _Optimizer(get_param_groups([model], configs.optimizer))
        decay_of = {id(p): g["weight_decay"] for g in optimizer.param_groups
                    for p in g["params"]}
        decays.append({name: decay_of[id(p)] for name, p in model.named_parameters()})
    assert decays[0] == decays[1] and decays[0]["decoder.linear.weight"] == 0.1
    assert decays[0]["decoder.layers.0.input_layernorm.weight"] == 0.0
