"""Context parallelism: each rank of the cp group holds 1/cp of every sequence.

* `split.py` — the load-balanced split (chunks i and 2N-1-i of 2N), global positions, the
  batch split the entry scripts and `smp.transform` use.
* `attention.py` — core attention across the group (`--cp-comm-type` p2p / all_gather / a2a),
  built through the layer spec (`core_attention_spec`).
* `loss.py` — the loss over the whole sequence from each rank's share of it.

Everything else in a layer (linears, norms, MLP) is per token and needs nothing; grads are
reduced over the dp x cp group by `DistributedDataParallel`.
"""
from megatron_smp.context_parallel.attention import (
    CP_COMM_TYPES,
    AllGatherAttention,
    AllToAllAttention,
    RingAttention,
    core_attention_spec,
)
from megatron_smp.context_parallel.loss import masked_mean_over_context_parallel
from megatron_smp.context_parallel.split import (
    check_divisible,
    gather_from_context_parallel,
    get_batch_on_this_cp_rank,
    local_positions,
    split_for_context_parallel,
)

__all__ = [
    "CP_COMM_TYPES",
    "AllGatherAttention",
    "AllToAllAttention",
    "RingAttention",
    "core_attention_spec",
    "masked_mean_over_context_parallel",
    "check_divisible",
    "gather_from_context_parallel",
    "get_batch_on_this_cp_rank",
    "local_positions",
    "split_for_context_parallel",
]
