"""Packed-sequence attention on the device: "auto" takes the varlen flash kernel on CUDA sm80+
in bf16 (the segments path elsewhere), compiled flex attention runs on CUDA, and both match the
fp32 dense document mask to bf16 accuracy, forward and backward."""
import pytest
import torch
import torch.nn.functional as F

from megatron_smp.transformer.attention import _capability
from megatron_smp.transformer.packed import PackedSequence, packed_attention_plan
from tests.gpu.common import BF16_EPS, DEVICES

DOCUMENTS = torch.tensor([[0] * 40 + [1] * 70 + [2] * 18, [0] * 100 + [1] * 28])
B, NQ, NKV, S, D = 2, 8, 2, 128, 64


def _run(device, dtype, backend):
    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randn(B, n, S, D, generator=generator) for n in (NQ, NKV, NKV)]
    grad = torch.randn(B, NQ, S, D, generator=generator)
    inputs = [t.to(device=device, dtype=dtype).requires_grad_() for t in inputs]
    documents = DOCUMENTS.to(device)
    if backend == "reference":
        out = F.scaled_dot_product_attention(
            *inputs, attn_mask=~PackedSequence(documents).dense_mask(), enable_gqa=True)
    else:
        out = PackedSequence(documents, backend=backend).attend(*inputs)
    out.backward(grad.to(device=device, dtype=dtype))
    return [t.detach().float().cpu() for t in [out] + [x.grad for x in inputs]]


@pytest.mark.parametrize("device", DEVICES)
def test_packed_backends_match_the_dense_mask_in_bf16(device):
    chosen = packed_attention_plan("auto", device, torch.bfloat16, D,
                                   _capability(torch.device(device)))
    if device == "cuda" and _capability(torch.device(device)) >= (8, 0):
        assert chosen == "varlen"
    backends = ["auto"] + (["flex"] if device == "cuda" else [])
    reference = _run(device, torch.float32, "reference")
    for backend in backends:
        got = _run(device, torch.bfloat16, backend)
        for name, want, have in zip(["out", "dq", "dk", "dv"], reference, got):
            scale = want.abs().max()
            assert (have - want).abs().max() <= 8 * BF16_EPS * scale, (backend, name)
