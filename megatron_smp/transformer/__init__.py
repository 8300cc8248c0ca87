"""Decoder building blocks over [s, b, h] activations: attention, MLP, layer, block."""
from megatron_smp.transformer.attention import (
    DotProductAttention,
    FlashGroupedQueryAttention,
    FlashSelfAttention,
    RotaryEmbedding,
    SelfAttention,
    alibi_slopes,
    apply_rotary_pos_emb,
    core_attention,
)
from megatron_smp.transformer.block import TransformerBlock
from megatron_smp.transformer.layer import TransformerLayer, get_gpt_layer_spec
from megatron_smp.transformer.mlp import MLP
from megatron_smp.transformer.norm import LayerNorm, RMSNorm, build_norm
from megatron_smp.transformer.spec import (
    ModuleSpec,
    SelfAttentionSubmodules,
    TransformerLayerSubmodules,
    build_module,
)

__all__ = [
    "DotProductAttention",
    "FlashGroupedQueryAttention",
    "FlashSelfAttention",
    "RotaryEmbedding",
    "SelfAttention",
    "alibi_slopes",
    "apply_rotary_pos_emb",
    "core_attention",
    "TransformerBlock",
    "TransformerLayer",
    "get_gpt_layer_spec",
    "ModuleSpec",
    "SelfAttentionSubmodules",
    "TransformerLayerSubmodules",
    "build_module",
    "MLP",
    "LayerNorm",
    "RMSNorm",
    "build_norm",
]
