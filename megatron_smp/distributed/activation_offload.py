"""Activation checkpointing per transformer layer, and SMP's activation offloading.

`apply_activation_checkpointing(model, layers)` wraps every layer in torch's
`checkpoint_wrapper` whose checkpoint function is our `tensor_parallel.random.checkpoint`
(it replays the tensor-parallel RNG streams, so dropout inside TP regions recomputes the same
masks; torch's own checkpoint only replays the default generators). A checkpointed layer
keeps only its inputs between forward and backward.

With an `ActivationOffloader` (SMP's `sm_activation_offloading`) those saved inputs go to host
memory as soon as the layer's forward has saved them (pinned, copied asynchronously on CUDA)
and come back during backward: when backward reaches layer i it needs layer i's inputs, and
the offloader also brings back layers i-1 ... i-h+1 ahead of time, so at most
`activation_loading_horizon` (h) layers' inputs are resident on the device at once. The
accounting (`offloaded_layers`, `max_resident`) is kept on every device, so the mechanism
is tested on CPU, where host and device memory are the same and nothing is copied.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Dict, Iterator, List, Optional, Set

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from megatron_smp.config import ConfigError


class ActivationOffloader:
    """Saved-tensor hooks that park checkpointed layers' inputs in host memory.

    `layer(i)` is the context for layer i's forward (layers numbered in forward order). Each
    forward of a layer gets a new sequence number, so several microbatches' forwards may run
    before their backwards. After backward, `offloaded_layers` holds every layer whose inputs
    went to the host, `max_resident` the most forwards' inputs ever loaded back at once,
    `offloaded_bytes` the bytes moved out per layer.
    """

    def __init__(self, horizon: int = 2) -> None:
        if horizon < 1:
            raise ConfigError(
                f"activation_loading_horizon must be a positive integer, got {horizon}"
            )
        self.horizon = horizon
        self._sequence = 0
        self._host: Dict[int, List[torch.Tensor]] = {}  # sequence number -> host copies
        self._unpacked: Dict[int, int] = {}
        self._loaded: Dict[int, List[torch.Tensor]] = {}  # sequence number -> device copies
        self.offloaded_layers: Set[int] = set()
        self.offloaded_bytes: Dict[int, int] = {}
        self.resident_trace: List[int] = []
        self.max_resident = 0

    # Forward: pack -------------------------------------------------------------------------
    @contextlib.contextmanager
    def layer(self, index: int) -> Iterator[None]:
        """Offload what autograd saves inside this context as layer `index`'s inputs."""
        self._release_finished()
        key = self._sequence
        self._sequence += 1
        self._host[key] = []
        self._unpacked[key] = 0

        def pack(tensor: torch.Tensor):
            self._host[key].append(self._to_host(tensor))
            self.offloaded_layers.add(index)
            self.offloaded_bytes[index] = (
                self.offloaded_bytes.get(index, 0) + tensor.numel() * tensor.element_size()
            )
            return key, len(self._host[key]) - 1, tensor.device

        def unpack(packed):
            return self._fetch(*packed)

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield

    @staticmethod
    def _to_host(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device.type == "cpu":
            return tensor  # already in host memory: nothing to move
        host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        return host

    # Backward: unpack with a bounded look-ahead -----------------------------------------------
    def _fetch(self, key: int, slot: int, device: torch.device) -> torch.Tensor:
        # Backward visits forwards in reverse order: reaching `key` means the backward of
        # every later forward is done, so their loaded copies are released.
        for done in [k for k in self._loaded if k > key]:
            self._drop(done)
        self._load(key, device)
        earlier = sorted((k for k in self._host if k < key), reverse=True)
        for ahead in earlier[: self.horizon - 1]:
            self._load(ahead, device)
        resident = len(self._loaded)
        self.resident_trace.append(resident)
        self.max_resident = max(self.max_resident, resident)
        self._unpacked[key] += 1
        return self._loaded[key][slot]

    def _load(self, key: int, device: torch.device) -> None:
        if key not in self._loaded:
            self._loaded[key] = [
                t if device.type == "cpu" else t.to(device, non_blocking=True)
                for t in self._host[key]
            ]

    def _drop(self, key: int) -> None:
        self._loaded.pop(key, None)
        self._host.pop(key, None)
        self._unpacked.pop(key, None)

    def _release_finished(self) -> None:
        # A forward starting after a backward: the forwards whose every saved input was
        # unpacked are finished (the first layer's copies are otherwise never released).
        for key in [k for k in self._loaded if self._unpacked[k] == len(self._host[k])]:
            self._drop(key)

    @property
    def pending(self) -> int:
        """Forwards whose inputs are still held (offloaded or loaded)."""
        return len(self._host)


def _checkpointed_forward(offloader: Optional[ActivationOffloader], index: int,
                          module: torch.nn.Module, *args, **kwargs):
    from megatron_smp.tensor_parallel.random import checkpoint

    if kwargs:
        raise TypeError("checkpointed transformer layers take positional arguments only")
    if not torch.is_grad_enabled():  # no backward to save anything for
        return module(*args)
    context = offloader.layer(index) if offloader is not None else contextlib.nullcontext()
    with context:
        return checkpoint(module, False, *args, module=module)


def bare_layer(module: torch.nn.Module) -> torch.nn.Module:
    """`module` without the FSDP1 unit and torch checkpoint wrapper around it (read from the
    child modules: FSDP1 forwards unknown attributes to what it wraps)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torch.distributed.fsdp import FullyShardedDataParallel

    while True:
        if isinstance(module, FullyShardedDataParallel):
            module = module._modules["_fsdp_wrapped_module"]
        elif isinstance(module, CheckpointWrapper):
            module = module._modules["_checkpoint_wrapped_module"]
        else:
            return module


def apply_activation_checkpointing(
    model: torch.nn.Module,
    layers: List[torch.nn.Module],
    offloader: Optional[ActivationOffloader] = None,
) -> List[torch.nn.Module]:
    """Replace each of `layers` (modules of `model`) by a checkpoint wrapper where its parent
    holds it (a ModuleList, or an FSDP1 unit around the layer); a torch `checkpoint_wrapper`
    a script put around a layer is replaced by ours. Returns the wrappers in order.
    State-dict names are unchanged (torch's wrapper strips its prefix)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    wrapped = []
    targets = {}  # id(module to replace) -> (index, our wrapper)
    for index, layer in enumerate(layers):
        wrapper = checkpoint_wrapper(
            layer, checkpoint_fn=functools.partial(_checkpointed_forward, offloader, index)
        )
        targets[id(layer)] = (index, wrapper)
        wrapped.append(wrapper)
    found = set()
    for parent in list(model.modules()):
        if isinstance(parent, CheckpointWrapper):  # replaced as a child of its own parent
            continue
        for name, child in list(parent.named_children()):
            inner = child._checkpoint_wrapped_module if isinstance(
                child, CheckpointWrapper) else child
            if id(inner) in targets:
                index, wrapper = targets[id(inner)]
                if isinstance(parent, torch.nn.ModuleList):
                    parent[int(name)] = wrapper
                else:
                    setattr(parent, name, wrapper)
                found.add(index)
    if len(found) != len(layers):
        raise ConfigError(
            "activation checkpointing wraps layers that are modules of the model; "
            f"found {len(found)} of {len(layers)}"
        )
    return wrapped


__all__ = ["ActivationOffloader", "apply_activation_checkpointing", "bare_layer"]
