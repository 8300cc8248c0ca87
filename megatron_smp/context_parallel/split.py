"""The load-balanced sequence split of context parallelism.

With causal attention the last tokens of a sequence attend to every earlier token and the
first ones to almost none, so cutting the sequence into N consecutive pieces would leave rank
N-1 with most of the work. Instead the sequence is cut into 2N chunks and rank i keeps chunk
i and chunk 2N-1-i (Megatron's layout):

    N = 2, chunks 0 1 2 3:   rank 0 keeps [0, 3],  rank 1 keeps [1, 2]

Every rank then does the same amount of causal attention. A rank's local sequence is the
concatenation of its two chunks, in that order, so its global positions increase along it.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch

from megatron_smp.config import ConfigError
from megatron_smp.tensor_parallel.mappings import gather_from_sequence_parallel_region


def check_divisible(seq_length: int, cp_size: int) -> None:
    """ConfigError unless `seq_length` splits into 2 x cp_size equal chunks."""
    if seq_length % (2 * cp_size) != 0:
        raise ConfigError(
            f"--seq-length ({seq_length}) must be divisible by 2 x --context-parallel-size "
            f"({2 * cp_size}): the load-balanced split cuts each sequence into "
            f"{2 * cp_size} chunks"
        )


def chunk_indices(cp_size: int, cp_rank: int):
    """The two chunk numbers (of 2 x cp_size) rank `cp_rank` holds, in local order."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def local_positions(
    seq_length: int, cp_size: int, cp_rank: int, device: Optional[torch.device] = None
) -> torch.Tensor:
    """Global sequence positions [seq_length / cp_size] (int64) of rank `cp_rank`'s tokens."""
    check_divisible(seq_length, cp_size)
    chunk = seq_length // (2 * cp_size)
    first, second = chunk_indices(cp_size, cp_rank)
    return torch.cat([
        torch.arange(first * chunk, (first + 1) * chunk, device=device),
        torch.arange(second * chunk, (second + 1) * chunk, device=device),
    ])


def positions_of_local_length(
    local_length: int, cp_size: int, cp_rank: int, device: Optional[torch.device] = None
) -> torch.Tensor:
    """`local_positions` from a rank's local length [s / cp] (what a layer sees)."""
    return local_positions(local_length * cp_size, cp_size, cp_rank, device)


def gathered_order(seq_length: int, cp_size: int, device=None) -> torch.Tensor:
    """Global positions [s] of the rows of an all-gather of every rank's local sequence
    (rank 0's two chunks, then rank 1's, ...): `x_global = x_gathered[argsort(order)]`."""
    return torch.cat([local_positions(seq_length, cp_size, r, device) for r in range(cp_size)])


def split_for_context_parallel(
    tensor: torch.Tensor, dim: int, cp_size: int, cp_rank: int
) -> torch.Tensor:
    """Rank `cp_rank`'s two chunks of `tensor` along `dim` (length s -> s / cp_size)."""
    if cp_size == 1:
        return tensor
    seq_length = tensor.shape[dim]
    check_divisible(seq_length, cp_size)
    chunks = tensor.chunk(2 * cp_size, dim=dim)
    first, second = chunk_indices(cp_size, cp_rank)
    return torch.cat([chunks[first], chunks[second]], dim=dim)


def gather_from_context_parallel(tensor: torch.Tensor, cp_group,
                                 rank_indices: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[b, s/cp, ...] of every rank -> [b, s, ...] in sequence order, the inverse of
    `split_for_context_parallel(tensor, 1, ...)`, or with `rank_indices` [cp, b, s/cp] (packed
    rows, `packed_rank_indices`) the inverse of that split. Backward keeps this rank's rows
    (the consumer of the whole sequence is replicated over the group)."""
    gathered = gather_from_sequence_parallel_region(tensor.transpose(0, 1), cp_group, False)
    cp_size = gathered.shape[0] // tensor.shape[1]
    if cp_size == 1:
        return tensor
    if rank_indices is None:
        order = gathered_order(gathered.shape[0], cp_size, tensor.device)
        return gathered.index_select(0, torch.argsort(order)).transpose(0, 1)
    # Gathered rows are rank by rank: row r * s/cp + j of batch entry i sits at
    # rank_indices[r, i, j] of its row.
    b = tensor.shape[0]
    order = rank_indices.to(tensor.device).permute(1, 0, 2).reshape(b, -1)  # [b, s]
    inverse = torch.argsort(order, dim=1)
    rows = gathered.transpose(0, 1)  # [b, s, ...] in gathered order
    index = inverse.view(*inverse.shape, *([1] * (rows.dim() - 2))).expand_as(rows)
    return rows.gather(1, index)


def packed_rank_indices(document_ids: torch.Tensor, cp_size: int) -> torch.Tensor:
    """Row positions [cp, b, s / cp] of each CP rank's tokens of packed rows `document_ids`
    [b, s] (a document: a run of equal ids), in local order.

    When every document's length divides by 2 x cp_size, each document is split the
    load-balanced way on its own, as Megatron splits THD batches: rank i keeps chunk i and
    chunk 2cp-1-i of every document (`SFTDataset` pads conversations so). Otherwise the row is
    split as a whole (`local_positions`); attention is exact either way, only the balance of
    work differs.
    """
    b, s = document_ids.shape
    check_divisible(s, cp_size)
    device = document_ids.device
    first = torch.ones(b, s, dtype=torch.bool, device=device)
    first[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    number = first.flatten().cumsum(0) - 1  # documents numbered over the flattened rows
    lengths = torch.bincount(number)
    if bool((lengths % (2 * cp_size) != 0).any()):
        return torch.stack([local_positions(s, cp_size, rank, device).expand(b, s // cp_size)
                            for rank in range(cp_size)])
    length = lengths[number].view(b, s)
    positions = torch.arange(s, device=device).expand(b, s)
    starts = torch.where(first, positions, torch.zeros_like(positions)).cummax(dim=1).values
    chunk = (positions - starts) // (length // (2 * cp_size))
    owner = torch.where(chunk < cp_size, chunk, 2 * cp_size - 1 - chunk)
    return torch.stack([positions[owner == rank].view(b, s // cp_size)
                        for rank in range(cp_size)])


def get_batch_on_this_cp_rank(batch: Dict[str, torch.Tensor], cp_size: int,
                              cp_rank: int) -> Dict[str, torch.Tensor]:
    """This rank's share of a microbatch (a new dict; `batch` is not changed).

    tokens / labels / loss_mask / position_ids [b, s] -> [b, s / cp]; attention_mask
    [b, 1, s, s] -> [b, 1, s / cp, s]: only the queries are split, every key stays (the
    attention gathers the keys of the whole sequence). Position ids keep their global values,
    so RoPE and learned positions see where each local token really is. With packed rows
    (`document_ids` [b, s], kept whole: the attention needs every rank's share) the tokens
    are taken by `packed_rank_indices`.
    """
    if cp_size == 1:
        return dict(batch)
    packed = batch.get("document_ids")
    local = None if packed is None else packed_rank_indices(packed, cp_size)[cp_rank]
    out = {}
    for key, value in batch.items():
        if value is None or not torch.is_tensor(value) or value.dim() < 2:
            out[key] = value
        elif key == "document_ids":
            out[key] = value
        elif key == "attention_mask":
            out[key] = split_for_context_parallel(value, 2, cp_size, cp_rank)
        elif local is not None:
            out[key] = value.gather(1, local.to(value.device))
        else:
            out[key] = split_for_context_parallel(value, 1, cp_size, cp_rank)
    return out


__all__ = [
    "check_divisible",
    "chunk_indices",
    "local_positions",
    "positions_of_local_length",
    "gathered_order",
    "split_for_context_parallel",
    "gather_from_context_parallel",
    "get_batch_on_this_cp_rank",
    "packed_rank_indices",
]
