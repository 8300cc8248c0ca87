"""Llama / Mistral: GPTModel with RoPE, RMSNorm, SwiGLU, grouped-query attention, no biases
and an untied output layer. There is no separate model class: `LlamaModel` is `GPTModel`,
and `llama_config` gives the TransformerConfig.

    model = LlamaModel(llama_config(num_layers=2, hidden_size=64, num_attention_heads=4,
                                    num_query_groups=2, vocab_size=1003), state)
"""
from __future__ import annotations

from megatron_smp.config import TransformerConfig
from megatron_smp.models.gpt import GPTModel

LlamaModel = GPTModel
MistralModel = GPTModel

_LLAMA_DEFAULTS = dict(
    normalization="RMSNorm",
    layernorm_epsilon=1e-6,
    activation="silu",
    gated_linear_unit=True,
    position_embedding_type="rope",
    rotary_base=10000.0,
    add_bias_linear=False,
    untie_embeddings_and_output_weights=True,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    use_scaled_init_method=False,
)


def llama_ffn_hidden_size(hidden_size: int, multiple_of: int = 256) -> int:
    """Llama's SwiGLU width: 2/3 of 4h, rounded up to `multiple_of`."""
    size = int(2 * 4 * hidden_size / 3)
    return multiple_of * ((size + multiple_of - 1) // multiple_of)


def llama_config(
    num_layers: int,
    hidden_size: int,
    num_attention_heads: int,
    vocab_size: int,
    max_position_embeddings: int = 4096,
    num_query_groups: int | None = None,
    ffn_hidden_size: int | None = None,
    **overrides,
) -> TransformerConfig:
    """A Llama-family TransformerConfig; `overrides` set any other field (e.g. rotary_base)."""
    settings = dict(_LLAMA_DEFAULTS)
    settings.update(overrides)
    return TransformerConfig(
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_attention_heads=num_attention_heads,
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        num_query_groups=num_query_groups,
        ffn_hidden_size=ffn_hidden_size or llama_ffn_hidden_size(hidden_size),
        **settings,
    )


def mistral_config(*args, **kwargs) -> TransformerConfig:
    """Mistral-7B conventions: Llama's with 8 query groups and v0.1's 4096-token sliding
    window (pass window_size=None for v0.2 and later, which attend to the whole context)."""
    kwargs.setdefault("num_query_groups", 8)
    kwargs.setdefault("window_size", (4095, 0))
    return llama_config(*args, **kwargs)


__all__ = ["LlamaModel", "MistralModel", "llama_config", "mistral_config", "llama_ffn_hidden_size"]
