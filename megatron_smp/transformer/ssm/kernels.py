"""The mixers' scans on fast kernels where they can run, the torch-native ones elsewhere.

`ssd_scan` runs Mamba-2's chunked scan through `mamba_ssm`'s Triton kernel
(`mamba_chunk_scan_combined`) and `gated_delta_rule_scan` the chunked gated delta rule through
flash-linear-attention's (`fla.ops.gated_delta_rule.chunk_gated_delta_rule`) when the package
imports and the tensors are on a CUDA device in fp32 / bf16 / fp16 (`kernel_plan`), as the
packed attention picks the varlen flash kernel; otherwise, and always for fp64, they run the
torch-native `ops.ssd_chunked` / `ops.gated_delta_rule_chunked` (the same function: the
arguments are laid out for each kernel here). Nothing is installed or required.

Packed rows map to each kernel's own form: `segments` [b, s] is mamba_ssm's `seq_idx`
(int32, the state restarts where it changes); flash-linear-attention takes one row of
documents with `cu_seqlens`, so the batch is flattened and the boundaries found on the host.
"""
from __future__ import annotations

import functools
from typing import Callable, Optional

import torch

from megatron_smp.transformer.ssm.ops import expand_key_heads, gated_delta_rule_chunked, ssd_chunked

KERNELS = {
    "mamba_ssm": ("mamba_ssm.ops.triton.ssd_combined", "mamba_chunk_scan_combined"),
    "fla": ("fla.ops.gated_delta_rule", "chunk_gated_delta_rule"),
}
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.lru_cache(maxsize=None)
def load_kernel(name: str) -> Optional[Callable]:
    """The fast kernel `name` ("mamba_ssm" or "fla") if its package imports, else None
    (cached: a missing package is looked for once)."""
    import importlib

    module, function = KERNELS[name]
    try:
        return getattr(importlib.import_module(module), function)
    except Exception:  # not installed, or a build that cannot load here (no CUDA, no Triton)
        return None


def kernel_fits(tensor: torch.Tensor) -> bool:
    """Whether the fast kernels can take `tensor`: on a CUDA device, fp32 / bf16 / fp16."""
    return tensor.device.type == "cuda" and tensor.dtype in _KERNEL_DTYPES


def kernel_plan(name: str, tensor: torch.Tensor) -> str:
    """`name` when its kernel is available and fits `tensor` (`kernel_fits`), else "torch"."""
    if not kernel_fits(tensor):
        return "torch"
    return name if load_kernel(name) is not None else "torch"


def ssd_scan(x, dt, A, B, C, chunk_size: int, D=None, initial_state=None, segments=None,
             return_final_state: bool = False):
    """`ops.ssd_chunked` (same arguments and results: x [b, s, h, p], dt [b, s, h] after
    softplus / clamp, A [h], B, C [b, s, g, n], D [h], initial_state [b, h, p, n], segments
    [b, s]) on mamba_ssm's kernel where `kernel_plan` allows."""
    if kernel_plan("mamba_ssm", x) == "torch":
        return ssd_chunked(x, dt, A, B, C, chunk_size, D, initial_state=initial_state,
                           segments=segments, return_final_state=return_final_state)
    kernel = load_kernel("mamba_ssm")
    seq_idx = None if segments is None else segments.to(torch.int32).contiguous()
    result = kernel(x, dt, A.float(), B, C, chunk_size, D=D,
                    initial_states=initial_state, seq_idx=seq_idx,
                    return_final_states=return_final_state)
    return tuple(result) if return_final_state else result


def _cu_seqlens(segments: torch.Tensor) -> torch.Tensor:
    """[b, s] run numbers -> int32 offsets of the documents of the flattened batch (a row
    start always starts a document)."""
    b, s = segments.shape
    starts = torch.ones_like(segments, dtype=torch.bool)
    starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
    offsets = starts.reshape(-1).nonzero().squeeze(-1)
    end = torch.tensor([b * s], device=segments.device, dtype=offsets.dtype)
    return torch.cat([offsets, end]).to(torch.int32)


def gated_delta_rule_scan(q, k, v, g, beta, chunk_size: int = 64, scale: Optional[float] = None,
                          initial_state=None, segments=None, return_final_state: bool = False):
    """`ops.gated_delta_rule_chunked` (same arguments and results: q, k [b, s, hk, dk]
    l2-normalised, v [b, s, hv, dv], g, beta [b, s, hv], initial_state [b, hv, dk, dv],
    segments [b, s]) on flash-linear-attention's kernel where `kernel_plan` allows. Packed
    rows with a state in or out run the torch path (the kernel's states are per document)."""
    packed_state = segments is not None and (initial_state is not None or return_final_state)
    if kernel_plan("fla", v) == "torch" or packed_state:
        return gated_delta_rule_chunked(q, k, v, g, beta, chunk_size, scale=scale,
                                        initial_state=initial_state, segments=segments,
                                        return_final_state=return_final_state)
    kernel = load_kernel("fla")
    b, s, hv, dv = v.shape
    q, k = expand_key_heads(q, k, hv)  # the kernel wants one key head per value head
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q, k, beta = q.to(v.dtype), k.to(v.dtype), beta.to(v.dtype)
    cu_seqlens = None
    if segments is not None:  # one row of documents
        cu_seqlens = _cu_seqlens(segments)
        q, k, v, g, beta = (t.reshape((1, b * s) + t.shape[2:]) for t in (q, k, v, g, beta))
    o, state = kernel(q, k, v, g.float(), beta, scale=scale, initial_state=initial_state,
                      output_final_state=return_final_state, cu_seqlens=cu_seqlens,
                      use_qk_l2norm_in_kernel=False)
    o = o.reshape(b, s, hv, dv)
    return (o, state) if return_final_state else o


__all__ = ["KERNELS", "load_kernel", "kernel_fits", "kernel_plan", "ssd_scan",
           "gated_delta_rule_scan"]
