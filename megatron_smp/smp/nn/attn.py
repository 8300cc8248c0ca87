"""torch.sagemaker.nn.attn: SMP v2's flash attention modules (on SDPA)."""
from megatron_smp.transformer.attention import FlashGroupedQueryAttention, FlashSelfAttention

__all__ = ["FlashSelfAttention", "FlashGroupedQueryAttention"]
