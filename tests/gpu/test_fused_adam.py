"""Fused AdamW (the kernel our optimizer factory picks where the device has one: CUDA, and the
CPU in recent torch) steps parameters as the per-tensor loop and foreach do."""
import pytest
import torch

from megatron_smp.config import OptimizerConfig
from megatron_smp.optimizer import _fused_supported, build_torch_optimizer
from tests.gpu.common import DEVICES

SHAPES = [(64, 48), (48,), (3, 5, 7), (1,)]
STEPS = 4
ADAM = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8)


def _initial():
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=generator) for s in SHAPES]


def _run(device, make_optimizer):
    """Params after STEPS AdamW steps on fixed grads (CPU fp32 copies), and the optimizer."""
    params = [p.to(device).requires_grad_() for p in _initial()]
    generator = torch.Generator().manual_seed(1)
    groups = [{"params": params[:2], "weight_decay": 0.1},
              {"params": params[2:], "weight_decay": 0.0}]
    optimizer = make_optimizer(groups)
    for _ in range(STEPS):
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator).to(device)
        optimizer.step()
    return [p.detach().cpu() for p in params], optimizer


@pytest.mark.parametrize("device", DEVICES)
def test_fused_and_foreach_adamw_equal_the_loop(device):
    device = torch.device(device)
    loop, _ = _run(device, lambda g: torch.optim.AdamW(g, foreach=False, fused=False, **ADAM))
    moved = max((p - q).abs().max().item() for p, q in zip(loop, _initial()))
    assert moved > 1e-2  # four steps of ~lr each
    config = OptimizerConfig(lr=ADAM["lr"], adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8)
    candidates = {
        "foreach": lambda g: torch.optim.AdamW(g, foreach=True, **ADAM),
        "ours": build_torch_optimizer(config, device),
    }
    if _fused_supported(device):
        candidates["fused"] = lambda g: torch.optim.AdamW(g, fused=True, **ADAM)
    for name, make in candidates.items():
        params, optimizer = _run(device, make)
        if name == "ours" and _fused_supported(device):
            # torch's fused kernel, or apex's FusedAdam where apex imports (CUDA).
            assert optimizer.defaults.get("fused") or type(optimizer).__name__ == "FusedAdam"
        for got, want in zip(params, loop):
            # Fused kernels reorder a few fp32 operations per element.
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=name)
