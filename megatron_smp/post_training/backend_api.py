"""The backend API that post-training frameworks drive (verl's engine workers, NeMo-RL's
policy interface), over a built model at any layout:

* `compute_logprobs(model, batch, ...)` (`training.logprobs`'s, which `Trainer.compute_logprobs`
  runs too): per-token log-probs of the target tokens (and the entropy), vocab-parallel
  (three all-reduces over TP, never a [s, b, V] gather), fp32, packed or not, fixed or
  token-budget micro-batches, at TP/SP, PP, CP, EP; the whole sequences on every rank.
* `iter_hf_weights(model, ...)`: (Hugging Face name, full tensor) pairs, gathered over
  TP / EP / PP / FSDP one group of tensors at a time, converted by the family's HF adapter.
* `offload(model, optimizer)` / `onload(...)`: params, grads and optimizer state to host
  memory and back, on an accelerator (on the CPU there is nothing to free: an error).
"""
from __future__ import annotations

import math
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron_smp.config import ConfigError
# The log-probs have one implementation (Trainer.compute_logprobs calls it too), re-exported
# here as part of the backend API.
from megatron_smp.training.logprobs import (
    compute_logprobs, context_parallel_local_indices, gather_tokens_from_context_parallel,
    logprobs_of_microbatches, model_chunks as _chunks, model_outputs,
    split_batch_for_context_parallel, token_budget_microbatches, token_log_probs,
)


# -- the Hugging Face weight stream ------------------------------------------------------------

def _provenance_mode(sources: dict):
    """A TorchDispatchMode recording which source tensors each op's outputs were computed
    from: `sources[id(tensor)]` = (tensor, frozenset of source names)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            deps = set()
            for item in tree_flatten((args, kwargs))[0]:
                if isinstance(item, torch.Tensor):
                    deps |= sources.get(id(item), (None, frozenset()))[1]
            for item in tree_flatten(out)[0]:
                if isinstance(item, torch.Tensor):
                    before = sources.get(id(item), (None, frozenset()))[1]
                    # The tensor is kept alive so that its id is not reused meanwhile.
                    sources[id(item)] = (item, frozenset(deps) | before)
            return out

    return Mode()


def _without_clones():
    """A TorchDispatchMode in which `clone` of a contiguous tensor returns it. The family
    adapters clone what they return so that an HF state dict never aliases the model; the
    stream converts fresh gathered tensors that nothing else holds, where a clone would only
    double the peak."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.clone.default and args[0].is_contiguous():
                return args[0]  # (a strided input is still copied: callers may view it)
            return func(*args, **(kwargs or {}))

    return Mode()


def trace_dependencies(convert: Callable, shapes: Dict[str, Tuple[Tuple[int, ...], torch.dtype]]
                       ) -> Dict[str, frozenset]:
    """{output name: the input names it is computed from} of `convert(state_dict)`, run once
    on meta tensors of `shapes` (no memory, no values)."""
    inputs = {name: torch.empty(shape, dtype=dtype, device="meta")
              for name, (shape, dtype) in shapes.items()}
    sources = {id(t): (t, frozenset([name])) for name, t in inputs.items()}
    with _provenance_mode(sources):
        outputs = convert(inputs)
    return {name: sources.get(id(t), (None, frozenset()))[1] for name, t in outputs.items()}


def _groups(dependencies: Dict[str, frozenset], order: Sequence[str]) -> List[List[str]]:
    """The input names in groups that share an output (connected components), in `order`."""
    parent = {name: name for name in order}

    def root(name):
        while parent[name] != name:
            parent[name] = parent[parent[name]]
            name = parent[name]
        return name

    for deps in dependencies.values():
        deps = [d for d in deps if d in parent]
        for other in deps[1:]:
            parent[root(other)] = root(deps[0])
    groups: Dict[str, List[str]] = {}
    for name in order:
        groups.setdefault(root(name), []).append(name)
    return list(groups.values())


def _rank_pieces(model, state, vocab_size: int):
    """This rank's pieces of the global (TP=1, one-stage) tensors: [(name, global shape,
    dtype, [(offsets, piece)])], the last stage's copy of a tied embedding left out."""
    from megatron_smp.checkpointing.sharded_state import describe, model_layouts

    pieces = []
    for layout, tensor in model_layouts(_chunks(model), state, vocab_size):
        if layout.tied_copy or layout.key.endswith("_extra_state"):
            continue
        view = describe(layout, tensor.detach())
        if view is None:
            continue
        pieces.append((layout.key, tuple(view._global_shape), view.dtype, view._chunks))
    return pieces


class _WorldTensors:
    """Gathers any global tensor of the model on every rank, one at a time: each piece is
    broadcast over the world by the lowest rank holding it (data-parallel replicas hold the
    same pieces; one of them sends)."""

    def __init__(self, model, state, vocab_size: int):
        self.local = {name: (shape, dtype, chunks)
                      for name, shape, dtype, chunks in _rank_pieces(model, state, vocab_size)}
        summary = [(name, shape, str(dtype).replace("torch.", ""),
                    [(tuple(offsets), tuple(piece.shape)) for offsets, piece in chunks])
                   for name, (shape, dtype, chunks) in self.local.items()]
        world = dist.get_world_size() if dist.is_initialized() else 1
        summaries = [None] * world
        if world > 1:
            dist.all_gather_object(summaries, summary)
        else:
            summaries = [summary]
        self.rank = dist.get_rank() if world > 1 else 0
        self.world = world
        self.shapes: Dict[str, Tuple[Tuple[int, ...], torch.dtype]] = {}
        self.sources: Dict[str, List[Tuple[int, Tuple[int, ...], Tuple[int, ...]]]] = {}
        self.order: List[str] = []
        for rank, entries in enumerate(summaries):
            for name, shape, dtype, blocks in entries:
                if name not in self.shapes:
                    self.shapes[name] = (tuple(shape), getattr(torch, dtype))
                    self.sources[name] = []
                    self.order.append(name)
                for offsets, sizes in blocks:
                    if all((o, s) != (offsets, sizes) for _, o, s in self.sources[name]):
                        self.sources[name].append((rank, offsets, sizes))
        self.device = state.device

    def full(self, name: str, device=None) -> torch.Tensor:
        """The whole tensor `name` on every rank (collective over the world)."""
        shape, dtype = self.shapes[name]
        device = self.device if device is None else device
        out = torch.empty(shape, dtype=dtype, device=device)
        local = {tuple(o): piece for o, piece in self.local.get(name, (None, None, []))[2]}
        for src, offsets, sizes in self.sources[name]:
            region = out
            for dim, (begin, length) in enumerate(zip(offsets, sizes)):
                region = region.narrow(dim, begin, length)
            if self.world == 1:
                region.copy_(local[tuple(offsets)])
                continue
            buffer = (local[tuple(offsets)].contiguous() if src == self.rank
                      else torch.empty(sizes, dtype=dtype, device=self.device))
            dist.broadcast(buffer, src)
            region.copy_(buffer)
            del buffer
        return out


def iter_hf_weights(model, state, config, family: str, lora: Optional[dict] = None,
                    device=None) -> Iterator[Tuple[str, torch.Tensor]]:
    """(Hugging Face name, full tensor) pairs of the current weights, in HF's layout, on every
    rank -- what `hf_state_dict()` gives, streamed: the tensors that produce one HF tensor
    (q/k/v from the fused qkv, gate/up from fc1, an adapter with its base weight) are
    gathered together, converted, yielded and freed before the next, packed in groups up to
    the largest tensor's bytes. So the memory above the model stays within about twice the
    largest tensor (its gathered source and its converted copy).

    model: this rank's chunk(s) at any TP / PP / EP / CP / DP / FSDP2 layout; config: the
    model's TransformerConfig; family: the HF adapter's name (`models.hf.get_adapter`);
    lora: {"alpha", "rank"} when the model has adapters (merged, as the export merges them);
    device: where the yielded tensors live (default the model's device). Collective over the
    world: every rank must consume the whole iterator.
    """
    from megatron_smp.models.hf import get_adapter
    from megatron_smp.tensor_parallel.lora import merge_lora

    adapter = get_adapter(family)

    def convert(state_dict):
        if lora is not None:
            state_dict = merge_lora(state_dict, lora["alpha"], lora["rank"])
        return adapter.to_hf(state_dict, config)

    tensors = _WorldTensors(model, state, config.vocab_size)
    dependencies = trace_dependencies(convert, tensors.shapes)
    groups = _groups(dependencies, tensors.order)
    nbytes = {name: math.prod(shape) * torch.empty((), dtype=dtype).element_size()
              for name, (shape, dtype) in tensors.shapes.items()}
    budget = max(nbytes.values())
    batches: List[List[str]] = []
    size = budget + 1
    for group in groups:
        group_bytes = sum(nbytes[name] for name in group)
        if size + group_bytes > budget:
            batches.append([])
            size = 0
        batches[-1].extend(group)
        size += group_bytes
    emitted = set()
    for index, batch in enumerate(batches):
        members = set(batch)
        inputs = {name: (tensors.full(name, device) if name in members else
                         torch.empty(tensors.shapes[name][0], dtype=tensors.shapes[name][1],
                                     device="meta"))
                  for name in tensors.order}
        with _without_clones():
            outputs = convert(inputs)
        del inputs
        for name in list(outputs):
            deps = dependencies.get(name, frozenset())
            # An output computed from no input (a constant) comes with the first batch.
            if name in emitted or not (deps <= members) or (not deps and index):
                continue
            tensor = outputs.pop(name)
            emitted.add(name)
            yield name, tensor
            del tensor
        del outputs
    missing = set(dependencies) - emitted
    if missing:
        raise RuntimeError(f"iter_hf_weights: {sorted(missing)[:5]} were never produced")


# -- offload / onload --------------------------------------------------------------------------

def _offloadable(model, optimizer) -> List[torch.Tensor]:
    """One tensor per device storage holding params (their contiguous buffers), grads or
    optimizer state: the view's base where there is one, so that the whole storage moves."""
    seen, tensors = set(), []

    def add(tensor):
        if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
            return
        if hasattr(tensor, "to_local"):  # an FSDP2 DTensor: its local shard
            tensor = tensor.to_local()
        tensor = tensor.detach()
        root = tensor._base if tensor._base is not None else tensor
        storage = root.untyped_storage()
        if storage.nbytes() == 0 or storage._cdata in seen:  # _cdata: the StorageImpl
            return
        seen.add(storage._cdata)
        tensors.append(root)

    for chunk in _chunks(model):
        for buffer in getattr(chunk, "param_and_grad_buffers", []) or []:
            add(buffer.param_data)
            add(getattr(buffer, "grad_data", None))
        for param in chunk.parameters():
            add(param)
            add(getattr(param, "main_grad", None))
            add(param.grad)
    if optimizer is not None:
        inner = getattr(optimizer, "optimizer", optimizer)
        for group in getattr(inner, "param_groups", []):
            for param in group["params"]:
                add(param)  # the fp32 main params of the mixed-precision optimizers
                add(param.grad)
        for per_param in inner.state.values():
            for value in per_param.values():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    add(value)
    return tensors


class Offloaded:
    """What `offload` moved: (device tensor, host copy) pairs; `onload` brings them back."""

    def __init__(self, pairs: List[Tuple[torch.Tensor, torch.Tensor]]):
        self.pairs = pairs

    @property
    def nbytes(self) -> int:
        return sum(host.numel() * host.element_size() for _, host in self.pairs)


def offload(model, optimizer=None) -> Offloaded:
    """Move the params (their buffers), grads and the optimizer's state of `model` (chunk or
    list of chunks) to host memory, freeing their device memory. Every view -- params into
    buffers, buckets, main grads -- stays valid: each storage is emptied in place and refilled
    by `onload`. Between the two nothing may use the model or the optimizer. On the CPU there
    is no device memory to free: a ConfigError (a capability check, before anything moves)."""
    return _offload(model, optimizer)


def _offload(model, optimizer, check_device: bool = True) -> Offloaded:
    tensors = _offloadable(model, optimizer)
    if check_device and any(t.device.type == "cpu" for t in tensors):
        raise ConfigError("offload: the model or optimizer state is on the CPU, there is no "
                          "device memory to free (offload/onload are for accelerators)")
    pin = any(t.device.type == "cuda" for t in tensors)
    pairs = []
    for tensor in tensors:
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pin) if pin else None
        if host is None:
            host = tensor.to("cpu", copy=True)
        else:
            host.copy_(tensor, non_blocking=True)
        pairs.append((tensor, host))
    if pin:
        torch.cuda.synchronize()  # the copies are done before the memory is released
    for tensor, _ in pairs:
        tensor.untyped_storage().resize_(0)
    return Offloaded(pairs)


def onload(offloaded: Offloaded) -> None:
    """Bring back what `offload` moved to host memory: the same storages, refilled."""
    for tensor, host in offloaded.pairs:
        tensor.untyped_storage().resize_(tensor.numel() * tensor.element_size())
        tensor.copy_(host, non_blocking=host.is_pinned())
    offloaded.pairs = []


__all__ = ["compute_logprobs", "logprobs_of_microbatches", "token_budget_microbatches",
           "token_log_probs", "model_outputs", "iter_hf_weights", "trace_dependencies",
           "offload", "onload", "gather_tokens_from_context_parallel",
           "context_parallel_local_indices", "split_batch_for_context_parallel"]
