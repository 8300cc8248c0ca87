"""Token dispatchers: bring each token to the ranks holding its experts, and back.

Both take this rank's tokens [T, h] (its sequence shard under sequence parallelism), the
router's probs [T, E] and routing map [T, E], and give the local experts their input sorted
by local expert; `combine` takes the experts' output (tensor-parallel partial sums) and
returns [T, h]. "TP" below is the experts' tensor-parallel group (`state.etp_group`: the TP
group, or --expert-tensor-parallel-size ranks of Megatron's expert grid); every rank of a
stage holds tokens of its own, so the scheme is the same whichever ranks form it. Every communication is an autograd pair (all-gather <-> reduce-scatter,
all-to-all <-> all-to-all with the splits swapped), so backward retraces the same path.

* allgather: all-gather the tokens over the TP group, then over the EP group; each rank
  runs its experts on the tokens routed to them; reduce-scatter over EP, then TP, sums the
  experts' (and the TP ranks') contributions back into each token's own rank.
* alltoall: all-gather over TP only (the TP ranks of an expert compute on the same tokens);
  sort the tokens by expert, all-to-all over EP with per-rank counts (exchanged first), so
  each rank receives only tokens for its experts; the reverse all-to-all brings the outputs
  home, where they are weighted by their probs and summed per token; reduce-scatter over TP.
* flex (Megatron-LM main's MoEFlexTokenDispatcher): one all-to-all over the tp x ep group
  instead of a TP all-gather and an EP all-to-all: each rank sends its own tokens straight to
  every TP rank of the EP rank holding their experts (the routing map repeated over TP), and
  gets back each TP rank's partial output, summed per row before the per-token sum. The
  experts receive the same rows in the same order as with alltoall (source EP rank, its TP
  ranks' tokens in turn); only the sums over TP and over a token's experts swap places.
  Megatron-LM's DeepEP / HybridEP / NCCL-EP backends are kernels fusing these steps on NVIDIA
  GPUs; here the same exchange runs through torch.distributed.

The experts compute one contiguous block per local expert; the routing weights multiply the
outputs before the per-token sum, in the token's own rank (alltoall) or the expert's
(allgather).
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron_smp.tensor_parallel.mappings import (
    _gather_first_dim,
    all_to_all,
    gather_from_sequence_parallel_region,
    group_size,
    reduce_scatter_to_sequence_parallel_region,
)


def permute(tokens: torch.Tensor, routing_map: torch.Tensor):
    """Rows of `tokens` [T, h] for each (expert, token) pair of `routing_map` [T, E], sorted
    by expert then token -> (rows [N, h], token_index [N], expert_index [N])."""
    expert_index, token_index = routing_map.t().nonzero(as_tuple=True)
    return tokens.index_select(0, token_index), token_index, expert_index


def unpermute(rows: torch.Tensor, token_index: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Sum rows [N, h] into their tokens: [num_tokens, h] (zero for tokens with no row)."""
    out = rows.new_zeros((num_tokens,) + tuple(rows.shape[1:]))
    return out.index_add(0, token_index, rows)


def _gather_tokens(tokens, probs, routing_map, groups: Sequence):
    """All-gather tokens and probs (autograd: backward reduce-scatters, because every rank's
    experts add their part of each token's gradient) and the map over `groups` in turn."""
    for group in groups:
        if group_size(group) == 1:
            continue
        tokens = gather_from_sequence_parallel_region(tokens, group, True)
        probs = gather_from_sequence_parallel_region(probs, group, True)
        routing_map = _gather_first_dim(routing_map.to(torch.uint8), group).bool()
    return tokens, probs, routing_map


def _reduce_scatter_tokens(output: torch.Tensor, groups: Sequence) -> torch.Tensor:
    for group in groups:
        output = reduce_scatter_to_sequence_parallel_region(output, group)
    return output


def _by_expert(received: torch.Tensor, sizes: List[List[int]]) -> torch.Tensor:
    """Rows received as blocks [source][expert] (sizes) -> blocks [expert][source]."""
    chunks = torch.split(received, [count for row in sizes for count in row])
    sources, local = len(sizes), len(sizes[0])
    return torch.cat([chunks[source * local + expert]
                      for expert in range(local) for source in range(sources)], dim=0)


def _by_source(rows: torch.Tensor, sizes: List[List[int]]) -> torch.Tensor:
    """The inverse of `_by_expert`: blocks [expert][source] -> [source][expert]."""
    sources, local = len(sizes), len(sizes[0])
    chunks = torch.split(rows, [sizes[source][expert]
                                for expert in range(local) for source in range(sources)])
    return torch.cat([chunks[expert * sources + source]
                      for source in range(sources) for expert in range(local)], dim=0)


class MoEAllGatherTokenDispatcher:
    """See the module docstring. `local_expert_indices`: the global indices of this rank's
    experts (consecutive)."""

    def __init__(self, num_experts: int, local_expert_indices: Sequence[int], state) -> None:
        self.num_experts = num_experts
        self.local_start = local_expert_indices[0]
        self.local_end = local_expert_indices[-1] + 1
        self.groups = (state.etp_group, state.ep_group)

    def dispatch(self, tokens: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor
                 ) -> Tuple[torch.Tensor, List[int]]:
        """-> (expert input [N, h] sorted by local expert, tokens per local expert)."""
        tokens, probs, routing_map = _gather_tokens(tokens, probs, routing_map, self.groups)
        local_map = routing_map[:, self.local_start:self.local_end]
        rows, token_index, expert_index = permute(tokens, local_map)
        local_probs = probs[:, self.local_start:self.local_end]
        self._row_probs = local_probs[token_index, expert_index]
        self._token_index = token_index
        self._num_tokens = tokens.shape[0]
        return rows, local_map.sum(dim=0).tolist()

    def combine(self, expert_output: torch.Tensor) -> torch.Tensor:
        weighted = expert_output * self._row_probs.unsqueeze(-1).to(expert_output.dtype)
        output = unpermute(weighted, self._token_index, self._num_tokens)
        self._row_probs = self._token_index = None
        return _reduce_scatter_tokens(output, tuple(reversed(self.groups)))


class MoEAlltoAllTokenDispatcher:
    """See the module docstring."""

    def __init__(self, num_experts: int, local_expert_indices: Sequence[int], state) -> None:
        self.num_experts = num_experts
        self.num_local_experts = len(local_expert_indices)
        self.tp_group = state.etp_group
        self.ep_group = state.ep_group
        self.ep_size = group_size(state.ep_group)

    def dispatch(self, tokens: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor
                 ) -> Tuple[torch.Tensor, List[int]]:
        """-> (expert input [N, h] sorted by local expert, tokens per local expert)."""
        tokens, probs, routing_map = _gather_tokens(tokens, probs, routing_map, (self.tp_group,))
        rows, token_index, expert_index = permute(tokens, routing_map)
        self._row_probs = probs[token_index, expert_index]
        self._token_index = token_index
        self._num_tokens = tokens.shape[0]
        # [ep, local experts]: rows this rank sends to each expert of each EP rank.
        send_counts = routing_map.sum(dim=0).view(self.ep_size, self.num_local_experts)
        if self.ep_size == 1:
            self._chunk_sizes = None
            return rows, send_counts[0].tolist()
        receive_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(receive_counts, send_counts.contiguous(), group=self.ep_group)
        # Every count the all-to-alls and the experts need, read on the host at once: one
        # device sync per dispatch (Megatron's one copy of its counts), not one per list.
        local = self.num_local_experts
        counts = torch.cat([send_counts.flatten(), receive_counts.flatten()]).tolist()
        sent, received_counts = counts[:len(counts) // 2], counts[len(counts) // 2:]
        # [source][expert]: rows received from each EP rank for each local expert.
        sizes = [received_counts[source * local:(source + 1) * local]
                 for source in range(self.ep_size)]
        self._input_splits = [sum(sent[rank * local:(rank + 1) * local])
                              for rank in range(self.ep_size)]
        self._output_splits = [sum(row) for row in sizes]
        received = all_to_all(rows, self.ep_group, self._output_splits, self._input_splits)
        # Received blocks are (source rank, expert); the experts want (expert, source rank).
        self._chunk_sizes = sizes
        tokens_per_expert = [sum(sizes[source][expert] for source in range(self.ep_size))
                             for expert in range(local)]
        return _by_expert(received, sizes), tokens_per_expert

    def combine(self, expert_output: torch.Tensor) -> torch.Tensor:
        if self._chunk_sizes is not None:
            expert_output = all_to_all(_by_source(expert_output, self._chunk_sizes),
                                       self.ep_group, self._input_splits, self._output_splits)
        weighted = expert_output * self._row_probs.unsqueeze(-1).to(expert_output.dtype)
        output = unpermute(weighted, self._token_index, self._num_tokens)
        self._row_probs = self._token_index = self._chunk_sizes = None
        return _reduce_scatter_tokens(output, (self.tp_group,))


class MoEFlexTokenDispatcher:
    """See the module docstring (flex): one all-to-all over `state.tp_ep_group`, whose
    member at position ep_rank * tp_size + tp_rank holds experts
    ep_rank * E/ep ... (ep_rank + 1) * E/ep - 1 (split over TP). `backend` is Megatron's
    --moe-flex-dispatcher-backend: which fused kernel would run the exchange."""

    def __init__(self, num_experts: int, local_expert_indices: Sequence[int], state,
                 backend: str = "deepep") -> None:
        self.num_local_experts = len(local_expert_indices)
        self.tp_size, self.ep_size = state.etp_size, state.ep_size
        self.group = state.tp_ep_group
        self.backend = backend

    def dispatch(self, tokens: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor
                 ) -> Tuple[torch.Tensor, List[int]]:
        """-> (expert input [N, h] sorted by local expert, tokens per local expert)."""
        rows, token_index, expert_index = permute(tokens, routing_map)
        self._row_probs = probs[token_index, expert_index]
        self._token_index = token_index
        self._num_tokens = tokens.shape[0]
        local, tp, ep = self.num_local_experts, self.tp_size, self.ep_size
        # [ep, local]: rows for each expert; every TP rank of an EP rank gets that EP block.
        per_expert = routing_map.sum(dim=0).view(ep, local)
        send_counts = per_expert.unsqueeze(1).expand(ep, tp, local).reshape(ep * tp, local)
        if ep * tp == 1:
            self._sizes = None
            return rows, send_counts[0].tolist()
        receive_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(receive_counts, send_counts.contiguous(), group=self.group)
        counts = torch.cat([per_expert.sum(dim=1), receive_counts.flatten()]).tolist()
        self._block_sizes, received_counts = counts[:ep], counts[ep:]
        # [source][expert]: rows received from each tp x ep member for each local expert.
        self._sizes = [received_counts[source * local:(source + 1) * local]
                       for source in range(ep * tp)]
        blocks = torch.split(rows, self._block_sizes)
        send = torch.cat([blocks[rank] for rank in range(ep) for _ in range(tp)], dim=0)
        self._input_splits = [self._block_sizes[rank] for rank in range(ep) for _ in range(tp)]
        self._output_splits = [sum(row) for row in self._sizes]
        received = all_to_all(send, self.group, self._output_splits, self._input_splits)
        tokens_per_expert = [sum(row[expert] for row in self._sizes) for expert in range(local)]
        return _by_expert(received, self._sizes), tokens_per_expert

    def combine(self, expert_output: torch.Tensor) -> torch.Tensor:
        if self._sizes is not None:
            returned = all_to_all(_by_source(expert_output, self._sizes), self.group,
                                  self._input_splits, self._output_splits)
            # Each EP block came back from its TP ranks: sum their partial outputs.
            tp = self.tp_size
            blocks = torch.split(returned, [size * tp for size in self._block_sizes])
            expert_output = torch.cat(
                [block.view(tp, size, *block.shape[1:]).sum(dim=0)
                 for block, size in zip(blocks, self._block_sizes)], dim=0)
        weighted = expert_output * self._row_probs.unsqueeze(-1).to(expert_output.dtype)
        output = unpermute(weighted, self._token_index, self._num_tokens)
        self._row_probs = self._token_index = self._sizes = None
        return output


def build_token_dispatcher(dispatcher_type: str, num_experts: int,
                           local_expert_indices: Sequence[int], state,
                           flex_backend: str = "deepep"):
    """The dispatcher named by --moe-token-dispatcher-type (validated by the config)."""
    if dispatcher_type == "flex":
        return MoEFlexTokenDispatcher(num_experts, local_expert_indices, state, flex_backend)
    dispatchers = {"allgather": MoEAllGatherTokenDispatcher,
                   "alltoall": MoEAlltoAllTokenDispatcher}
    return dispatchers[dispatcher_type](num_experts, local_expert_indices, state)


__all__ = [
    "MoEAllGatherTokenDispatcher",
    "MoEAlltoAllTokenDispatcher",
    "MoEFlexTokenDispatcher",
    "build_token_dispatcher",
    "permute",
    "unpermute",
]
