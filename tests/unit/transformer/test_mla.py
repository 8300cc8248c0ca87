"""Multi-latent attention equals Hugging Face's DeepseekV3Attention (random weights, odd sizes,
interleaved RoPE on the positional channels, q through a latent or not): output, input grad and
the replicated down-projection's grad, at TP=1 and at TP=2 with sequence parallelism, with and
without --recompute-modules mla_up_proj."""
import pytest
import torch

from megatron_smp.testing import run_distributed

S, B, H, HEADS = 6, 2, 24, 4
DIMS = dict(kv_lora_rank=10, qk_head_dim=6, qk_pos_emb_head_dim=4, v_head_dim=5)


def _hf_attention(q_lora_rank):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3Attention, DeepseekV3RotaryEmbedding)

    config = DeepseekV3Config(
        hidden_size=H, num_attention_heads=HEADS, num_key_value_heads=HEADS,
        q_lora_rank=q_lora_rank, kv_lora_rank=DIMS["kv_lora_rank"],
        qk_nope_head_dim=DIMS["qk_head_dim"], qk_rope_head_dim=DIMS["qk_pos_emb_head_dim"],
        v_head_dim=DIMS["v_head_dim"], rms_norm_eps=1e-6, attention_bias=False,
        max_position_embeddings=64, rope_interleave=True)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    attention = DeepseekV3Attention(config, layer_idx=0)
    with torch.no_grad():
        for name, param in attention.named_parameters():
            if "layernorm" in name:
                param.normal_(1.0, 0.2)
    return attention, DeepseekV3RotaryEmbedding(config)


_NAMES = {"q_proj": "linear_q_proj", "q_a_proj": "linear_q_down_proj",
          "q_a_layernorm": "q_layernorm", "q_b_proj": "linear_q_up_proj",
          "kv_a_proj_with_mqa": "linear_kv_down_proj", "kv_a_layernorm": "kv_layernorm",
          "kv_b_proj": "linear_kv_up_proj", "o_proj": "linear_proj"}
_COLUMN = ("linear_q_proj", "linear_q_up_proj", "linear_kv_up_proj")


def _mla_against_hf(rank, world_size, q_lora_rank, recompute=False):
    from megatron_smp.config import ParallelConfig
    from megatron_smp.distributed.finalize_model_grads import allreduce_sequence_parallel_grads
    from megatron_smp.models.llama import llama_config
    from megatron_smp.parallel_state import build_parallel_state
    from megatron_smp.transformer.attention import RotaryEmbedding
    from megatron_smp.transformer.mla import MLASelfAttention
    from tests.unit.models.common import to_numpy

    state = build_parallel_state(ParallelConfig(tensor_model_parallel_size=world_size))
    sp = world_size > 1
    config = llama_config(num_layers=1, hidden_size=H, num_attention_heads=HEADS,
                          vocab_size=10, multi_latent_attention=True, qk_layernorm=True,
                          q_lora_rank=q_lora_rank,
                          rotary_interleaved=True, layernorm_epsilon=1e-6,
                          sequence_parallel=sp, **DIMS)
    if recompute:  # --recompute-granularity selective --recompute-modules mla_up_proj
        config = config.replace(recompute_granularity="selective",
                                recompute_modules=["mla_up_proj"])
    hf, hf_rotary = _hf_attention(q_lora_rank)
    ours = MLASelfAttention(config, state)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            module, leaf = name.split(".")
            target = ours.get_submodule(_NAMES[module]).get_parameter(leaf)
            if _NAMES[module] in _COLUMN:
                value = param.chunk(world_size, dim=0)[rank]
            elif _NAMES[module] == "linear_proj":
                value = param.chunk(world_size, dim=1)[rank]
            else:
                value = param
            target.copy_(value)

    x = torch.randn(B, S, H, generator=torch.Generator().manual_seed(1))
    positions = torch.arange(S)[None].expand(B, -1)
    x_hf = x.clone().requires_grad_()
    want = hf(x_hf, hf_rotary(x_hf, positions), None)[0]
    want.square().sum().backward()

    x_ours = x.transpose(0, 1).contiguous()  # [s, b, h]
    if sp:
        x_ours = x_ours.chunk(world_size, dim=0)[rank].contiguous()
    x_ours.requires_grad_()
    rotary = RotaryEmbedding(DIMS["qk_pos_emb_head_dim"], interleaved=True)(S)
    heads = []  # q/k/v of every up-projection run (the forward's, and backward's recompute)
    original = ours._up_projections

    def recorded(*args):
        heads.append(original(*args))
        return heads[-1]
    ours._up_projections = recorded
    got = ours(x_ours, None, rotary)
    # With mla_up_proj the forward's q/k/v hold no storage until backward refills them.
    discarded = [t.untyped_storage().size() == 0 for t in heads[0]]
    # The loss is a sum over this rank's shard: the shards' grads add up to the whole one's.
    got.square().sum().backward()
    allreduce_sequence_parallel_grads([ours], state)
    want_out = want.detach().transpose(0, 1)
    want_grad = x_hf.grad.transpose(0, 1)
    if sp:
        want_out = want_out.chunk(world_size, dim=0)[rank]
        want_grad = want_grad.chunk(world_size, dim=0)[rank]
    assert discarded == [recompute] * 3 and len(heads) == 1 + recompute
    return to_numpy({
        "out": (got.detach(), want_out),
        "x_grad": (x_ours.grad, want_grad),
        "down_grad": (ours.linear_kv_down_proj.weight.grad, hf.kv_a_proj_with_mqa.weight.grad),
        "norm_grad": (ours.kv_layernorm.weight.grad, hf.kv_a_layernorm.weight.grad),
    })


@pytest.mark.parametrize("world_size, q_lora_rank, recompute",
                         [(1, 7, False), (1, None, True), (2, 7, True)])
def test_mla_equals_hf_deepseek_v3_attention(world_size, q_lora_rank, recompute):
    """--recompute-modules mla_up_proj (q/k/v discarded after the core attention, recomputed
    in backward) gives the same output and grads."""
    # One process runs in this one (a spawned child costs ~10 s of imports here).
    results = ([_mla_against_hf(0, 1, q_lora_rank, recompute)] if world_size == 1 else
               run_distributed(_mla_against_hf, world_size, args=(q_lora_rank, recompute),
                               timeout=120))
    for result in results:
        for name, (got, want) in result.items():
            torch.testing.assert_close(torch.from_numpy(got), torch.from_numpy(want),
                                       rtol=1e-4, atol=2e-5, msg=name)


@pytest.mark.parametrize("settings, parallel, message", [
    (dict(position_embedding_type="learned_absolute"), {}, "position-embedding-type rope or "
                                                           "yarn, or --rope-type"),
    (dict(num_query_groups=2), {}, "--group-query-attention"),
    (dict(qk_pos_emb_head_dim=5), {}, "must be even"),
])
def test_mla_flag_errors(settings, parallel, message):
    from megatron_smp.config import ConfigError, ParallelConfig
    from megatron_smp.models.llama import llama_config

    settings = dict(dict(num_layers=1, hidden_size=H, num_attention_heads=HEADS, vocab_size=10,
                         multi_latent_attention=True, **DIMS), **settings)
    config = llama_config(**settings)
    with pytest.raises(ConfigError, match=message):
        config.validate(ParallelConfig(**parallel))


def test_rope_type_flags_follow_megatron():
    """Megatron's MLA takes YaRN unless --rope-type rope (--rotary-scaling-factor 1, its
    default, is plain RoPE); DeepSeek-V3's scripts give --position-embedding-type rope with
    --rotary-scaling-factor 40 --mscale 1 --mscale-all-dim 1; --rope-type yarn without MLA is
    an error; YaRN scales MLA's scores by mscale(factor, mscale_all_dim)^2."""
    import math

    from megatron_smp.config import ConfigError, ParallelConfig
    from megatron_smp.parallel_state import build_parallel_state
    from megatron_smp.transformer.mla import MLASelfAttention
    from tests.unit.training.test_arguments import BASE, parse

    mla = BASE + "--multi-latent-attention --position-embedding-type rope".split()
    assert parse(mla).model.position_embedding_type == "yarn"
    assert parse(mla).model.yarn_rotary_scaling_factor == 1.0
    assert parse(mla + ["--rope-type", "rope"]).model.position_embedding_type == "rope"
    model = parse(mla + "--rotary-scaling-factor 40 --mscale 1 --mscale-all-dim 1".split()).model
    assert (model.position_embedding_type, model.yarn_rotary_scaling_factor,
            model.yarn_mscale, model.yarn_mscale_all_dim) == ("yarn", 40.0, 1.0, 1.0)
    with pytest.raises(ConfigError, match="--rope-type yarn applies to --multi-latent"):
        parse(BASE + "--position-embedding-type rope --rope-type yarn".split())
    with pytest.raises(ConfigError, match="configure YaRN"):
        parse(mla + "--rope-type rope --mscale 1".split())
    model = model.replace(qk_head_dim=128, qk_pos_emb_head_dim=64, kv_lora_rank=32,
                          v_head_dim=128, hidden_size=64, num_attention_heads=4)
    attention = MLASelfAttention(model, build_parallel_state(ParallelConfig()), device="meta")
    assert attention.softmax_scale == pytest.approx((0.1 * math.log(40) + 1) ** 2 / 192 ** 0.5)


def test_mla_with_learned_absolute_positions_rotates_its_channels_too():
    """Megatron's MLA builds its own rotary embedding (--rope-type, default yarn) whatever
    --position-embedding-type says: with learned_absolute the model adds the learned
    positions to its embeddings and rotates MLA's positional channels, so with those
    positions zeroed it computes what --position-embedding-type rope (YaRN) computes."""
    from megatron_smp.config import ParallelConfig
    from megatron_smp.models.gpt import GPTModel
    from megatron_smp.parallel_state import build_parallel_state
    from megatron_smp.tensor_parallel.random import model_parallel_seed
    from tests.unit.training.test_arguments import BASE, parse

    mla = BASE + ("--multi-latent-attention --qk-head-dim 8 --qk-pos-emb-head-dim 4 "
                  "--v-head-dim 8 --kv-lora-rank 8 --max-position-embeddings 32").split()
    learned = parse(mla).model
    assert (learned.position_embedding_type, learned.mla_rope_type) == ("learned_absolute",
                                                                        "yarn")
    assert parse(mla + ["--rope-type", "rope"]).model.mla_rope_type == "rope"
    rotary = parse(mla + ["--position-embedding-type", "rope"]).model
    state = build_parallel_state(ParallelConfig())
    model_parallel_seed(3, state)
    models = [GPTModel(config, state).eval() for config in (learned, rotary)]
    assert models[0].rotary_pos_emb is not None and models[0].embedding.add_position_embedding
    missing = models[0].load_state_dict(models[1].state_dict(), strict=False).missing_keys
    assert missing == ["embedding.position_embeddings.weight"]
    tokens = torch.randint(0, 1000, (2, 16))
    with torch.no_grad():
        models[0].embedding.position_embeddings.weight.zero_()
        torch.testing.assert_close(models[0](tokens), models[1](tokens))
        models[0].embedding.position_embeddings.weight.normal_()
        assert not torch.allclose(models[0](tokens), models[1](tokens))


def test_latent_norms_follow_qk_layernorm():
    """megatron-core's MLA spec: q_layernorm / kv_layernorm are norms with --qk-layernorm
    (DeepSeek's models), identities without it."""
    from megatron_smp.config import ParallelConfig
    from megatron_smp.models.llama import llama_config
    from megatron_smp.parallel_state import build_parallel_state
    from megatron_smp.transformer.mla import MLASelfAttention

    state = build_parallel_state(ParallelConfig())
    for qk_layernorm in (False, True):
        config = llama_config(num_layers=1, hidden_size=H, num_attention_heads=HEADS,
                              vocab_size=10, multi_latent_attention=True, q_lora_rank=7,
                              qk_layernorm=qk_layernorm, **DIMS)
        names = {n for n, _ in MLASelfAttention(config, state).named_parameters()}
        assert ({"q_layernorm.weight", "kv_layernorm.weight"} <= names) == qk_layernorm
        assert not qk_layernorm or not any("layernorm.bias" in n for n in names)
