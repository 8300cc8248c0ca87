"""Decoder building blocks over [s, b, h] activations: attention, MLP, layer, block."""
from megatron_smp.transformer.attention import (
    FlashGroupedQueryAttention,
    FlashSelfAttention,
    RotaryEmbedding,
    SelfAttention,
    alibi_slopes,
    apply_rotary_pos_emb,
    core_attention,
)
from megatron_smp.transformer.block import TransformerBlock
from megatron_smp.transformer.layer import TransformerLayer
from megatron_smp.transformer.mlp import MLP
from megatron_smp.transformer.norm import LayerNorm, RMSNorm, build_norm

__all__ = [
    "FlashGroupedQueryAttention",
    "FlashSelfAttention",
    "RotaryEmbedding",
    "SelfAttention",
    "alibi_slopes",
    "apply_rotary_pos_emb",
    "core_attention",
    "TransformerBlock",
    "TransformerLayer",
    "MLP",
    "LayerNorm",
    "RMSNorm",
    "build_norm",
]
