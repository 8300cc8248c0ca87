"""Context-parallel core attention equals the single-rank attention: output and the grads of
query, key and value, for every comm type, at CP=2 and CP=4, MHA and GQA (and with ALiBi or a
sliding window, whose masks come from global positions; or with attention sinks, whose grads
of the CP ranks add up to the single-rank grad); and all_gather over packed rows
(`PackedSequence`, documents split load-balanced each or rows split whole) equals the
single-rank attention under the dense document mask. Given a KV cache (an inference step
run whole on each CP rank, as train_rl.py's engine does) every core hands it what the
single-rank attention does."""
import math

import pytest
import torch

from megatron_smp.testing import run_distributed

SEQ, BATCH, HEAD_DIM = 32, 2, 8
# (name, heads, query groups, extra TransformerConfig fields)
CASES = [
    ("mha", 4, 4, {}),
    ("gqa", 8, 4, {}),
    ("alibi", 4, 4, {"position_embedding_type": "alibi"}),
    ("window", 4, 2, {"window_size": (5, 0)}),
    # gpt-oss: learned sinks (enter the merge once) with a window; GQA.
    ("sinks", 8, 4, {"softmax_type": "learnable", "window_size": (5, 0)}),
    # Sinks without a window: the ring's blocks run on the fused kernel.
    ("sinks_full", 8, 4, {"softmax_type": "learnable"}),
]
# Cases whose p2p / all_gather blocks run on the fused CPU kernel (returns the log-sum-exp);
# the others (sliding window) use the tiled math path.
FUSED_CASES = {"mha", "gqa", "alibi", "sinks_full"}
COMM_TYPES = ["p2p", "all_gather", "a2a"]


def _config(heads, groups, comm_type, extra):
    from megatron_smp.config import TransformerConfig

    return TransformerConfig(
        num_layers=1, hidden_size=heads * HEAD_DIM, num_attention_heads=heads,
        num_query_groups=groups, vocab_size=16, max_position_embeddings=SEQ,
        attention_dropout=0.0, cp_comm_type=comm_type, **extra,
    )


def _inputs(heads, groups):
    generator = torch.Generator().manual_seed(heads * 10 + groups)
    q = torch.randn(SEQ, BATCH, heads, HEAD_DIM, generator=generator)
    k = torch.randn(SEQ, BATCH, groups, HEAD_DIM, generator=generator)
    v = torch.randn(SEQ, BATCH, groups, HEAD_DIM, generator=generator)
    grad = torch.randn(SEQ, BATCH, heads * HEAD_DIM, generator=generator)
    return q, k, v, grad


def _run(module, q, k, v, grad):
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = module(q, k, v)
    out.backward(grad)
    return out.detach(), q.grad, k.grad, v.grad


def _max_diffs(rank, world_size, kernel="auto"):
    from megatron_smp.config import ParallelConfig
    from megatron_smp.context_parallel import core_attention_spec, split_for_context_parallel
    from megatron_smp.parallel_state import build_parallel_state
    from megatron_smp.transformer.attention import DotProductAttention
    from megatron_smp.transformer.spec import build_module

    from megatron_smp.context_parallel import attention

    # Small tiles, so the ring's blocks are taken in several query tiles (and the causal
    # block skips the keys after each tile).
    attention._TILE_ELEMENTS = 1024
    attention.BLOCK_KERNEL = kernel
    fused_calls = []
    supported = attention.fused_blocks_supported

    def recording(*args):
        fused_calls.append(supported(*args))
        return fused_calls[-1]

    attention.fused_blocks_supported = recording
    state = build_parallel_state(ParallelConfig(context_parallel_size=world_size))
    diffs = {}
    for name, heads, groups, extra in CASES:
        for comm_type in COMM_TYPES:
            if comm_type == "a2a" and groups % world_size:
                continue
            config = _config(heads, groups, comm_type, extra)
            q, k, v, grad = _inputs(heads, groups)
            single = DotProductAttention(config, _NoTP(state))
            reference = _run(single, q, k, v, grad)
            module = build_module(core_attention_spec(config, state), config, state)
            assert type(module).__name__ != "DotProductAttention"
            local = [split_for_context_parallel(t, 0, world_size, rank) for t in (q, k, v, grad)]
            if single.softmax_offset is not None:
                with torch.no_grad():
                    module.softmax_offset.copy_(single.softmax_offset)
            fused_calls.clear()
            got = _run(module, *local)
            if comm_type != "a2a":
                # Which kernel the blocks ran on, forward and backward.
                assert fused_calls and all(
                    fused_calls[0] == f for f in fused_calls), fused_calls
                assert fused_calls[0] == (kernel == "auto" and name in FUSED_CASES), name
            expected = [split_for_context_parallel(t, 0, world_size, rank) for t in reference]
            if single.softmax_offset is not None:
                sink_grad = module.softmax_offset.grad.clone()
                torch.distributed.all_reduce(sink_grad, group=state.cp_group)
                got, expected = got + (sink_grad,), expected + [single.softmax_offset.grad]
            diffs[(name, comm_type)] = max(
                float((a - b).abs().max()) for a, b in zip(got, expected)
            )
            # An inference step over a KV cache (train_rl.py's engine): the core hands the
            # cache whole requests with the single-rank attention's arguments.
            step = [t[:, :1] for t in (q, k, v)]
            cached, plain = _RecordingCache(), _RecordingCache()
            out = module(*step, cached)
            assert torch.equal(out, single(*step, plain)), (name, comm_type)
            assert len(cached.calls) == 1 and _same(cached.calls[0], plain.calls[0]), (
                name, comm_type)
    diffs.update(_packed_diffs(state, rank, world_size))
    return diffs


def _same(a, b):
    return all(x is y or (torch.is_tensor(x) and torch.equal(x, y)) or x == y
               for x, y in zip(a, b))


def _recording_cache_base():
    from megatron_smp.transformer.kv_cache import KVCacheContext

    return KVCacheContext


class _RecordingCache(_recording_cache_base()):
    """A KV cache that records what the layer hands it and returns the queries."""

    def __init__(self):
        self.calls = []

    def attend(self, layer_number, query, key, value, scale=None, window_size=None, sinks=None,
               alibi_slopes=None):
        # None: the attention's default, 1 / sqrt(d) (what the context-parallel cores hold).
        scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
        self.calls.append((layer_number, query, key, value, scale, window_size, sinks,
                           alibi_slopes))
        return query


# Packed rows (document lengths per row): every length divisible by 2 x CP (each document is
# split load-balanced on its own), or not (the row is split as a whole).
PACKED = {"packed_documents": [[16, 8, 8], [24, 8]], "packed_rows": [[5, 11, 16], [20, 12]]}


def _packed_diffs(state, rank, world_size):
    """All-gather attention over a PackedSequence equals the single rank's attention under
    the dense document mask, on this rank's tokens (output and q/k/v grads)."""
    from megatron_smp.context_parallel.attention import AllGatherAttention
    from megatron_smp.context_parallel.split import packed_rank_indices
    from megatron_smp.transformer.attention import DotProductAttention
    from megatron_smp.transformer.packed import PackedSequence

    diffs = {}
    for name, rows in PACKED.items():
        documents = torch.tensor([[d for d, n in enumerate(row) for _ in range(n)]
                                  for row in rows])
        config = _config(8, 4, "all_gather", {})
        q, k, v, grad = _inputs(8, 4)
        single = DotProductAttention(config, _NoTP(state))
        q1, k1, v1 = (t.clone().requires_grad_(True) for t in (q, k, v))
        single(q1, k1, v1, PackedSequence(documents).dense_mask()).backward(grad)
        reference = single(q, k, v, PackedSequence(documents).dense_mask())
        indices = packed_rank_indices(documents, world_size)
        mine = indices[rank]  # [b, s / cp]

        def local(t):  # [s, b, ...] -> this rank's tokens [s / cp, b, ...]
            return torch.stack([t[mine[b], b] for b in range(BATCH)], dim=1)

        module = AllGatherAttention(config, state)
        packed = PackedSequence(documents, indices, rank)
        ql, kl, vl = (local(t).clone().requires_grad_(True) for t in (q, k, v))
        out = module(ql, kl, vl, packed)
        out.backward(local(grad))
        got = (out.detach(), ql.grad, kl.grad, vl.grad)
        expected = (local(reference.detach()), local(q1.grad), local(k1.grad), local(v1.grad))
        diffs[(name, "all_gather")] = max(float((a - b).abs().max())
                                          for a, b in zip(got, expected))
    return diffs


class _NoTP:
    """The reference runs every head on one rank: a state whose tp group is the caller's
    (size-one) tp group."""

    def __init__(self, state):
        self.tp_group = state.tp_group


@pytest.mark.parametrize("world_size,kernel", [(2, "auto"), (4, "auto"), (2, "math")])
def test_context_parallel_attention_matches_single_rank(world_size, kernel):
    """Fused blocks where supported ("auto"), and the math fallback for every case."""
    results = run_distributed(_max_diffs, world_size, args=(kernel,), timeout=300)
    for rank_diffs in results:
        assert len(rank_diffs) >= 10
        for case, diff in rank_diffs.items():
            assert diff < 1e-5, (world_size, case, diff)
    print({case: max(r[case] for r in results) for case in results[0]})


def _ring_dropout_checks(rank, world_size, module_name):
    """fp64 ring / all-gather attention with attention dropout 0.3 and attention sinks: with
    the RNG state rewound before each call the function is deterministic, so its custom
    backward must match central differences along a random direction, for q, k, v and the
    sinks (the same direction on every rank: one parameter)."""
    from megatron_smp.config import ParallelConfig
    from megatron_smp.context_parallel import attention, split_for_context_parallel
    from megatron_smp.parallel_state import build_parallel_state
    from megatron_smp.tensor_parallel.random import get_rng_tracker, model_parallel_seed

    state = build_parallel_state(ParallelConfig(context_parallel_size=world_size))
    model_parallel_seed(5, state)
    config = _config(8, 4, "p2p", {"softmax_type": "learnable"})
    config.attention_dropout = 0.3
    ring = getattr(attention, module_name)(config, state).train().double()
    inputs = [split_for_context_parallel(t, 0, world_size, rank).double()
              for t in _inputs(8, 4)]
    q, k, v, grad = inputs
    start = get_rng_tracker().get_states()

    def f(q, k, v):
        get_rng_tracker().set_states(start)
        return (ring(q, k, v) * grad).sum()

    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    f(*leaves).backward()
    generator = torch.Generator().manual_seed(rank)
    errors = []
    for index in range(3):
        direction = torch.randn(inputs[index].shape, generator=generator, dtype=torch.float64)
        eps = 1e-6
        plus = [t.clone() for t in (q, k, v)]
        minus = [t.clone() for t in (q, k, v)]
        plus[index] += eps * direction
        minus[index] += eps * direction * -1
        # The directional derivative of the sum over all ranks' outputs.
        numeric = torch.stack([f(*plus) - f(*minus)]) / (2 * eps)
        analytic = torch.stack([(leaves[index].grad * direction).sum()])
        for t in (numeric, analytic):
            torch.distributed.all_reduce(t, group=state.cp_group)
        errors.append(float((numeric - analytic).abs().max() / analytic.abs().max()))
    sinks = ring.softmax_offset
    direction = torch.randn(sinks.shape, generator=torch.Generator().manual_seed(9),
                            dtype=torch.float64)
    values = []
    with torch.no_grad():
        for sign in (1, -1):
            sinks.add_(sign * 1e-6 * direction)
            values.append(f(q, k, v))
            sinks.sub_(sign * 1e-6 * direction)
    numeric = torch.stack([(values[0] - values[1]) / 2e-6])
    analytic = torch.stack([(sinks.grad * direction).sum()])
    for t in (numeric, analytic):
        torch.distributed.all_reduce(t, group=state.cp_group)
    errors.append(float((numeric - analytic).abs().max() / analytic.abs().max()))
    with torch.no_grad():
        get_rng_tracker().set_states(start)
        dropped = ring(q, k, v)
        ring.eval()
        undropped = ring(q, k, v)
    return errors, float((dropped - undropped).abs().max())


@pytest.mark.parametrize("module_name", ["RingAttention", "AllGatherAttention"])
def test_attention_dropout_backward_matches_finite_differences(module_name):
    for errors, dropout_effect in run_distributed(_ring_dropout_checks, 2, args=(module_name,),
                                                  timeout=300):
        assert max(errors) < 1e-6, errors
        assert dropout_effect > 0.1  # the masks did drop something
