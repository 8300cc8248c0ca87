"""Model and optimizer state as sharded state dicts in the global (TP=1, one-stage) form.

Every tensor is saved under the name it has in a single-stage, TP=1 `GPTModel` and with that
model's shape, so a checkpoint loads at any tensor / pipeline / data-parallel layout, with or
without the distributed optimizer:

* layer names carry the global layer index (`decoder.layers.{layer_offset + i}.`), and an
  expert's the global expert index (`...local_experts.{ep_rank * E/ep + i}.`);
* a tensor-parallel shard is placed by its `partition_dim` / `partition_stride`;
* the vocab-parallel tables keep only `config.vocab_size` rows (the padding, which depends
  on TP, is never saved and stays zero on load);
* the last pipeline stage's copy of a tied word embedding is the same tensor as the first
  stage's: it is loaded from `embedding.word_embeddings.weight` and not saved separately.

Optimizer state is saved per parameter (`optimizer.state.{name}.{fp32_param,exp_avg,...}`),
described exactly like the parameter. The distributed optimizer owns a flat `[start, end)`
range of each TP-local parameter on each data-parallel rank; that range is cut into
rectangular blocks (a partial row, whole rows, a partial row), each placed at its global
offsets, so every rank writes and reads only the state it owns -- no gather, no copy.
"""
from __future__ import annotations

import math
import re
import sys
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from megatron_smp.checkpointing.engine.sharded_tensor import ShardedTensorView, local_to_global_blocks
from megatron_smp.distributed.unwrap import unwrap_model
from megatron_smp.models.sharding import VOCAB_PARALLEL_SUFFIXES
from megatron_smp.tensor_parallel.utils import tensor_parallel_coords

TIED_EMBEDDING_KEY = "embedding.word_embeddings.weight"
_LOCAL_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")

Block = Tuple[Tuple[int, ...], Tuple[int, ...]]  # (start index, sizes) in some tensor


@dataclass
class ParamLayout:
    """Where one rank's (TP-local) tensor lives in its global checkpoint tensor."""

    key: str
    local_shape: torch.Size
    global_shape: Tuple[int, ...]
    partition_dim: Optional[int]  # None: not split over TP
    partition_stride: int
    tp_rank: int
    tp_size: int
    row_limit: Optional[int]  # rows kept (vocab tables): the rest is TP padding
    tied_copy: bool  # the last stage's copy of a tied embedding (not written by torch_dist)

    def global_blocks(self, start: Sequence[int], sizes: Sequence[int]):
        """Map a block of the local tensor to global blocks.

        Yields (global offsets, start within the block, sizes). A block crossing a stride
        boundary of a strided (fused) weight splits in two; rows past `row_limit` vanish.
        """
        offset = [0] * len(self.local_shape)
        piece = block = 0
        if self.partition_dim is not None:
            piece = self.local_shape[self.partition_dim] // self.partition_stride
            block = piece * self.tp_size
            offset[self.partition_dim] = self.tp_rank * piece
        for offsets, relative, lengths in local_to_global_blocks(
                start, sizes, offset, self.partition_dim, piece, block):
            if self.row_limit is not None:
                lengths = (min(lengths[0], self.row_limit - offsets[0]),) + lengths[1:]
            if all(n > 0 for n in lengths):
                yield offsets, relative, lengths


def _global_name(name: str, layer_offset: int) -> str:
    match = _LOCAL_LAYER.match(name)
    if match is None:
        return name
    return f"decoder.layers.{int(match.group(1)) + layer_offset}.{name[match.end():]}"


def model_layouts(model_chunks: Sequence[torch.nn.Module], state, vocab_size: int):
    """[(ParamLayout, tensor)] for every tensor of this rank's model chunks, in order."""
    entries = []
    for chunk in model_chunks:
        module = unwrap_model(chunk)
        decoder = getattr(module, "decoder", None)
        layer_offset = getattr(decoder, "layer_offset", 0)
        pre_process = getattr(module, "pre_process", True)
        for name, tensor in module.state_dict(keep_vars=True).items():
            if not isinstance(tensor, torch.Tensor):
                continue
            tied_copy = getattr(tensor, "shared_embedding", False) and not pre_process
            key = TIED_EMBEDDING_KEY if tied_copy else _global_name(name, layer_offset)
            # An expert's parameters are stored under its global expert index.
            rename = getattr(tensor, "expert_checkpoint_rename", None)
            if rename is not None:
                key = key.replace(rename[0], rename[1], 1)
            split = getattr(tensor, "tensor_model_parallel", False)
            dim = int(getattr(tensor, "partition_dim", 0)) if split else None
            stride = int(getattr(tensor, "partition_stride", 1)) if split else 1
            # An expert's split is over its expert-tensor-parallel group.
            tp_rank, tp_size = tensor_parallel_coords(tensor, state)
            global_shape = list(tensor.shape)
            if dim is not None:
                global_shape[dim] *= tp_size
            row_limit = None
            if key.endswith(VOCAB_PARALLEL_SUFFIXES):
                row_limit = vocab_size
                global_shape[0] = min(global_shape[0], vocab_size)
            layout = ParamLayout(
                key=key, local_shape=tensor.shape, global_shape=tuple(global_shape),
                partition_dim=dim, partition_stride=stride,
                tp_rank=tp_rank if split else 0, tp_size=tp_size if split else 1,
                row_limit=row_limit, tied_copy=tied_copy,
            )
            entries.append((layout, tensor))
    return entries


def flat_range_blocks(start: int, end: int, shape: Sequence[int]) -> List[Block]:
    """Cut the flat range [start, end) of a row-major `shape` into rectangular blocks.

    Each block (a run of 1s, then one partial dim, then whole trailing dims) is contiguous
    in the flat order, so it is a view of the range.
    """
    if end <= start:
        return []
    if len(shape) <= 1:
        return [((start,), (end - start,))]
    inner = math.prod(shape[1:])
    first_row, first_rest = divmod(start, inner)
    last_row, last_rest = divmod(end, inner)

    def prefixed(row: int, blocks: List[Block]) -> List[Block]:
        return [((row,) + s, (1,) + n) for s, n in blocks]

    if first_row == last_row:
        return prefixed(first_row, flat_range_blocks(first_rest, last_rest, shape[1:]))
    blocks: List[Block] = []
    if first_rest:
        blocks += prefixed(first_row, flat_range_blocks(first_rest, inner, shape[1:]))
        first_row += 1
    if last_row > first_row:
        zeros = (0,) * (len(shape) - 1)
        blocks.append(((first_row,) + zeros, (last_row - first_row,) + tuple(shape[1:])))
    if last_rest:
        blocks += prefixed(last_row, flat_range_blocks(0, last_rest, shape[1:]))
    return blocks


def _flat_index(index: Sequence[int], shape: Sequence[int]) -> int:
    flat = 0
    for i, n in zip(index, shape):
        flat = flat * n + i
    return flat


def describe(
    layout: ParamLayout, flat: torch.Tensor, start: int = 0
) -> Optional[ShardedTensorView]:
    """`flat` holds elements [start, start + numel) of the TP-local tensor: its global view.

    None when nothing of it is in the checkpoint (e.g. only vocab padding rows). An FSDP2
    DTensor (a parameter or its optimizer state) holds a run of dim-0 rows of the TP-local
    tensor, i.e. one flat range: its local shard is described from that range's start.
    """
    from torch.distributed.tensor import DTensor

    if isinstance(flat, DTensor):
        from megatron_smp.distributed.fsdp import shard_row_offset

        start += shard_row_offset(flat) * math.prod(flat.shape[1:])
        flat = flat.to_local()
    flat = flat.reshape(-1)
    chunks = []
    for block_start, sizes in flat_range_blocks(start, start + flat.numel(), layout.local_shape):
        position = _flat_index(block_start, layout.local_shape) - start
        data = flat[position : position + math.prod(sizes)].view(sizes)
        for offsets, relative, lengths in layout.global_blocks(block_start, sizes):
            piece = data
            for dim, (begin, length) in enumerate(zip(relative, lengths)):
                if begin or length != piece.shape[dim]:
                    piece = piece.narrow(dim, begin, length)
            chunks.append((offsets, piece))
    if not chunks:
        return None
    return ShardedTensorView(chunks, layout.global_shape, flat.dtype, flat.device)


def model_sharded_state_dict(
    model_chunks: Sequence[torch.nn.Module], state, vocab_size: int, tied_copies: bool = True
) -> Dict[str, ShardedTensorView]:
    """{global name: view of this rank's piece}; loading into it loads the model in place.

    `tied_copies=False` leaves out the last stage's copy of a tied embedding (a DCP save
    writes the first stage's; a per-rank "torch" file must hold what that rank loads).
    """
    result: Dict[str, ShardedTensorView] = {}
    for layout, tensor in model_layouts(model_chunks, state, vocab_size):
        if layout.tied_copy and not tied_copies:
            continue
        view = describe(layout, tensor.detach())
        if view is not None:
            _put(result, layout.key, view)
    return result


def _put(target: dict, key: str, value) -> None:
    if key in target:
        raise ValueError(f"two tensors of this rank map to checkpoint key {key!r}")
    target[key] = value


# -- optimizer ----------------------------------------------------------------------------------


def _apex_fused_adam(optimizer: torch.optim.Optimizer) -> bool:
    """apex's FusedAdam (what `build_torch_optimizer` picks on CUDA where apex imports). It
    keeps Adam's moments per param, as torch does, but its step count per param *group*
    (`group["step"]`, an int, or a device tensor when capturable). apex is looked up only if
    already imported: an optimizer of its class cannot exist otherwise."""
    module = sys.modules.get("apex.optimizers")
    fused_adam = getattr(module, "FusedAdam", None)
    return isinstance(fused_adam, type) and isinstance(optimizer, fused_adam)


def _state_keys(optimizer: torch.optim.Optimizer, group: dict) -> Tuple[str, ...]:
    if hasattr(optimizer, "state_keys"):  # optimizer.muon's Muon / Lion
        return optimizer.state_keys(group)
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)) or _apex_fused_adam(optimizer):
        return ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group.get("amsgrad") else ())
    if isinstance(optimizer, torch.optim.SGD):
        return ("momentum_buffer",) if group.get("momentum", 0) else ()
    raise NotImplementedError(
        f"checkpointing the state of {type(optimizer).__name__} is not supported; use torch's "
        "Adam/AdamW or SGD, or apex's FusedAdam"
    )


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the state torch would create at the first step (zeros) where it is missing,
    so that a checkpoint can be loaded into it (or one taken before any step saved)."""
    per_param_step = not (isinstance(optimizer, torch.optim.SGD) or _apex_fused_adam(optimizer))
    for group in optimizer.param_groups:
        keys = _state_keys(optimizer, group)
        for param in group["params"]:
            state = optimizer.state[param]
            if "step" not in state and per_param_step:
                on_device = group.get("fused") or group.get("capturable")
                state["step"] = torch.zeros(
                    (), dtype=torch.float32, device=param.device if on_device else "cpu"
                )
            for key in keys:
                if state.get(key) is None:
                    state[key] = torch.zeros_like(param, memory_format=torch.preserve_format)


def _group_step(group: dict) -> torch.Tensor:
    """apex's per-group step as the 0-dim fp32 CPU tensor torch's Adam keeps per param, so
    that checkpoints of either optimizer load into the other."""
    step = group.get("step", 0)
    if isinstance(step, torch.Tensor):
        return step.detach().reshape(()).to("cpu", torch.float32)
    return torch.tensor(float(step), dtype=torch.float32)


def _param_ranges(megatron_optimizer) -> Iterator[Tuple[torch.nn.Parameter, torch.Tensor, int]]:
    """(model param, main param, start of the main param in the flattened model param)."""
    if hasattr(megatron_optimizer, "param_shards"):  # the distributed optimizer
        for shard in megatron_optimizer.param_shards():
            yield shard["param"], shard["main_param"], shard["range"].start
    else:
        for model_param, main_param in megatron_optimizer.param_pairs:
            yield model_param, main_param, 0


def optimizer_sharded_state_dict(
    megatron_optimizer,
    model_chunks: Sequence[torch.nn.Module],
    state,
    vocab_size: int,
    tied_copies: bool = True,
) -> dict:
    """{"state": {name: {"fp32_param", "exp_avg", ..., "step"}}, "grad_scaler": {...}}.

    Tensors are views of the live optimizer state: loading fills it in place.
    """
    optimizer = megatron_optimizer.optimizer
    init_optimizer_state(optimizer)
    layouts = {id(t): layout for layout, t in model_layouts(model_chunks, state, vocab_size)}
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    per_param: Dict[str, dict] = {}
    group_steps = (
        {id(group): _group_step(group) for group in optimizer.param_groups}
        if _apex_fused_adam(optimizer) else {}
    )
    for model_param, main_param, start in _param_ranges(megatron_optimizer):
        layout = layouts[id(model_param)]
        if layout.tied_copy and not tied_copies:
            continue
        param_state = optimizer.state[main_param]
        tensors = {"fp32_param": main_param.detach()}
        for key in _state_keys(optimizer, group_of[id(main_param)]):
            tensors[key] = param_state[key]
        entry = {}
        for key, tensor in tensors.items():
            view = describe(layout, tensor, start)
            if view is not None:
                entry[key] = view
        if not entry:
            continue
        if "step" in param_state:
            entry["step"] = param_state["step"]  # the same on every rank: written once
        elif group_steps:
            entry["step"] = group_steps[id(group_of[id(main_param)])]
        _put(per_param, layout.key, entry)
    result: dict = {"state": per_param}
    scaler = megatron_optimizer.grad_scaler
    if scaler is not None and scaler.state_dict():
        result["grad_scaler"] = scaler.state_dict()
    return result


def finish_optimizer_load(megatron_optimizer, loaded: dict) -> None:
    """After `loaded` (the template `optimizer_sharded_state_dict` gave) was filled: restore
    what a load cannot fill in place -- the grad scaler's state, and apex FusedAdam's step
    count, which lives in its param groups (every group steps together, so every saved
    "step" holds the same count)."""
    scaler = megatron_optimizer.grad_scaler
    if scaler is not None and "grad_scaler" in loaded:
        scaler.load_state_dict(loaded["grad_scaler"])
    optimizer = megatron_optimizer.optimizer
    if not _apex_fused_adam(optimizer):
        return
    steps = [entry["step"] for entry in loaded.get("state", {}).values() if "step" in entry]
    if not steps:
        return
    count = int(steps[0])
    for group in optimizer.param_groups:
        if isinstance(group.get("step"), torch.Tensor):  # capturable: stays on the device
            group["step"].fill_(count)
        else:
            group["step"] = count


__all__ = [
    "ParamLayout",
    "TIED_EMBEDDING_KEY",
    "model_layouts",
    "flat_range_blocks",
    "describe",
    "model_sharded_state_dict",
    "init_optimizer_state",
    "optimizer_sharded_state_dict",
    "finish_optimizer_load",
]
