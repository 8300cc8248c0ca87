"""muP (--use-mup) against Megatron-LM main's formulas, with width multiplier m = hidden /
base hidden: init std / sqrt(m) for hidden matrices (output projections also / sqrt(2 L)),
embeddings and an untied output layer unscaled; logits x 1 / m (or --mup-output-mult);
embeddings x --mup-embedding-mult; attention scores x sqrt(base head dim or 1) /
kv_channels ** power; Adam's hidden matrices LR and eps / m (SGD: vector-like LR x m).
The muP property itself (the best LR transfers across widths) is measured by
tools/bench/bench_mup_sweep.py."""
import math

import pytest
import torch

from megatron_smp.config import OptimizerConfig, TransformerConfig
from megatron_smp.optimizer import get_param_groups
from megatron_smp.testing import run_distributed
from megatron_smp.training.optimizer_param_scheduler import OptimizerParamScheduler
from tests.unit.models.common import to_numpy
from tests.unit.training.test_scheduler import _Optimizer, module_with_parameters

WIDTH, BASE, SEQ, VOCAB = 128, 32, 8, 97  # m = 4


def _config(**overrides):
    settings = dict(num_layers=2, hidden_size=WIDTH, num_attention_heads=4, vocab_size=VOCAB,
                    max_position_embeddings=SEQ, hidden_dropout=0.0, attention_dropout=0.0,
                    untie_embeddings_and_output_weights=True)
    settings.update(overrides)
    return TransformerConfig(**settings)


def test_config_formulas():
    mup = _config(use_mup=True, mup_base_hidden_size=BASE)
    assert mup.mup_width_mult == 4.0 and mup.mup_logit_mult() == 0.25
    assert mup.attention_softmax_scale() == 1 / 32  # kv_channels 32, power 1
    assert _config(use_mup=True, mup_base_hidden_size=BASE, mup_base_head_dim=8
                   ).attention_softmax_scale() == math.sqrt(8) / 32
    assert _config(use_mup=True, mup_base_hidden_size=BASE, mup_attn_scale_power=0.5
                   ).attention_softmax_scale() == 1 / math.sqrt(32)
    assert _config(use_mup=True, softmax_scale=0.3).attention_softmax_scale() == 0.3
    assert _config(use_mup=True, mup_base_hidden_size=BASE, mup_output_mult=0.5
                   ).mup_logit_mult() == 0.5
    base = _config(use_mup=True)  # the base model itself: m = 1, logits unscaled
    assert base.mup_width_mult == 1.0 and base.mup_logit_mult() == 1.0
    assert base.attention_softmax_scale() == 1 / 32  # muP attention at every width
    plain = _config(mup_base_hidden_size=BASE)  # read only with use_mup
    assert (plain.mup_width_mult, plain.mup_logit_mult(),
            plain.attention_softmax_scale()) == (1.0, 1.0, None)


def _models(rank, world_size):
    from megatron_smp.models import GPTModel
    from megatron_smp.parallel_state import build_parallel_state
    from megatron_smp.tensor_parallel.random import model_parallel_seed

    state = build_parallel_state()
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    out = {}
    for name, config in (
            ("plain", _config()),
            ("mup", _config(use_mup=True, mup_base_hidden_size=BASE)),
            # The same scores as muP's, without its logit scaling.
            ("plain_mup_attention", _config(softmax_scale=1 / 32)),
            ("mup_embedding_mult", _config(use_mup=True, mup_base_hidden_size=BASE,
                                           mup_embedding_mult=3.0))):
        model_parallel_seed(1234, state)
        model = GPTModel(config, state)
        out[name] = model
    weights = {name: {k: v.detach().clone() for k, v in model.state_dict().items()}
               for name, model in out.items()}
    out["plain_mup_attention"].load_state_dict(weights["mup"])
    logits = {name: out[name](ids) for name in ("mup", "plain_mup_attention")}
    embeddings = {name: out[name].embedding(ids) for name in ("mup", "mup_embedding_mult")}
    return to_numpy({"weights": weights, "logits": logits, "embeddings": embeddings})


def test_init_logits_and_embeddings_follow_megatron_formulas():
    (result,) = run_distributed(_models, 1)
    plain, mup = result["weights"]["plain"], result["weights"]["mup"]
    assert plain.keys() == mup.keys()
    checked = 0
    for name, weight in plain.items():
        if "_extra_state" in name:
            continue
        unscaled = weight.ndim < 2 or "embedding" in name or name == "output_layer.weight"
        # The same draws (same seeds): N(0, s / sqrt(4)) is exactly N(0, s) / 2.
        expected = weight if unscaled else weight / 2
        assert (mup[name] == expected).all(), name
        checked += not unscaled
    assert checked >= 8  # qkv, proj, fc1, fc2 of both layers
    # Depth scaling kept on top: linear_proj's std is 0.02 / sqrt(2 * 2) / 2.
    proj = mup["decoder.layers.0.self_attention.linear_proj.weight"]
    assert proj.std() == pytest.approx(0.02 / 2 / 2, rel=0.1)
    logits = result["logits"]
    assert logits["mup"] == pytest.approx(logits["plain_mup_attention"] / 4, rel=1e-5,
                                          abs=1e-7)
    embeddings = result["embeddings"]
    assert embeddings["mup_embedding_mult"] == pytest.approx(3.0 * embeddings["mup"],
                                                             rel=1e-6)


SHAPES = {
    "embedding.word_embeddings.weight": (6, 4), "embedding.position_embeddings.weight": (5, 4),
    "decoder.layers.0.self_attention.linear_qkv.weight": (12, 4),
    "decoder.layers.0.self_attention.linear_qkv.bias": (12,),
    "decoder.layers.0.input_layernorm.weight": (4,),
    "decoder.layers.0.mlp.linear_fc2.weight": (4, 8),
    "output_layer.weight": (6, 4),
}
HIDDEN = {"decoder.layers.0.self_attention.linear_qkv.weight",
          "decoder.layers.0.mlp.linear_fc2.weight"}


def _groups_by_name(optimizer, width_mult, **settings):
    config = OptimizerConfig(optimizer=optimizer, lr=1e-3, min_lr=1e-4, adam_eps=1e-8,
                             weight_decay=0.1, **settings)
    model = module_with_parameters(SHAPES)
    groups = get_param_groups([model], config, mup_width_mult=width_mult)
    by_id = {id(p): group for group in groups for p in group["params"]}
    return config, groups, {name: by_id[id(p)] for name, p in model.named_parameters()}


def test_optimizer_groups_follow_megatron_formulas():
    config, groups, group_of = _groups_by_name("adam", 4.0)
    for name, group in group_of.items():
        if name in HIDDEN:  # LR and eps / m, on a schedule of their own
            assert (group["max_lr"], group["min_lr"], group["eps"]) == (
                config.lr / 4, config.min_lr / 4, config.adam_eps / 4), name
            assert not group["default_config"]
        else:  # vector-like: the base LR and eps
            assert "max_lr" not in group and "eps" not in group and group["default_config"]
    # The scheduler moves each group between its own bounds (Megatron's per-group max/min).
    scheduler = OptimizerParamScheduler(_Optimizer(groups), config, 100)
    scheduler.step(60)
    hidden = group_of["decoder.layers.0.mlp.linear_fc2.weight"]["lr"]
    vector = group_of["output_layer.weight"]["lr"]
    assert hidden == pytest.approx(vector / 4, rel=1e-12) and config.min_lr < vector < config.lr
    # SGD: vector-like params' LR x m (hidden ones keep the base LR), no eps.
    config, _, group_of = _groups_by_name("sgd", 4.0)
    for name, group in group_of.items():
        if name in HIDDEN:
            assert "max_lr" not in group
        else:
            assert (group["max_lr"], group["min_lr"]) == (config.lr * 4, config.min_lr * 4)
    # SGD with --decoupled-lr: the embedding and output weights keep their decoupled LR.
    _, _, group_of = _groups_by_name("sgd", 4.0, decoupled_lr=5e-3)
    assert group_of["output_layer.weight"]["max_lr"] == 5e-3
    assert group_of["embedding.position_embeddings.weight"]["max_lr"] == 4e-3
    # Lion: hidden LR / m, no eps override; m = 1: no groups of muP's.
    config, _, group_of = _groups_by_name("lion", 4.0)
    assert group_of["decoder.layers.0.mlp.linear_fc2.weight"]["max_lr"] == config.lr / 4
    assert "eps" not in group_of["decoder.layers.0.mlp.linear_fc2.weight"]
    _, groups_m1, _ = _groups_by_name("adam", 1.0)
    _, groups_plain, _ = _groups_by_name("adam", 1.0)
    assert len(groups_m1) == len(groups_plain) == 2


def test_hugging_face_conversion_refuses_what_its_config_cannot_express():
    """HF configs have no logit / embedding multiplier nor muP attention: a muP model
    converts only at its base width with --mup-base-head-dim its head dim (then standard)."""
    from megatron_smp.config import ConfigError
    from megatron_smp.models.hf import config_to_hf

    with pytest.raises(ConfigError, match="--use-mup model multiplies its logits by 0.25"):
        config_to_hf(_config(use_mup=True, mup_base_hidden_size=BASE), "gpt2")
    with pytest.raises(ConfigError, match="attention scores by 0.03125"):
        config_to_hf(_config(use_mup=True), "gpt2")
    standard = config_to_hf(_config(use_mup=True, mup_base_head_dim=32), "gpt2")
    assert standard.n_embd == WIDTH
