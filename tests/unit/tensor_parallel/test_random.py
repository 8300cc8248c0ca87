"""RNG tracker (dropout inside/outside TP regions) and activation recompute."""
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_smp.config import ParallelConfig
from megatron_smp.parallel_state import build_parallel_state
from megatron_smp.testing import run_distributed
from megatron_smp.tensor_parallel import (
    checkpoint,
    get_rng_tracker,
    model_parallel_seed,
)


def _block(x, weight):
    """Dropout outside the TP region, then dropout inside it (under fork)."""
    hidden = F.dropout(torch.tanh(x @ weight), p=0.5, training=True)
    with get_rng_tracker().fork():
        hidden = F.dropout(hidden * 2.0, p=0.5, training=True)
    return hidden.sin()


def _run_block(x, weight, recompute, tp_group=None):
    x = x.detach().clone().requires_grad_(True)
    weight = weight.detach().clone().requires_grad_(True)
    if recompute:
        out = checkpoint(_block, tp_group is not None, x, weight, tp_group=tp_group)
    else:
        out = _block(x, weight)
    out.sum().backward()
    return out.detach(), x.grad, weight.grad


def _tracker_body(rank, world_size):
    state = build_parallel_state(ParallelConfig(tensor_model_parallel_size=world_size))
    model_parallel_seed(1234, state)

    def gathered(t):
        parts = [torch.empty_like(t) for _ in range(world_size)]
        dist.all_gather(parts, t, group=state.tp_group)
        return parts

    outside = F.dropout(torch.ones(64), p=0.5)
    with get_rng_tracker().fork():
        inside = F.dropout(torch.ones(64), p=0.5)
    after = torch.rand(8)
    # fork() leaves the default stream where it was: same draw as with no fork at all.
    torch.manual_seed(1234)
    F.dropout(torch.ones(64), p=0.5)
    after_without_fork = torch.rand(8)

    # Recompute reproduces both masks: grads equal the non-recomputed ones, and the streams
    # end where the non-recomputed run left them.
    x, weight = torch.randn(4, 2, 8), torch.randn(8, 8)
    states = (torch.get_rng_state(), get_rng_tracker().get_states())
    results = {}
    for name, recompute, group in (
        ("plain", False, None),
        ("checkpoint", True, None),
        ("distributed_checkpoint", True, state.tp_group),
    ):
        torch.set_rng_state(states[0])
        get_rng_tracker().set_states(states[1])
        out, x_grad, weight_grad = _run_block(x, weight, recompute, group)
        with get_rng_tracker().fork():
            next_inside = torch.rand(4)
        results[name] = (out, x_grad, weight_grad, torch.rand(4), next_inside)
    plain = results["plain"]
    recompute_diffs = {
        name: max((a - b).abs().max().item() for a, b in zip(result, plain))
        for name, result in results.items()
    }
    return dict(
        outside_same=all(torch.equal(p, outside) for p in gathered(outside)),
        inside_same=all(torch.equal(p, inside) for p in gathered(inside)),
        default_untouched=torch.equal(after, after_without_fork),
        recompute_diffs=recompute_diffs,
        dropped_fraction=float((plain[0] == 0).float().mean()),
    )


def test_tracker_and_checkpoint_tp2():
    for result in run_distributed(_tracker_body, 2):
        assert result["outside_same"] is True  # identical across TP ranks outside the region
        assert result["inside_same"] is False  # different inside it
        assert result["default_untouched"] is True
        assert result["recompute_diffs"] == {
            "plain": 0.0, "checkpoint": 0.0, "distributed_checkpoint": 0.0
        }
        assert 0.5 < result["dropped_fraction"] < 0.95  # both dropouts really dropped


def test_tracker_states_and_seeds_single_process():
    state = SimpleNamespace(pp_rank=1, tp_rank=0, ep_rank=0)
    model_parallel_seed(7, state)
    tracker = get_rng_tracker()
    # Pipeline stage 1: the default generator is seeded with seed + 100.
    default_draw = torch.rand(3)
    torch.manual_seed(107)
    assert torch.equal(default_draw, torch.rand(3))
    # The tensor-parallel stream is seeded with seed + 100 * pp + 2718 + tp_rank.
    with tracker.fork():
        tp_draw = torch.rand(3)
    torch.manual_seed(107 + 2718)
    assert torch.equal(tp_draw, torch.rand(3))

    saved = tracker.get_states()
    with tracker.fork("expert-parallel-rng"):
        first = torch.rand(3)
    tracker.set_states(saved)
    with tracker.fork("expert-parallel-rng"):
        assert torch.equal(first, torch.rand(3))
    with pytest.raises(ValueError, match="already exists"):
        tracker.add("model-parallel-rng", 1)
    with pytest.raises(KeyError, match="never added"):
        with tracker.fork("no-such-stream"):
            pass


def test_checkpoint_with_module_returns_weight_grads_through_its_backward():
    """checkpoint(module=...): the grads of the module's weights leave through the
    checkpoint's own backward, so each weight's grad accumulates once, in the outer backward
    (FSDP1 reshards a flat parameter when its grad accumulates); a weight from outside the
    module reached by the recompute is an error."""
    import pytest

    torch.manual_seed(0)
    inner = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4))
    outer = torch.nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)

    def loss(recompute):
        h = outer(x)
        h = checkpoint(inner, False, h, module=inner) if recompute else inner(h)
        return checkpoint(inner, False, h, module=inner).sum() if recompute else inner(h).sum()

    loss(False).backward()
    params = [x, *outer.parameters(), *inner.parameters()]
    expected = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    accumulations = []
    for p in inner.parameters():
        p.register_post_accumulate_grad_hook(lambda p: accumulations.append(p))
    loss(True).backward()
    assert all(torch.allclose(p.grad, e, atol=1e-6) for p, e in zip(params, expected))
    assert len(accumulations) == 4  # once per weight, though used by two checkpoints

    def uses_outer(h):
        return outer(inner(h))

    h = torch.randn(3, 4, requires_grad=True)
    with pytest.raises(RuntimeError, match="not weights of the module"):
        checkpoint(uses_outer, False, h, module=inner).sum().backward()
