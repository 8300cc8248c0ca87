"""gpt-oss: exact state-dict and config round trips, MXFP4 dequantization equal to transformers'
own, HF's logits through smp.transform at TP=1, TP=2 (+SP) and EP=2 (GQA, head_dim != hidden /
heads, non-zero biases and sinks, a sliding and a full layer, clamped GLU that clamps), and
convert.py HF (MXFP4) -> framework (TP=2) -> HF tensor-exact."""
import json
import warnings

import pytest
import torch

import megatron_smp as smp
from megatron_smp.models.hf import config_to_hf, get_adapter
from megatron_smp.models.hf.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from megatron_smp.models.sharding import (
    expert_parallel_merge,
    expert_parallel_shard,
    merge_state_dicts,
    shard_state_dict,
)
from megatron_smp.testing import run_distributed

warnings.filterwarnings("ignore", message=".*")
BATCH, SEQ = 2, 12


def build_gpt_oss(seed=0, **overrides):
    """A small random GptOssForCausalLM: 2 layers (sliding window 5 < SEQ, then full), YaRN, 4
    experts top-2, GQA 4/2 heads of dim 12 (hidden 64), a swiglu_limit the activations reach,
    and biases, sinks and norms moved off HF's zero / one init."""
    import transformers as tf

    fields = dict(vocab_size=1003, hidden_size=64, intermediate_size=40, head_dim=12,
                  num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                  num_local_experts=4, num_experts_per_tok=2, sliding_window=5,
                  max_position_embeddings=32, swiglu_limit=0.3, initializer_range=0.05,
                  # YaRN as published (factor 32, truncate False), from an original context
                  # of 8 positions: SEQ reaches beyond it.
                  rope_parameters={"rope_type": "yarn", "rope_theta": 1.5e5, "factor": 4.0,
                                   "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                   "original_max_position_embeddings": 8})
    fields.update(overrides)
    torch.manual_seed(seed)
    model = tf.GptOssForCausalLM(tf.GptOssConfig(**fields)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("bias", "sinks")) or "norm" in name:
                param.add_(0.5 * torch.randn_like(param))
    return model


def _ids(vocab_size):
    return torch.randint(0, vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))


def test_round_trips_are_exact():
    hf = build_gpt_oss()
    adapter = get_adapter(hf)
    config = adapter.config_from_hf(hf.config)
    assert config.window_layer_pattern() == [1, 0] and config.window_attn_skip_freq == 2
    assert (config.softmax_type, config.activation, config.glu_linear_offset,
            config.activation_func_clamp_value) == ("learnable", "quick_gelu", 1.0, 0.3)
    assert (config.position_embedding_type, config.yarn_rotary_scaling_factor,
            config.yarn_correction_range_round_to_int) == ("yarn", 4.0, False)
    hf_sd = hf.state_dict()
    full = adapter.from_hf(hf_sd, config)
    back = adapter.to_hf(full, config)
    assert back.keys() == hf_sd.keys()
    assert all(torch.equal(back[k], hf_sd[k]) for k in hf_sd)
    assert adapter.config_from_hf(config_to_hf(config, "gpt_oss")) == config
    source = {k: v for k, v in hf.config.to_diff_dict().items() if k != "transformers_version"}
    again = {k: v for k, v in config_to_hf(config, "gpt_oss").to_diff_dict().items()
             if k != "transformers_version"}
    for key in ("bos_token_id", "eos_token_id"):  # not model fields; we write values out
        if source.get(key) is None:
            source.pop(key, None)
            again.pop(key, None)
    assert again == source  # config.json
    shards = [expert_parallel_shard(shard_state_dict(full, config, 2, r), 4, 2, ep)
              for ep in range(2) for r in range(2)]
    assert shards[0]["decoder.layers.0.self_attention.core_attention.softmax_offset"].shape == (2,)
    merged = expert_parallel_merge([merge_state_dicts(shards[2 * ep: 2 * ep + 2], config)
                                    for ep in range(2)], 4)
    assert merged.keys() == full.keys() and all(torch.equal(merged[k], full[k]) for k in full)


def test_mxfp4_dequantization_matches_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    weight = torch.randn(3, 64, 40) * torch.logspace(-3, 2, 40)  # [E, in, out], wide range
    blocks, scales = quantize_mxfp4(weight)
    assert blocks.shape == (3, 40, 2, 16) and scales.shape == (3, 40, 2)
    for dtype in (torch.bfloat16, torch.float32):
        ours = dequantize_mxfp4(blocks, scales, dtype)
        assert torch.equal(ours, convert_moe_packed_tensors(blocks, scales, dtype=dtype))
    ours = dequantize_mxfp4(blocks, scales, torch.float32)
    # FP4 E2M1 keeps ~1 mantissa bit: within a quarter of each block's largest value.
    block_max = weight.abs().unflatten(1, (2, 32)).amax(2, keepdim=True)
    assert ((ours - weight).abs().unflatten(1, (2, 32)) <= block_max / 4 + 1e-30).all()


def test_transform_tp1_matches_hf_logits():
    smp.init({"random_seed": 3})
    hf = build_gpt_oss()
    ids = _ids(hf.config.vocab_size)
    with torch.no_grad():
        expected = hf(ids).logits
        model = smp.transform(hf)
        assert (model(ids).logits - expected).abs().max() < 2e-4
        # Each gpt-oss feature is in the logits: a sink, the clamp, the window.
        sink = model.module.decoder.layers[0].self_attention.core_attention.softmax_offset
        sink.add_(1.0)
        assert (model(ids).logits - expected).abs().max() > 1e-3
        sink.sub_(1.0)
    for override in ({"activation_func_clamp_value": 100.0}, {"window_attn_skip_freq": 1}):
        changed = smp.transform(hf, config=override)
        with torch.no_grad():
            assert (changed(ids).logits - expected).abs().max() > 1e-3, override


def _parallel_worker(rank, world_size, layouts):
    import numpy as np

    out = {}
    for layout in layouts:
        smp.init(dict(layout))
        hf = build_gpt_oss()
        ids = _ids(hf.config.vocab_size)
        model = smp.transform(hf, config={"sequence_parallel": True})
        with torch.no_grad():
            out[tuple(sorted(layout.items()))] = (model(ids).logits - hf(ids).logits).abs().max().item()
        out["state"] = {k: np.asarray(v.detach()) for k, v in model.module.state_dict().items()}
        out["coords"] = (smp.state.tp_rank, smp.state.parallel_state.ep_rank)
    return out


def test_transform_tp2_and_ep2_match_hf_logits_and_tp2_shards_merge_to_hf():
    layouts = ({"expert_parallel_degree": 2}, {"tensor_parallel_degree": 2})
    results = run_distributed(_parallel_worker, 2, args=(layouts,), timeout=300)
    for result in results:
        errors = [v for k, v in result.items() if isinstance(k, tuple)]
        assert len(errors) == 2 and max(errors) < 2e-4, errors
    hf = build_gpt_oss()
    adapter = get_adapter(hf)
    config = adapter.config_from_hf(hf.config)
    shards = [{k: torch.from_numpy(v) for k, v in r["state"].items()}
              for r in sorted(results, key=lambda r: r["coords"])]
    back = adapter.to_hf(merge_state_dicts(shards, config), config)
    expected = hf.state_dict()
    assert back.keys() == expected.keys()
    assert all(torch.equal(back[k], expected[k]) for k in expected)


def _quantized_checkpoint(hf, path):
    """`hf` saved in bf16 as the published checkpoints are: experts as MXFP4 blocks + scales,
    everything else bf16, quantization_config in config.json."""
    from safetensors.torch import load_file

    from tools.checkpoint.hf_format import quantize_hf_experts

    hf.to(torch.bfloat16).save_pretrained(path)
    quantize_hf_experts(str(path))
    return load_file(path / "model.safetensors")


def test_convert_mxfp4_checkpoint_to_tp2_and_back_to_bf16_hf(tmp_path):
    """MXFP4 in (dequantized as transformers does), bf16 out by default, MXFP4 out with
    --mxfp4-experts (the same values)."""
    import transformers
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from tests.unit.tools.test_convert import _config_json, _convert, _convert_ok

    hf = build_gpt_oss(intermediate_size=64)  # MXFP4 blocks of 32 along both inputs
    stored = _quantized_checkpoint(hf, tmp_path / "hf")
    _convert_ok("gpt_oss", "hf", "megatron_smp", tmp_path / "hf", tmp_path / "smp",
                "--target-tensor-parallel-size", "2")
    _convert_ok("gpt_oss", "megatron_smp", "hf", tmp_path / "smp", tmp_path / "hf2")
    written = _config_json(tmp_path / "hf2")
    source = _config_json(tmp_path / "hf")
    assert "quantization_config" not in written  # bf16 export
    source.pop("quantization_config")
    assert written == source
    result = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf2")
    actual = result.state_dict()
    for name, tensor in actual.items():
        if name + "_blocks" in stored:  # dequantized exactly as transformers does it
            want = convert_moe_packed_tensors(stored[name + "_blocks"],
                                              stored[name + "_scales"], dtype=torch.bfloat16)
        else:
            want = stored[name] if name in stored else stored["model.embed_tokens.weight"]
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, want), name

    # Asked for, the export stores the experts in MXFP4 again: the same values.
    _convert_ok("gpt_oss", "megatron_smp", "hf", tmp_path / "smp", tmp_path / "hf3",
                "--mxfp4-experts")
    assert _config_json(tmp_path / "hf3") == _config_json(tmp_path / "hf")
    from tools.checkpoint.hf_format import read_hf_checkpoint

    _, _, requantized = read_hf_checkpoint(str(tmp_path / "hf3"), "gpt_oss", "gpt_oss")
    assert all(torch.equal(requantized[name], actual[name]) for name in requantized)
    status, stderr = _convert("gpt_oss", "hf", "megatron_smp", tmp_path / "hf",
                              tmp_path / "bad", "--mxfp4-experts")
    assert status == 2 and "--mxfp4-experts writes a gpt-oss HF checkpoint" in stderr


def test_megatron_legacy_format_round_trip_at_tp2(tmp_path):
    """HF -> ours -> Megatron-LM (legacy, TP=2, its args carrying --softmax-type,
    --window-size, --window-attn-skip-freq, --quick-geglu, the GLU offset and clamp) -> ours:
    the same config and bit-identical tensors."""
    from tests.unit.tools.test_convert import _convert_ok
    from tools.checkpoint.common import architecture
    from tools.checkpoint.smp_format import read_smp_checkpoint

    build_gpt_oss().save_pretrained(tmp_path / "hf")
    _convert_ok("gpt_oss", "hf", "megatron_smp", tmp_path / "hf", tmp_path / "ours")
    _convert_ok("gpt_oss", "megatron_smp", "megatron", tmp_path / "ours", tmp_path / "megatron",
                "--target-tensor-parallel-size", "2")
    _convert_ok("gpt_oss", "megatron", "megatron_smp", tmp_path / "megatron", tmp_path / "back")
    config, first, _ = read_smp_checkpoint(str(tmp_path / "ours"), "gpt_oss", "gpt_oss")
    config_back, back, _ = read_smp_checkpoint(str(tmp_path / "back"), "gpt_oss", "gpt_oss")
    # Megatron's args hold the architecture (not dropout or init).
    assert architecture(config_back) == architecture(config) and sorted(back) == sorted(first)
    assert config_back.window_attn_skip_freq == 2 and config_back.softmax_type == "learnable"
    differing = [name for name in first if not torch.equal(back[name], first[name])]
    assert not differing, differing
