"""torch.sagemaker.nn.huggingface.llama_flashattn: `LlamaFlashAttention`, Llama's attention on
`FlashGroupedQueryAttention` (SDPA's fused kernels here)."""
from __future__ import annotations

from typing import Optional

import torch

from megatron_smp.config import ConfigError
from megatron_smp.smp.hf_contract import padding_to_attention_mask
from megatron_smp.transformer.attention import FlashGroupedQueryAttention, core_attention


class LlamaFlashAttention(torch.nn.Module):
    """SMP v2's `LlamaFlashAttention(config)`: Hugging Face Llama's self-attention (the same
    `q_proj` / `k_proj` / `v_proj` / `o_proj` parameters, so an HF `LlamaAttention`'s state dict
    loads into it) with grouped-query flash attention and HF's rotary embedding.

    forward(hidden_states [b, s, hidden], attention_mask=None, position_ids=None,
            past_key_value=None, output_attentions=False, use_cache=False)
      * attention_mask: HF's [b, s] padding mask (1 = token, 0 = padding), or the 4-D mask
        HF's model hands its attention layers ([b, 1, s, s], bool True = attend, or additive
        float 0 / -inf); None = causal.
      * position_ids [b, s]: positions for the rotary embedding (default 0..s-1).
      * past_key_value / output_attentions / use_cache: SMP's signature; a cache or attention
        probabilities cannot be produced by the fused kernel: any value but the default is a
        ConfigError.
    Returns the attention block's output [b, s, hidden] (after `o_proj`), one tensor.
    """

    def __init__(self, config) -> None:
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        super().__init__()
        self.config = config
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = (getattr(config, "head_dim", None)
                         or config.hidden_size // config.num_attention_heads)
        bias = getattr(config, "attention_bias", False)
        hidden = config.hidden_size
        self.q_proj = torch.nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = torch.nn.Linear(hidden, self.num_key_value_heads * self.head_dim, bias=bias)
        self.v_proj = torch.nn.Linear(hidden, self.num_key_value_heads * self.head_dim, bias=bias)
        self.o_proj = torch.nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.rotary_emb = LlamaRotaryEmbedding(config)
        dropout = getattr(config, "attention_dropout", 0.0)
        self.flash = FlashGroupedQueryAttention(attention_dropout_prob=dropout,
                                                scale=self.head_dim ** -0.5)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
        past_key_value=None,
        output_attentions: bool = False,
        use_cache: bool = False,
    ) -> torch.Tensor:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        for name, value in (("past_key_value", past_key_value is not None),
                            ("output_attentions", output_attentions), ("use_cache", use_cache)):
            if value:
                raise ConfigError(f"LlamaFlashAttention: {name} is not supported (the fused "
                                  "kernel keeps no cache and forms no attention probabilities)")
        batch, seq, _ = hidden_states.shape
        if position_ids is None:
            position_ids = torch.arange(seq, device=hidden_states.device).expand(batch, seq)
        q = self.q_proj(hidden_states).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        cos, sin = self.rotary_emb(v, position_ids)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        mask = padding_to_attention_mask(attention_mask, seq)
        if mask is None:
            context = self.flash(q, (k, v), causal=True, layout="b h s d")
        else:  # padding: the masked (non-fused) path of the same SDPA core
            dropout = self.flash.attention_dropout_prob if self.training else 0.0
            context = core_attention(q, k, v, mask, False, dropout, self.head_dim ** -0.5)
        return self.o_proj(context.transpose(1, 2).reshape(batch, seq, -1))


__all__ = ["LlamaFlashAttention"]
