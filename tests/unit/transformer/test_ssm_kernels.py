"""The mixers dispatch their scans to mamba_ssm / flash-linear-attention where those import and
the device is CUDA, else the torch-native scans: on the CPU with stand-in kernel modules (the
real ones need CUDA), the stand-ins receive each kernel's argument layout (mamba_ssm's seq_idx,
fla's one row of documents with cu_seqlens and a key head per value head) and give the
layers' outputs; without the packages, or on the CPU, the torch path runs."""
import sys
import types

import pytest
import torch

from megatron_smp.config import ParallelConfig
from megatron_smp.models import llama_config
from megatron_smp.parallel_state import build_parallel_state
from megatron_smp.transformer.packed import PackedSequence
from megatron_smp.transformer.ssm import kernels
from megatron_smp.transformer.ssm.gated_delta_net import GatedDeltaNet
from megatron_smp.transformer.ssm.mamba_mixer import MambaMixer
from megatron_smp.transformer.ssm.ops import gated_delta_rule_recurrent, ssd_recurrent

B, S, H = 2, 13, 48
CONFIG = llama_config(1, H, 4, 100, mamba_num_groups=2, mamba_num_heads=4, mamba_head_dim=6,
                      mamba_state_dim=5, mamba_chunk_size=4, linear_num_key_heads=2,
                      linear_num_value_heads=4, linear_key_head_dim=6, linear_value_head_dim=5,
                      linear_chunk_size=4)
DOCUMENTS = torch.tensor([[0] * 5 + [1] * 8, [3] * S])  # row 0: two documents


def fake_mamba(calls):
    def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, initial_states=None,
                                  seq_idx=None, return_final_states=False):
        b, s, h, p = x.shape
        assert dt.shape == (b, s, h) and A.shape == (h,) and A.dtype == torch.float32
        assert B.shape == C.shape and B.shape[:2] == (b, s) and h % B.shape[2] == 0
        assert D.shape == (h,) and seq_idx.dtype == torch.int32 and seq_idx.shape == (b, s)
        calls.append("mamba_ssm")
        return ssd_recurrent(x, dt, A, B, C, D, initial_states, seq_idx.long(),
                             return_final_states)
    return mamba_chunk_scan_combined


def fake_fla(calls):
    def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None,
                               output_final_state=False, cu_seqlens=None,
                               use_qk_l2norm_in_kernel=False):
        one, t, hv, dk = q.shape
        assert one == 1 and k.shape == q.shape and v.shape[:3] == (1, t, hv)  # one row
        assert g.shape == beta.shape == (1, t, hv) and g.dtype == torch.float32
        assert cu_seqlens.dtype == torch.int32 and cu_seqlens.tolist() == [0, 5, 13, 26]
        assert scale == dk ** -0.5 and not use_qk_l2norm_in_kernel
        calls.append("fla")
        parts = [gated_delta_rule_recurrent(*(x[:, a:e] for x in (q, k, v, g, beta)),
                                            scale=scale)
                 for a, e in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())]
        return torch.cat(parts, dim=1), None
    return chunk_gated_delta_rule


def install(monkeypatch, name, function):
    """`function` as the kernel `name` (its module and parents in sys.modules)."""
    module_name, attribute = kernels.KERNELS[name]
    parts = module_name.split(".")
    for i in range(1, len(parts) + 1):
        monkeypatch.setitem(sys.modules, ".".join(parts[:i]),
                            types.ModuleType(".".join(parts[:i])))
    setattr(sys.modules[module_name], attribute, function)


@pytest.fixture()
def layers():
    state = build_parallel_state(ParallelConfig())
    torch.manual_seed(0)
    mamba, gdn = MambaMixer(CONFIG, state), GatedDeltaNet(CONFIG, state)
    x = torch.randn(S, B, H)
    packed = PackedSequence(DOCUMENTS)
    with torch.no_grad():
        expected = [layer(x, packed) for layer in (mamba, gdn)]
    kernels.load_kernel.cache_clear()
    yield (mamba, gdn), x, packed, expected
    kernels.load_kernel.cache_clear()


def test_fast_kernels_take_their_layouts_and_give_the_layers_outputs(monkeypatch, layers):
    (mamba, gdn), x, packed, expected = layers
    calls = []
    install(monkeypatch, "mamba_ssm", fake_mamba(calls))
    install(monkeypatch, "fla", fake_fla(calls))
    # On the CPU the kernels are never taken, even when they import.
    assert kernels.kernel_plan("mamba_ssm", x) == kernels.kernel_plan("fla", x) == "torch"
    with torch.no_grad():
        mamba(x, packed), gdn(x, packed)
    assert calls == []
    assert not kernels.kernel_fits(x.double())
    monkeypatch.setattr(kernels, "kernel_fits", lambda tensor: True)  # as on a CUDA device
    with torch.no_grad():
        got = [layer(x, packed) for layer in (mamba, gdn)]
    assert calls == ["mamba_ssm", "fla"]
    for ours, theirs in zip(got, expected):
        assert (ours - theirs).abs().max() < 1e-5


def test_missing_packages_take_the_torch_path(monkeypatch, layers):
    (mamba, gdn), x, packed, expected = layers
    monkeypatch.setattr(kernels, "kernel_fits", lambda tensor: True)
    for name, (module, _) in kernels.KERNELS.items():
        monkeypatch.setitem(sys.modules, module.split(".")[0], None)  # import fails
        assert kernels.load_kernel(name) is None and kernels.kernel_plan(name, x) == "torch"
    with torch.no_grad():
        got = [layer(x, packed) for layer in (mamba, gdn)]
    assert all(torch.equal(ours, theirs) for ours, theirs in zip(got, expected))
