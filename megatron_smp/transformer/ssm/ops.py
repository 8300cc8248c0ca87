"""Torch-native kernels of the recurrent mixers: the causal depthwise convolution, Mamba-2's
chunked state-space scan (SSD) and the chunked gated delta rule (Gated DeltaNet), each with
its step-by-step recurrence (the definition the chunked forms are tested against, and the
decode step a cache will call).

All work on batch-first tensors `[b, s, heads, dim]` and compute in fp32 (fp64 stays fp64).
Chunked forms are exact for any length: the sequence is zero-padded to a multiple of the
chunk size, and padding sits after every real token so it never reaches them.

Packed rows (several documents in one row): `segments` [b, s] int numbers each position's
document (non-decreasing along the row, see `segment_ids`). The recurrent state then starts
from zero at every document start: every pairwise term between positions of different
documents is masked, the state carried into a chunk reaches only the positions of the
document it belongs to, and a chunk's state leaves only from its last document.

Every function takes `initial_state` and can return the final state, so a cache can thread
the recurrent state through consecutive calls.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F


def segment_ids(document_ids: torch.Tensor) -> torch.Tensor:
    """[b, s] document ids (a document is a maximal run of equal ids) -> [b, s] int64 run
    numbers 0, 1, ... (non-decreasing), so equality means "same document"."""
    starts = torch.zeros_like(document_ids, dtype=torch.int64)
    starts[:, 1:] = (document_ids[:, 1:] != document_ids[:, :-1]).long()
    return starts.cumsum(dim=1)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _pad_to(x: torch.Tensor, length: int, dim: int = 1) -> torch.Tensor:
    pad = length - x.shape[dim]
    if pad == 0:
        return x
    shape = list(x.shape)
    shape[dim] = pad
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


def _chunk_segments(segments: torch.Tensor, padded: int, chunk: int):
    """Per chunk: `seg` [b, c, L] (padding continues the last document), `previous` [b, c]
    the document of the token before each chunk (the first chunk: the first token's, so an
    initial state carries into the row's first document)."""
    b, s = segments.shape
    if padded > s:
        segments = torch.cat([segments, segments[:, -1:].expand(b, padded - s)], dim=1)
    seg = segments.view(b, -1, chunk)
    previous = torch.cat([segments[:, :1], segments[:, chunk - 1:-1:chunk]], dim=1)
    return seg, previous


# Causal depthwise convolution -------------------------------------------------------------------


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                  segments: Optional[torch.Tensor] = None,
                  initial_state: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Depthwise causal convolution: x [b, s, c], weight [c, k], bias [c] -> [b, s, c];
    out[t] = bias + sum_j weight[:, j] * x[t - k + 1 + j]. With `segments` [b, s] a window
    never reaches into the previous document. `initial_state` [b, c, k - 1]: the inputs
    before x (a cache's conv state; zeros when None)."""
    b, s, c = x.shape
    k = weight.shape[1]
    if initial_state is None and segments is None:
        out = F.conv1d(x.transpose(1, 2), weight.unsqueeze(1), bias, padding=k - 1, groups=c)
        return out[..., :s].transpose(1, 2)
    history = (x.new_zeros(b, k - 1, c) if initial_state is None
               else initial_state.transpose(1, 2).to(x.dtype))
    padded = torch.cat([history, x], dim=1)  # [b, s + k - 1, c]
    out = 0
    for j in range(k):
        shifted = padded[:, j:j + s]  # x[t - (k - 1 - j)]
        if segments is not None and j < k - 1:
            back = k - 1 - j
            same = torch.zeros_like(segments, dtype=torch.bool)
            same[:, back:] = segments[:, back:] == segments[:, :-back]
            if initial_state is not None:  # the history belongs to the first document
                same[:, :back] = segments[:, :back] == segments[:, :1]
            shifted = shifted * same.unsqueeze(-1).to(x.dtype)
        out = out + shifted * weight[:, j]
    return out if bias is None else out + bias


# Mamba-2: the state-space duality (SSD) scan -----------------------------------------------------


def ssd_recurrent(x, dt, A, B, C, D=None, initial_state=None, segments=None,
                  return_final_state: bool = False):
    """The SSM recurrence one token at a time (the definition of `ssd_chunked`).

    x [b, s, h, p], dt [b, s, h] (after softplus / clamp), A [h] (negative), B, C [b, s, g, n]
    (g divides h: head i reads group i // (h / g)), D [h] -> y [b, s, h, p]:
        state_t = exp(dt_t A) state_{t-1} + dt_t x_t B_t^T    ([h, p, n]; zero at a document start)
        y_t = state_t C_t + D x_t
    """
    dtype = _compute_dtype(x.dtype)
    b, s, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    x, dt, A = x.to(dtype), dt.to(dtype), A.to(dtype)
    B = B.to(dtype).repeat_interleave(h // g, dim=2)
    C = C.to(dtype).repeat_interleave(h // g, dim=2)
    state = (x.new_zeros(b, h, p, n) if initial_state is None else initial_state.to(dtype))
    outputs = []
    for t in range(s):
        if segments is not None and t > 0:
            keep = (segments[:, t] == segments[:, t - 1]).to(dtype)
            state = state * keep[:, None, None, None]
        decay = torch.exp(dt[:, t] * A)  # [b, h]
        state = state * decay[..., None, None] + (dt[:, t, :, None, None] * x[:, t, :, :, None]
                                                   * B[:, t, :, None, :])
        outputs.append(torch.einsum("bhpn,bhn->bhp", state, C[:, t]))
    y = torch.stack(outputs, dim=1)
    if D is not None:
        y = y + x * D.to(dtype)[:, None]
    return (y, state) if return_final_state else y


def ssd_chunked(x, dt, A, B, C, chunk_size: int, D=None, initial_state=None, segments=None,
                return_final_state: bool = False):
    """Mamba-2's chunked scan (Dao & Gu 2024), the same function as `ssd_recurrent`: within
    a chunk of `chunk_size` tokens the output is a masked, decayed attention-like product
    (C B^T); across chunks one state per chunk is passed on. Shapes as `ssd_recurrent`;
    returns y [b, s, h, p] (and the final state [b, h, p, n]).

    B and C stay per group (never repeated to the heads): C B^T is one product per group,
    and the per-head decays multiply x and the outputs instead."""
    dtype = _compute_dtype(x.dtype)
    b, s, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    r = h // g  # heads per group
    L = min(chunk_size, s)  # a chunk longer than the sequence only adds padding
    padded = -(-s // L) * L
    nc = padded // L
    x32 = x.to(dtype)
    dt = dt.to(dtype)
    xdt = _pad_to(x32 * dt[..., None], padded).view(b, nc, L, g, r, p)
    log_decay = _pad_to(dt * A.to(dtype), padded).view(b, nc, L, g, r)
    B = _pad_to(B.to(dtype), padded).view(b, nc, L, g, n)
    C = _pad_to(C.to(dtype), padded).view(b, nc, L, g, n)
    cum = log_decay.cumsum(dim=2)  # [b, c, L, g, r]: log of the decay from the chunk start

    mask = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()
    to_end = torch.exp(cum[:, :, -1:] - cum)  # [b, c, L, g, r]
    from_start = torch.exp(cum)
    chunk_decay = torch.exp(cum[:, :, -1])  # [b, c, g, r]
    if segments is not None:
        seg, previous = _chunk_segments(segments, padded, L)
        mask = mask & (seg[:, :, None, None, :, None] == seg[:, :, None, None, None, :])
        to_end = to_end * (seg == seg[:, :, -1:])[..., None, None].to(dtype)
        carry = (seg == previous[:, :, None]).to(dtype)  # [b, c, L]
        from_start = from_start * carry[..., None, None]
        chunk_decay = chunk_decay * carry[:, :, -1, None, None]
    # Pairwise decays exp(cum_i - cum_j), i >= j, masked before exp (no overflow above it).
    heads_cum = cum.permute(0, 1, 3, 4, 2)  # [b, c, g, r, L]
    diff = heads_cum.unsqueeze(-1) - heads_cum.unsqueeze(-2)  # [b, c, g, r, L(i), L(j)]
    pairwise = torch.exp(diff.masked_fill(~mask, float("-inf")))
    scores = pairwise * torch.einsum("bclgn,bcsgn->bcgls", C, B).unsqueeze(3)
    y = torch.einsum("bcgrls,bcsgrp->bclgrp", scores, xdt)

    # Each chunk's own contribution to the state at its end, then the pass across chunks.
    chunk_states = torch.einsum("bclgn,bclgrp->bcgrpn", B, xdt * to_end.unsqueeze(-1))
    state = (x32.new_zeros(b, g, r, p, n) if initial_state is None
             else initial_state.to(dtype).view(b, g, r, p, n))
    starts = []
    # unbind: one backward for all chunks (indexing each would zero-fill a full-size grad).
    for decay, own in zip(chunk_decay.unbind(1), chunk_states.unbind(1)):
        starts.append(state)
        state = state * decay[:, :, :, None, None] + own
    start_states = torch.stack(starts, dim=1)  # [b, c, g, r, p, n]
    y = y + torch.einsum("bclgn,bcgrpn->bclgrp", C, start_states) * from_start.unsqueeze(-1)

    y = y.reshape(b, padded, h, p)[:, :s]
    if D is not None:
        y = y + x32 * D.to(dtype)[:, None]
    state = state.reshape(b, h, p, n)
    return (y, state) if return_final_state else y


# Gated DeltaNet: the gated delta rule ------------------------------------------------------------


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (flash-linear-attention's, as HF's)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def expand_key_heads(q, k, num_value_heads: int):
    """q/k [b, s, hk, dk] -> [b, s, hv, dk]: key head i serves value heads i*r .. i*r + r - 1."""
    repeat = num_value_heads // q.shape[2]
    if repeat == 1:
        return q, k
    return q.repeat_interleave(repeat, dim=2), k.repeat_interleave(repeat, dim=2)


def gated_delta_rule_recurrent(q, k, v, g, beta, scale: Optional[float] = None,
                               initial_state=None, segments=None,
                               return_final_state: bool = False):
    """The gated delta rule one token at a time (the definition of `gated_delta_rule_chunked`).

    q, k [b, s, hk, dk] (l2-normalised by the caller), v [b, s, hv, dv], g [b, s, hv] (log
    decay, <= 0), beta [b, s, hv] -> o [b, s, hv, dv]; per head, state S [dk, dv]:
        S = exp(g_t) S;  S = S + beta_t k_t (v_t - S^T k_t)^T;  o_t = S^T (scale q_t)
    with S zero at a document start; scale default dk^-0.5.
    """
    dtype = _compute_dtype(v.dtype)
    b, s, hv, dv = v.shape
    q, k = expand_key_heads(q, k, hv)
    dk = q.shape[-1]
    scale = dk ** -0.5 if scale is None else scale
    q, k, v, g, beta = (t.to(dtype) for t in (q, k, v, g, beta))
    q = q * scale
    state = v.new_zeros(b, hv, dk, dv) if initial_state is None else initial_state.to(dtype)
    outputs = []
    for t in range(s):
        if segments is not None and t > 0:
            keep = (segments[:, t] == segments[:, t - 1]).to(dtype)
            state = state * keep[:, None, None, None]
        state = state * torch.exp(g[:, t])[..., None, None]
        predicted = torch.einsum("bhkv,bhk->bhv", state, k[:, t])
        delta = (v[:, t] - predicted) * beta[:, t, :, None]
        state = state + k[:, t, :, :, None] * delta[:, :, None, :]
        outputs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t]))
    o = torch.stack(outputs, dim=1)
    return (o, state) if return_final_state else o


def gated_delta_rule_chunked(q, k, v, g, beta, chunk_size: int = 64,
                             scale: Optional[float] = None, initial_state=None, segments=None,
                             return_final_state: bool = False):
    """The chunked gated delta rule (Yang et al. 2024, the WY / UT form): within a chunk the
    delta updates are condensed by one unit-triangular solve, across chunks one state per
    chunk is passed on. Same function and shapes as `gated_delta_rule_recurrent`."""
    dtype = _compute_dtype(v.dtype)
    b, s, hv, dv = v.shape
    q, k = expand_key_heads(q, k, hv)
    dk = q.shape[-1]
    scale = dk ** -0.5 if scale is None else scale
    L = min(chunk_size, s)  # a chunk longer than the sequence only adds padding
    padded = -(-s // L) * L
    nc = padded // L
    # [b, h, c, L, d]: heads ahead of chunks for the batched matmuls.
    def chunks(t):
        t = _pad_to(t.to(dtype), padded)
        return t.view(b, nc, L, hv, -1).permute(0, 3, 1, 2, 4)

    q, k, v = chunks(q * scale), chunks(k), chunks(v)
    g, beta = chunks(g.unsqueeze(-1)).squeeze(-1), chunks(beta.unsqueeze(-1)).squeeze(-1)
    cum = g.cumsum(dim=-1)  # [b, h, c, L]
    lower = torch.ones(L, L, dtype=torch.bool, device=v.device).tril()
    mask = lower.view(1, 1, 1, L, L)
    to_end = torch.exp(cum[..., -1:] - cum)
    from_start = torch.exp(cum)
    chunk_decay = torch.exp(cum[..., -1])  # [b, h, c]
    if segments is not None:
        seg, previous = _chunk_segments(segments, padded, L)  # [b, c, L], [b, c]
        mask = mask & (seg[:, None, :, :, None] == seg[:, None, :, None, :])
        to_end = to_end * (seg == seg[:, :, -1:]).unsqueeze(1).to(dtype)
        carry = (seg == previous[:, :, None]).unsqueeze(1).to(dtype)  # [b, 1, c, L]
        from_start = from_start * carry
        chunk_decay = chunk_decay * carry[..., -1]
    diff = cum.unsqueeze(-1) - cum.unsqueeze(-2)  # [b, h, c, L(i), L(j)]
    pairwise = torch.exp(diff.masked_fill(~mask, float("-inf")))
    k_beta = k * beta.unsqueeze(-1)
    strictly_lower = (k_beta @ k.transpose(-1, -2)) * pairwise
    strictly_lower = strictly_lower.masked_fill(torch.eye(L, dtype=torch.bool,
                                                          device=v.device), 0.0)
    system = strictly_lower + torch.eye(L, dtype=dtype, device=v.device)
    # (I + A) [u | w] = [v beta | k beta exp(cum)]: one solve for both.
    rhs = torch.cat([v * beta.unsqueeze(-1), k_beta * from_start.unsqueeze(-1)], dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u, w = solved[..., :dv], solved[..., dv:]
    attention = (q @ k.transpose(-1, -2)) * pairwise
    q_from_start = q * from_start.unsqueeze(-1)
    k_to_end = k * to_end.unsqueeze(-1)

    state = v.new_zeros(b, hv, dk, dv) if initial_state is None else initial_state.to(dtype)
    outputs = []
    # unbind: one backward for all chunks (indexing each would zero-fill a full-size grad).
    for u_c, w_c, q_c, attention_c, decay_c, k_c in zip(
            u.unbind(2), w.unbind(2), q_from_start.unbind(2), attention.unbind(2),
            chunk_decay.unbind(2), k_to_end.unbind(2)):
        v_new = u_c - w_c @ state
        outputs.append(q_c @ state + attention_c @ v_new)
        state = state * decay_c[..., None, None] + k_c.transpose(-1, -2) @ v_new
    o = torch.stack(outputs, dim=2)  # [b, h, c, L, dv]
    o = o.permute(0, 2, 3, 1, 4).reshape(b, padded, hv, dv)[:, :s]
    return (o, state) if return_final_state else o


__all__ = [
    "segment_ids",
    "causal_conv1d",
    "ssd_recurrent",
    "ssd_chunked",
    "l2norm",
    "expand_key_heads",
    "gated_delta_rule_recurrent",
    "gated_delta_rule_chunked",
]
