"""Describe a rank's piece of a global tensor so that DCP can save and reshard it.

Why a small tensor type of our own rather than DTensor or ShardedTensor (measured on gloo/CPU,
torch 2.13):

* DTensor (``init_device_mesh`` + ``Shard``/``Replicate`` placements) saves and reshards fine,
  including a 2-D (dp x tp) mesh with an uneven ``torch.chunk`` split, but it can only express
  the offsets its placements imply. Two layouts we need fall outside that: the distributed
  optimizer's flat buffers (each rank owns an arbitrary ``[start, end)`` range of a 1-D buffer)
  and fused weights with ``partition_stride > 1`` (one rank holds ``stride`` separate blocks).
* ``ShardedTensor.init_from_local_shards`` can express any offsets, but it all-gathers metadata
  once per tensor and rejects data-parallel replicas as "overlapping shards", so a tensor
  replicated over dp cannot be described on every rank -- and every rank needs it on load.

`ShardedTensorView` implements DCP's checkpointable protocol (``__create_write_items__``,
``__create_chunk_list__``, ``__get_tensor_shard__``, the same hooks DTensor uses) and holds a
list of chunks ``(global_offsets, local_view)``. It needs no collective to build. Replicas are
simply chunks with equal offsets on several ranks: DCP's save planner keeps one writer per
``(key, offsets)`` and on load every replica reads its own copy. Chunks are views into the
caller's tensors, so an in-place load writes straight into the parameters.
"""
from __future__ import annotations

from typing import Iterator, List, Optional, Sequence, Tuple

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from megatron_smp.tensor_parallel.utils import tensor_parallel_coords

Chunk = Tuple[Tuple[int, ...], torch.Tensor]


class ShardedTensorView(torch.Tensor):
    """A tensor of `global_shape` of which this rank holds `chunks` (offsets, local view).

    It is only a description for checkpointing: `size()` is the global shape, and any tensor
    operation on it raises. Build it with `make_sharded_tensor`, `tp_sharded_tensor` or
    `flat_sharded_tensor` rather than directly.
    """

    @staticmethod
    def __new__(
        cls,
        chunks: Sequence[Chunk],
        global_shape: Sequence[int],
        dtype: torch.dtype,
        device: torch.device,
    ):
        view = torch.Tensor._make_wrapper_subclass(
            cls, tuple(global_shape), dtype=dtype, device=device, requires_grad=False
        )
        view._chunks = [(tuple(int(o) for o in offsets), t) for offsets, t in chunks]
        view._global_shape = torch.Size(global_shape)
        _validate_chunks(view._chunks, view._global_shape, dtype)
        return view

    def __init__(self, *args, **kwargs):  # all state is set in __new__
        super().__init__()

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise TypeError(
            f"ShardedTensorView only describes a sharded tensor for checkpointing; {func} is "
            "not supported on it. Use `.chunks` for the local data."
        )

    def __repr__(self) -> str:
        pieces = ", ".join(f"{list(o)}+{list(t.shape)}" for o, t in self._chunks)
        return f"ShardedTensorView(global_shape={list(self._global_shape)}, chunks=[{pieces}])"

    @property
    def chunks(self) -> List[Chunk]:
        return list(self._chunks)

    @property
    def global_shape(self) -> torch.Size:
        return self._global_shape

    def local_tensors(self) -> List[torch.Tensor]:
        return [t for _, t in self._chunks]

    def map_chunks(self, fn) -> "ShardedTensorView":
        """Same description over `fn(chunk)` (e.g. a CPU copy for asynchronous saving)."""
        chunks = [(o, fn(t)) for o, t in self._chunks]
        device = chunks[0][1].device if chunks else self.device
        return ShardedTensorView(chunks, self._global_shape, self.dtype, device)

    # DCP's checkpointable protocol (see torch.distributed.checkpoint.planner_helpers).
    def __create_write_items__(self, fqn: str, obj) -> List[WriteItem]:
        items = []
        for offsets, local in self._chunks:
            items.append(
                WriteItem(
                    index=MetadataIndex(fqn, torch.Size(offsets)),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(
                            offsets=torch.Size(offsets), sizes=local.shape
                        ),
                        properties=TensorProperties.create_from_tensor(local),
                        size=self._global_shape,
                    ),
                )
            )
        return items

    def __create_chunk_list__(self) -> List[ChunkStorageMetadata]:
        return [
            ChunkStorageMetadata(offsets=torch.Size(o), sizes=t.shape) for o, t in self._chunks
        ]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for offsets, local in self._chunks:
            if index.offset is None or torch.Size(offsets) == index.offset:
                return local
        raise ValueError(f"{index.fqn}: this rank holds no chunk at offsets {index.offset}")


def _validate_chunks(chunks: List[Chunk], global_shape: torch.Size, dtype: torch.dtype) -> None:
    for offsets, local in chunks:
        if len(offsets) != len(global_shape) or local.dim() != len(global_shape):
            raise ValueError(
                f"chunk at {list(offsets)} of shape {list(local.shape)} does not have the "
                f"rank of the global shape {list(global_shape)}"
            )
        if local.dtype != dtype:
            raise ValueError(f"chunk dtype {local.dtype} differs from {dtype}")
        for dim, (start, length, total) in enumerate(zip(offsets, local.shape, global_shape)):
            if start < 0 or start + length > total:
                raise ValueError(
                    f"chunk at {list(offsets)} of shape {list(local.shape)} leaves the global "
                    f"shape {list(global_shape)} along dim {dim}"
                )


def local_to_global_blocks(
    start: Sequence[int], sizes: Sequence[int], global_offset: Sequence[int],
    partition_dim: Optional[int] = None, piece: int = 0, global_block: int = 0,
) -> Iterator[Tuple[Tuple[int, ...], Tuple[int, ...], Tuple[int, ...]]]:
    """Where the block [start, start + sizes) of a rank's local tensor lives in the global
    tensor -- the one mapping every sharded view here is built with.

    The local tensor sits at `global_offset`; split along `partition_dim` into pieces of
    `piece` elements (Megatron's strided split of fused weights: piece j at
    `j * global_block` past the offset), a block crossing a piece boundary splits in two.
    Yields (global offsets, start within the block, sizes) of each part.
    """
    start, sizes = list(start), list(sizes)
    if partition_dim is None:
        parts = [(start, [0] * len(start), sizes)]
    else:
        dim = partition_dim
        parts = []
        position, end = start[dim], start[dim] + sizes[dim]
        while position < end:
            index, within = divmod(position, piece)
            length = min(end, (index + 1) * piece) - position
            offsets = list(start)
            offsets[dim] = index * global_block + within
            relative = [0] * len(start)
            relative[dim] = position - start[dim]
            lengths = list(sizes)
            lengths[dim] = length
            parts.append((offsets, relative, lengths))
            position += length
    for offsets, relative, lengths in parts:
        yield (tuple(o + int(g) for o, g in zip(offsets, global_offset)), tuple(relative),
               tuple(lengths))


def make_sharded_tensor(
    local_tensor: torch.Tensor,
    global_shape: Sequence[int],
    global_offset: Sequence[int],
    *,
    partition_dim: Optional[int] = None,
    partition_stride: int = 1,
) -> ShardedTensorView:
    """Describe `local_tensor` as the block of a `global_shape` tensor starting at `global_offset`.

    With `partition_stride > 1` the local tensor is `partition_stride` equal pieces along
    `partition_dim`, piece j living at `j * global_shape[partition_dim] / partition_stride +
    global_offset[partition_dim]` (Megatron's strided split of fused weights).
    """
    global_shape = tuple(int(s) for s in global_shape)
    global_offset = tuple(int(o) for o in global_offset)
    if partition_stride == 1:
        chunks = [(global_offset, local_tensor)]
    else:
        if partition_dim is None:
            raise ValueError("partition_stride > 1 needs partition_dim")
        local_len = local_tensor.shape[partition_dim]
        if local_len % partition_stride or global_shape[partition_dim] % partition_stride:
            raise ValueError(
                f"dim {partition_dim} (local {local_len}, global {global_shape[partition_dim]}) "
                f"is not divisible by partition_stride {partition_stride}"
            )
        chunks = [
            (offsets, local_tensor.narrow(partition_dim, relative[partition_dim],
                                          lengths[partition_dim]))
            for offsets, relative, lengths in local_to_global_blocks(
                (0,) * local_tensor.dim(), tuple(local_tensor.shape), global_offset,
                partition_dim, local_len // partition_stride,
                global_shape[partition_dim] // partition_stride)
        ]
    return ShardedTensorView(chunks, global_shape, local_tensor.dtype, local_tensor.device)


def tp_sharded_tensor(
    local_tensor: torch.Tensor,
    tp_rank: int,
    tp_size: int,
    partition_dim: int,
    partition_stride: int = 1,
) -> ShardedTensorView:
    """A tensor-parallel shard: equal split of `partition_dim` over `tp_size` ranks.

    `local_tensor` has shape `global / tp_size` along `partition_dim`.
    """
    global_shape = list(local_tensor.shape)
    global_shape[partition_dim] *= tp_size
    global_offset = [0] * local_tensor.dim()
    global_offset[partition_dim] = tp_rank * (
        local_tensor.shape[partition_dim] // partition_stride
    )
    return make_sharded_tensor(
        local_tensor,
        global_shape,
        global_offset,
        partition_dim=partition_dim,
        partition_stride=partition_stride,
    )


def flat_sharded_tensor(
    local_flat: torch.Tensor, global_numel: int, global_start: int
) -> ShardedTensorView:
    """This rank's range `[global_start, global_start + numel)` of a 1-D buffer (any split)."""
    local_flat = local_flat.reshape(-1)
    chunks = [((int(global_start),), local_flat)] if local_flat.numel() else []
    return ShardedTensorView(chunks, (int(global_numel),), local_flat.dtype, local_flat.device)


def sharded_state_dict(module: torch.nn.Module, state, prefix: str = "") -> dict:
    """The module's state dict with tensor-parallel parameters described by global offsets.

    Parameters carrying `tensor_model_parallel=True` (set by the tensor_parallel layers, with
    `partition_dim` and `partition_stride`) become `ShardedTensorView`s over `state.tp_group`;
    every other tensor is returned as is and treated as replicated (written once). Tensors are
    detached views of the module's own storage, so loading into the result loads the module.
    """
    result = {}
    for name, value in module.state_dict(keep_vars=True).items():
        if not isinstance(value, torch.Tensor):
            result[prefix + name] = value
            continue
        tensor = value.detach()
        tp_rank, tp_size = tensor_parallel_coords(value, state)  # an expert's: its ETP
        if getattr(value, "tensor_model_parallel", False) and tp_size > 1:
            tensor = tp_sharded_tensor(
                tensor,
                tp_rank,
                tp_size,
                partition_dim=int(getattr(value, "partition_dim", 0)),
                partition_stride=int(getattr(value, "partition_stride", 1)),
            )
        result[prefix + name] = tensor
    return result


__all__ = [
    "ShardedTensorView",
    "make_sharded_tensor",
    "local_to_global_blocks",
    "tp_sharded_tensor",
    "flat_sharded_tensor",
    "sharded_state_dict",
]
