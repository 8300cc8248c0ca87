"""Packed sequences: several documents share one row of the batch, each attending only to
itself, with causal attention inside it (Megatron's THD layout, its PackedSeqParams).

A `PackedSequence` is built once per forward from `document_ids` [b, s] (a row's documents
are its maximal runs of equal ids; padding at the end of a pack is a document of its own) and
travels down to the core attention in the `attention_mask` argument. The core attention then
does no work across documents, through one of these backends (`packed_attention_plan`):

* "varlen": `torch.nn.attention.varlen.varlen_attn`, the flash kernel's variable-length entry
  (CUDA sm80+, fp16/bf16, head dim <= 256 and a multiple of 8, no attention dropout): the
  tokens as [b * s, n, d] with `cu_seqlens`.
* "flex": `flex_attention` with a document block mask; compiled on CUDA, where the blocks
  holding no pair of one document are skipped. On the CPU torch 2.13 has no flex backward and
  its uncompiled form evaluates every block, so there it serves inference only and "auto"
  never picks it.
* "segments": torch-native, any device, with backward (the CPU's training path): the
  documents are cut out and batched with others of similar length (padded at their end), one
  causal SDPA per batch; a query only ever meets keys of its own document, and zero padding
  after them that causality hides. Under context parallelism the same engine attends this
  rank's query runs to their document's gathered keys.
* "mask": the dense document-causal mask [b, 1, s, s] through SDPA, which evaluates the whole
  square: the fallback for sliding windows, ALiBi and attention sinks, kept tested.
"""
from __future__ import annotations

import warnings
from typing import List, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F

from megatron_smp.config import PACKED_ATTENTION_BACKENDS, ConfigError


def varlen_available() -> bool:
    """Whether this torch has the variable-length flash entry point."""
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


def _varlen_fits(device_type: str, dtype: torch.dtype, head_dim: int,
                 capability: Tuple[int, int], dropout_p: float) -> bool:
    return (device_type == "cuda" and capability >= (8, 0)
            and dtype in (torch.float16, torch.bfloat16) and head_dim <= 256
            and head_dim % 8 == 0 and dropout_p == 0.0)


def packed_attention_plan(requested: str, device_type: str, dtype: torch.dtype, head_dim: int,
                          capability: Tuple[int, int] = (0, 0), dropout_p: float = 0.0,
                          needs_grad: bool = True, context_parallel: bool = False,
                          has_varlen: Optional[bool] = None) -> str:
    """The backend one packed attention call runs on (see the module docstring).

    "auto": the varlen flash kernel where it fits, otherwise "segments" (context
    parallelism always takes "segments": its gathered keys are not a packed row). A backend
    asked for by name that cannot run the call is a ConfigError saying what would.
    """
    if requested not in PACKED_ATTENTION_BACKENDS:
        raise ConfigError(f"packed_attention must be one of {', '.join(PACKED_ATTENTION_BACKENDS)}"
                          f", got {requested!r}")
    has_varlen = varlen_available() if has_varlen is None else has_varlen
    fits = has_varlen and _varlen_fits(device_type, dtype, head_dim, capability, dropout_p)
    if requested == "auto":
        return "varlen" if fits and not context_parallel else "segments"
    if context_parallel and requested != "segments":
        raise ConfigError(f"packed_attention={requested!r} with context parallelism: only "
                          "'segments' (or 'auto') attends to keys gathered over the CP group")
    if requested == "varlen" and not fits:
        raise ConfigError(
            "packed_attention='varlen' needs torch.nn.attention.varlen, a CUDA device of "
            f"capability 8.0+, fp16/bf16, head dim <= 256 and a multiple of 8 and no attention "
            f"dropout (got {device_type}, {capability}, {dtype}, head dim {head_dim}, dropout "
            f"{dropout_p}); use 'auto' or 'segments'")
    if requested == "flex" and device_type == "cpu" and needs_grad:
        raise ConfigError("packed_attention='flex' on the CPU: torch has no flex attention "
                          "backward there; use 'auto' or 'segments' to train")
    if requested == "flex" and dropout_p > 0.0:
        raise ConfigError("packed_attention='flex' has no attention dropout; use 'segments'")
    return requested


class _Group(NamedTuple):
    """One batched SDPA call: `q_index` [n, Lq] into the (padded) flat queries, `k_index`
    [n, Lk] into the flat keys; `mask` bool [n, 1, Lq, Lk] (True = attend) or None for plain
    causal (every run its document's start: query slot i sees key slots <= i)."""

    q_index: torch.Tensor
    k_index: torch.Tensor
    mask: Optional[torch.Tensor]


class PackedSequence:
    """The document structure of a packed microbatch.

    `document_ids` [b, s]: whole rows, in sequence order (also under context parallelism);
    `rank_indices` [cp, b, s / cp]: the row positions of each CP rank's tokens in its local
    order (None without CP: every position, in order); `cp_rank`: this rank;
    `backend`: "auto" or a name of PACKED_ATTENTION_BACKENDS. Host-side plans are built on
    first use and shared by all layers of the forward.
    """

    def __init__(self, document_ids: torch.Tensor, rank_indices: Optional[torch.Tensor] = None,
                 cp_rank: int = 0, backend: str = "auto") -> None:
        if document_ids.dim() != 2:
            raise ValueError(f"document_ids must be [b, s], got {tuple(document_ids.shape)}")
        self.document_ids = document_ids
        self.rank_indices = rank_indices
        self.cp_rank = cp_rank
        self.backend = backend
        self._plans = {}

    @property
    def context_parallel(self) -> bool:
        return self.rank_indices is not None and self.rank_indices.shape[0] > 1

    @property
    def local_indices(self) -> torch.Tensor:
        """Row positions [b, s_local] of this rank's tokens."""
        if self.rank_indices is None:
            b, s = self.document_ids.shape
            return torch.arange(s, device=self.document_ids.device).expand(b, s)
        return self.rank_indices[self.cp_rank]

    # Host-side structure ------------------------------------------------------------------------

    def document_starts(self) -> torch.Tensor:
        """[b, s]: the row position where each position's document begins."""
        doc = self.document_ids
        b, s = doc.shape
        first = torch.ones(b, s, dtype=torch.bool, device=doc.device)
        first[:, 1:] = doc[:, 1:] != doc[:, :-1]
        positions = torch.arange(s, device=doc.device).expand(b, s)
        return torch.where(first, positions, torch.zeros_like(positions)).cummax(dim=1).values

    def cu_seqlens(self) -> Tuple[torch.Tensor, int]:
        """int32 [documents + 1] over the flattened [b * s] tokens, and the longest document."""
        if "cu" not in self._plans:
            starts = self.document_starts()
            b, s = starts.shape
            first = starts == torch.arange(s, device=starts.device)
            flat = first.flatten().nonzero().flatten()
            ends = torch.cat([flat, flat.new_tensor([b * s])])
            cu = ends.to(torch.int32)
            self._plans["cu"] = (cu, int((ends[1:] - ends[:-1]).max()))
        return self._plans["cu"]

    def _runs(self) -> List[Tuple[int, int, int, int, int]]:
        """This rank's query runs: (row, local start, local end, row position of the first
        query, row position where the run's document starts). A run is a stretch of local
        tokens consecutive in the row and within one document."""
        local = self.local_indices.cpu()
        starts = self.document_starts().cpu().gather(1, local)
        b, sl = local.shape
        new = torch.ones(b, sl, dtype=torch.bool)
        new[:, 1:] = (local[:, 1:] != local[:, :-1] + 1) | (starts[:, 1:] != starts[:, :-1])
        runs = []
        for row, begin in new.nonzero().tolist():
            runs.append([row, begin, sl, int(local[row, begin]), int(starts[row, begin])])
        for current, following in zip(runs, runs[1:]):
            if following[0] == current[0]:
                current[2] = following[1]
        return [tuple(run) for run in runs]

    def _groups(self, device: torch.device) -> Tuple[List[_Group], torch.Tensor]:
        """Batched calls for "segments" and the permutation putting their outputs back in
        local token order. Runs are sorted by key length and batched while the longest is at
        most 4/3 of the shortest, so padding adds at most ~78% to a run's work (usually far
        less) while a long-tailed mix of lengths takes a few calls, not one per document."""
        key = ("groups", str(device))
        if key in self._plans:
            return self._plans[key]
        b, s = self.document_ids.shape
        sl = self.local_indices.shape[1]
        runs = self._runs()
        order = sorted(range(len(runs)), key=lambda i: -(runs[i][3] - runs[i][4]
                                                          + runs[i][2] - runs[i][1]))
        batches, current = [], []
        for i in order:
            row, begin, end, first, doc_start = runs[i]
            key_length = first - doc_start + end - begin
            if current and 4 * key_length < 3 * current[0][0]:
                batches.append(current)
                current = []
            current.append((key_length, runs[i]))
        if current:
            batches.append(current)
        q_pad, k_pad = b * sl, b * s  # index of an appended zero row
        groups, covered = [], []
        for batch in batches:
            lq = max(run[2] - run[1] for _, run in batch)
            lk = batch[0][0]
            q_index = torch.full((len(batch), lq), q_pad, dtype=torch.long)
            k_index = torch.full((len(batch), lk), k_pad, dtype=torch.long)
            square = True
            q_pos = torch.full((len(batch), lq), -1, dtype=torch.long)
            k_pos = torch.full((len(batch), lk), 1 << 40, dtype=torch.long)
            for n, (key_length, (row, begin, end, first, doc_start)) in enumerate(batch):
                q_index[n, : end - begin] = torch.arange(row * sl + begin, row * sl + end)
                k_index[n, :key_length] = torch.arange(row * s + doc_start,
                                                       row * s + first + end - begin)
                q_pos[n, : end - begin] = torch.arange(first, first + end - begin)
                k_pos[n, :key_length] = torch.arange(doc_start, first + end - begin)
                square = square and first == doc_start
                covered.append(q_index[n, : end - begin])
            mask = None
            if not square:
                # A padding query row may attend anywhere (its output is dropped); keeping it
                # finite keeps NaN out of the key gradients.
                mask = (k_pos[:, None, :] <= q_pos[:, :, None]) | (q_pos[:, :, None] < 0)
                mask = mask[:, None].to(device)
            groups.append(_Group(q_index.to(device), k_index.to(device), mask))
        inverse = torch.argsort(torch.cat(covered)).to(device)
        self._plans[key] = (groups, inverse)
        return self._plans[key]

    def dense_mask(self) -> torch.Tensor:
        """bool [b, 1, s, s], True = masked: the future and other documents (the "mask"
        fallback; whole rows only, not under context parallelism)."""
        if self.context_parallel:
            raise ConfigError("the dense document mask of a packed sequence is not split over "
                              "context-parallel ranks; packed attention there uses 'segments'")
        doc = self.document_ids
        s = doc.shape[1]
        future = torch.ones(s, s, dtype=torch.bool, device=doc.device).triu(1)
        return ((doc[:, :, None] != doc[:, None, :]) | future)[:, None]

    # Attention ----------------------------------------------------------------------------------

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               dropout_p: float = 0.0, scale: Optional[float] = None) -> torch.Tensor:
        """Document-causal attention of whole rows: q [b, nq, s, d], k/v [b, nkv, s, d]
        (nkv divides nq) -> [b, nq, s, d]."""
        from megatron_smp.transformer.utils import device_capability as _capability

        needs_grad = torch.is_grad_enabled() and any(
            t.requires_grad for t in (query, key, value))
        backend = packed_attention_plan(
            self.backend, query.device.type, query.dtype, query.shape[-1],
            _capability(query.device), dropout_p, needs_grad, self.context_parallel)
        gqa = query.shape[1] != key.shape[1]
        if backend == "mask":
            return F.scaled_dot_product_attention(query, key, value, attn_mask=~self.dense_mask(),
                                                  dropout_p=dropout_p, scale=scale,
                                                  enable_gqa=gqa)
        b, nq, s, d = query.shape
        if backend == "flex":
            if not needs_grad:  # flex refuses CPU inputs that require grad, even unused
                query, key, value = query.detach(), key.detach(), value.detach()
            return self._flex(query, key, value, scale, gqa)
        flat_q = query.permute(0, 2, 1, 3).reshape(b * s, nq, d)
        flat_k = key.permute(0, 2, 1, 3).reshape(b * s, key.shape[1], d)
        flat_v = value.permute(0, 2, 1, 3).reshape(b * s, value.shape[1], value.shape[-1])
        if backend == "varlen":
            from torch.nn.attention.varlen import varlen_attn

            cu, longest = self.cu_seqlens()
            cu = cu.to(query.device)
            out = varlen_attn(flat_q, flat_k, flat_v, cu, cu, longest, longest, scale=scale,
                              window_size=(-1, 0), enable_gqa=gqa)
        else:
            out = self.attend_segments(flat_q, flat_k, flat_v, dropout_p, scale)
        return out.reshape(b, s, nq, -1).permute(0, 2, 1, 3)

    def attend_segments(self, flat_q: torch.Tensor, flat_k: torch.Tensor, flat_v: torch.Tensor,
                        dropout_p: float = 0.0, scale: Optional[float] = None) -> torch.Tensor:
        """The "segments" engine over flattened tokens: this rank's queries [b * s_local, nq,
        d] (local order), the keys/values of whole rows [b * s, nkv, d] (row order)
        -> [b * s_local, nq, d_v]."""
        groups, inverse = self._groups(flat_q.device)
        gqa = flat_q.shape[1] != flat_k.shape[1]
        padded_q = torch.cat([flat_q, flat_q.new_zeros(1, *flat_q.shape[1:])])
        padded_k = torch.cat([flat_k, flat_k.new_zeros(1, *flat_k.shape[1:])])
        padded_v = torch.cat([flat_v, flat_v.new_zeros(1, *flat_v.shape[1:])])
        pieces = []
        for group in groups:
            q = padded_q[group.q_index].transpose(1, 2)  # [n, nq, Lq, d]
            k = padded_k[group.k_index].transpose(1, 2)
            v = padded_v[group.k_index].transpose(1, 2)
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=group.mask, dropout_p=dropout_p,
                is_causal=group.mask is None, scale=scale, enable_gqa=gqa)
            pieces.append(out.transpose(1, 2)[group.q_index < flat_q.shape[0]])
        return torch.cat(pieces).index_select(0, inverse)

    def _flex(self, query, key, value, scale, gqa):
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        b, _, s, _ = query.shape
        key_name = ("flex", str(query.device))
        if key_name not in self._plans:
            doc = self.document_ids.to(query.device)

            def same_document_causal(batch, head, q_index, k_index):
                return (doc[batch, q_index] == doc[batch, k_index]) & (q_index >= k_index)

            self._plans[key_name] = create_block_mask(same_document_causal, b, None, s, s,
                                                      device=query.device)
        block_mask = self._plans[key_name]
        if query.device.type == "cuda":
            return _compiled_flex()(query, key, value, block_mask=block_mask, scale=scale,
                                    enable_gqa=gqa)
        with warnings.catch_warnings():  # the uncompiled form's advice to compile
            warnings.simplefilter("ignore")
            return flex_attention(query, key, value, block_mask=block_mask, scale=scale,
                                  enable_gqa=gqa)


_COMPILED_FLEX = []


def _compiled_flex():
    if not _COMPILED_FLEX:
        from torch.nn.attention.flex_attention import flex_attention

        _COMPILED_FLEX.append(torch.compile(flex_attention, dynamic=False))
    return _COMPILED_FLEX[0]


__all__ = ["PACKED_ATTENTION_BACKENDS", "PackedSequence", "packed_attention_plan",
           "varlen_available"]
