"""Core attention across the context-parallel group: ring (p2p), all-gather KV, all-to-all.

Each rank holds the queries, keys and values of its two sequence chunks (`split.py`): chunk
i and chunk 2N-1-i of 2N. Every module here has `DotProductAttention`'s call signature,

    forward(query [s/cp, b, nh, d], key/value [s/cp, b, ng, d], attention_mask=None)
        -> context [s/cp, b, nh * d]

with `nh`/`ng` this tensor-parallel rank's heads and query groups, and returns exactly the
rows of the non-parallel attention's output that belong to this rank's tokens. Causal masks,
sliding windows and ALiBi biases are computed from the tokens' global sequence positions.

* `RingAttention` (`--cp-comm-type p2p`): the key/value blocks travel around the ring while
  the current block is computed; partial outputs merge by their log-sum-exp.
* `AllGatherAttention` (`all_gather`): all-gather keys and values (only the ng KV heads),
  then attend the local queries to the whole sequence; backward reduce-scatters dK/dV.
* `AllToAllAttention` (`a2a`, DeepSpeed-Ulysses): all-to-all from sequence- to head-sharded,
  ordinary attention over the whole sequence for nh/N heads, all-to-all back.

At inference over a KV cache (a `KVCacheContext` in place of the mask, which only an engine
built with `replicate_context_parallel=True` passes) every CP rank runs the whole step on
its own: each core then attends like `DotProductAttention` (`attend_cached`).
"""
from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch
import torch.distributed as dist

from megatron_smp.config import CP_COMM_TYPES, ConfigError, TransformerConfig
from megatron_smp.context_parallel.split import gathered_order, positions_of_local_length
from megatron_smp.tensor_parallel import divide
from megatron_smp.tensor_parallel.mappings import (
    _all_to_all_first_dim,
    _gather_first_dim,
    _reduce_scatter_first_dim,
    gather_from_sequence_parallel_region,
    group_rank,
    group_size,
)
from megatron_smp.tensor_parallel.random import dropout_scale, get_rng_tracker
from megatron_smp.transformer.attention import (
    DotProductAttention,
    alibi_bias,
    alibi_slopes,
    build_softmax_offset,
    register_softmax_offset,
    sliding_window_mask,
)
from megatron_smp.transformer.kv_cache import KVCacheContext
from megatron_smp.transformer.packed import PackedSequence
from megatron_smp.transformer.spec import ModuleSpec

class _ContextParallelCore(torch.nn.Module):
    """What every context-parallel core attention knows: heads, group, window, ALiBi, sinks
    (`softmax_offset`, the same parameter as `DotProductAttention`'s)."""

    def __init__(
        self,
        config: TransformerConfig,
        state,
        layer_number: int = 1,
        device: Optional[torch.device] = None,
        softmax_scale: Optional[float] = None,
    ) -> None:
        super().__init__()
        tp_size = group_size(state.tp_group)
        self.num_heads = divide(config.num_attention_heads, tp_size)
        self.num_groups = divide(config.num_query_groups, tp_size)
        self.head_dim = config.kv_channels
        # Multi-latent attention gives its own (YaRN's mscale); else the config's
        # (--softmax-scale, or muP's with --use-mup), else 1/sqrt(d).
        if softmax_scale is None:
            softmax_scale = config.attention_softmax_scale()
        self.scale = 1.0 / math.sqrt(self.head_dim) if softmax_scale is None else softmax_scale
        self.layer_number = layer_number
        self.cp_group = state.cp_group
        self.cp_size = group_size(state.cp_group)
        self.cp_rank = group_rank(state.cp_group)
        self.cp_global_ranks = state.group_ranks["cp"]
        self.attention_dropout = config.attention_dropout
        window = config.layer_window_size(layer_number)
        self.window_size = window if window is not None and window[0] >= 0 else None
        register_softmax_offset(self, build_softmax_offset(config, state.tp_group,
                                                           self.num_heads, device))
        self.register_buffer("alibi_slopes", None, persistent=False)
        if config.position_embedding_type == "alibi":
            start = group_rank(state.tp_group) * self.num_heads
            slopes = alibi_slopes(config.num_attention_heads)[start : start + self.num_heads]
            if device is not None and torch.device(device).type != "meta":
                slopes = slopes.to(device)
            self.register_buffer("alibi_slopes", slopes, persistent=False)

    def attend_cached(self, query, key, value, cache: KVCacheContext) -> torch.Tensor:
        """An inference step over a KV cache (`InferenceEngine(replicate_context_parallel=
        True)`): the step's tokens and the cache hold whole requests on this rank, so it
        attends as `DotProductAttention` does, with no context-parallel communication.
        query [T, 1, nh, d], key/value [T, 1, ng, d] -> [T, 1, nh * d]."""
        s, b = query.shape[:2]
        context = cache.attend(self.layer_number, query, key, value, self.scale,
                               self.window_size, self.softmax_offset, self.alibi_slopes)
        return context.reshape(s, b, self.num_heads * self.head_dim)

    def positions(self, local_length: int, device, rank: Optional[int] = None) -> torch.Tensor:
        """Global positions [s/cp] of `rank`'s (default: this rank's) local tokens."""
        rank = self.cp_rank if rank is None else rank
        return positions_of_local_length(local_length, self.cp_size, rank, device)

    def positional_bias(
        self, query_positions: torch.Tensor, key_positions: torch.Tensor, causal: bool,
    ) -> Optional[torch.Tensor]:
        """Additive fp32 bias [1, nh or 1, sq, sk] of one block (-inf = masked): the causal
        mask (when `causal`), the sliding window, ALiBi. None when nothing applies."""
        bias = None
        if self.alibi_slopes is not None:
            bias = alibi_bias(self.alibi_slopes, 0, causal, torch.float32,
                              query_positions=query_positions, key_positions=key_positions)
        elif causal:
            future = key_positions[None, :] > query_positions[:, None]
            bias = torch.zeros(future.shape, device=future.device).masked_fill(
                future, float("-inf"))[None, None]
        if self.window_size is not None:
            window = sliding_window_mask(0, self.window_size, query_positions.device,
                                         query_positions=query_positions,
                                         key_positions=key_positions)
            base = bias if bias is not None else torch.zeros(window.shape,
                                                             device=window.device)
            bias = base.masked_fill(window, float("-inf"))
        return bias


# p2p: ring attention -----------------------------------------------------------------------------


def _ring_exchange(send: torch.Tensor, recv: torch.Tensor, core: _ContextParallelCore):
    """Start sending `send` to the next rank of the ring and receiving `recv` from the
    previous one; returns the requests to wait on."""
    ranks, rank, size = core.cp_global_ranks, core.cp_rank, core.cp_size
    ops = [
        dist.P2POp(dist.isend, send, ranks[(rank + 1) % size], core.cp_group),
        dist.P2POp(dist.irecv, recv, ranks[(rank - 1) % size], core.cp_group),
    ]
    return dist.batch_isend_irecv(ops)


def _wait(requests) -> None:
    for request in requests:
        request.wait()


def _ring_block(step: int, rank: int, local_length: int):
    """Which rows of the local queries and of the visiting keys meet at ring `step`, and
    whether their block needs the causal mask.

    At step 0 a rank attends to its own keys (causal). Afterwards it holds rank
    j = rank - step's keys, chunks (j, 2N-1-j) against its queries' chunks (rank, 2N-1-rank):
    for j < rank every query sees the first half of the keys (the second lies in the future
    of all of them); for j > rank only the second half of the queries sees anything, and
    it sees every key. Half of each off-diagonal block is skipped either way.
    """
    half = local_length // 2
    everything = slice(0, local_length)
    if step == 0:
        return everything, everything, True
    if step <= rank:
        return everything, slice(0, half), False
    return slice(half, local_length), everything, False


def _finite(lse: torch.Tensor) -> torch.Tensor:
    # A row that sees no key (sliding window) has lse = -inf: its probabilities must be 0.
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


# Scores of at most this many elements exist at a time: a block's query rows are taken in
# tiles, so memory stays linear in the sequence (as in flash attention) instead of s^2.
_TILE_ELEMENTS = 1 << 20


def _tiles(q: torch.Tensor, rows: slice, cols: slice, causal: bool):
    """(query rows, key columns) of each tile of one block. In the causal (diagonal) block
    the local order is the position order, so keys after a tile's last query are skipped."""
    per_row = q.numel() // (q.shape[-2] * q.shape[-1]) * (cols.stop - cols.start)
    tile = max(1, _TILE_ELEMENTS // max(per_row, 1))
    for start in range(rows.start, rows.stop, tile):
        stop = min(start + tile, rows.stop)
        yield slice(start, stop), slice(cols.start, stop) if causal else cols


def _tile_scores(q, k, q_positions, k_positions, causal, core, mask=None):
    """Scores [b, ng, qpg, sq, sk] of one tile with its positional bias; `mask` (bool
    [b, 1, sq, sk], True = masked) adds an explicit attention mask."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * core.scale
    bias = core.positional_bias(q_positions, k_positions, causal)
    if bias is not None:
        # [1, nh or 1, sq, sk] -> [1, ng, qpg, sq, sk] against q [b, ng, qpg, sq, d].
        bias = bias.unflatten(1, (core.num_groups, -1) if bias.shape[1] > 1 else (1, 1))
        scores = scores + bias.to(scores.dtype)
    if mask is not None:
        scores = scores.masked_fill(mask.unsqueeze(1), float("-inf"))
    return scores


def _dropout_masks(dropout_p: float, rng_states):
    """Attention-dropout masks (keep / (1 - p)) for the tiles, drawn in tile order from the
    tracker's model-parallel stream as it was at `rng_states`; None without dropout.
    Backward draws them again from the same states instead of storing them."""
    if dropout_p == 0.0:
        return None
    tracker = get_rng_tracker()

    def draw(like: torch.Tensor) -> torch.Tensor:
        current = tracker.get_states()
        tracker.set_states(draw.states)
        with tracker.fork():
            scale = dropout_scale(like, dropout_p, like.dtype)
        draw.states = tracker.get_states()
        tracker.set_states(current)
        return scale

    draw.states = rng_states
    return draw


# The blocks' attention kernel: "auto" uses the fused one where `fused_blocks_supported`
# allows, "math" always the tiled matmul path (the fallback, kept tested).
BLOCK_KERNEL = "auto"
_FUSED_DTYPES = (torch.float32, torch.float64)


def fused_blocks_supported(core, q, dropout_p, mask) -> bool:
    """Whether a block can run on aten's fused CPU flash-attention op, which returns the
    log-sum-exp the merge needs (public SDPA does not): on CPU, fp32/fp64, without attention
    dropout (its masks must be redrawn in backward, which the op cannot), without an explicit
    mask or sliding window (rows that see no key need the math path's -inf handling).
    ALiBi enters as an additive bias; attention sinks merge after the blocks either way."""
    return (BLOCK_KERNEL == "auto" and q.device.type == "cpu" and q.dtype in _FUSED_DTYPES
            and dropout_p == 0.0 and mask is None and core.window_size is None
            and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"))


class _Blocks:
    """Attention of this rank's queries against key/value blocks of other ranks, one block
    at a time, tiled; shared by the ring and the all-gather functions.

    Tensors: q [b, ng, qpg, s, d]; a block's k/v [b, ng, 1, s, d] (fp32 or fp64). `out`
    and `lse` [b, ng, qpg, s] accumulate the merged result. Dropout of the probabilities
    applies per tile: the merge uses the lse of the undropped scores, and backward uses
    rowsum(dO * O) of the dropped output, as flash attention does.
    """

    def __init__(self, core, q, dropout_p, rng_states, mask=None):
        self.core, self.q, self.mask = core, q, mask
        self.local_length = q.shape[-2]
        self.q_positions = core.positions(self.local_length, q.device)
        self.dropout = _dropout_masks(dropout_p, rng_states)
        self.fused = fused_blocks_supported(core, q, dropout_p, mask)

    def _plan(self, owner: int):
        """The block of rank `owner`: its (query rows, key columns), key positions and
        whether it is causal."""
        core = self.core
        step = (core.cp_rank - owner) % core.cp_size
        k_positions = core.positions(self.local_length, self.q.device, owner)
        rows, cols, causal = _ring_block(step, core.cp_rank, self.local_length)
        return rows, cols, k_positions, causal

    def _fused_inputs(self, rows, cols, k, v, k_positions, causal):
        """q rows [b, nh, sr, d], the block's k / v [b, ng, sc, d] (the kernel maps query
        head i to key/value head i // (nh / ng), our grouping), the additive bias (ALiBi with
        its causal part) or None, and is_causal for the kernel."""
        b, ng, qpg, _, d = self.q.shape
        q = self.q[..., rows, :].reshape(b, ng * qpg, -1, d)
        k_heads, v_heads = (t[..., cols, :].squeeze(2) for t in (k, v))
        bias = None
        if self.core.alibi_slopes is not None:
            bias = self.core.positional_bias(self.q_positions[rows], k_positions[cols], causal)
            bias = bias.to(q.dtype)
        return q, k_heads, v_heads, bias, causal and bias is None

    def _scores(self, rows, cols, k, k_positions, causal):
        mask = None
        if self.mask is not None:
            mask = self.mask[:, :, rows][..., k_positions[cols]]
        return _tile_scores(self.q[..., rows, :], k[..., cols, :], self.q_positions[rows],
                            k_positions[cols], causal, self.core, mask)

    def forward(self, owner, k, v, out, lse) -> None:
        """Add the block of rank `owner` (its k, v) into `out` / `lse`."""
        block_rows, block_cols, k_positions, causal = self._plan(owner)
        if self.fused:
            q, k_heads, v_heads, bias, is_causal = self._fused_inputs(
                block_rows, block_cols, k, v, k_positions, causal)
            block_out, block_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, k_heads, v_heads, 0.0, is_causal, attn_mask=bias, scale=self.core.scale)
            self._merge(block_rows, block_out.reshape(self.q[..., block_rows, :].shape),
                        block_lse.reshape(lse[..., block_rows].shape).to(lse.dtype), out, lse)
            return
        for rows, cols in _tiles(self.q, block_rows, block_cols, causal):
            scores = self._scores(rows, cols, k, k_positions, causal)
            block_lse = torch.logsumexp(scores, dim=-1)
            probs = torch.exp(scores - _finite(block_lse)[..., None])
            if self.dropout is not None:
                probs = probs * self.dropout(probs)
            block_out = torch.matmul(probs, v[..., cols, :])
            self._merge(rows, block_out, block_lse, out, lse)

    @staticmethod
    def _merge(rows, block_out, block_lse, out, lse) -> None:
        """Merge by log-sum-exp: out = sum_blocks exp(lse_block - lse) * out_block."""
        old_lse = lse[..., rows]
        new_lse = torch.logaddexp(old_lse, block_lse)
        keep = torch.exp(old_lse - _finite(new_lse)).nan_to_num(0.0)
        take = torch.exp(block_lse - _finite(new_lse)).nan_to_num(0.0)
        out[..., rows, :] = out[..., rows, :] * keep[..., None] + block_out * take[..., None]
        lse[..., rows] = new_lse

    def finish_forward(self) -> None:
        if self.dropout is not None:
            # The stream moves on as if the masks had been drawn in one go, as SDPA's would.
            get_rng_tracker().set_states(self.dropout.states)

    def backward(self, owner, k, v, out, lse, grad_out, delta, dq):
        """Add the block's share of dq (in place); return its dk, dv. `out` / `lse` are
        the merged (final) ones: each block's probabilities are exp(scores - lse), so the
        kernel's backward of one block with them gives that block's exact share."""
        core = self.core
        dk, dv = torch.zeros_like(k), torch.zeros_like(v)
        block_rows, block_cols, k_positions, causal = self._plan(owner)
        if self.fused:
            q, k_heads, v_heads, bias, is_causal = self._fused_inputs(
                block_rows, block_cols, k, v, k_positions, causal)
            shape = q.shape
            dq_block, dk_block, dv_block = \
                torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                    grad_out[..., block_rows, :].reshape(shape), q, k_heads, v_heads,
                    out[..., block_rows, :].reshape(shape),
                    lse[..., block_rows].reshape(shape[:-1]).contiguous(), 0.0, is_causal,
                    attn_mask=bias, scale=core.scale)
            b, ng, qpg, _, d = self.q.shape
            dq[..., block_rows, :] += dq_block.reshape(b, ng, qpg, -1, d)
            dk[..., block_cols, :] += dk_block.unsqueeze(2)
            dv[..., block_cols, :] += dv_block.unsqueeze(2)
            return dk, dv
        for rows, cols in _tiles(self.q, block_rows, block_cols, causal):
            scores = self._scores(rows, cols, k, k_positions, causal)
            probs = torch.exp(scores - _finite(lse[..., rows])[..., None])
            d_out = grad_out[..., rows, :]
            d_probs = torch.matmul(d_out, v[..., cols, :].transpose(-1, -2))
            dropped = probs
            if self.dropout is not None:
                keep = self.dropout(probs)
                d_probs = d_probs * keep
                dropped = probs * keep
            d_scores = probs * (d_probs - delta[..., rows, None])
            dq[..., rows, :] += torch.matmul(d_scores, k[..., cols, :]) * core.scale
            q_rows = self.q[..., rows, :]
            dk[..., cols, :] += (torch.matmul(d_scores.transpose(-1, -2), q_rows)
                                 * core.scale).sum(2, True)
            dv[..., cols, :] += torch.matmul(dropped.transpose(-1, -2), d_out).sum(2, True)
        return dk, dv


def _merge_sinks(out, lse, sinks):
    """The attention sinks enter the merged result once, after every block: the sink is one
    more logit of the row's softmax with no value, so out scales by exp(lse - lse') with
    lse' = logaddexp(lse, sink), and backward's probabilities use lse'."""
    if sinks is None:
        return out, lse
    merged = torch.logaddexp(lse, sinks)
    return out * torch.exp(lse - merged)[..., None], merged


def _sinks_grad(sinks, lse, delta):
    """d loss / d sink [1, ng, qpg, 1]: the sink column's softmax backward, p_sink * (0 -
    rowsum(dO * O)) summed over this rank's rows (the CP ranks' shares add up in the grad
    reduction over data x context-parallel ranks)."""
    if sinks is None:
        return None
    return -(torch.exp(sinks - lse) * delta).sum(dim=(0, 3), keepdim=True)


def _begin(q, dropout_p):
    rng_states = get_rng_tracker().get_states() if dropout_p > 0.0 else None
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
    return rng_states, out, lse


class _RingAttentionFunction(torch.autograd.Function):
    """q [b, ng, qpg, s, d], k/v [b, ng, 1, s, d] (fp32, this rank's rows) -> out, same
    shape as q. Forward: KV travels the ring. Backward: KV travels again and dK/dV follow
    it, each rank adding its queries' share, until they are back with their owner."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, core, dropout_p):
        rng_states, out, lse = _begin(q, dropout_p)
        blocks = _Blocks(core, q, dropout_p, rng_states)
        size, rank = core.cp_size, core.cp_rank
        kv = torch.stack([k, v])
        for step in range(size):
            requests = []
            if step + 1 < size:
                incoming = torch.empty_like(kv)
                requests = _ring_exchange(kv, incoming, core)
            blocks.forward((rank - step) % size, kv[0], kv[1], out, lse)
            _wait(requests)
            if requests:
                kv = incoming
        blocks.finish_forward()
        out, lse = _merge_sinks(out, lse, sinks)
        ctx.core, ctx.dropout_p, ctx.rng_states = core, dropout_p, rng_states
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        core = ctx.core
        blocks = _Blocks(core, q, ctx.dropout_p, ctx.rng_states)
        size, rank = core.cp_size, core.cp_rank
        grad_out = grad_out.contiguous()
        delta = (grad_out * out).sum(-1)  # rowsum(dO * O): the softmax backward's correction
        dq = torch.zeros_like(q)
        kv = torch.stack([k, v])
        dkv_requests = []
        for step in range(size):
            kv_requests = []
            if step + 1 < size:
                incoming = torch.empty_like(kv)
                kv_requests = _ring_exchange(kv, incoming, core)
            dk, dv = blocks.backward((rank - step) % size, kv[0], kv[1], out, lse,
                                     grad_out, delta, dq)
            # The dK/dV partial sums of the visiting block arrive from the previous rank
            # (it added its share one step earlier); add ours and pass them on.
            _wait(dkv_requests)
            dkv = torch.stack([dk, dv]) if step == 0 else dkv_incoming + torch.stack([dk, dv])
            dkv_incoming = torch.empty_like(dkv)
            dkv_requests = _ring_exchange(dkv, dkv_incoming, core)
            _wait(kv_requests)
            if kv_requests:
                kv = incoming
        _wait(dkv_requests)
        # After N hops the partial sums are home: the owner's keys, every rank's share.
        return dq, dkv_incoming[0], dkv_incoming[1], _sinks_grad(sinks, lse, delta), None, None


class _AllGatherAttentionFunction(torch.autograd.Function):
    """Same contract as `_RingAttentionFunction` (plus an optional bool mask [b, 1, s/cp, s],
    keys in global order): all-gather K/V once, attend block by block (the same tiles and
    skipped halves as the ring); backward reduce-scatters dK/dV."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, core, dropout_p, mask):
        rng_states, out, lse = _begin(q, dropout_p)
        blocks = _Blocks(core, q, dropout_p, rng_states, mask)
        gathered = _gather_first_dim(torch.stack([k, v]).unsqueeze(0), core.cp_group)
        for owner in range(core.cp_size):
            blocks.forward(owner, gathered[owner][0], gathered[owner][1], out, lse)
        blocks.finish_forward()
        out, lse = _merge_sinks(out, lse, sinks)
        ctx.core, ctx.dropout_p, ctx.rng_states, ctx.mask = core, dropout_p, rng_states, mask
        ctx.save_for_backward(q, gathered, out, lse, sinks)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, gathered, out, lse, sinks = ctx.saved_tensors
        core = ctx.core
        blocks = _Blocks(core, q, ctx.dropout_p, ctx.rng_states, ctx.mask)
        grad_out = grad_out.contiguous()
        delta = (grad_out * out).sum(-1)
        dq = torch.zeros_like(q)
        d_gathered = torch.empty_like(gathered)
        for owner in range(core.cp_size):
            dk, dv = blocks.backward(owner, gathered[owner][0], gathered[owner][1], out, lse,
                                     grad_out, delta, dq)
            d_gathered[owner] = torch.stack([dk, dv])
        dkv = _reduce_scatter_first_dim(d_gathered, core.cp_group)[0]
        return dq, dkv[0], dkv[1], _sinks_grad(sinks, lse, delta), None, None, None


class RingAttention(_ContextParallelCore):
    """Ring attention over the context-parallel group (`--cp-comm-type p2p`).

    Per block the scores are formed in fp32 with matmul + logsumexp (SDPA does not return
    the log-sum-exp the merge needs); the backward recomputes each block from the saved
    q/k/v/output/lse, as flash attention does; attention dropout masks are drawn again
    from the saved RNG state rather than stored. Computes in fp32 (fp64 for fp64 inputs).
    """

    def forward(self, query, key, value, attention_mask=None):
        if isinstance(attention_mask, KVCacheContext):
            return self.attend_cached(query, key, value, attention_mask)
        if attention_mask is not None:
            raise ConfigError(
                "--cp-comm-type p2p attends with causal masks built from positions; an "
                "explicit attention mask (--reset-attention-mask, padding) needs "
                "--cp-comm-type all_gather"
            )
        return _attend(self, _RingAttentionFunction, query, key, value, None)


def _attend(core, function, query, key, value, attention_mask):
    """[s, b, n, d] in, [s, b, nh * d] out, around the block functions' layout."""
    s, b = query.shape[:2]
    qpg = core.num_heads // core.num_groups
    dtype = torch.promote_types(query.dtype, torch.float32)
    # [s, b, n, d] -> [b, ng, qpg, s, d]: a query group's heads share one key/value head.
    q = query.to(dtype).permute(1, 2, 0, 3).reshape(b, core.num_groups, qpg, s, core.head_dim)
    k = key.to(dtype).permute(1, 2, 0, 3).unsqueeze(2)
    v = value.to(dtype).permute(1, 2, 0, 3).unsqueeze(2)
    dropout_p = core.attention_dropout if core.training else 0.0
    extra = () if function is _RingAttentionFunction else (attention_mask,)
    sinks = None
    if core.softmax_offset is not None:  # [nh] -> [1, ng, qpg, 1], beside lse [b, ng, qpg, s]
        sinks = core.softmax_offset.to(dtype).view(1, core.num_groups, qpg, 1)
    out = function.apply(q.contiguous(), k.contiguous(), v.contiguous(), sinks, core, dropout_p,
                         *extra)
    out = out.reshape(b, core.num_heads, s, core.head_dim).to(query.dtype)
    return out.permute(2, 0, 1, 3).reshape(s, b, core.num_heads * core.head_dim)


# all_gather: gather K and V ----------------------------------------------------------------------


class AllGatherAttention(_ContextParallelCore):
    """Local queries against the keys/values of the whole sequence (`--cp-comm-type
    all_gather`). Only the ng key/value heads are gathered, once per layer (and kept for
    backward, which reduce-scatters dK/dV); the attention itself is the ring's tiled block
    computation, so memory stays linear in the sequence.

    attention_mask, if given: bool [b, 1, s/cp, s] (queries split, keys in global order),
    True = masked, as `get_batch_on_this_cp_rank` leaves it; or a `PackedSequence`: then
    each local query run attends only to the gathered keys of its own document
    (`_attend_packed`).
    """

    def forward(self, query, key, value, attention_mask=None):
        if isinstance(attention_mask, KVCacheContext):
            return self.attend_cached(query, key, value, attention_mask)
        if isinstance(attention_mask, PackedSequence):
            return _attend_packed(self, query, key, value, attention_mask)
        return _attend(self, _AllGatherAttentionFunction, query, key, value, attention_mask)


def _attend_packed(core, query, key, value, packed: PackedSequence):
    """Packed rows under context parallelism: [s/cp, b, n, d] in, [s/cp, b, nh * d] out.
    Keys and values of the whole rows are all-gathered (backward reduce-scatters their
    gradients) and put in row order; the "segments" engine then attends every local run of
    queries to its document's keys up to the run's end, so no work crosses a document."""
    if core.window_size is not None or core.alibi_slopes is not None \
            or core.softmax_offset is not None:
        raise ConfigError(
            "packed sequences (--sft, --reset-attention-mask) under context parallelism "
            "attend without sliding windows, ALiBi or attention sinks; drop those or use "
            "--context-parallel-size 1")
    s_local, b = query.shape[:2]
    rows = packed.document_ids.shape[1]
    # Gathered rows come rank by rank; `rank_indices` says where each sits in its row.
    row_of = torch.arange(b, device=query.device).view(1, b, 1) * rows
    place = (packed.rank_indices.to(query.device) + row_of).permute(1, 0, 2).reshape(-1)
    to_row_order = torch.argsort(place)

    def whole_rows(x):
        gathered = gather_from_sequence_parallel_region(x, core.cp_group, True)
        gathered = gathered.view(core.cp_size, s_local, b, *x.shape[2:]).permute(2, 0, 1, 3, 4)
        return gathered.reshape(b * core.cp_size * s_local, *x.shape[2:]).index_select(
            0, to_row_order)

    flat_q = query.transpose(0, 1).reshape(b * s_local, *query.shape[2:])
    dropout_p = core.attention_dropout if core.training else 0.0
    with get_rng_tracker().fork() if dropout_p > 0.0 else contextlib.nullcontext():
        out = packed.attend_segments(flat_q, whole_rows(key), whole_rows(value), dropout_p,
                                     core.scale)
    return out.view(b, s_local, -1).transpose(0, 1)


# a2a: DeepSpeed-Ulysses --------------------------------------------------------------------------


def _sequence_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """[s/N, b, n, d] sequence-sharded -> [s, b, n/N, d] head-sharded (rows in rank order)."""
    size = group_size(group)
    s, b, n, d = x.shape
    parts = x.reshape(s, b, size, n // size, d).permute(2, 0, 1, 3, 4)
    return _all_to_all_first_dim(parts, group).reshape(size * s, b, n // size, d)


def _heads_to_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """Inverse of `_sequence_to_heads`: [s, b, n/N, d] -> [s/N, b, n, d]."""
    size = group_size(group)
    s, b, n, d = x.shape
    parts = _all_to_all_first_dim(x.reshape(size, s // size, b, n, d), group)
    return parts.permute(1, 2, 0, 3, 4).reshape(s // size, b, size * n, d)


class _SequenceToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _sequence_to_heads(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_sequence(grad, ctx.group), None


class _HeadsToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _heads_to_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _sequence_to_heads(grad, ctx.group), None


def sequence_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """Differentiable [s/N, b, n, d] sequence-sharded -> [s, b, n/N, d] head-sharded, rows in
    rank order (each rank's local sequence, then the next's: `split.gathered_order`)."""
    return _SequenceToHeads.apply(x, group)


def heads_to_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """Differentiable inverse of `sequence_to_heads`: [s, b, n/N, d] -> [s/N, b, n, d]."""
    return _HeadsToSequence.apply(x, group)


class AllToAllAttention(_ContextParallelCore):
    """DeepSpeed-Ulysses (`--cp-comm-type a2a`): trade the sequence split for a head split,
    run `DotProductAttention` over the whole sequence for nh/N heads (and ng/N query groups),
    trade back. The query groups of this TP rank must divide by N (`TransformerConfig.
    validate`)."""

    def __init__(self, config, state, layer_number=1, device=None, softmax_scale=None):
        super().__init__(config, state, layer_number, device, softmax_scale)
        heads = self.num_heads // self.cp_size
        # The sinks are this module's (same name as without CP); the inner attention takes
        # this CP rank's share of them each forward.
        self.inner = DotProductAttention(config.replace(softmax_type="vanilla"), state,
                                         layer_number, device, softmax_scale)
        self.head_share = slice(self.cp_rank * heads, (self.cp_rank + 1) * heads)
        # The inner attention sees this CP rank's slice of the TP rank's heads.
        self.inner.num_heads_per_partition = heads
        if self.inner.use_alibi:
            start = self.cp_rank * heads
            self.inner.alibi_slopes = self.inner.alibi_slopes[start : start + heads]

    def forward(self, query, key, value, attention_mask=None):
        if isinstance(attention_mask, KVCacheContext):
            return self.attend_cached(query, key, value, attention_mask)
        if attention_mask is not None:
            raise ConfigError(
                "--cp-comm-type a2a attends with causal masks; an explicit attention mask "
                "(--reset-attention-mask, padding) needs --cp-comm-type all_gather"
            )
        group = self.cp_group
        q, k, v = (sequence_to_heads(t, group) for t in (query, key, value))
        order = gathered_order(q.shape[0], self.cp_size, q.device)
        to_global = torch.argsort(order)
        q, k, v = (t.index_select(0, to_global) for t in (q, k, v))
        sinks = None if self.softmax_offset is None else self.softmax_offset[self.head_share]
        context = self.inner(q, k, v, None, sinks)  # [s, b, nh/N * d], causal, whole sequence
        context = context.index_select(0, order)
        s, b = context.shape[:2]
        context = context.reshape(s, b, self.num_heads // self.cp_size, self.head_dim)
        context = heads_to_sequence(context, group)
        return context.reshape(context.shape[0], b, self.num_heads * self.head_dim)


_CORE_ATTENTION = {"p2p": RingAttention, "all_gather": AllGatherAttention,
                   "a2a": AllToAllAttention}
assert tuple(_CORE_ATTENTION) == CP_COMM_TYPES


def core_attention_spec(config: TransformerConfig, state) -> ModuleSpec:
    """The core attention the layout asks for: `DotProductAttention` without context
    parallelism, else the `config.cp_comm_type` module (checked by `TransformerConfig.validate`)."""
    if state.cp_size == 1:
        return ModuleSpec(DotProductAttention)
    return ModuleSpec(_CORE_ATTENTION[config.cp_comm_type])


__all__ = [
    "CP_COMM_TYPES",
    "RingAttention",
    "AllGatherAttention",
    "AllToAllAttention",
    "core_attention_spec",
    "sequence_to_heads",
    "heads_to_sequence",
]
