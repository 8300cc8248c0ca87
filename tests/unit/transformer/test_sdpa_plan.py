"""Which SDPA kernel each attention case takes on CUDA (torch's rules: flash, then
memory-efficient, then math), and that repeating grouped k/v to the query heads -- the plan
for masked or fp32 grouped-query attention -- gives the grouped result (issue 26: GQA with a
sliding window, ALiBi or --reset-attention-mask, and fp32 GQA, fell to the math kernel)."""
import pytest
import torch

from megatron_smp.transformer import attention
from megatron_smp.transformer.attention import SdpaPlan, core_attention, sdpa_plan

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32

# (dtype, head_dim, grouped, masked, capability) -> plan on CUDA
CASES = {
    "causal_bf16_mha": ((BF16, 128, False, False, (9, 0)), SdpaPlan(False, "flash")),
    "causal_bf16_gqa": ((BF16, 128, True, False, (9, 0)), SdpaPlan(False, "flash")),
    "causal_fp16_gqa": ((FP16, 64, True, False, (8, 0)), SdpaPlan(False, "flash")),
    "sliding_window_bf16_gqa": ((BF16, 128, True, True, (9, 0)), SdpaPlan(True, "efficient")),
    "alibi_bf16_mha": ((BF16, 128, False, True, (9, 0)), SdpaPlan(False, "efficient")),
    "reset_mask_bf16_gqa": ((BF16, 64, True, True, (9, 0)), SdpaPlan(True, "efficient")),
    "causal_fp32_gqa": ((FP32, 128, True, False, (9, 0)), SdpaPlan(True, "efficient")),
    "causal_fp32_mha": ((FP32, 128, False, False, (9, 0)), SdpaPlan(False, "efficient")),
    "causal_bf16_gqa_head_dim_288": ((BF16, 288, True, False, (9, 0)),
                                     SdpaPlan(True, "efficient")),
    "causal_fp16_gqa_volta": ((FP16, 128, True, False, (7, 0)), SdpaPlan(True, "efficient")),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_case_takes_flash_or_efficient_on_cuda(case):
    (dtype, head_dim, grouped, masked, capability), expected = CASES[case]
    assert sdpa_plan("cuda", dtype, head_dim, grouped, masked, capability) == expected


def test_other_devices_keep_the_grouped_call():
    assert sdpa_plan("cpu", FP32, 64, True, True) == SdpaPlan(False, "device default")


@pytest.mark.parametrize("masked", [False, True])
def test_repeated_kv_equals_grouped_attention(monkeypatch, masked):
    generator = torch.Generator().manual_seed(0)
    b, nq, nkv, s, d = 2, 4, 2, 8, 16
    query = torch.randn(b, nq, s, d, generator=generator)
    key, value = (torch.randn(b, nkv, s, d, generator=generator) for _ in range(2))
    mask = attention.sliding_window_mask(s, (3, 0)) if masked else None
    grouped = core_attention(query, key, value, mask)
    calls = []

    def spy(*args, **kwargs):
        calls.append(args[1].shape[1])
        return real_sdpa(*args, **kwargs)

    real_sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(attention, "sdpa_plan", lambda *args: SdpaPlan(True, "efficient"))
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", spy)
    repeated = core_attention(query, key, value, mask)
    assert calls == [nq]  # the kernel saw k/v with the query heads
    torch.testing.assert_close(repeated, grouped, rtol=1e-6, atol=1e-6)
    # Head h of the query uses group h // (nq / nkv): a wrong repeat would differ here.
    assert not torch.allclose(core_attention(query, key.flip(1), value.flip(1), mask), grouped)
