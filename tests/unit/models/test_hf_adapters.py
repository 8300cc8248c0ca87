"""Hugging Face adapters and smp.transform: exact state-dict round trips, TP shard/merge round
trips, and HF's logits from the transformed model at TP=1 and TP=2 (also loading from rank 0)."""
import json
import warnings

import pytest
import torch

import megatron_smp as smp
from megatron_smp.config import ConfigError
from megatron_smp.models.hf import config_to_hf, get_adapter
from megatron_smp.models.sharding import merge_state_dicts, shard_state_dict
from megatron_smp.testing import run_distributed
from tests.unit.models.common import to_numpy, to_torch

warnings.filterwarnings("ignore", message=".*")
# llama31: a Llama with Llama 3.1 RoPE scaling; qwen2: q/k/v biases, tied head, YaRN.
FAMILIES = ("gpt2", "llama", "llama31", "mistral", "gpt_neox", "qwen2")
# The adapter family (config_to_hf's name) of each test family.
HF_FAMILY = {"llama31": "llama"}
BATCH, SEQ = 2, 12


# Scaled RoPE with original contexts below SEQ, their ramps inside a head dim of 24.
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
               "low_freq_factor": 0.5, "high_freq_factor": 2.0,
               "original_max_position_embeddings": 8}
YARN_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
             "original_max_position_embeddings": 8, "beta_fast": 32.0, "beta_slow": 0.25,
             "mscale": 1.0, "mscale_all_dim": 0.5, "truncate": False}


def build_hf(family, seed=0, device=None, **overrides):
    """A small random HF causal LM; vocab sizes are not multiples of 128. `overrides` go to
    the HF config (e.g. head_dim)."""
    import transformers as tf

    common = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                  max_position_embeddings=32)
    if family == "gpt2":
        config = tf.GPT2Config(vocab_size=1003, n_positions=32, n_embd=64, n_layer=2, n_head=4,
                               bos_token_id=0, eos_token_id=0)
        cls = tf.GPT2LMHeadModel
    elif family == "llama":
        config = tf.LlamaConfig(vocab_size=1003, num_key_value_heads=2, intermediate_size=96,
                                rope_parameters={"rope_type": "default", "rope_theta": 5e5},
                                **common)
        cls = tf.LlamaForCausalLM
    elif family == "mistral":
        config = tf.MistralConfig(vocab_size=1000, num_key_value_heads=2, intermediate_size=96,
                                  sliding_window=5, **common)  # < SEQ: the window matters
        cls = tf.MistralForCausalLM
    elif family == "mixtral":
        config = tf.MixtralConfig(vocab_size=1003, num_key_value_heads=2, intermediate_size=48,
                                  num_local_experts=4, num_experts_per_tok=2, **common)
        cls = tf.MixtralForCausalLM
    elif family == "llama31":  # Llama 3.1 scaling; SEQ reaches past the original context
        config = tf.LlamaConfig(vocab_size=1003, num_key_value_heads=2, intermediate_size=96,
                                head_dim=24, rope_parameters=dict(LLAMA3_ROPE), **common)
        cls = tf.LlamaForCausalLM
    elif family == "qwen2":  # q/k/v biases, tied head, head_dim != hidden / heads, YaRN
        config = tf.Qwen2Config(vocab_size=1003, num_key_value_heads=2, intermediate_size=96,
                                head_dim=24, tie_word_embeddings=True,
                                rope_parameters=dict(YARN_ROPE), **common)
        cls = tf.Qwen2ForCausalLM
    elif family == "qwen3_moe":  # q/k norms, renormalised top-k, layer 1 dense
        config = tf.Qwen3MoeConfig(vocab_size=1003, num_key_value_heads=2, intermediate_size=96,
                                   head_dim=24, moe_intermediate_size=32, num_experts=4,
                                   num_experts_per_tok=2, norm_topk_prob=True,
                                   mlp_only_layers=[1], **common)
        cls = tf.Qwen3MoeForCausalLM
    elif family == "qwen2_moe":  # layer 1 dense, softmax before top-k, gated shared expert
        config = tf.Qwen2MoeConfig(vocab_size=1003, num_key_value_heads=2, intermediate_size=96,
                                   moe_intermediate_size=32, shared_expert_intermediate_size=80,
                                   num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1],
                                   **common)
        cls = tf.Qwen2MoeForCausalLM
    else:
        config = tf.GPTNeoXConfig(vocab_size=1003, intermediate_size=128, **common)
        cls = tf.GPTNeoXForCausalLM
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    if device is not None:
        with torch.device(device):
            return cls(config).eval()
    model = cls(config).eval()
    with torch.no_grad():  # HF zero-inits biases and sets norms to one: make them count
        for name, param in model.named_parameters():
            if name.endswith(("bias", "gate.weight")) or "norm" in name or "ln_" in name:
                param.add_(0.1 * torch.randn_like(param))
    return model


def _ids(vocab_size):
    return torch.randint(0, vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("family", FAMILIES)
def test_state_dict_round_trips_are_exact(family):
    hf = build_hf(family)
    adapter = get_adapter(hf)
    config = adapter.config_from_hf(hf.config)
    hf_sd = hf.state_dict()
    full = adapter.from_hf(hf_sd, config)
    back = adapter.to_hf(full, config)
    assert back.keys() == hf_sd.keys()
    for name in hf_sd:
        assert torch.equal(back[name], hf_sd[name]), name
    again = adapter.from_hf(back, config)
    assert all(torch.equal(again[k], full[k]) for k in full)
    for tp_size in (2, 4):
        shards = [shard_state_dict(full, config, tp_size, r) for r in range(tp_size)]
        padded = config.padded_vocab_size(tp_size) // tp_size
        assert shards[0]["embedding.word_embeddings.weight"].shape[0] == padded
        merged = merge_state_dicts(shards, config)
        assert merged.keys() == full.keys()
        for name in full:
            assert torch.equal(merged[name], full[name]), (tp_size, name)
    # Config translation round trip.
    family = HF_FAMILY.get(family, family)
    assert get_adapter(family).config_from_hf(config_to_hf(config, family)) == config


@pytest.mark.parametrize("family", FAMILIES)
def test_transform_tp1_matches_hf_logits(family):
    smp.init({"tensor_parallel_degree": 1, "random_seed": 3})
    hf = build_hf(family)
    model = smp.transform(hf)
    ids = _ids(hf.config.vocab_size)
    with torch.no_grad():
        expected = hf(ids).logits
        logits = model(ids)
        assert logits.shape == expected.shape
        assert (logits - expected).abs().max() < 1e-4
        # HF-style padding mask: right padding leaves the real tokens' logits unchanged.
        padding = torch.ones(BATCH, SEQ, dtype=torch.long)
        padding[0, -3:] = 0
        expected = hf(ids, attention_mask=padding).logits
        masked = model(ids, attention_mask=padding)
        assert (masked[0, :-3] - expected[0, :-3]).abs().max() < 1e-4
        assert (masked[1] - expected[1]).abs().max() < 1e-4


def _transform_worker(rank, world_size):
    """Per family: rank-local weights, then rank 0's weights broadcast while rank 1 holds
    other random weights, then while rank 1's model is on the meta device."""
    smp.init({"tensor_parallel_degree": 2})
    results = {}
    for family in FAMILIES:
        hf = build_hf(family)
        ids = _ids(hf.config.vocab_size)
        with torch.no_grad():
            reference = hf(ids).logits
            outputs = {"local": smp.transform(hf)(ids)}
            if family in ("gpt2", "llama"):  # sequence parallelism as a transformer-config override
                model = smp.transform(hf, config={"sequence_parallel": True})
                outputs["sequence_parallel"] = model(ids)
            for mode, other in (("random", lambda: build_hf(family, seed=100)),
                                ("meta", lambda: build_hf(family, device="meta"))):
                source = hf if rank == 0 else other()
                outputs[mode] = smp.transform(source, load_state_dict_from_rank0=True)(ids)
        results[family] = (reference, outputs)
    return to_numpy(results)


def test_transform_tp2_matches_hf_logits():
    results = to_torch(run_distributed(_transform_worker, 2))
    for family in FAMILIES:
        reference = results[0][family][0]
        for rank in (0, 1):
            for mode, logits in results[rank][family][1].items():
                assert logits.shape == reference.shape
                assert (logits - reference).abs().max() < 1e-4, (family, rank, mode)


def test_init_validates_config(tmp_path):
    with pytest.raises(ConfigError, match="unknown"):
        smp.init({"tensor_parallel_degre": 2})
    with pytest.raises(ConfigError, match="integer"):
        smp.init({"tensor_parallel_degree": "2"})
    with pytest.raises(ConfigError, match="true or false"):
        smp.init({"sm_activation_offloading": 1})
    with pytest.raises(ConfigError, match="world size"):
        smp.init({"tensor_parallel_degree": 2})
    with pytest.raises(ConfigError, match="activation_loading_horizon"):
        smp.init({"activation_loading_horizon": 0})
    with pytest.raises(ConfigError, match="does not exist"):
        smp.init(str(tmp_path / "missing.json"))
    path = tmp_path / "smp.json"
    with pytest.raises(ConfigError, match="shard_optimizer_state only applies"):
        smp.init({"shard_optimizer_state": True})
    path.write_text(json.dumps({"hybrid_shard_degree": 1, "random_seed": 9}))
    smp.init(str(path))
    assert smp.is_initialized()
    state = smp.state
    assert (state.rank, state.world_size, state.tp_size, state.tp_rank) == (0, 1, 1, 0)
    assert state.hybrid_shard_degree == 1 and state.random_seed == 9
    assert state.tp_process_group is state.parallel_state.tp_group
    assert state.rep_rank_process_group is state.parallel_state.dp_cp_group


def test_mistral_sliding_window_is_modelled():
    hf_model = build_hf("mistral")
    config = get_adapter("mistral").config_from_hf(hf_model.config)
    assert config.window_size == (4, 0)
    assert config_to_hf(config, "mistral").sliding_window == 5
    with pytest.raises(ConfigError, match="Llama has no sliding-window"):
        config_to_hf(config, "llama")
    # The window changes HF's logits at SEQ > 5, and ours follow (test_transform_* compare).
    ids = _ids(1000)
    with torch.no_grad():
        windowed = hf_model(ids).logits
        hf_model.config.sliding_window = None
        full = hf_model(ids).logits
    assert (windowed - full).abs().max() > 1e-3
    assert torch.equal(windowed[:, :5], full[:, :5])


def test_transform_rejects_unknown_models():
    smp.init()
    with pytest.raises(ConfigError, match="no Hugging Face adapter"):
        smp.transform(torch.nn.Linear(2, 2))


def _head_dim_worker(rank, world_size):
    smp.init({"tensor_parallel_degree": world_size})
    hf = build_hf("mistral", head_dim=32)  # 4 heads x 32 = 128 != hidden 64
    ids = _ids(hf.config.vocab_size)
    with torch.no_grad():
        return to_numpy((hf(ids).logits, smp.transform(hf)(ids)))


def test_head_dim_other_than_hidden_over_heads_keeps_logits():
    """Mistral-style head_dim (--kv-channels): conversion is exact both ways and the logits
    equal HF's at TP=1 and TP=2."""
    hf = build_hf("mistral", head_dim=32)
    adapter = get_adapter(hf)
    config = adapter.config_from_hf(hf.config)
    assert config.kv_channels == 32 and config.hidden_size == 64
    assert config_to_hf(config, "mistral").head_dim == 32
    back = adapter.to_hf(adapter.from_hf(hf.state_dict(), config), config)
    assert all(torch.equal(back[k], v) for k, v in hf.state_dict().items())
    for world_size in (1, 2):
        for reference, logits in to_torch(run_distributed(_head_dim_worker, world_size)):
            assert (logits - reference).abs().max() < 1e-4, world_size
