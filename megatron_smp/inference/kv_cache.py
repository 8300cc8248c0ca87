"""The paged (block) key/value cache and one step's attention over it.

Memory: every attention layer of this pipeline stage owns one pool of token slots (plus one
scratch slot that padding keys read): keys and values [slots, ng_local, d] for standard
attention, or [slots, kv_lora_rank + pos] for multi-latent attention (the compressed latent
and the positional key). Layers are grouped by *kind*: full attention, or a sliding window
of `left` keys. Each kind has its blocks of `block_size` slots and its `BlockAllocator`, and a
request holds one block table per kind, the same block ids in every layer of that kind; token
`p` lives in slot `table[(p // block_size) % len(table)] * block_size + p % block_size`. A
full-attention table covers the whole request; a windowed one is a ring of at most
`ceil(left / block_size) + 1` blocks, which keeps only the window (older keys are
overwritten). Blocks go back to their allocator when the request finishes, so requests of
any length share one budget.

Recurrent layers (Mamba-2, Gated DeltaNet) keep no keys: each holds, per request, a
fixed-size state (its conv state and its SSM / delta-rule state, `state_shapes()` of the
mixer) in one of `max_requests` slots; a request takes a slot when it joins and gives it back
when it leaves, so its state costs the same bytes at any length
(`state_bytes_per_request`). The attention layers of a hybrid model keep the paged KV cache.

A step (`StepBatch`, the `KVCacheContext` the layers see) flattens the new tokens of all its
requests into one sequence. Each layer runs its queries in groups (all one-token decodes
together; all requests with a few new tokens after cached ones, as speculative decoding
verifies drafts, together; each longer chunk on its own): a group's keys are its requests' cached keys and
the step's new ones (full attention: written to the pool first and gathered back by slot in
one go; a window: its still-visible cached keys, then the new ones, which are written
afterwards, so a ring never loses a key the step needs), padded to the group's longest
context, and one SDPA call (`transformer.attention.core_attention`, so GQA, sinks and
scaling are the training attention's) attends under a mask built from the tokens' positions:
causal, and the layer's sliding window.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from megatron_smp.config import ConfigError
from megatron_smp.transformer.attention import core_attention
from megatron_smp.transformer.kv_cache import KVCacheContext
from megatron_smp.transformer.ssm.layers import RecurrentMixer


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
        self._free.extend(blocks)
        self._free.sort(reverse=True)


def _sequence_mixer(layer: torch.nn.Module) -> Optional[torch.nn.Module]:
    """A layer's part that reads the sequence: a GPT layer's self-attention (or the Gated
    DeltaNet in its place), a hybrid layer's mixer; None for a hybrid MLP / MoE layer."""
    if hasattr(layer, "self_attention"):
        return layer.self_attention
    mixer = getattr(layer, "mixer", None)
    return mixer if getattr(layer, "symbol", None) in ("M", "G", "*") else None


def is_recurrent(mixer: torch.nn.Module) -> bool:
    """A Mamba-2 or Gated DeltaNet mixer (a recurrent state, no keys/values)."""
    return isinstance(mixer, RecurrentMixer)


def _mixers(model: torch.nn.Module, recurrent: bool) -> Dict[int, torch.nn.Module]:
    layers = {}
    for layer in model.decoder.layers:
        mixer = _sequence_mixer(layer)
        if mixer is not None and is_recurrent(mixer) == recurrent:
            layers[layer.layer_number] = mixer
    return layers


def attention_layers(model: torch.nn.Module) -> Dict[int, torch.nn.Module]:
    """{global layer number: its self-attention} of this stage's decoder (the layers with
    keys and values; recurrent mixers and hybrid MLP / MoE layers left out)."""
    return _mixers(model, recurrent=False)


def recurrent_layers(model: torch.nn.Module) -> Dict[int, torch.nn.Module]:
    """{global layer number: its Mamba-2 / Gated DeltaNet mixer} of this stage's decoder."""
    return _mixers(model, recurrent=True)


def is_latent(attention: torch.nn.Module) -> bool:
    return hasattr(attention, "kv_lora_rank")


def layer_bytes_per_token(attention: torch.nn.Module, dtype: torch.dtype) -> int:
    """Cache bytes of one token in one layer on this rank: 2 * ng_local * d (key and value)
    for standard attention, kv_lora_rank + qk_pos_emb_head_dim for multi-latent attention,
    times the element size."""
    size = torch.tensor([], dtype=dtype).element_size()
    if is_latent(attention):
        return (attention.kv_lora_rank + attention.pos_dim) * size
    return 2 * attention.num_groups_per_partition * attention.head_dim * size


def bytes_per_token(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Cache bytes one token costs on this rank, summed over this stage's layers (a windowed
    layer's tokens past its window are not kept: see `CacheLayout`)."""
    return sum(layer_bytes_per_token(a, dtype) for a in attention_layers(model).values())


def _nbytes(shape, dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.tensor([], dtype=dtype).element_size()


def state_bytes_per_request(model: torch.nn.Module) -> int:
    """Recurrent-state bytes one request holds on this rank, summed over this stage's
    Mamba-2 / Gated DeltaNet layers: conv channels/tp x (kernel - 1) in the model's dtype plus
    heads/tp x the state's two dims in fp32 (`state_shapes()`), at any request length."""
    return sum(_nbytes(shape, dtype) for mixer in recurrent_layers(model).values()
               for shape, dtype in mixer.state_shapes())


def blocks_for(tokens: int, block_size: int) -> int:
    return math.ceil(tokens / block_size)


Kind = Optional[int]  # None: full attention; an int: a sliding window of that many keys left


def keeps_keys(config, layer_number: int) -> bool:
    """Whether global layer `layer_number` is an attention layer (keys and values in the
    cache), not a Mamba-2 / Gated DeltaNet mixer or a hybrid MLP / MoE layer."""
    index = config.layer_pattern_number(layer_number) - 1
    symbols = config.hybrid_layer_symbols()
    if symbols is not None:
        return symbols[index] == "*"
    return not config.linear_attention_pattern()[index]


class CacheLayout:
    """The kinds of the model's attention layers (all of them, on every pipeline stage alike)
    and the blocks each kind has: `num_blocks` for full attention (`max_tokens` /
    `block_size`), for a window at most `max_requests` rings. A model without attention
    layers (all recurrent) has no kinds: its requests need no blocks."""

    def __init__(self, config, num_blocks: int, block_size: int, max_requests: int) -> None:
        self.block_size = block_size
        self.max_requests = max_requests
        self.layer_kind: Dict[int, Kind] = {}
        for number in range(1, config.num_layers + 1):
            if not keeps_keys(config, number):
                continue
            window = config.layer_window_size(number)
            causal_window = window is not None and window[0] >= 0 and window[1] == 0
            self.layer_kind[number] = window[0] if causal_window else None
        self.kinds = sorted(set(self.layer_kind.values()), key=lambda k: -1 if k is None else k)
        self.num_blocks = {kind: num_blocks if kind is None
                           else min(num_blocks, max_requests * self.ring_blocks(kind))
                           for kind in self.kinds}

    def ring_blocks(self, left: int) -> int:
        """Blocks a window of `left` keys needs: a query at p sees p - left .. p, read before
        p is written, and the ring turns a block at a time."""
        return blocks_for(left, self.block_size) + 1

    def blocks_needed(self, kind: Kind, total_tokens: int) -> int:
        whole = blocks_for(total_tokens, self.block_size)
        return whole if kind is None else min(whole, self.ring_blocks(kind))


class PagedKVCache:
    """The pools of this stage's attention layers (see `CacheLayout` for their sizes), in
    `dtype` on `device`."""

    def __init__(self, model: torch.nn.Module, layout: CacheLayout, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.layout = layout
        self.block_size = layout.block_size
        self.dtype, self.device = dtype, device
        self.pools: Dict[int, Tuple[torch.Tensor, ...]] = {}
        self.scratch_slot: Dict[Kind, int] = {
            kind: count * self.block_size for kind, count in layout.num_blocks.items()}
        for number, attention in attention_layers(model).items():
            slots = self.scratch_slot[layout.layer_kind[number]] + 1
            if is_latent(attention):
                width = attention.kv_lora_rank + attention.pos_dim
                self.pools[number] = (torch.zeros(slots, width, dtype=dtype, device=device),)
            else:
                shape = (slots, attention.num_groups_per_partition, attention.head_dim)
                self.pools[number] = (torch.zeros(shape, dtype=dtype, device=device),
                                      torch.zeros(shape, dtype=dtype, device=device))
        # Recurrent layers: one state slot per running request.
        self.states: Dict[int, Tuple[torch.Tensor, ...]] = {
            number: tuple(torch.zeros(layout.max_requests, *shape, dtype=state_dtype,
                                      device=device)
                          for shape, state_dtype in mixer.state_shapes())
            for number, mixer in recurrent_layers(model).items()}

    def add_layers(self, attentions: Dict[int, torch.nn.Module]) -> None:
        """Pools for more full-attention layers by global number (the multi-token-prediction
        layers that draft for speculative decoding), on the full-attention block tables."""
        for number, attention in attentions.items():
            self.layout.layer_kind[number] = None
            slots = self.scratch_slot[None] + 1
            shapes = [(slots, attention.kv_lora_rank + attention.pos_dim)] \
                if is_latent(attention) else \
                [(slots, attention.num_groups_per_partition, attention.head_dim)] * 2
            self.pools[number] = tuple(torch.zeros(shape, dtype=self.dtype, device=self.device)
                                       for shape in shapes)

    def allocated_bytes(self) -> int:
        """Bytes of the token slots (the scratch slots not counted) and the state slots."""
        tokens = sum(pool[:-1].numel() * pool.element_size()
                     for pools in self.pools.values() for pool in pools)
        return tokens + sum(pool.numel() * pool.element_size()
                            for pools in self.states.values() for pool in pools)


@dataclass
class StepRequest:
    """One request's share of a step: its new tokens start at position `start` (the tokens
    before are cached), `blocks` its block table of each kind, `slot` its recurrent-state
    slot (models with recurrent layers)."""

    tokens: List[int]
    start: int
    blocks: Dict[Kind, List[int]]
    slot: Optional[int] = None


@dataclass
class _Group:
    """One batched attention call over n requests: rows `q_index` [n, Lq] of the step's
    tokens (padding: row 0, its output dropped) at positions `q_pos` (-1: padding);
    `starts` [n] (CPU) the requests' first new positions and `tables` per kind their block
    tables, from which `StepBatch._keys` makes (on first use) per kind the cached keys'
    slots [n, Lc] and positions [n, Lc] (huge: padding) in `cached`, and for full attention
    `all_slots` [n, Lc + Lq], the cached keys' slots then the new keys' (written first).
    `row_start`: the rows are row_start .. row_start + n * Lq - 1 in order, all real;
    otherwise `out_rows` / `flat_valid` scatter the real rows back."""

    q_index: torch.Tensor
    q_pos: torch.Tensor
    valid: torch.Tensor  # bool [n, Lq]: real query rows
    starts: torch.Tensor
    host: Tuple[torch.Tensor, torch.Tensor]  # q_pos and valid on the CPU
    tables: Dict["Kind", List[List[int]]]
    row_start: Optional[int]
    out_rows: Optional[torch.Tensor]
    flat_valid: Optional[torch.Tensor]
    lengths: Optional[torch.Tensor] = None  # [n] real tokens per request (recurrent layers)
    slots: Optional[torch.Tensor] = None  # [n] recurrent-state slots
    fresh: Optional[torch.Tensor] = None  # bool [n]: the request's first tokens (zero state)
    # One request whose full-attention blocks up to its last new token are consecutive (so
    # at batch 1 always): its keys, cached and new, are pool rows span[0] .. span[1] - 1 in
    # position order, read as a view instead of gathered.
    span: Optional[Tuple[int, int]] = None
    cached: Dict["Kind", Tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    all_slots: Optional[torch.Tensor] = None


_FAR = 1 << 40
_FEW = 17  # the most new tokens of a request batched with others in one attention group


def _slot(table: List[int], position: int, block_size: int) -> int:
    return table[(position // block_size) % len(table)] * block_size + position % block_size


class StepBatch(KVCacheContext):
    """The flattened tokens of one step and their attention over the cache.

    `tokens` [T_pad] / `positions` [T_pad] (T real tokens, then padding up to a multiple of
    `pad_to`, for sequence parallelism), `request_rows` per request its rows."""

    def __init__(self, cache: PagedKVCache, requests: Sequence[StepRequest], device,
                 pad_to: int = 1) -> None:
        self.cache = cache
        layout = cache.layout
        block_size = cache.block_size
        tokens, positions, self.request_rows = [], [], []
        writes = {kind: ([], []) for kind in layout.kinds}  # rows, slots
        for request in requests:
            first = len(tokens)
            end = request.start + len(request.tokens)
            tokens.extend(request.tokens)
            positions.extend(range(request.start, end))
            self.request_rows.append(list(range(first, len(tokens))))
            for kind in layout.kinds:
                table = request.blocks[kind]
                # A ring keeps the last len(table) blocks' worth: write only those tokens
                # (each to a slot of its own).
                keep_from = max(request.start, end - len(table) * block_size)
                rows, slots = writes[kind]
                for position in range(keep_from, end):
                    rows.append(first + position - request.start)
                    slots.append(_slot(table, position, block_size))
        self.num_tokens = len(tokens)
        padding = (-len(tokens)) % pad_to
        self.tokens = torch.tensor(tokens + [0] * padding, dtype=torch.long, device=device)
        self.positions = torch.tensor(positions + [0] * padding, dtype=torch.long,
                                      device=device)
        # rows None: the written rows are the step's first len(slots) rows in order (every
        # decode step, and any step whose tokens all fit their tables), so a slice of the new
        # keys is written, no gather.
        self.writes = {kind: (None if rows == list(range(len(rows)))
                              else torch.tensor(rows, dtype=torch.long, device=device),
                              torch.tensor(slots, dtype=torch.long, device=device))
                       for kind, (rows, slots) in writes.items()}
        self.groups = self._build_groups(requests, device)
        self._masks: Dict[Tuple, torch.Tensor] = {}

    def _build_groups(self, requests: Sequence[StepRequest], device) -> List[_Group]:
        layout = self.cache.layout
        block_size = self.cache.block_size
        singles = [i for i, r in enumerate(requests) if len(r.tokens) == 1]
        # A few tokens after a cached context (speculative decoding's verified drafts): one
        # group, padded to the longest, as decodes are (attention-only models: a recurrent
        # state runs each request's rows in order anyway). Prompts and long chunks alone.
        few = [i for i, r in enumerate(requests)
               if 1 < len(r.tokens) <= _FEW and r.start > 0 and not self.cache.states]
        members = ([singles] if singles else []) + ([few] if few else []) + [
            [i] for i, r in enumerate(requests) if len(r.tokens) > 1 and i not in few]
        groups = []
        for indices in members:
            sizes = [len(requests[i].tokens) for i in indices]
            firsts = [self.request_rows[i][0] for i in indices]
            starts = torch.tensor([requests[i].start for i in indices])
            lq = max(sizes)
            if lq == 1:  # decodes: one real row each
                host = (starts[:, None], torch.ones(len(indices), 1, dtype=torch.bool))
                q_index = torch.tensor(firsts, device=device)[:, None]
            else:
                counts = torch.tensor(sizes)
                offsets = torch.arange(lq)
                valid = offsets[None, :] < counts[:, None]  # [n, Lq]
                host = (torch.where(valid, starts[:, None] + offsets, -1), valid)
                q_index = torch.where(valid, torch.tensor(firsts)[:, None] + offsets,
                                      0).to(device)
            q_pos, valid = host[0].to(device), host[1].to(device)
            in_order = all(size == lq and row == firsts[0] + k * lq
                           for k, (size, row) in enumerate(zip(sizes, firsts)))
            out_rows = flat_valid = None
            if not in_order:
                out_rows = q_index[valid]
                flat_valid = valid.flatten().nonzero().flatten()
            lengths = slots = fresh = None
            if self.cache.states:
                lengths = torch.tensor(sizes, device=device)
                slots = torch.tensor([requests[i].slot for i in indices], device=device)
                fresh = (starts == 0).to(device)
            span = None
            if len(indices) == 1 and None in layout.kinds:
                request = requests[indices[0]]
                table = request.blocks[None]
                end = request.start + len(request.tokens)
                used = blocks_for(end, block_size)
                if table[:used] == list(range(table[0], table[0] + used)):
                    span = (table[0] * block_size, table[0] * block_size + end)
            tables = {kind: [requests[i].blocks[kind] for i in indices]
                      for kind in layout.kinds}
            groups.append(_Group(q_index, q_pos, valid, starts, host, tables,
                                 firsts[0] if in_order else None, out_rows, flat_valid,
                                 lengths, slots, fresh, span))
        return groups

    def _keys(self, group: _Group, kind: Kind) -> Tuple[torch.Tensor, torch.Tensor]:
        """(slots [n, Lc], positions [n, Lc]) of the group's cached keys of `kind` (made on
        first use; for full attention `group.all_slots` with them)."""
        if kind not in group.cached:
            block_size, device = self.cache.block_size, group.q_pos.device
            starts = group.starts
            lows = torch.zeros_like(starts) if kind is None else (starts - kind).clamp(min=0)
            lc = int((starts - lows).max())
            positions = lows[:, None] + torch.arange(lc)  # [n, Lc]
            present = positions < starts[:, None]
            tables = group.tables[kind]
            width = max(len(t) for t in tables)
            table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
            lengths = torch.tensor([len(t) for t in tables])
            blocks = table.gather(1, (positions // block_size) % lengths[:, None])
            slots = torch.where(present, blocks * block_size + positions % block_size,
                                self.cache.scratch_slot[kind])
            k_pos = torch.where(present, positions, _FAR)
            group.cached[kind] = (slots.to(device), k_pos.to(device))
            if kind is None:
                q_pos, valid = group.host[0].clamp(min=0), group.host[1]
                new = table.gather(1, q_pos // block_size) * block_size + q_pos % block_size
                new = torch.where(valid, new, self.cache.scratch_slot[kind])
                group.all_slots = torch.cat([slots, new], dim=1).to(device)
        return group.cached[kind]

    def _key_positions(self, group: _Group, kind: Kind) -> torch.Tensor:
        """[n, Lc + Lq]: the cached keys' positions, then the new keys' (padding far)."""
        new = group.q_pos.masked_fill(~group.valid, _FAR)
        return torch.cat([self._keys(group, kind)[1], new], dim=1)

    def _mask(self, index: int, kind: Kind, window_size):
        """(mask, plain): the bool mask [n, 1, Lq, Lk], True = masked (core_attention's
        convention): the future, padding keys and keys left of the window (a padding query
        row sees its first key, so no row is fully masked); and, where the mask says no more
        than SDPA's own paths do, (None, causal) to call them instead (a decode seeing all
        its keys: no mask; a prompt alone: is_causal), else None."""
        key = (index, kind, window_size)
        if key not in self._masks:
            group = self.groups[index]
            q_pos = group.q_pos[:, :, None]
            k_pos = self._key_positions(group, kind)[:, None, :]
            allowed = k_pos <= q_pos
            if window_size is not None:
                left, right = window_size
                allowed = allowed & (k_pos - q_pos <= right)
                if left >= 0:
                    allowed = allowed & (q_pos - k_pos <= left)
            allowed[:, :, 0] |= q_pos[:, :, 0] < 0
            masked = (~allowed)[:, None]
            plain = None
            n, _, lq, lk = masked.shape
            if not bool(masked.any()):
                plain = (None, False)
            elif n == 1 and lq == lk and torch.equal(
                    masked[0, 0], torch.ones(lq, lk, dtype=torch.bool,
                                             device=masked.device).triu(1)):
                plain = (None, True)
            self._masks[key] = (masked, plain)
        return self._masks[key]

    def _alibi(self, group: _Group, kind: Kind, slopes: torch.Tensor, dtype) -> torch.Tensor:
        """[n, heads, Lq, Lk]: slope * (j - i) (ALiBi, as `alibi_bias`, from positions)."""
        k_pos = self._key_positions(group, kind)
        distance = (k_pos[:, None, :] - group.q_pos[:, :, None]).clamp(-_FAR, _FAR).float()
        return (slopes.float()[None, :, None, None] * distance[:, None]).to(dtype)

    def _run_groups(self, kind: Kind, query, new_keys, new_values, keys, values, scale,
                    window_size, sinks=None, alibi_slopes=None) -> torch.Tensor:
        """query [T_pad, nh, d], the step's keys / values [T_pad, nkv, d]; keys / values:
        the pools [slots, nkv, d] (for full attention already holding the step's keys)
        -> [T_pad, nh, dv]."""

        def rows(source, index, n):  # [n, L, ...] gathered along dim 0
            return source.index_select(0, index.view(-1)).view(n, -1, *source.shape[1:])

        output = None
        for index, group in enumerate(self.groups):
            n, lq = group.q_index.shape
            if group.row_start is not None:
                q = query[group.row_start:group.row_start + n * lq].view(n, lq,
                                                                        *query.shape[1:])
            else:
                q = rows(query, group.q_index, n)
            if kind is None and group.span is not None:
                k, v = keys[None, group.span[0]:group.span[1]], \
                    values[None, group.span[0]:group.span[1]]
            elif kind is None:
                self._keys(group, kind)
                k, v = rows(keys, group.all_slots, n), rows(values, group.all_slots, n)
            else:
                slots = self._keys(group, kind)[0]
                k = torch.cat([rows(keys, slots, n), rows(new_keys, group.q_index, n)], dim=1)
                v = torch.cat([rows(values, slots, n), rows(new_values, group.q_index, n)],
                              dim=1)
            if k.dtype != q.dtype:
                k, v = k.to(q.dtype), v.to(q.dtype)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            bias = (None if alibi_slopes is None
                    else self._alibi(group, kind, alibi_slopes, q.dtype))
            causal = False
            if (bias is None and kind is None and window_size is None
                    and group.span is not None
                    and (lq == 1 or group.span[1] - group.span[0] == lq)):
                # One request over all its keys in order: a decode sees them all, a prompt
                # from position 0 is plain causal; no mask to build.
                mask, causal = None, lq > 1
            else:
                mask, plain = self._mask(index, kind, window_size)
                if plain is not None and bias is None:  # ALiBi's bias carries no causal mask
                    mask, causal = plain
            context = core_attention(q, k, v, mask, causal, 0.0, scale, bias,
                                     sinks).transpose(1, 2)  # [n, Lq, nh, dv]
            if len(self.groups) == 1 and group.row_start == 0 \
                    and n * lq == query.shape[0]:
                return context.reshape(n * lq, *context.shape[2:])
            output = self._scatter(output, group, context, query.shape[0])
        return output

    def _scatter(self, output: Optional[torch.Tensor], group: _Group, context: torch.Tensor,
                 rows: int) -> torch.Tensor:
        """Put a group's [n, Lq, ...] results into output [rows, ...] (made on first use)."""
        n, lq = group.q_index.shape
        flat = context.reshape(n * lq, *context.shape[2:])
        if output is None:
            output = context.new_zeros(rows, *context.shape[2:])
        if group.row_start is not None:
            output[group.row_start:group.row_start + n * lq] = flat
        else:
            output.index_copy_(0, group.out_rows, flat.index_select(0, group.flat_valid))
        return output

    def recurrent(self, layer_number, inputs, step):
        pools = self.cache.states[layer_number]
        outputs = None
        for group in self.groups:
            n, lq = group.q_index.shape
            rows = [x.index_select(0, group.q_index.flatten()).view(n, lq, *x.shape[1:])
                    for x in inputs]
            states = []
            for pool in pools:
                state = pool.index_select(0, group.slots)
                fresh = group.fresh.view(-1, *([1] * (state.dim() - 1)))
                states.append(state.masked_fill(fresh, 0))
            results, new_states = step(rows, group.lengths, tuple(states))
            for pool, state in zip(pools, new_states):
                pool.index_copy_(0, group.slots, state.to(pool.dtype))
            if outputs is None:
                outputs = [None] * len(results)
            rows_total = inputs[0].shape[0]
            outputs = [self._scatter(out, group, result, rows_total)
                       for out, result in zip(outputs, results)]
        return tuple(outputs)

    def _write(self, kind: Kind, pool: torch.Tensor, new: torch.Tensor) -> None:
        rows, slots = self.writes[kind]
        new = new[:len(slots)] if rows is None else new.index_select(0, rows)
        pool.index_copy_(0, slots, new if new.dtype == pool.dtype else new.to(pool.dtype))

    def attend(self, layer_number, query, key, value, scale=None, window_size=None,
               sinks=None, alibi_slopes=None):
        keys, values = self.cache.pools[layer_number]
        kind = self.cache.layout.layer_kind[layer_number]
        t = query.shape[0] * query.shape[1]
        key, value = key.reshape(t, *key.shape[2:]), value.reshape(t, *value.shape[2:])
        if kind is None:  # read back with the cached keys in one gather
            self._write(kind, keys, key)
            self._write(kind, values, value)
        context = self._run_groups(kind, query.reshape(t, *query.shape[2:]), key, value, keys,
                                   values, scale, window_size, sinks, alibi_slopes)
        if kind is not None:  # a ring: written after, so no key the queries need is lost
            self._write(kind, keys, key)
            self._write(kind, values, value)
        return context.view(*query.shape[:3], -1)

    def attend_latent(self, layer_number, query, latent, latent_dim, scale):
        (pool,) = self.cache.pools[layer_number]
        kind = self.cache.layout.layer_kind[layer_number]
        self._write(kind, pool, latent)  # multi-latent attention has no windows
        entries = latent[:, None, :]  # one key/value head shared by all query heads
        pooled = pool[:, None, :]
        return self._run_groups(kind, query, entries, entries[..., :latent_dim], pooled,
                                pooled[..., :latent_dim], scale, None)


def check_inference_layout(state, replicate_context_parallel: bool = False,
                           recurrent: bool = False) -> None:
    """Context parallelism splits a sequence over ranks, which a decode step of one token
    per request cannot be: a clear error. With `replicate_context_parallel` (train_rl.py,
    whose context-parallel ranks hold the full weights) each CP rank runs every step whole
    instead, which the attention cores do (`context_parallel.attention`), but not
    `recurrent` layers (Mamba-2 / Gated DeltaNet take 1/cp of their groups' parameters in
    each forward)."""
    if state.cp_size == 1:
        return
    if not replicate_context_parallel:
        raise ConfigError("inference: --context-parallel-size must be 1 (a decode step has "
                          "one token per request; generate at tensor, pipeline or expert "
                          "parallelism)")
    if recurrent:
        raise ConfigError("inference at --context-parallel-size > 1: Mamba / Gated DeltaNet "
                          "layers use 1/cp of their groups' parameters in each forward, so a "
                          "context-parallel rank cannot generate on its own; use "
                          "--context-parallel-size 1 for a hybrid model")


__all__ = ["BlockAllocator", "CacheLayout", "PagedKVCache", "StepBatch", "StepRequest",
           "blocks_for", "bytes_per_token", "layer_bytes_per_token", "attention_layers",
           "recurrent_layers", "is_recurrent", "check_inference_layout",
           "state_bytes_per_request"]
