"""flops_per_iteration gives the number Megatron-LM core_v0.16.1 prints in its training log
(megatron/training/training.py num_floating_point_operations). The expected values were
evaluated by hand from Megatron's formula, per token:
    6*h*(ffn*e*dense + moe_ffn*topk*e*moe + shared*e*moe)
    + L*6*(h*(q + 2*kv) + q*s + q*h) + 6*h*V,          e = 3 if SwiGLU else 2,
times batch * seq."""
import pytest

from megatron_smp.config import TransformerConfig
from megatron_smp.training.logging import flops_per_iteration


def _config(**kwargs) -> TransformerConfig:
    kwargs.setdefault("max_position_embeddings", 4096)
    return TransformerConfig(**kwargs)


CASES = [
    # GPT-2 125M: MHA, GeLU MLP, padded vocab 50304, seq 1024, batch 8.
    # per token 6*(2*768*3072*12 + 12*(768*2304 + 768*1024 + 768*768) + 768*50304)
    (dict(num_layers=12, hidden_size=768, num_attention_heads=12, ffn_hidden_size=3072,
          vocab_size=50257), 50304, 1024, 8, 6537477095424),
    # Llama ~1B: GQA 32 heads / 8 groups, SwiGLU 8192, vocab 128256, seq 4096, batch 1.
    (dict(num_layers=16, hidden_size=2048, num_attention_heads=32, num_query_groups=8,
          ffn_hidden_size=8192, gated_linear_unit=True, activation="silu",
          normalization="RMSNorm", position_embedding_type="rope", vocab_size=128256),
     128256, 4096, 1, 33668248633344),
    # MoE every 2nd layer (layers 0, 2), 8 experts top-2 of 256, shared expert 512, SwiGLU.
    (dict(num_layers=4, hidden_size=512, num_attention_heads=8, num_query_groups=2,
          ffn_hidden_size=1024, gated_linear_unit=True, activation="silu", vocab_size=32000,
          num_moe_experts=8, moe_layer_freq=2, moe_router_topk=2, moe_ffn_hidden_size=256,
          moe_shared_expert_intermediate_size=512), 32000, 128, 4, 78517370880),
    # Heads x head dim (4 x 128) wider than hidden 256.
    (dict(num_layers=2, hidden_size=256, num_attention_heads=4, kv_channels=128,
          ffn_hidden_size=1024, vocab_size=1000), 1024, 64, 2, 1862270976),
    # MoE pattern [0,1,1,0], top-1, experts of ffn_hidden_size, no shared expert.
    (dict(num_layers=4, hidden_size=256, num_attention_heads=4, num_query_groups=2,
          ffn_hidden_size=512, gated_linear_unit=True, activation="silu", vocab_size=1000,
          num_moe_experts=4, moe_layer_freq="[0,1,1,0]", moe_router_topk=1),
     1024, 32, 3, 1528823808),
    # Qwen2.5-7B: GQA 28 heads / 4 groups, q/k/v biases (not counted, as in Megatron),
    # SwiGLU 18944, vocab 152064, seq 4096, batch 1.
    (dict(num_layers=28, hidden_size=3584, num_attention_heads=28, num_query_groups=4,
          ffn_hidden_size=18944, gated_linear_unit=True, activation="silu",
          add_bias_linear=False, add_qkv_bias=True, vocab_size=152064),
     152064, 4096, 1, 183861107490816),
    # Qwen3-30B-A3B: head dim 128 (32 x 128 = 4096 wider than hidden 2048), 4 groups, 48 MoE
    # layers of 128 experts, top-8 of width 768, q/k norms (not counted), vocab 151936.
    (dict(num_layers=48, hidden_size=2048, num_attention_heads=32, num_query_groups=4,
          kv_channels=128, ffn_hidden_size=6144, gated_linear_unit=True, activation="silu",
          qk_layernorm=True, vocab_size=151936, num_moe_experts=128, moe_router_topk=8,
          moe_ffn_hidden_size=768), 151936, 4096, 1, 94233729957888),
]


@pytest.mark.parametrize("kwargs,padded_vocab,seq,batch,expected", CASES)
def test_flops_match_megatron(kwargs, padded_vocab, seq, batch, expected):
    config = _config(**kwargs)
    assert config.padded_vocab_size(1) == padded_vocab
    assert flops_per_iteration(config, seq, batch, padded_vocab) == expected


def test_causal_attention_counts_half_the_square():
    """Doubling the sequence adds exactly the (causal) attention term 6*L*q*s per token."""
    config = _config(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256,
                     vocab_size=128)
    short = flops_per_iteration(config, 32, 1, 128)
    long = flops_per_iteration(config, 64, 1, 128)
    # per token at s: c + 6*L*q*s; long = 64*(c + 6*2*64*64), short = 32*(c + 6*2*64*32)
    assert long - 2 * short == 64 * 6 * 2 * 64 * 64 - 2 * 32 * 6 * 2 * 64 * 32


def test_sliding_window_layers_count_the_keys_in_their_window():
    """gpt-oss-style: window 128 on every other layer of 4 at s = 1024: each such layer's
    core term is 6*q*(2*128 - 128^2/1024) per token instead of 6*q*1024."""
    common = dict(num_layers=4, hidden_size=256, num_attention_heads=4, ffn_hidden_size=512,
                  gated_linear_unit=True, activation="quick_gelu", vocab_size=1000)
    full = flops_per_iteration(_config(**common), 1024, 2, 1024)
    windowed = _config(**common, window_size=(127, 0), window_attn_skip_freq=2)
    q = 256
    saved = 2 * 1024 * 2 * 6 * q * (1024 - (2 * 128 - 128 * 128 / 1024))
    assert flops_per_iteration(windowed, 1024, 2, 1024) == full - saved
    # A window at least as long as the sequence is plain causal attention.
    wide = _config(**common, window_size=(1023, 0), window_attn_skip_freq=2)
    assert flops_per_iteration(wide, 1024, 2, 1024) == full


def test_gemma3_1b_counts_its_gemms_and_windows():
    """Gemma 3 1B (26 layers of h 1152, 4 heads / 1 group of 256, GeGLU 6912, vocab 262144,
    window 512 on 22 of 26 layers: every 6th full) at s = 4096: the GEMMs as for any GQA
    model, the sliding layers' core term over their 512 keys. The sandwich and q/k norms, the
    embedding scaling and the soft-cap are no GEMMs: not counted (Megatron counts no norms)."""
    gemma = _config(num_layers=26, hidden_size=1152, num_attention_heads=4, num_query_groups=1,
                    kv_channels=256, ffn_hidden_size=6912, gated_linear_unit=True,
                    activation="gelu_tanh", normalization="RMSNorm", qk_layernorm=True,
                    sandwich_norm=True, apply_embedding_scaling=True,
                    position_embedding_type="rope", local_rotary_base=1e4,
                    window_size=(511, 0), window_attn_skip_freq=6, vocab_size=262144,
                    final_logit_softcapping=30.0, layernorm_zero_centered_gamma=True)
    h, q, kv, f, s, v, w = 1152, 1024, 256, 6912, 4096, 262144, 512
    core = q * (4 * s + 22 * (2 * w - w * w / s))
    per_token = 3 * h * f * 26 + 26 * (h * (q + 2 * kv) + q * h) + core + h * v
    assert flops_per_iteration(gemma, s, 1, v) == 6.0 * per_token * s


def test_multi_latent_attention_count_is_megatrons():
    """MLA, Megatron's terms by hand (L=2, h=64, 4 heads, q_lora 32, kv_lora 16, qk 8, pos 4,
    v 8, seq 32): q 32*(64+48+1) = 3616, kv 16*(64+4*16+1) + 64*4 = 2320, out 4*8*64 = 2048,
    core 32*48/2 + 32*32/2 = 1280; per token 2*64*128*2 + 2*9264 + 64*128 = 59488."""
    config = _config(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                     vocab_size=128, multi_latent_attention=True, q_lora_rank=32,
                     kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=8,
                     position_embedding_type="rope")
    assert flops_per_iteration(config, 32, 1, 128) == 6 * 59488 * 32


def test_multi_token_prediction_count_is_megatrons():
    """MTP (Megatron's count): the 2 MTP layers count as layers of the last (MoE) layer's kind,
    plus norms 3*h and eh_proj 2*h*h each, and the logits 3 times. The MLA model above with
    MoE on layer 2 (4 experts, top-2 of 32, shared 16), SwiGLU 128: per token
    MLP 3*64*(128*1 + (2*32 + 16)*3) = 70656, attention 4*9264 = 37056,
    MTP 2*(3*64 + 2*64*64) = 16768, logits 64*128*3 = 24576; total 149056."""
    config = _config(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                     vocab_size=128, multi_latent_attention=True, q_lora_rank=32,
                     kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=8,
                     position_embedding_type="rope", gated_linear_unit=True, activation="silu",
                     num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
                     moe_shared_expert_intermediate_size=16, moe_layer_freq=[0, 1],
                     mtp_num_layers=2)
    assert flops_per_iteration(config, 32, 1, 128) == 6 * 149056 * 32
