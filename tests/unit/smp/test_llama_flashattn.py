"""LlamaFlashAttention gives HF LlamaAttention's output for the same weights."""
import pytest
import torch

from megatron_smp.config import ConfigError
from megatron_smp.smp.hf_contract import padding_to_attention_mask
from megatron_smp.smp.nn.huggingface.llama_flashattn import LlamaFlashAttention
from tests.unit.models.test_hf_adapters import build_hf


def test_llama_flash_attention_matches_hf_attention():
    hf = build_hf("llama")  # grouped-query: 4 heads, 2 key/value heads
    reference = hf.model.layers[0].self_attn
    ours = LlamaFlashAttention(hf.config)
    ours.load_state_dict(reference.state_dict(), strict=False)
    assert set(reference.state_dict()) <= set(ours.state_dict())
    hidden = torch.randn(2, 10, 64, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(3, 13).expand(2, 10)
    padding = torch.ones(2, 10, dtype=torch.long)
    padding[1, -4:] = 0
    with torch.no_grad():
        rotary = hf.model.rotary_emb(hidden, positions)
        expected = reference(hidden, position_embeddings=rotary, attention_mask=None)[0]
        got = ours(hidden, position_ids=positions)
        assert (got - expected).abs().max() < 1e-5
        allowed = ~padding_to_attention_mask(padding, 10)  # HF's SDPA bool mask: True = attend
        expected = reference(hidden, position_embeddings=rotary, attention_mask=allowed)[0]
        got = ours(hidden, attention_mask=padding, position_ids=positions)
        assert (got[padding.bool()] - expected[padding.bool()]).abs().max() < 1e-5
    for keyword in ("past_key_value", "output_attentions", "use_cache"):
        with pytest.raises(ConfigError, match=keyword):
            ours(hidden, **{keyword: object() if keyword == "past_key_value" else True})
