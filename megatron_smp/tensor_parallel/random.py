"""Random-number streams for tensor parallelism, on any device, and activation recompute.

Two kinds of randomness in a tensor-parallel model:

* outside tensor-parallel regions (hidden dropout on replicated or sequence-parallel
  activations) every TP rank must draw the same numbers: the default generator, seeded
  identically on the ranks of a pipeline stage;
* inside them (dropout on attention probabilities, whose heads are split over ranks) each
  rank must draw different numbers: run under `get_rng_tracker().fork()`, which swaps in a
  per-TP-rank generator state for the duration.

The tracker swaps the default generator state of the device that computes: the CPU
generator on a CPU-only machine, the current accelerator's generator (e.g. CUDA) otherwise.
"""
from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, Optional

import torch
import torch.nn.functional as F

from megatron_smp.tensor_parallel.mappings import (
    ProcessGroup,
    _gather_first_dim,
    group_rank,
    group_size,
)

MODEL_PARALLEL_RNG = "model-parallel-rng"
EXPERT_PARALLEL_RNG = "expert-parallel-rng"
DATA_PARALLEL_RNG = "data-parallel-rng"

# Offsets as in Megatron, so a seed gives the same streams there and here.
_PIPELINE_SEED_STRIDE = 100
_TENSOR_PARALLEL_SEED_OFFSET = 2718
_EXPERT_PARALLEL_SEED_OFFSET = 1024


def rng_device() -> torch.device:
    """The device whose default generator dropout uses: the current accelerator, else CPU."""
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and accelerator.is_available():
        current = accelerator.current_accelerator()
        return torch.device(current.type, accelerator.current_device_index())
    if torch.cuda.is_available():  # torch without the torch.accelerator API
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def get_device_rng_state(device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return torch.get_rng_state()
    return torch.get_device_module(device.type).get_rng_state(device)


def set_device_rng_state(state: torch.Tensor, device: torch.device) -> None:
    if device.type == "cpu":
        torch.set_rng_state(state)
    else:
        torch.get_device_module(device.type).set_rng_state(state, device)


def _seed_device(seed: int, device: torch.device) -> None:
    if device.type == "cpu":
        torch.default_generator.manual_seed(seed)
    else:
        with torch.get_device_module(device.type).device(device):
            torch.get_device_module(device.type).manual_seed(seed)


class RNGStatesTracker:
    """Named generator states that `fork(name)` swaps in and out of the default generator.

    States belong to one device, fixed by the first `add` (see `rng_device`).
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.states: Dict[str, torch.Tensor] = {}
        self.seeds: set = set()
        self.seed_of: Dict[str, int] = {}
        self.device: Optional[torch.device] = None

    def is_initialized(self) -> bool:
        return bool(self.states)

    def get_states(self) -> Dict[str, torch.Tensor]:
        """A copy of every named state (for checkpoints and recompute)."""
        return {name: state.clone() for name, state in self.states.items()}

    def set_states(self, states: Dict[str, torch.Tensor]) -> None:
        self.states = {name: state.clone() for name, state in states.items()}
        if self.device is None and states:
            self.device = rng_device()

    def add(self, name: str, seed: int) -> None:
        """Create the stream `name` from `seed` without disturbing the default generator."""
        if name in self.states:
            raise ValueError(f"RNG state {name!r} already exists")
        if seed in self.seeds:
            raise ValueError(f"seed {seed} is already used by another RNG state")
        if self.device is None:
            self.device = rng_device()
        saved = get_device_rng_state(self.device)
        _seed_device(seed, self.device)
        self.states[name] = get_device_rng_state(self.device)
        set_device_rng_state(saved, self.device)
        self.seeds.add(seed)
        self.seed_of[name] = seed

    def reseed(self, name: str, seed: int) -> None:
        """Start the existing stream `name` again from `seed` (e.g. SMP's
        MoEConfig.random_seed for the expert-parallel stream)."""
        if name in self.states:
            self.seeds.discard(self.seed_of.pop(name, None))
            del self.states[name]
        self.add(name, seed)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Draw from stream `name` inside the block; the default stream is left untouched."""
        if name not in self.states:
            raise KeyError(
                f"RNG state {name!r} was never added; call model_parallel_seed(seed, state) "
                "after building the ParallelState"
            )
        saved = get_device_rng_state(self.device)
        set_device_rng_state(self.states[name], self.device)
        try:
            yield
        finally:
            self.states[name] = get_device_rng_state(self.device)
            set_device_rng_state(saved, self.device)


_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    """The process-wide tracker (one per process: it mirrors the process-wide generators)."""
    return _TRACKER


def model_parallel_seed(seed: int, state: Any) -> None:
    """Seed the default generators and the tracker's streams for this rank of `state`.

    As in Megatron, with base = seed + 100 * pp_rank:
      * default generator (CPU and accelerators): base, the same on every TP/DP rank of a stage;
      * "model-parallel-rng":  base + 2718 + tp_rank, different on each TP rank;
      * "expert-parallel-rng": base + 1024 + 100 * ep_rank + tp_rank;
      * "data-parallel-rng":   base.
    `state` is a ParallelState (reads pp_rank, tp_rank, ep_rank).
    """
    base = seed + _PIPELINE_SEED_STRIDE * state.pp_rank
    torch.manual_seed(base)
    tracker = get_rng_tracker()
    tracker.reset()
    tracker.add(MODEL_PARALLEL_RNG, base + _TENSOR_PARALLEL_SEED_OFFSET + state.tp_rank)
    tracker.add(EXPERT_PARALLEL_RNG, expert_parallel_stream_seed(seed, state))
    tracker.add(DATA_PARALLEL_RNG, base)


def expert_parallel_stream_seed(seed: int, state: Any) -> int:
    """The "expert-parallel-rng" stream's seed of this rank: seed + 100 * pp_rank + 1024 +
    100 * ep_rank + tp_rank (Megatron's), unique per expert- and tensor-parallel rank."""
    return (seed + _PIPELINE_SEED_STRIDE * state.pp_rank + _EXPERT_PARALLEL_SEED_OFFSET
            + _PIPELINE_SEED_STRIDE * state.ep_rank + state.tp_rank)



# Layout-independent initialisation. -----------------------------------------------------------

_SEED_MODULUS = 2**63 - 1


def derive_seed(base_seed: int, index: int) -> int:
    """A seed for part `index` of a model, decorrelated from its neighbours' seeds."""
    return (base_seed * 1_000_003 + 7_919 * (index + 1)) % _SEED_MODULUS


@contextlib.contextmanager
def init_rng_scope(seed: Optional[int]) -> Iterator[None]:
    """Build parameters from the CPU default generator seeded with `seed`, then restore it.

    The tensor-parallel layers draw their master weights from the CPU default generator in
    construction order; seeding it per model part (embedding, each layer by its global
    number, output layer, each LoRA adapter) makes each part's weights independent of which
    other parts this process builds, so a pipeline stage gets exactly the single-stage
    model's weights. `None` draws from the generator as it is.
    """
    if seed is None:
        yield
        return
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        yield


# Activation recompute. ---------------------------------------------------------------------------


def _all_rng_states(device: torch.device) -> tuple:
    device_state = None if device.type == "cpu" else get_device_rng_state(device)
    return torch.get_rng_state(), device_state, get_rng_tracker().get_states()


def _restore_rng_states(states: tuple, device: torch.device) -> None:
    cpu_state, device_state, tracker_states = states
    torch.set_rng_state(cpu_state)
    if device_state is not None:
        set_device_rng_state(device_state, device)
    get_rng_tracker().set_states(tracker_states)


# What the checkpointed functions running now are doing, innermost last: "forward" (the
# first run, without grad) or "recompute" (the rerun in backward). See `recompute_phase`.
_PHASES: list = []


@contextlib.contextmanager
def _phase(name: str) -> Iterator[None]:
    _PHASES.append(name)
    try:
        yield
    finally:
        _PHASES.pop()


def recompute_phase() -> Optional[str]:
    """The activation-recompute phase now: "recompute" while a checkpointed function reruns
    in backward (at any depth), "forward" during its first run, None outside any checkpoint.

    Modules that record statistics in forward (the MoE router's losses and token counts)
    record them in the first run only: the recompute repeats the same computation for its
    graph, and recording again would count every microbatch twice. The first run has grads
    off, so `torch.is_grad_enabled()` alone cannot tell it from evaluation."""
    if "recompute" in _PHASES:
        return "recompute"
    return _PHASES[-1] if _PHASES else None


def _rerun(run_function, ctx, tensors, rng_states: tuple, device: torch.device):
    """Recompute: `run_function` on grad-requiring detached copies of the saved inputs
    (`ctx` holds where the tensors go among the arguments), under the forward's RNG states.
    Returns (args, outputs)."""
    args = list(ctx.non_tensor_args)
    for position, tensor, requires_grad in zip(ctx.tensor_positions, tensors,
                                               ctx.inputs_require_grad):
        args[position] = tensor.detach().requires_grad_(requires_grad)
    current = _all_rng_states(device)
    _restore_rng_states(rng_states, device)
    try:
        with torch.enable_grad(), _phase("recompute"):
            outputs = run_function(*args)
    finally:
        _restore_rng_states(current, device)
    return args, outputs


def _backward_through(args, outputs, grad_outputs) -> tuple:
    """Backward from the recomputed `outputs`; the grads of `args` (None for non-tensors)."""
    if torch.is_tensor(outputs):
        outputs = (outputs,)
    pairs = [(out, grad) for out, grad in zip(outputs, grad_outputs)
             if torch.is_tensor(out) and out.requires_grad and grad is not None]
    if pairs:
        torch.autograd.backward([p[0] for p in pairs], [p[1] for p in pairs])
    return tuple(a.grad if torch.is_tensor(a) else None for a in args)


class _CheckpointFunction(torch.autograd.Function):
    """Run `function` without keeping its activations; rerun it in backward with the RNG
    states (default and tracker) it saw in forward, so dropout masks are reproduced."""

    @staticmethod
    def forward(ctx, run_function, distribute_group, num_leaves, *inputs):
        # The last `num_leaves` inputs are the weights' leaves (`checkpoint(module=...)`):
        # inputs only so that backward can return their grads; held, not saved.
        args = inputs[:len(inputs) - num_leaves]
        ctx.leaves = inputs[len(inputs) - num_leaves:]
        ctx.run_function = run_function
        ctx.device = rng_device()
        ctx.rng_states = _all_rng_states(ctx.device)
        with _phase("forward"):  # autograd.Function.forward already runs without grad
            outputs = run_function(*args)

        ctx.tensor_positions = [i for i, a in enumerate(args) if torch.is_tensor(a)]
        ctx.inputs_require_grad = [args[i].requires_grad for i in ctx.tensor_positions]
        ctx.non_tensor_args = [None if torch.is_tensor(a) else a for a in args]
        tensors = [args[i] for i in ctx.tensor_positions]
        ctx.distribute_group = None
        if (
            distribute_group is not None
            and group_size(distribute_group) > 1
            and ctx.tensor_positions[:1] == [0]
        ):
            # Keep only this rank's 1/tp of the first input (the hidden states, identical on
            # every TP rank); backward all-gathers it before the recompute.
            world = group_size(distribute_group)
            first = args[0]
            if first.numel() % world != 0:
                raise ValueError(
                    f"distribute_saved_activations: {first.numel()} elements of the first "
                    f"input do not split over {world} tensor-parallel ranks"
                )
            chunk = first.numel() // world
            flat = first.detach().contiguous().view(-1)
            tensors[0] = flat.narrow(0, group_rank(distribute_group) * chunk, chunk).clone()
            ctx.first_shape = first.shape
            ctx.distribute_group = distribute_group
        ctx.save_for_backward(*tensors)
        return outputs

    @staticmethod
    def backward(ctx, *grad_outputs):
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError(
                "checkpoint() is not compatible with torch.autograd.grad(); use .backward()"
            )
        tensors = list(ctx.saved_tensors)
        if ctx.distribute_group is not None:
            tensors[0] = _gather_first_dim(tensors[0], ctx.distribute_group).view(ctx.first_shape)
        args, outputs = _rerun(ctx.run_function, ctx, tensors, ctx.rng_states, ctx.device)
        if not ctx.leaves:
            return (None, None, None) + _backward_through(args, outputs, grad_outputs)
        return (None, None, None) + _grads_through(args, outputs, grad_outputs, ctx.leaves)


def weight_leaves(module: torch.nn.Module) -> list:
    """The autograd leaves behind `module`'s weights as they are now: each parameter that is
    a leaf, and for a weight that is a view with a graph (FSDP1 sets its modules' weights
    to views of its unsharded flat parameter during forward and backward) the leaves that
    graph reaches (that flat parameter)."""
    leaves: Dict[int, torch.Tensor] = {}
    seen = set()
    for sub in module.modules():
        tensors = list(sub._parameters.values()) + [
            v for v in vars(sub).values() if isinstance(v, torch.Tensor)]
        for tensor in tensors:
            if tensor is None or not tensor.requires_grad:
                continue
            if tensor.grad_fn is None:
                leaves[id(tensor)] = tensor
                continue
            stack = [tensor.grad_fn]
            while stack:
                node = stack.pop()
                if node is None or node in seen:
                    continue
                seen.add(node)
                variable = getattr(node, "variable", None)  # AccumulateGrad
                if variable is not None:
                    leaves[id(variable)] = variable
                stack.extend(next_node for next_node, _ in node.next_functions)
    return list(leaves.values())


def _reached_leaves(outputs) -> Dict[int, torch.Tensor]:
    """The leaves the recorded graph of `outputs` accumulates into."""
    reached: Dict[int, torch.Tensor] = {}
    seen = set()
    stack = [o.grad_fn for o in outputs if torch.is_tensor(o) and o.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            reached[id(variable)] = variable
        stack.extend(next_node for next_node, _ in node.next_functions)
    return reached


def _grads_through(args, outputs, grad_outputs, leaves) -> tuple:
    """Backward from the recomputed `outputs` without accumulating into any leaf: the grads
    of `args` and of the weights' `leaves` come back as this Function's input grads, so the
    leaves get theirs once, in the outer backward (FSDP1 reshards a flat parameter and
    reduces its grad when its grad accumulates: a nested backward that accumulated would
    leave the next recomputed layer on the sharded views)."""
    if torch.is_tensor(outputs):
        outputs = (outputs,)
    pairs = [(out, grad) for out, grad in zip(outputs, grad_outputs)
             if torch.is_tensor(out) and out.requires_grad and grad is not None]
    declared = {id(leaf) for leaf in leaves}
    stray = [v for k, v in _reached_leaves([p[0] for p in pairs]).items()
             if k not in declared and not any(k == id(a) for a in args)]
    if stray:
        raise RuntimeError(
            f"checkpoint(module=...): the recompute reached {len(stray)} tensor(s) with "
            f"shapes {[tuple(t.shape) for t in stray[:3]]} that are not weights of the module "
            "(a weight shared with a module outside the checkpointed one); checkpoint the "
            "module holding every weight it uses"
        )
    wanted = [(i, a) for i, a in enumerate(args) if torch.is_tensor(a) and a.requires_grad]
    targets = [a for _, a in wanted] + list(leaves)
    arg_grads = [None] * len(args)
    leaf_grads = [None] * len(leaves)
    if pairs and targets:
        grads = torch.autograd.grad([p[0] for p in pairs], targets, [p[1] for p in pairs],
                                    allow_unused=True)
        for (position, _), grad in zip(wanted, grads):
            arg_grads[position] = grad
        leaf_grads = list(grads[len(wanted):])
    return tuple(arg_grads) + tuple(leaf_grads)


def checkpoint(
    function,
    distribute_saved_activations: bool,
    *args,
    tp_group: ProcessGroup = None,
    module: Optional[torch.nn.Module] = None,
):
    """Activation recompute: `function(*args)` keeps no activations; backward reruns it
    under the forward's RNG states (default generator and tracker streams).

    At least one tensor argument must require grad (as the hidden states do), otherwise
    autograd never calls the recompute. With `distribute_saved_activations` each rank of
    `tp_group` keeps only 1/tp of the first argument (replicated across TP ranks) until backward.

    `module` (the module `function` runs, holding every weight it uses): the recompute's
    weight grads are returned through this checkpoint's own backward instead of being
    accumulated by a nested backward, so each weight's grad accumulates once, in the outer
    backward, as without recompute. Needed under FSDP1, whose post-backward hook on a flat
    parameter's grad accumulation reshards it (see `_grads_through`).
    """
    if distribute_saved_activations and tp_group is None:
        raise ValueError("checkpoint: distribute_saved_activations=True needs tp_group=")
    group = tp_group if distribute_saved_activations else None
    leaves = weight_leaves(module) if module is not None and torch.is_grad_enabled() else []
    return _CheckpointFunction.apply(function, group, len(leaves), *args, *leaves)


class _RunWithoutGraph(torch.autograd.Function):
    """Forward of `CheckpointWithoutOutput`: the function runs without recording a graph;
    backward sends the output grads through the graph its recompute recorded."""

    @staticmethod
    def forward(ctx, owner, *args):
        ctx.owner = owner
        ctx.tensor_positions = [i for i, a in enumerate(args) if torch.is_tensor(a)]
        ctx.inputs_require_grad = [args[i].requires_grad for i in ctx.tensor_positions]
        ctx.non_tensor_args = [None if torch.is_tensor(a) else a for a in args]
        ctx.save_for_backward(*[args[i] for i in ctx.tensor_positions])
        owner.ctx = ctx
        with torch.no_grad(), _phase("forward"):
            return owner.run_function(*args)

    @staticmethod
    def backward(ctx, *grad_outputs):
        owner = ctx.owner
        if ctx.recomputed is None:  # the consumer's hook did not fire: recompute now
            owner.recompute(None)
        args, outputs = ctx.recomputed
        ctx.recomputed = None
        return (None,) + _backward_through(args, outputs, grad_outputs)


class CheckpointWithoutOutput:
    """Megatron's output-discarding checkpoint (`--recompute-modules layernorm`): the
    function's output is handed to its consumer (which may save it for backward), then its
    storage is freed; when the consumer's output gets its grad, the function is rerun under
    the forward's RNG states and the result written back into the same storage, before the
    consumer's backward reads it.

        ckpt = CheckpointWithoutOutput()
        normed = ckpt.checkpoint(norm, hidden_states)
        out = attention(normed)
        ckpt.discard_output_and_register_recompute(out)
    """

    def __init__(self):
        self.ctx = None
        self.outputs = None
        self.storage_sizes = []

    def checkpoint(self, run_function, *args):
        self.run_function = run_function
        self.device = rng_device()
        self.rng_states = _all_rng_states(self.device)
        outputs = _RunWithoutGraph.apply(self, *args)
        self.ctx.recomputed = None
        self.outputs = (outputs,) if torch.is_tensor(outputs) else tuple(outputs)
        return outputs

    def discard_output_and_register_recompute(self, hook_tensor: torch.Tensor) -> None:
        """Free the outputs' storage; recompute when `hook_tensor`'s grad is computed."""
        if not hook_tensor.requires_grad:
            return
        self.storage_sizes = []
        for output in self.outputs:
            self.storage_sizes.append(output.untyped_storage().size())
            output.untyped_storage().resize_(0)
        hook_tensor.register_hook(self.recompute)

    def recompute(self, _grad) -> None:
        ctx = self.ctx
        if ctx is None or ctx.recomputed is not None:
            return
        args, outputs = _rerun(self.run_function, ctx, ctx.saved_tensors, self.rng_states,
                               self.device)
        recomputed = (outputs,) if torch.is_tensor(outputs) else tuple(outputs)
        for index, (output, value) in enumerate(zip(self.outputs, recomputed)):
            if output.untyped_storage().size() == 0:  # discarded: refill in place
                size = self.storage_sizes[index]
                source = value.detach().contiguous().untyped_storage()
                if source.size() != size:
                    raise RuntimeError(
                        f"CheckpointWithoutOutput: the recomputed output holds {source.size()} "
                        f"bytes, the discarded one {size}; the function must return a fresh "
                        "contiguous tensor")
                output.untyped_storage().resize_(size)
                # Through the storage: the consumer saved `output` at this version.
                output.untyped_storage().copy_(source)
        ctx.recomputed = (args, outputs)
        self.outputs = None
        self.ctx = None


def dropout_scale(like: torch.Tensor, p: float,
                  draw_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A dropout mask of `like`'s shape, dtype and device, scaled: 1 / (1 - p) where a uniform
    draw (in `draw_dtype`, from the current default generator) is >= p, else 0."""
    scale = torch.rand(like.shape, dtype=draw_dtype, device=like.device).ge_(p)
    if scale.dtype != like.dtype:
        scale = scale.to(like.dtype)
    return scale.mul_(1.0 / (1.0 - p))


class _CpuDropout(torch.autograd.Function):
    """x * `dropout_scale(x, p)`. ATen's CPU dropout draws its mask with `bernoulli_`, about
    twice the time of `rand` for the same tensor (3.7 against 1.9 ms for 4 x 8 x 128 x 128
    fp32, one thread); the kept fraction is the same, 1 - p."""

    @staticmethod
    def forward(ctx, x, p):
        scale = dropout_scale(x, p)
        ctx.save_for_backward(scale)  # what F.dropout keeps too: one x-sized mask
        return x * scale

    @staticmethod
    def backward(ctx, grad_output):
        (scale,) = ctx.saved_tensors
        return grad_output * scale, None


def dropout(x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
    """`F.dropout(x, p, training)`, drawn from the current default generator of x's device
    (so `get_rng_tracker().fork()` and recompute's state restore apply as to F.dropout). On
    the CPU the mask comes from `rand` (`_CpuDropout`), elsewhere from F.dropout's kernel (a
    fused one on CUDA)."""
    if not training or p == 0.0:
        return x
    if x.device.type != "cpu" or not 0.0 < p < 1.0 or not x.is_floating_point():
        return F.dropout(x, p, training=True)
    return _CpuDropout.apply(x, p)


__all__ = [
    "CheckpointWithoutOutput",
    "dropout",
    "dropout_scale",
    "MODEL_PARALLEL_RNG",
    "EXPERT_PARALLEL_RNG",
    "expert_parallel_stream_seed",
    "DATA_PARALLEL_RNG",
    "derive_seed",
    "init_rng_scope",
    "RNGStatesTracker",
    "get_rng_tracker",
    "model_parallel_seed",
    "checkpoint",
    "recompute_phase",
    "rng_device",
    "get_device_rng_state",
    "set_device_rng_state",
]
