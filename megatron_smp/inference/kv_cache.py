"""The paged (block) key/value cache and one step's attention over it.

Memory: every attention layer of this pipeline stage owns one pool of `num_blocks *
block_size` token slots (plus one scratch slot that padding tokens write to): keys and values
[slots, ng_local, d] for standard attention, or [slots, kv_lora_rank + pos] for multi-latent
attention (the compressed latent and the positional key). A request holds a table of blocks,
the same block ids in every layer; token `p` of a request lives in slot
`table[p // block_size] * block_size + p % block_size`. Blocks come from a `BlockAllocator`
and go back to it when the request finishes, so requests of any length share one budget.

A step (`StepBatch`, the `KVCacheContext` the layers see) flattens the new tokens of all its
requests into one sequence. Each layer writes its new keys/values into their slots, then runs
its queries in groups (all one-token decodes together, each longer chunk on its own): each
group's keys are gathered from the pool by slot, padded to the group's longest context, and
one SDPA call (`transformer.attention.core_attention`, so GQA, sinks and scaling are the
training attention's) attends under a mask built from the tokens' positions: causal, and the
layer's sliding window.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from megatron_smp.config import ConfigError
from megatron_smp.transformer.attention import core_attention
from megatron_smp.transformer.kv_cache import KVCacheContext


class BlockAllocator:
    """Free list of block ids 0 .. num_blocks - 1 (lowest first, so runs are reproducible)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> List[int]:
        if count > len(self._free):
            raise RuntimeError(f"KV cache: {count} blocks asked, {len(self._free)} free")
        return [self._free.pop() for _ in range(count)]

    def free(self, blocks: Sequence[int]) -> None:
        self._free.extend(sorted(blocks, reverse=True))
        self._free.sort(reverse=True)


def attention_layers(model: torch.nn.Module) -> Dict[int, torch.nn.Module]:
    """{global layer number: its self-attention} of this stage's decoder."""
    return {layer.layer_number: layer.self_attention for layer in model.decoder.layers}


def is_latent(attention: torch.nn.Module) -> bool:
    return hasattr(attention, "kv_lora_rank")


def bytes_per_token(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Cache bytes one token costs on this rank, over this stage's layers: 2 * ng_local * d
    per standard layer (key and value), kv_lora_rank + qk_pos_emb_head_dim per multi-latent
    layer, times the element size."""
    size = torch.tensor([], dtype=dtype).element_size()
    total = 0
    for attention in attention_layers(model).values():
        if is_latent(attention):
            total += (attention.kv_lora_rank + attention.pos_dim) * size
        else:
            total += 2 * attention.num_groups_per_partition * attention.head_dim * size
    return total


class PagedKVCache:
    """The pools of this stage's attention layers: `num_blocks` blocks of `block_size`
    tokens each, in `dtype` on `device`."""

    def __init__(self, model: torch.nn.Module, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.scratch_slot = num_blocks * block_size  # padding tokens write here
        slots = self.scratch_slot + 1
        self.pools: Dict[int, Tuple[torch.Tensor, ...]] = {}
        for number, attention in attention_layers(model).items():
            if is_latent(attention):
                width = attention.kv_lora_rank + attention.pos_dim
                self.pools[number] = (torch.zeros(slots, width, dtype=dtype, device=device),)
            else:
                shape = (slots, attention.num_groups_per_partition, attention.head_dim)
                self.pools[number] = (torch.zeros(shape, dtype=dtype, device=device),
                                      torch.zeros(shape, dtype=dtype, device=device))

    def allocated_bytes(self) -> int:
        """Bytes of the token slots (the scratch slot not counted)."""
        return sum(pool[:-1].numel() * pool.element_size()
                   for pools in self.pools.values() for pool in pools)


def blocks_for(tokens: int, block_size: int) -> int:
    return math.ceil(tokens / block_size)


@dataclass
class _Group:
    """One batched attention call: rows `q_index` [n, Lq] of the step's tokens (T = a zero
    padding row), key slots `k_slots` [n, Lk]; positions `q_pos` [n, Lq] (-1: padding) and
    `k_pos` [n, Lk] (huge: padding)."""

    q_index: torch.Tensor
    k_slots: torch.Tensor
    q_pos: torch.Tensor
    k_pos: torch.Tensor
    valid: torch.Tensor  # bool [n, Lq]: real query rows


@dataclass
class StepRequest:
    """One request's share of a step: its new tokens start at `start` (the tokens before are
    cached), its blocks are `blocks`."""

    tokens: List[int]
    start: int
    blocks: List[int]


class StepBatch(KVCacheContext):
    """The flattened tokens of one step and their attention over the cache.

    `tokens` [T_pad] / `positions` [T_pad] (T real tokens, then padding up to a multiple of
    `pad_to`, for sequence parallelism), `slots` [T_pad] where each token's key/value goes,
    `last_rows` [R] each request's last token row, `request_rows` per request its rows."""

    def __init__(self, cache: PagedKVCache, requests: Sequence[StepRequest], device,
                 pad_to: int = 1) -> None:
        self.cache = cache
        block_size = cache.block_size
        tokens, positions, slots, self.request_rows = [], [], [], []
        for request in requests:
            first = len(tokens)
            for offset, token in enumerate(request.tokens):
                position = request.start + offset
                tokens.append(token)
                positions.append(position)
                slots.append(request.blocks[position // block_size] * block_size
                             + position % block_size)
            self.request_rows.append(list(range(first, len(tokens))))
        self.num_tokens = len(tokens)
        padding = (-len(tokens)) % pad_to
        tokens += [0] * padding
        positions += [0] * padding
        slots += [cache.scratch_slot] * padding
        self.tokens = torch.tensor(tokens, dtype=torch.long, device=device)
        self.positions = torch.tensor(positions, dtype=torch.long, device=device)
        self.slots = torch.tensor(slots, dtype=torch.long, device=device)
        self.last_rows = torch.tensor([rows[-1] for rows in self.request_rows],
                                      dtype=torch.long, device=device)
        self.groups = self._build_groups(requests, device)
        self._masks: Dict[Tuple, torch.Tensor] = {}

    def _build_groups(self, requests: Sequence[StepRequest], device) -> List[_Group]:
        singles = [i for i, r in enumerate(requests) if len(r.tokens) == 1]
        members = ([singles] if singles else []) + [
            [i] for i, r in enumerate(requests) if len(r.tokens) > 1]
        block_size = self.cache.block_size
        pad_row = len(self.tokens)
        groups = []
        for indices in members:
            lq = max(len(requests[i].tokens) for i in indices)
            lk = max(requests[i].start + len(requests[i].tokens) for i in indices)
            n = len(indices)
            q_index = torch.full((n, lq), pad_row, dtype=torch.long)
            q_pos = torch.full((n, lq), -1, dtype=torch.long)
            k_slots = torch.full((n, lk), self.cache.scratch_slot, dtype=torch.long)
            k_pos = torch.full((n, lk), 1 << 40, dtype=torch.long)
            for row, i in enumerate(indices):
                request = requests[i]
                count, end = len(request.tokens), request.start + len(request.tokens)
                q_index[row, :count] = torch.tensor(self.request_rows[i])
                q_pos[row, :count] = torch.arange(request.start, end)
                positions = torch.arange(end)
                blocks = torch.tensor(request.blocks, dtype=torch.long)
                k_slots[row, :end] = blocks[positions // block_size] * block_size \
                    + positions % block_size
                k_pos[row, :end] = positions
            groups.append(_Group(q_index.to(device), k_slots.to(device), q_pos.to(device),
                                 k_pos.to(device), (q_pos >= 0).to(device)))
        return groups

    def _mask(self, index: int, window_size: Optional[Tuple[int, int]]) -> torch.Tensor:
        """bool [n, 1, Lq, Lk], True = masked (SDPA's convention inverted, as core_attention's
        masks): the future, padding keys and keys left of the window; a padding query row
        sees its first key, so no row is fully masked."""
        key = (index, window_size)
        if key not in self._masks:
            group = self.groups[index]
            q_pos, k_pos = group.q_pos[:, :, None], group.k_pos[:, None, :]
            allowed = k_pos <= q_pos
            if window_size is not None:
                left, right = window_size
                allowed = allowed & (k_pos - q_pos <= right)
                if left >= 0:
                    allowed = allowed & (q_pos - k_pos <= left)
            allowed[:, :, 0] |= q_pos[:, :, 0] < 0
            self._masks[key] = (~allowed)[:, None]
        return self._masks[key]

    def _alibi(self, group: _Group, slopes: torch.Tensor, dtype) -> torch.Tensor:
        """[n, heads, Lq, Lk]: slope * (j - i) (ALiBi, as `alibi_bias` from global positions)."""
        distance = (group.k_pos[:, None, :] - group.q_pos[:, :, None]).float()
        distance = distance.clamp(min=-(1 << 30), max=1 << 30)
        return (slopes.float()[None, :, None, None] * distance[:, None]).to(dtype)

    def _run_groups(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    scale, window_size, sinks=None, alibi_slopes=None) -> torch.Tensor:
        """query [T_pad, nh, d]; keys / values: the pools [slots, nkv, d] -> [T_pad, nh, dv]."""
        padded = torch.cat([query, query.new_zeros(1, *query.shape[1:])])
        output = query.new_zeros(query.shape[0], query.shape[1], values.shape[-1])
        for index, group in enumerate(self.groups):
            q = padded[group.q_index].transpose(1, 2)  # [n, nh, Lq, d]
            k = keys[group.k_slots].transpose(1, 2)  # [n, nkv, Lk, d]
            v = values[group.k_slots].transpose(1, 2)
            bias = None if alibi_slopes is None else self._alibi(group, alibi_slopes, q.dtype)
            context = core_attention(q, k, v, self._mask(index, window_size), False, 0.0,
                                     scale, bias, sinks)
            output[group.q_index[group.valid]] = context.transpose(1, 2)[group.valid]
        return output

    def attend(self, layer_number, query, key, value, scale=None, window_size=None,
               sinks=None, alibi_slopes=None):
        keys, values = self.cache.pools[layer_number]
        t = query.shape[0] * query.shape[1]
        keys.index_copy_(0, self.slots, key.reshape(t, *key.shape[2:]).to(keys.dtype))
        values.index_copy_(0, self.slots, value.reshape(t, *value.shape[2:]).to(values.dtype))
        context = self._run_groups(query.reshape(t, *query.shape[2:]), keys.to(query.dtype),
                                   values.to(query.dtype), scale, window_size, sinks,
                                   alibi_slopes)
        return context.view(*query.shape[:3], -1)

    def attend_latent(self, layer_number, query, latent, latent_dim, scale):
        (pool,) = self.cache.pools[layer_number]
        pool.index_copy_(0, self.slots, latent.to(pool.dtype))
        entries = pool.to(query.dtype)[:, None, :]  # one key/value head shared by all
        return self._run_groups(query, entries, entries[..., :latent_dim], scale, None)


def check_inference_layout(state) -> None:
    """Context parallelism splits a sequence over ranks, which a decode step of one token
    per request cannot be: a clear error."""
    if state.cp_size > 1:
        raise ConfigError("inference: --context-parallel-size must be 1 (a decode step has "
                          "one token per request; generate at tensor, pipeline or expert "
                          "parallelism)")


__all__ = ["BlockAllocator", "PagedKVCache", "StepBatch", "StepRequest", "blocks_for",
           "bytes_per_token", "attention_layers", "check_inference_layout"]
