"""SMP v1's translators on v1's own layout: v1 state dicts written here by following v1's
documented DistributedTransformer key layout (not by our translators) give the HF model's
logits exactly after `translate_state_dict_to_hf_<family>`, HF -> v1 -> HF is tensor-exact,
and bad input is a clear error."""
import importlib
import warnings

import pytest
import torch

from megatron_smp.config import ConfigError
from megatron_smp.models import hf as hf_adapters
from tests.unit.models.test_hf_adapters import build_hf

warnings.filterwarnings("ignore", message=".*")
FAMILIES = ("gpt2", "gpt_neox", "gptj")
NAMES = {"gpt2": "gpt2", "gpt_neox": "gptneox", "gptj": "gptj"}


def v1_layout(family, hf_model):
    """The state dict SMP v1's `model.state_dict(gather_to_rank0=True)` holds for this HF
    model, written out key by key from v1's layout: nn.Linear [out, in] weights, q/k/v
    separate, GPT-2's final norm under the last layer, NeoX's per-layer rotary buffers."""
    sd, cfg = hf_model.state_dict(), hf_model.config
    out = {}
    if family == "gpt2":
        h = cfg.n_embd
        out["word_embedding.weight"] = sd["transformer.wte.weight"]
        out["position_embedding.weight"] = sd["transformer.wpe.weight"]
        for i in range(cfg.n_layer):
            p, q = f"transformer.h.{i}.", f"transformer.seq_layers.{i}."
            c_attn_w, c_attn_b = sd[p + "attn.c_attn.weight"], sd[p + "attn.c_attn.bias"]
            for j, name in enumerate(("query", "key", "value")):  # Conv1D [h, 3h] columns
                out[q + f"attention.{name}.weight"] = c_attn_w[:, j * h:(j + 1) * h].t()
                out[q + f"attention.{name}.bias"] = c_attn_b[j * h:(j + 1) * h]
            out[q + "attention.dense.weight"] = sd[p + "attn.c_proj.weight"].t()
            out[q + "attention.dense.bias"] = sd[p + "attn.c_proj.bias"]
            out[q + "output.dense1.weight"] = sd[p + "mlp.c_fc.weight"].t()
            out[q + "output.dense1.bias"] = sd[p + "mlp.c_fc.bias"]
            out[q + "output.dense2.weight"] = sd[p + "mlp.c_proj.weight"].t()
            out[q + "output.dense2.bias"] = sd[p + "mlp.c_proj.bias"]
            for part in ("weight", "bias"):
                out[q + f"attention.pre_layernorm.{part}"] = sd[p + f"ln_1.{part}"]
                out[q + f"output.pre_layernorm.{part}"] = sd[p + f"ln_2.{part}"]
        last = f"transformer.seq_layers.{cfg.n_layer - 1}."
        out[last + "output.layernorm.weight"] = sd["transformer.ln_f.weight"]
        out[last + "output.layernorm.bias"] = sd["transformer.ln_f.bias"]
        out["lm_head.weight"] = sd["lm_head.weight"]
    elif family == "gpt_neox":
        heads = cfg.num_attention_heads
        d = cfg.hidden_size // heads
        rotary_dim = int(d * cfg.rope_parameters["partial_rotary_factor"])
        inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
        out["word_embedding.weight"] = sd["gpt_neox.embed_in.weight"]
        for i in range(cfg.num_hidden_layers):
            p, q = f"gpt_neox.layers.{i}.", f"transformer.seq_layers.{i}."
            for part in ("weight", "bias"):
                fused = sd[p + f"attention.query_key_value.{part}"]
                rows = fused.view(heads, 3, d, -1)  # NeoX: per head, its q, k, v rows
                for j, name in enumerate(("query", "key", "value")):
                    out[q + f"attention.{name}.{part}"] = rows[:, j].reshape(
                        (heads * d,) + tuple(fused.shape[1:]))
                out[q + f"attention.dense.{part}"] = sd[p + f"attention.dense.{part}"]
                out[q + f"output.dense1.{part}"] = sd[p + f"mlp.dense_h_to_4h.{part}"]
                out[q + f"output.dense2.{part}"] = sd[p + f"mlp.dense_4h_to_h.{part}"]
                out[q + f"attention.pre_layernorm.{part}"] = sd[p + f"input_layernorm.{part}"]
                out[q + f"output.pre_layernorm.{part}"] = sd[p + f"post_attention_layernorm.{part}"]
            out[q + "attention.rotary_emb.inv_freq"] = inv_freq
        out["layernorm.weight"] = sd["gpt_neox.final_layer_norm.weight"]
        out["layernorm.bias"] = sd["gpt_neox.final_layer_norm.bias"]
        out["lm_head.weight"] = sd["lm_head.weight"]
    else:  # gptj: one pre_layernorm per layer, no attention biases, lm_head bias
        out["word_embedding.weight"] = sd["transformer.wte.weight"]
        for i in range(cfg.n_layer):
            p, q = f"transformer.h.{i}.", f"transformer.seq_layers.{i}."
            out[q + "pre_layernorm.weight"] = sd[p + "ln_1.weight"]
            out[q + "pre_layernorm.bias"] = sd[p + "ln_1.bias"]
            for v1_name, hf_name in (("query", "q_proj"), ("key", "k_proj"), ("value", "v_proj"),
                                     ("dense", "out_proj")):
                out[q + f"attention.{v1_name}.weight"] = sd[p + f"attn.{hf_name}.weight"]
            for part in ("weight", "bias"):
                out[q + f"output.dense1.{part}"] = sd[p + f"mlp.fc_in.{part}"]
                out[q + f"output.dense2.{part}"] = sd[p + f"mlp.fc_out.{part}"]
        out["layernorm.weight"] = sd["transformer.ln_f.weight"]
        out["layernorm.bias"] = sd["transformer.ln_f.bias"]
        out["lm_head.weight"] = sd["lm_head.weight"]
        out["lm_head.bias"] = sd["lm_head.bias"]
    return {k: v.clone() for k, v in out.items()}


def _config_kwargs(family, hf_model):
    return {"config": hf_model.config} if family == "gpt_neox" else {}


def _logits(model, seed=3):
    ids = torch.randint(0, model.config.vocab_size, (2, 12),
                        generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("family", FAMILIES)
def test_v1_state_dict_gives_hf_logits(family):
    source = build_hf(family)
    to_hf = getattr(hf_adapters, f"translate_state_dict_to_hf_{NAMES[family]}")
    v1_sd = v1_layout(family, source)
    # A wrapped model's `module.` prefix reads the same.
    for state_dict in (v1_sd, {"module." + k: v for k, v in v1_sd.items()}):
        hf_sd = to_hf(state_dict, max_seq_len=32, **_config_kwargs(family, source))
        target = build_hf(family, seed=1)
        result = target.load_state_dict(hf_sd, strict=True)
        assert not result.missing_keys and not result.unexpected_keys
        assert torch.equal(_logits(target), _logits(source))


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_to_v1_to_hf_is_exact(family):
    source = build_hf(family)
    name = NAMES[family]
    to_v1 = getattr(hf_adapters, f"translate_hf_state_dict_to_smdistributed_{name}")
    to_hf = getattr(hf_adapters, f"translate_state_dict_to_hf_{name}")
    kwargs = _config_kwargs(family, source)
    hf_sd = source.state_dict()
    v1_sd = to_v1(hf_sd, **kwargs)
    expected = v1_layout(family, source)  # v1's layout, key for key
    assert v1_sd.keys() == expected.keys()
    for key in expected:  # the rotary frequencies are computed, the rest copied
        if key.endswith("inv_freq"):
            assert torch.allclose(v1_sd[key], expected[key], rtol=1e-6, atol=0), key
        else:
            assert torch.equal(v1_sd[key], expected[key]), key
    # v1's older name of the same function (its max_seq_len unused, as in v1).
    old_name = {"gpt2": "translate_hf_state_dict_to_smdistributed",
                "gpt_neox": "translate_hf_gptneox_state_dict_to_smdistributed",
                "gptj": "translate_hf_gptj_state_dict_to_smdistributed"}[family]
    module = importlib.import_module(f"megatron_smp.smp.nn.huggingface.{name}")
    again = getattr(module, old_name)(hf_sd, 32, **kwargs)
    assert again.keys() == v1_sd.keys() and all(torch.equal(again[k], v1_sd[k]) for k in v1_sd)
    back = to_hf(v1_sd, **kwargs)
    assert back.keys() == hf_sd.keys()
    for key in hf_sd:
        assert back[key].dtype == hf_sd[key].dtype and torch.equal(back[key], hf_sd[key]), key
    if family == "gpt_neox":  # older files (and v1's own output) name the head embed_out
        old_names = {("embed_out.weight" if k == "lm_head.weight" else k): v
                     for k, v in hf_sd.items()}
        assert torch.equal(to_v1(old_names, **kwargs)["lm_head.weight"], hf_sd["lm_head.weight"])


def test_errors_name_what_is_wrong():
    neox = build_hf("gpt_neox")
    v1_sd = v1_layout("gpt_neox", neox)
    with pytest.raises(ConfigError, match="needs config=.*number of heads cannot be read"):
        hf_adapters.translate_state_dict_to_hf_gptneox(v1_sd)
    with pytest.raises(ConfigError, match="needs config="):
        hf_adapters.translate_hf_state_dict_to_smdistributed_gptneox(neox.state_dict())
    wrong = build_hf("gpt_neox", rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                  "partial_rotary_factor": 0.5}).config
    with pytest.raises(ConfigError, match="rotary_emb.inv_freq .* differs from the config"):
        hf_adapters.translate_state_dict_to_hf_gptneox(v1_sd, config=wrong)

    gpt2_v1 = v1_layout("gpt2", build_hf("gpt2"))
    with pytest.raises(ConfigError, match="max_seq_len must be a positive int"):
        hf_adapters.translate_state_dict_to_hf_gpt2(gpt2_v1, max_seq_len=0)
    missing = dict(gpt2_v1)
    del missing["transformer.seq_layers.1.output.dense2.bias"]
    with pytest.raises(ConfigError,
                       match="no tensor 'transformer.seq_layers.1.output.dense2.bias'"):
        hf_adapters.translate_state_dict_to_hf_gpt2(missing)
    # A tensor v1's GPT-J does not have: named.
    gptj_v1 = v1_layout("gptj", build_hf("gptj"))
    gptj_v1["transformer.seq_layers.0.attention.query.bias"] = torch.zeros(64)
    with pytest.raises(ConfigError, match="unexpected tensors transformer.seq_layers.0.attention"
                                          ".query.bias"):
        hf_adapters.translate_state_dict_to_hf_gptj(gptj_v1)


def test_gptj_model_gives_hf_logits():
    """GPT-J in the framework (one shared norm, interleaved partial RoPE, unbiased attention,
    LM-head bias): HF's logits within 1e-5, and no parameter HF does not have."""
    import megatron_smp as smp

    smp.init({"tensor_parallel_degree": 1})
    source = build_hf("gptj")
    model = smp.transform(source)
    names = set(model.state_dict())
    assert not any("pre_mlp_layernorm" in n or "linear_qkv.bias" in n or "linear_proj.bias" in n
                   for n in names)
    assert any(n.endswith("output_layer.bias") for n in names)
    ids = torch.randint(0, source.config.vocab_size, (2, 12),
                        generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (model(ids).logits - source(ids).logits).abs().max() < 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_v1_module_paths(family):
    """A v1 script's import, with `smdistributed.modelparallel.torch` replaced by
    `megatron_smp.smp`, gives these functions."""
    name = NAMES[family]
    script = (f"from smdistributed.modelparallel.torch.nn.huggingface.{name} import "
              f"translate_state_dict_to_hf_{name}, translate_hf_state_dict_to_smdistributed_{name}")
    namespace = {}
    exec(script.replace("smdistributed.modelparallel.torch", "megatron_smp.smp"), namespace)
    assert namespace[f"translate_state_dict_to_hf_{name}"] is getattr(
        hf_adapters, f"translate_state_dict_to_hf_{name}")
    assert namespace[f"translate_hf_state_dict_to_smdistributed_{name}"] is getattr(
        hf_adapters, f"translate_hf_state_dict_to_smdistributed_{name}")
    # ... and as attributes of the package (`smp.nn.huggingface.gpt2.translate_...`).
    import megatron_smp.smp as smp

    module = getattr(smp.nn.huggingface, name)
    assert getattr(module, f"translate_state_dict_to_hf_{name}") is namespace[
        f"translate_state_dict_to_hf_{name}"]


def test_v1_custom_gpt2_layer_layout():
    """v1's custom GPT-2 (HF GPT-2 with its blocks replaced by DistributedTransformerLayers):
    the layers' v1 names under HF's transformer.h.N, everything else HF's."""
    from megatron_smp.smp.nn.huggingface.gpt2 import (
        translate_hf_state_dict_to_smdistributed_gpt2_layer, translate_state_dict_to_hf_gpt2_layer,
    )

    source = build_hf("gpt2")
    full_v1 = v1_layout("gpt2", source)
    last = f"transformer.seq_layers.{source.config.n_layer - 1}.output.layernorm."
    custom = {"transformer.wte.weight": full_v1["word_embedding.weight"],
              "transformer.wpe.weight": full_v1["position_embedding.weight"],
              "transformer.ln_f.weight": full_v1[last + "weight"],
              "transformer.ln_f.bias": full_v1[last + "bias"],
              "lm_head.weight": full_v1["lm_head.weight"]}
    for name, tensor in full_v1.items():
        if name.startswith("transformer.seq_layers.") and not name.startswith(last):
            custom[name.replace("transformer.seq_layers.", "transformer.h.")] = tensor
    hf_sd = translate_state_dict_to_hf_gpt2_layer(custom)
    target = build_hf("gpt2", seed=1)
    target.load_state_dict(hf_sd, strict=True)
    assert torch.equal(_logits(target), _logits(source))
    back = translate_hf_state_dict_to_smdistributed_gpt2_layer(source.state_dict())
    assert back.keys() == custom.keys() and all(torch.equal(back[k], custom[k]) for k in custom)


def test_gptj_fields_are_validated():
    from megatron_smp.config import ParallelConfig, TransformerConfig

    base = dict(num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=10,
                max_position_embeddings=8)
    with pytest.raises(ConfigError, match="parallel_residual_shared_norm .* needs "
                                          "--use-parallel-residual"):
        TransformerConfig(parallel_residual_shared_norm=True, **base).validate(ParallelConfig())
    with pytest.raises(ConfigError, match="--add-qkv-bias .* add_attention_bias=False"):
        TransformerConfig(add_attention_bias=False, add_bias_linear=False, add_qkv_bias=True,
                          **base).validate(ParallelConfig())
