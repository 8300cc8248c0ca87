"""A fake accelerator for the CPU build: find device mismatches and count host syncs per
training step without a GPU.

    with FakeDevice() as device:       # PrivateUse1 renamed "fakegpu"; state.device is it
        result = pretrain(...)         # or any model / optimizer code
    device.syncs                       # [Sync(kind, op, where)] in order

How it works
* torch's PrivateUse1 backend gets a Python device ("fakegpu", with a stub device module for
  the RNG, device-count and context-manager calls) and tensors on it are FakeTensors
  (`FakeTensorMode`): shapes, dtypes and devices are propagated by torch's own rules, so an
  op mixing a fakegpu tensor with a CPU tensor of more than 0 dims raises torch's
  "Expected all tensors to be on the same device" where CUDA would.
* Every fake tensor has a *shadow*: the same op run on real CPU tensors. Values are real, so
  control flow that reads them (routing maps, token counts, loss scale checks) behaves as on a
  device, and data-dependent shapes (nonzero, masked_select, splits by counts) get their
  real size.
* Host syncs are the reads of a device tensor's value on the host: `item`, `__bool__`,
  `__float__`, `__int__` (aten._local_scalar_dense / is_nonzero), `tolist`, `numpy`,
  blocking device->host copies (`.cpu()`, `.to("cpu")`), and ops whose output shape depends
  on values (nonzero, masked_select, unique, repeat_interleave without output_size, ...).
  Each is recorded with the innermost frame of our code (megatron_smp, an entry script, a
  test).
* Tensor collectives (torch.distributed, one rank) are checked to get fakegpu tensors -- the
  NCCL error "No backend type associated with device type cpu" -- and act as identities.
* Wrapper subclasses (FSDP2's DTensor) dispatch their local tensors, which are fake.

What torch 2.13's Python PrivateUse1 backend lacks, and is patched inside a session: kernels
(so tensors on it can only be fake), `torch.tensor(..., device=)` (built on the CPU, then
moved), pinned host memory (C++ allocator hook only: host memory stays pageable),
`nn.Module.to`'s swap of fake parameters (weak references: `.data =` instead), and the
`.data` / `tolist` paths that bypass the dispatcher (they carry or read the shadow).

Known limits: `device.type == "cuda"` branches (apex, torch.cuda streams and events, fused
kernels, flash/efficient SDPA) are not exercised; one rank only (collectives are identities,
so per-rank differences in *which* collectives run are not seen); the kernel an op would take
on CUDA is not CUDA's; streams and events are no-ops and non-blocking copies are taken to be
free, so overlap is not checked.
"""
from __future__ import annotations

import contextlib
import dataclasses
import traceback
import types
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
)
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map

DEVICE_TYPE = "fakegpu"
aten = torch.ops.aten

# Ops that read a value on the host.
_SCALAR_READS = {aten._local_scalar_dense.default, aten.is_nonzero.default}
# Python-level reads that do not pass through _local_scalar_dense.
_LIST_READS = ("tolist", "numpy")
_COPIES = {aten._to_copy.default, aten.copy_.default}
_SHADOW = "_fake_device_shadow"
_PLAIN = (torch.Tensor, torch.nn.Parameter, FakeTensor)


class DeviceMismatchError(RuntimeError):
    """A collective got a tensor that is not on the accelerator."""


@dataclasses.dataclass
class Sync:
    kind: str  # "scalar read", "list read", "device->host copy", "data-dependent shape"
    op: str
    where: str  # the innermost megatron_smp frame (or the caller's), "file:line function"

    def __str__(self) -> str:
        return f"{self.kind} ({self.op}) at {self.where}"


def _caller() -> str:
    """The innermost frame of our code (megatron_smp, an entry script, or a test)."""
    frames = traceback.extract_stack()[:-3]
    for frame in reversed(frames):
        name = frame.filename
        if ("/torch/" in name or "/site-packages/" in name or name.endswith("harness.py")
                or "/python3" in name):
            continue
        short = name[name.find("megatron_smp/"):] if "/megatron_smp/" in name \
            else name.rsplit("/", 1)[-1]
        return f"{short}:{frame.lineno} {frame.name}"
    return "?"


# -- the device ---------------------------------------------------------------------------------

class _DeviceModule(types.ModuleType):
    """torch.fakegpu: what our code calls on an accelerator module (RNG, counts, context)."""

    def __init__(self):
        super().__init__(DEVICE_TYPE)
        self._rng = {}

    def is_available(self) -> bool:
        return _ACTIVE

    def device_count(self) -> int:
        return 1

    def current_device(self) -> int:
        return 0

    def set_device(self, index) -> None:
        pass

    def synchronize(self, device=None) -> None:
        pass

    def _is_in_bad_fork(self) -> bool:
        return False

    def is_initialized(self) -> bool:
        return True

    def _lazy_init(self) -> None:
        pass

    def get_amp_supported_dtype(self):
        return [torch.float16, torch.bfloat16]

    def is_bf16_supported(self) -> bool:
        return True

    def manual_seed(self, seed: int) -> None:
        # A CUDA generator's state is 16 bytes (seed, offset): so is this one's.
        with _disable_current_modes():
            self._rng[0] = torch.tensor([int(seed) & 0xFF] + [0] * 15, dtype=torch.uint8)

    manual_seed_all = manual_seed

    def get_rng_state(self, device=None) -> torch.Tensor:
        with _disable_current_modes():
            return self._rng.setdefault(0, torch.zeros(16, dtype=torch.uint8)).clone()

    def set_rng_state(self, state: torch.Tensor, device=None) -> None:
        if state.numel() != 16:
            raise RuntimeError(f"{DEVICE_TYPE} RNG state must be 16 bytes, got {state.numel()}")
        with _disable_current_modes():
            self._rng[0] = state.clone()

    # Streams and events (FSDP2 overlaps its all-gathers on them): one ordered stream.
    class Event:
        def __init__(self, *args, **kwargs):
            pass

        def record(self, stream=None):
            pass

        def wait(self, stream=None):
            pass

        def synchronize(self):
            pass

        def query(self):
            return True

    class Stream:
        def __init__(self, *args, **kwargs):
            pass

        def wait_stream(self, stream):
            pass

        def wait_event(self, event):
            pass

        def record_event(self, event=None):
            return event or _DeviceModule.Event()

        def synchronize(self):
            pass

        def query(self):
            return True

    def current_stream(self, device=None):
        return self.Stream()

    default_stream = current_stream

    def set_stream(self, stream) -> None:
        pass

    @contextlib.contextmanager
    def stream(self, stream):
        yield

    class device:  # noqa: N801 - torch's name
        def __init__(self, index):
            self.index = index

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False


_REGISTERED = False
# Available (torch.accelerator, rng_device) only inside a FakeDevice session: the rest of a
# pytest process keeps seeing a CPU-only machine.
_ACTIVE = False


class _Hooks(torch._C._acc.PrivateUse1Hooks):
    def is_available(self) -> bool:
        return _ACTIVE

    def has_primary_context(self, dev_id) -> bool:
        return True

    def is_built(self) -> bool:
        return True


def register_fake_device() -> torch.device:
    """Rename PrivateUse1 to "fakegpu" and give it a Python device module (once per process)."""
    global _REGISTERED
    if not _REGISTERED:
        from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

        _setup_privateuseone_for_python_backend(DEVICE_TYPE, backend_module=_DeviceModule(),
                                                hook=_Hooks())
        _REGISTERED = True
    return torch.device(DEVICE_TYPE, 0)


@contextlib.contextmanager
def _active():
    global _ACTIVE
    _ACTIVE = True
    try:
        yield
    finally:
        _ACTIVE = False


def _on_device(value) -> bool:
    return isinstance(value, torch.Tensor) and value.device.type == DEVICE_TYPE


# -- the modes ----------------------------------------------------------------------------------

class _Shadows(TorchDispatchMode):
    """Runs each op that involves a fake tensor twice: fake (device rules) and on the real CPU
    shadows (values); records host syncs of fakegpu tensors."""

    def __init__(self, fake_mode: FakeTensorMode, record):
        super().__init__()
        self.fake_mode = fake_mode
        self.record = record

    @staticmethod
    def link(fake: torch.Tensor, real: torch.Tensor) -> None:
        # An attribute, not a weak table: nn.Module.to swaps tensors (torch.utils.swap_tensors
        # refuses tensors with weak references) and carries __dict__ along.
        fake.__dict__[_SHADOW] = real

    def real(self, value):
        if isinstance(value, FakeTensor):
            real = value.__dict__.get(_SHADOW)
            if real is None:
                raise RuntimeError("fake-device harness: a fake tensor without a shadow "
                                   f"({value.shape}, {value.dtype})")
            return real
        if isinstance(value, torch.device) and value.type == DEVICE_TYPE:
            return torch.device("cpu")
        return value

    def fake(self, value):
        if isinstance(value, torch.Tensor) and not isinstance(value, FakeTensor):
            # A factory call, not fake_mode.from_tensor: that keeps a weak reference to the
            # real tensor, which nn.Module.to then cannot swap.
            fake = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype,
                                       device=value.device)
            self.link(fake, value)
            return fake
        return value

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        if any(isinstance(v, torch.Tensor) and type(v) not in _PLAIN for v in flat):
            # A wrapper subclass (DTensor): it unwraps and dispatches its local tensors,
            # which come back here.
            return NotImplemented
        involved = any(isinstance(v, FakeTensor) for v in flat) or any(
            (isinstance(v, torch.device) and v.type == DEVICE_TYPE)
            or (isinstance(v, str) and v.startswith(DEVICE_TYPE)) for v in flat)
        if not involved:  # host work (data pipeline, CPU bookkeeping): real, untouched
            with _disable_current_modes():
                return func(*args, **kwargs)
        real_args = tree_map(self.real, args)
        real_kwargs = tree_map(self.real, kwargs)
        for key in ("device",):
            if isinstance(real_kwargs.get(key), str) and real_kwargs[key].startswith(DEVICE_TYPE):
                real_kwargs[key] = "cpu"
        on_device = any(_on_device(v) for v in flat)
        if func in _SCALAR_READS:
            if on_device:
                self.record("scalar read", str(func))
            with _disable_current_modes():
                return func(*real_args, **real_kwargs)
        if func in _COPIES and not kwargs.get("non_blocking", False):
            source = args[1] if func is aten.copy_.default else args[0]
            target_device = (args[0].device if func is aten.copy_.default
                             else kwargs.get("device", source.device))
            if _on_device(source) and torch.device(target_device).type == "cpu":
                self.record("device->host copy", str(func))
        with _disable_current_modes():
            real_out = func(*real_args, **real_kwargs)
        # Real inputs enter as fake tensors of their own device (torch's fake mode cannot move
        # a real tensor to a backend without kernels); a real tensor is its own shadow.
        args, kwargs = tree_map(self.fake, (args, kwargs))
        try:
            fake_out = func(*args, **kwargs)
        except (DynamicOutputShapeException, DataDependentOutputException):
            if on_device:
                self.record("data-dependent shape", str(func))
            device = next((v.device for v in flat if isinstance(v, torch.Tensor)),
                          torch.device("cpu"))
            fake_out = tree_map(
                lambda r: torch.empty_strided(r.shape, r.stride(), dtype=r.dtype, device=device)
                if isinstance(r, torch.Tensor) else r, real_out)
        for fake, real in zip(tree_flatten(fake_out)[0], tree_flatten(real_out)[0]):
            if isinstance(fake, FakeTensor) and isinstance(real, torch.Tensor):
                self.link(fake, real)
        return fake_out


def _list_read(shadows: _Shadows, record, name: str):
    """FakeTensor.tolist / numpy: recorded (on fakegpu) and answered from the shadow (a fake
    tensor's own tolist reads element by element; torch function modes do not see it)."""
    def read(self, *args, **kwargs):
        if _on_device(self):
            record("list read", name)
        return getattr(shadows.real(self).detach(), name)(*args, **kwargs)

    return read


def _data_property() -> property:
    """`.data` bypasses the dispatcher (`param.data = bucket_view` in our DDP): carry the
    shadow along both ways."""
    descriptor = torch._C.TensorBase.data

    def get(self):
        alias = descriptor.__get__(self)
        if _SHADOW in self.__dict__:
            alias.__dict__[_SHADOW] = self.__dict__[_SHADOW].data
        return alias

    def set(self, value):
        descriptor.__set__(self, value)
        if isinstance(value, FakeTensor) and _SHADOW in value.__dict__:
            self.__dict__[_SHADOW] = value.__dict__[_SHADOW]

    return property(get, set)


def _via_cpu(construct):
    """torch.tensor(data, device=fakegpu) allocates on the backend below the Python modes
    (no kernels there): build on the CPU, then move."""
    def build(data, *args, device=None, requires_grad=False, **kwargs):
        if device is not None and torch.device(device).type == DEVICE_TYPE:
            moved = construct(data, *args, **kwargs).to(device)
            return moved.requires_grad_() if requires_grad else moved
        if requires_grad:
            kwargs["requires_grad"] = True
        return construct(data, *args, device=device, **kwargs)

    return build


def _swap_or_set_data(swap):
    """nn.Module.to swaps a FakeTensor param with its converted copy, which fails on the weak
    references the fake mode keeps; `.data =` does what swapping would for a parameter."""
    def swap_tensors(t1, t2):
        try:
            return swap(t1, t2)
        except RuntimeError:
            if not (isinstance(t1, FakeTensor) and isinstance(t2, FakeTensor)):
                raise
            t1.data = t2
            return None

    return swap_tensors


# -- collectives --------------------------------------------------------------------------------

def _check(name: str, *tensors) -> None:
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and tensor.device.type != DEVICE_TYPE:
            raise DeviceMismatchError(
                f"dist.{name} got a tensor on {tensor.device} ({tuple(tensor.shape)}, "
                f"{tensor.dtype}); NCCL reduces accelerator tensors only")


class _Work:
    def wait(self, *args, **kwargs):
        return True

    def is_completed(self):
        return True


def _collectives() -> Dict[str, Any]:
    """One-rank identities that check their tensors' device."""
    def done(async_op=False):
        return _Work() if async_op else None

    def all_reduce(tensor, op=None, group=None, async_op=False):
        _check("all_reduce", tensor)
        return done(async_op)

    def broadcast(tensor, src=0, group=None, async_op=False, **kwargs):
        _check("broadcast", tensor)
        return done(async_op)

    def all_gather_into_tensor(output, input, group=None, async_op=False):
        _check("all_gather_into_tensor", output, input)
        output.copy_(input.reshape(output.shape))
        return done(async_op)

    def reduce_scatter_tensor(output, input, op=None, group=None, async_op=False):
        _check("reduce_scatter_tensor", output, input)
        output.copy_(input.reshape(output.shape))
        return done(async_op)

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None,
                          group=None, async_op=False):
        _check("all_to_all_single", output, input)
        output.copy_(input)
        return done(async_op)

    def all_gather(tensor_list, tensor, group=None, async_op=False):
        _check("all_gather", tensor, *tensor_list)
        for out in tensor_list:
            out.copy_(tensor)
        return done(async_op)

    def reduce(tensor, dst=0, op=None, group=None, async_op=False, **kwargs):
        _check("reduce", tensor)
        return done(async_op)

    return dict(all_reduce=all_reduce, broadcast=broadcast,
                all_gather_into_tensor=all_gather_into_tensor,
                reduce_scatter_tensor=reduce_scatter_tensor,
                all_to_all_single=all_to_all_single, all_gather=all_gather, reduce=reduce)


# -- the session --------------------------------------------------------------------------------

class FakeDevice(contextlib.AbstractContextManager):
    """See the module docstring. Inside, `megatron_smp.parallel_state.default_device()` is the
    fake device, and a one-rank gloo process group is expected (build_parallel_state makes
    it). `syncs` lists the host syncs in order; `mark()` starts a new step's list."""

    def __init__(self):
        self.device = register_fake_device()
        self.syncs: List[Sync] = []
        self._stack = contextlib.ExitStack()

    def _record(self, kind: str, op: str) -> None:
        self.syncs.append(Sync(kind, op, _caller()))

    def real(self, tensor: torch.Tensor) -> torch.Tensor:
        """The value of a fake tensor (no sync is recorded)."""
        return self._shadows.real(tensor)

    def __enter__(self) -> "FakeDevice":
        import megatron_smp.parallel_state as parallel_state

        from megatron_smp.tensor_parallel.random import get_rng_tracker

        stack = self._stack
        stack.enter_context(_active())
        # The process-wide RNG tracker gets fakegpu streams inside: give back the old ones.
        tracker = get_rng_tracker()
        saved = (dict(tracker.states), set(tracker.seeds), tracker.device)
        stack.callback(lambda: setattr(tracker, "states", saved[0]) or setattr(
            tracker, "seeds", saved[1]) or setattr(tracker, "device", saved[2]))
        patch = _Patcher(stack)
        patch(parallel_state, "default_device", lambda: self.device)
        for name, function in _collectives().items():
            patch(dist, name, function)
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        self._shadows = _Shadows(fake_mode, self._record)
        stack.enter_context(fake_mode)
        stack.enter_context(self._shadows)
        patch(FakeTensor, "data", _data_property())
        # Pinned host memory needs a C++ allocator hook: host memory stays pageable here.
        patch(torch.Tensor, "pin_memory", lambda self, *args, **kwargs: self)
        patch(torch.Tensor, "is_pinned", lambda self, *args, **kwargs: False)
        for name in ("tensor", "as_tensor"):
            patch(torch, name, _via_cpu(getattr(torch, name)))
        patch(torch.utils, "swap_tensors", _swap_or_set_data(torch.utils.swap_tensors))
        for name in _LIST_READS:
            patch(FakeTensor, name, _list_read(self._shadows, self._record, name))
        return self

    def __exit__(self, *exc) -> Optional[bool]:
        return self._stack.__exit__(*exc)


class _Patcher:
    """setattr with undo on the exit stack."""

    def __init__(self, stack: contextlib.ExitStack):
        self.stack = stack

    def __call__(self, owner, name: str, value) -> None:
        if name in vars(owner):
            self.stack.callback(setattr, owner, name, vars(owner)[name])
        else:
            self.stack.callback(delattr, owner, name)
        setattr(owner, name, value)


# -- training runs ------------------------------------------------------------------------------

@dataclasses.dataclass
class StepSyncs:
    """Host syncs of one steady-state training iteration (from the start of one train_step
    to the start of the next), and the losses the run logged."""

    syncs: List[Sync]
    losses: List[float]

    def summary(self) -> Dict[str, int]:
        """{"kind at where": count}."""
        counts: Dict[str, int] = {}
        for sync in self.syncs:
            key = f"{sync.kind} at {sync.where}"
            counts[key] = counts.get(key, 0) + 1
        return counts


def pretrain_on_fake_device(script: str, argv: List[str], measured_iteration: int = 2
                            ) -> StepSyncs:
    """Run `script`'s providers through `pretrain` with `argv` on the fake device (one rank,
    in this process); the host syncs of iteration `measured_iteration` (1-based, > 1, less
    than --train-iters so that it is a middle one)."""
    import importlib

    pretrain_module = importlib.import_module("megatron_smp.training.pretrain")

    entry = importlib.import_module(script)
    starts: List[int] = []
    with FakeDevice() as device:
        original = pretrain_module.Trainer.train_step

        def train_step(*args, **kwargs):
            starts.append(len(device.syncs))
            return original(*args, **kwargs)

        pretrain_module.Trainer.train_step = train_step
        try:
            result = pretrain_module.pretrain(
                entry.train_valid_test_datasets_provider, entry.model_provider,
                entry.forward_step, argv=argv,
                args_defaults=getattr(entry, "LLAMA_DEFAULTS", None))
        finally:
            pretrain_module.Trainer.train_step = original
            if dist.is_initialized():
                dist.destroy_process_group()
    begin, end = starts[measured_iteration - 1], starts[measured_iteration]
    losses = [result.train_losses[i]["lm loss"] for i in sorted(result.train_losses)]
    return StepSyncs(device.syncs[begin:end], losses)
