"""Hybrid families (Qwen3-Next, Qwen3.5 dense / MoE, Nemotron-H): exact state-dict, config and
TP-shard round trips; HF's logits through smp.transform at TP=1 (and each document of a packed
row equal to HF's logits of that document alone), TP=2 + SP and EP=2; HF -> framework at TP=2
-> HF tensor-exact, in memory and through tools/checkpoint/convert.py."""
import contextlib
import io
import warnings

import pytest
import torch

import megatron_smp as smp
from megatron_smp.models.gpt import gather_full_logits
from megatron_smp.models.hf import config_to_hf, get_adapter
from megatron_smp.models.sharding import (
    expert_parallel_merge,
    expert_parallel_shard,
    merge_state_dicts,
    shard_state_dict,
)
from megatron_smp.testing import run_distributed

warnings.filterwarnings("ignore", message=".*")
# nemotron_h_latent: Nemotron 3 Super's latent experts (moe_latent_size).
FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "nemotron_h", "nemotron_h_latent")
MODEL_TYPE = {"qwen3_next": "qwen3_next", "qwen3_5": "qwen3_5_text",
              "qwen3_5_moe": "qwen3_5_moe_text", "nemotron_h": "nemotron_h",
              "nemotron_h_latent": "nemotron_h"}
MOE = ("qwen3_next", "qwen3_5_moe", "nemotron_h", "nemotron_h_latent")
BATCH, SEQ, VOCAB = 2, 22, 1003
TOLERANCE = 2e-4
# Two documents in row 0 (boundary inside a scan chunk), one in row 1.
DOCUMENTS = torch.tensor([[0] * 9 + [1] * 13, [0] * SEQ])


def build_hf(family):
    """A small random HF model: GQA, head_dim 24 != hidden / heads, 2 key heads serving 4 value
    heads, MoE with a dense layer, norms and decays perturbed so that each matters."""
    import transformers as tf

    torch.manual_seed(0)
    qwen = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=24, linear_num_key_heads=2,
                linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
                max_position_embeddings=64)
    moe = dict(moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=4,
               num_experts_per_tok=2)
    if family == "qwen3_next":
        model = tf.Qwen3NextForCausalLM(tf.Qwen3NextConfig(
            intermediate_size=96, mlp_only_layers=[1], **moe, **qwen))
    elif family == "qwen3_5":
        model = tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(intermediate_size=96, **qwen))
    elif family == "qwen3_5_moe":
        model = tf.Qwen3_5MoeForCausalLM(tf.Qwen3_5MoeTextConfig(**moe, **qwen))
    else:
        model = tf.NemotronHForCausalLM(tf.NemotronHConfig(
            vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
            head_dim=24, layers_block_type=["mamba", "moe", "mamba", "attention", "mlp"],
            mamba_num_heads=8, mamba_head_dim=12, n_groups=2, ssm_state_size=8,
            intermediate_size=96, n_routed_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, moe_shared_expert_intermediate_size=48, n_group=2,
            topk_group=1, max_position_embeddings=64, chunk_size=8,
            moe_latent_size=40 if family == "nemotron_h_latent" else None))
    with torch.no_grad():
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            last = name.split(".")[-1]
            if ("norm" in name or last in ("A_log", "dt_bias", "D", "bias")
                    or "e_score" in name):
                tensor.add_(torch.randn_like(tensor) * 0.1)
            if "latent_proj" in name:  # at initializer_range 0.02 the experts barely count
                tensor.mul_(30)
    return model.eval()


def _ids():
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))


def _hf_logits(hf, ids):
    with torch.no_grad():
        return hf(ids, use_cache=False).logits


@pytest.mark.parametrize("family", FAMILIES)
def test_round_trips_are_exact(family):
    hf = build_hf(family)
    adapter = get_adapter(hf)
    config = adapter.config_from_hf(hf.config)
    hf_sd = hf.state_dict()
    full = adapter.from_hf(hf_sd, config)
    back = adapter.to_hf(full, config)
    assert back.keys() == hf_sd.keys()
    assert all(torch.equal(back[k], hf_sd[k]) for k in hf_sd)
    assert adapter.config_from_hf(config_to_hf(config, MODEL_TYPE[family])) == config
    shards = [shard_state_dict(full, config, 2, rank) for rank in range(2)]
    merged = merge_state_dicts(shards, config)
    assert merged.keys() == full.keys() and all(torch.equal(merged[k], full[k]) for k in full)
    if family in MOE:
        per_ep = [expert_parallel_shard(full, 4, 2, rank) for rank in range(2)]
        merged = expert_parallel_merge(per_ep, 4)
        assert all(torch.equal(merged[k], full[k]) for k in full)


@pytest.mark.parametrize("family", FAMILIES)
def test_transform_tp1_matches_hf_logits_and_packed_documents(family):
    smp.init({"random_seed": 3})
    hf = build_hf(family)
    ids = _ids()
    model = smp.transform(hf)
    with torch.no_grad():
        assert (model(ids).logits - _hf_logits(hf, ids)).abs().max() < TOLERANCE
        packed = model.module(ids, document_ids=DOCUMENTS)
        for start, end in ((0, 9), (9, SEQ)):
            alone = _hf_logits(hf, ids[:1, start:end])
            assert (packed[:1, start:end, :VOCAB] - alone).abs().max() < TOLERANCE


def _parallel_worker(rank, world_size):
    import numpy as np

    out = {}
    layouts = [{"tensor_parallel_degree": 2}, {"expert_parallel_degree": 2}]
    for layout in layouts:
        smp.init(dict(layout, random_seed=3))
        for family in FAMILIES:
            if "expert_parallel_degree" in layout and family not in MOE:
                continue
            hf = build_hf(family)
            ids = _ids()
            model = smp.transform(hf, config={"sequence_parallel": True})
            with torch.no_grad():
                error = (model(ids).logits - _hf_logits(hf, ids)).abs().max().item()
                packed = gather_full_logits(model.module(ids, document_ids=DOCUMENTS),
                                            smp.state.parallel_state, VOCAB)
                alone = _hf_logits(hf, ids[:1, 9:])
                error = max(error, (packed[:1, 9:] - alone).abs().max().item())
            out[(str(layout), family)] = error
            if "tensor_parallel_degree" in layout:
                back = model.hf_state_dict()  # TP shards gathered, then to HF
                out[family] = {k: np.asarray(v) for k, v in back.items()}
    return out


def test_transform_tp2_sp_and_ep2_match_hf_and_export_exactly():
    results = run_distributed(_parallel_worker, 2, timeout=400)
    for result in results:
        errors = {k: v for k, v in result.items() if isinstance(k, tuple)}
        assert len(errors) == len(FAMILIES) + len(MOE)
        assert max(errors.values()) < TOLERANCE, errors
    for family in FAMILIES:
        expected = build_hf(family).state_dict()
        back = results[0][family]
        assert back.keys() == expected.keys()
        assert all(torch.equal(torch.from_numpy(back[k]), expected[k]) for k in expected), family


@pytest.mark.parametrize("family", FAMILIES)
def test_convert_hf_to_framework_tp2_to_hf_is_exact(family, tmp_path):
    import transformers

    from tools.checkpoint.convert import main

    source = build_hf(family)
    source.save_pretrained(tmp_path / "hf")
    model_type = MODEL_TYPE[family].replace("_text", "")
    for loader, saver, load, save, extra in (
            ("hf", "megatron_smp", "hf", "smp", ("--target-tensor-parallel-size", "2")),
            ("megatron_smp", "hf", "smp", "hf2", ())):
        stderr = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(stderr):
            status = main(["--model-type", model_type, "--loader", loader, "--saver", saver,
                           "--load-dir", str(tmp_path / load), "--save-dir",
                           str(tmp_path / save), *extra])
        assert status == 0, stderr.getvalue()
    result = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf2")
    expected, actual = source.state_dict(), result.state_dict()
    assert expected.keys() == actual.keys()
    assert all(torch.equal(expected[k], actual[k]) for k in expected), family
