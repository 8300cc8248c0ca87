"""The distributed optimizer against plain DP and a single process (world 2 and 4),
fp16 overflow handling, checkpoint round trip, grad norms under TP, and bytes per param."""
import copy

import pytest
import torch

from megatron_smp.config import OptimizerConfig, ParallelConfig
from megatron_smp.distributed import DistributedDataParallel
from megatron_smp.optimizer import get_megatron_optimizer
from megatron_smp.parallel_state import build_parallel_state
from megatron_smp.testing import run_distributed
from tests.unit.distributed.toy_training import (
    ddp_training,
    max_relative_difference,
    memory_bytes,
    param_count,
    reference_training,
    relative_error,
    ToyModel,
)

ITERS, BATCH = 10, 16
BASE = dict(lr=1e-2, weight_decay=0.1, clip_grad=1.0)
DIST = dict(use_distributed_optimizer=True)
OVERLAP = dict(overlap_grad_reduce=True, overlap_param_gather=True, ddp_bucket_size=700)


def _configs(names):
    table = {
        "plain": OptimizerConfig(**BASE),
        "plain_overlap": OptimizerConfig(**BASE, overlap_grad_reduce=True, ddp_bucket_size=700),
        "dist": OptimizerConfig(**BASE, **DIST, ddp_bucket_size=700),
        "dist_overlap": OptimizerConfig(**BASE, **DIST, **OVERLAP),
        "dist_avg": OptimizerConfig(**BASE, **DIST, **OVERLAP, ddp_average_in_collective=True),
    }
    return {name: table[name] for name in names}


def _train_all(state, fp32_names, bf16_names, iters=ITERS):
    out = {}
    for name, config in _configs(fp32_names).items():
        losses, results, params, _, _ = ddp_training(config, state, iters, BATCH)
        out[name] = (losses, params.tolist(), results)
    # The reduce-scatter and all-gather NCCL runs (gloo all-reduces and broadcasts instead).
    losses, results, params, _, _ = ddp_training(
        _configs(["dist_overlap"])["dist_overlap"], state, iters, BATCH, nccl_collectives=True,
    )
    out["dist_overlap_reduce_scatter"] = (losses, params.tolist(), results)
    for name, config in _configs(bf16_names).items():
        losses, results, params, ddp, optimizer = ddp_training(
            config, state, iters, BATCH, dtype=torch.bfloat16
        )
        out["bf16_" + name] = (losses, params.tolist(), results)
        out["bf16_bytes_" + name] = memory_bytes(ddp, optimizer)
    return out


def _tp_grad_norm(rank):
    """tp=2: a TP-split weight counts on both ranks, a replicated one once."""
    state = build_parallel_state(ParallelConfig(tensor_model_parallel_size=2))
    layer = torch.nn.Module()
    layer.split = torch.nn.Parameter(torch.zeros(4))
    layer.split.tensor_model_parallel = True
    layer.replicated = torch.nn.Parameter(torch.zeros(3))
    ddp = DistributedDataParallel(layer, OptimizerConfig(**DIST), state)
    optimizer = get_megatron_optimizer(OptimizerConfig(**DIST, clip_grad=0.0), [ddp], state)
    layer.split.main_grad.fill_(rank + 1.0)  # full split grad: [1]*4 + [2]*4
    layer.replicated.main_grad.copy_(torch.tensor([0.0, 2.0, 2.0]))
    optimizer._copy_model_grads_to_main_grads()
    return optimizer.get_grad_norm(), optimizer.count_zeros()


def _fp16_overflow(state):
    """Inject inf into one element of rank 1's own grad shard at iterations 3 and 4."""
    def inject(iteration, ddp):
        if iteration in (3, 4) and state.dp_rank == 1:
            bucket = ddp.param_and_grad_buffers[0].buckets[0]
            bucket.shard(bucket.grad_data)[0] = float("inf")

    config = OptimizerConfig(**BASE, **DIST, initial_loss_scale=2.0**12, hysteresis=2)
    losses, results, params, _, _ = ddp_training(
        config, state, ITERS, BATCH, dtype=torch.float16, before_step=inject
    )
    return losses, results, params.tolist()


def _checkpoint_round_trip(state):
    """5 steps, state dicts, a fresh model/optimizer loads them, 5 more steps."""
    config = OptimizerConfig(**BASE, **DIST, **OVERLAP)
    _, _, _, ddp, optimizer = ddp_training(config, state, 5, BATCH, dtype=torch.bfloat16)
    checkpoint = (copy.deepcopy(ddp.state_dict()), copy.deepcopy(optimizer.state_dict()))
    resumed, _, params, _, _ = ddp_training(
        config, state, 5, BATCH, dtype=torch.bfloat16, start_iteration=5, checkpoint=checkpoint
    )
    return resumed, params.tolist()


def _world2_body(rank, world_size):
    state = build_parallel_state(ParallelConfig())
    out = _train_all(
        state, ["plain", "plain_overlap", "dist", "dist_overlap", "dist_avg"],
        ["plain", "dist", "dist_overlap"],
    )
    out["fp16"] = _fp16_overflow(state)
    out["resumed"] = _checkpoint_round_trip(state)
    out["tp_grad_norm"] = _tp_grad_norm(rank)
    if rank == 0:
        losses, params = reference_training(ITERS, BATCH)
        out["reference"] = (losses, params.tolist())
        losses, params = reference_training(ITERS, BATCH, skip_iterations=(3, 4))
        out["reference_skip"] = (losses, params.tolist())
    return out


def _world4_body(rank, world_size):
    state = build_parallel_state(ParallelConfig())
    out = _train_all(state, ["plain", "dist_overlap"], ["plain", "dist"])
    # fp32 bytes, measured after a step (Adam state exists from the first step on).
    for name in ("plain", "dist"):
        _, _, _, ddp, optimizer = ddp_training(_configs([name])[name], state, 1, BATCH)
        out["fp32_bytes_" + name] = memory_bytes(ddp, optimizer)
    out["param_shards"] = [
        (shard["name"], shard["range"].start, shard["range"].end,
         shard["optimizer_state"]["exp_avg"].numel())
        for shard in optimizer.param_shards()
    ]
    if rank == 0:
        losses, params = reference_training(ITERS, BATCH)
        out["reference"] = (losses, params.tolist())
    return out


@pytest.fixture(scope="module")
def world2():
    return run_distributed(_world2_body, 2, timeout=240)


@pytest.fixture(scope="module")
def world4():
    return run_distributed(_world4_body, 4, timeout=240)


def _check_fp32_against_reference(results, names):
    ref_losses, ref_params = results[0]["reference"]
    for out in results:
        for name in names:
            losses, params, steps = out[name]
            assert all(step[0] for step in steps)
            assert max_relative_difference(losses, ref_losses) < 1e-5, name
            assert relative_error(params, ref_params) < 1e-5, name
    # Every rank holds the same params after the all-gather.
    for name in names:
        assert all(out[name][1] == results[0][name][1] for out in results), name


def test_fp32_dp2_distributed_optimizer_equals_plain_dp_and_single_process(world2):
    _check_fp32_against_reference(
        world2, ["plain", "plain_overlap", "dist", "dist_overlap", "dist_avg",
                 "dist_overlap_reduce_scatter"]
    )
    out = world2[0]
    # Overlap on vs off (same buckets): bit-identical, the collectives only start earlier.
    assert out["dist"][:2] == out["dist_overlap"][:2]
    assert out["plain"][:2] == out["plain_overlap"][:2]


def test_fp32_dp4_distributed_optimizer_equals_plain_dp_and_single_process(world4):
    _check_fp32_against_reference(world4, ["plain", "dist_overlap", "dist_overlap_reduce_scatter"])


@pytest.mark.parametrize("world", ["world2", "world4"])
def test_bf16_distributed_optimizer_equals_plain_dp(world, request):
    results = request.getfixturevalue(world)
    ref_losses, _ = results[0]["reference"]
    names = ["dist", "dist_overlap"] if world == "world2" else ["dist"]
    for out in results:
        plain_losses, plain_params, _ = out["bf16_plain"]
        for name in names:
            losses, params, _ = out["bf16_" + name]
            # Same fp32 main params and grads: equal to plain DP up to summation order.
            assert max_relative_difference(losses, plain_losses) < 1e-5
            assert relative_error(params, plain_params) < 1e-2
        # bf16 (8-bit mantissa) forward vs the fp32 single process: close.
        assert max_relative_difference(plain_losses, ref_losses) < 5e-3  # measured ~1e-3


def test_fp16_overflow_skips_step_backs_off_scale_and_tracks_fp32(world2):
    ref_losses, ref_params = world2[0]["reference_skip"]
    for out in world2:
        losses, steps, params = out["fp16"]
        successes = [step[0] for step in steps]
        scales = [step[3] for step in steps]
        assert successes == [True] * 3 + [False, False] + [True] * 5
        assert all(step[1] is None for step in steps[3:5])
        # Hysteresis 2: the first overflow keeps 2^12, the second halves it.
        assert scales[:5] == [2.0**12] * 4 + [2.0**11]
        assert scales[5:] == [2.0**11] * 5
        assert max_relative_difference(losses, ref_losses) < 2e-3  # measured 2e-4
        assert relative_error(params, ref_params) < 1e-2  # measured 2.3e-3


def test_checkpoint_round_trip_resumes_identically(world2):
    for out in world2:
        losses, params, _ = out["bf16_dist_overlap"]
        resumed_losses, resumed_params = out["resumed"]
        assert resumed_losses == losses[5:]
        assert resumed_params == params


def test_grad_norm_and_zero_count_count_tp_replicated_params_once(world2):
    expected = (4 * 1.0 + 4 * 4.0 + 2 * 4.0) ** 0.5
    for out in world2:
        grad_norm, num_zeros = out["tp_grad_norm"]
        assert grad_norm == pytest.approx(expected, rel=1e-6)
        assert num_zeros == 1


def test_param_shards_tile_every_param_once(world4):
    sizes = {name: p.numel() for name, p in ToyModel().named_parameters()}
    covered = {name: [] for name in sizes}
    for out in world4:
        for name, start, end, state_numel in out["param_shards"]:
            assert state_numel == end - start
            covered[name].append((start, end))
    for name, pieces in covered.items():
        pieces.sort()
        assert pieces[0][0] == 0 and pieces[-1][1] == sizes[name], name
        assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:])), name


def _bytes_per_param(measured, count):
    return {k: measured[k] / count for k in ("params", "grads", "main", "state")}


def test_optimizer_state_bytes_per_param_match_megatron_table(world4):
    d = 4
    count = param_count(ToyModel())
    for kind, plain_total, dist_formula in (
        ("fp32", 16, 4 + 4 + 8 / d),
        ("bf16", 18, 2 + 4 + 12 / d),
    ):
        plain = [out[f"{kind}_bytes_plain"] for out in world4]
        sharded = [out[f"{kind}_bytes_dist"] for out in world4]
        # Non-distributed: every rank holds everything.
        for measured in plain:
            assert measured["local_numel"] == count
            assert sum(_bytes_per_param(measured, count).values()) == pytest.approx(
                plain_total, rel=2e-3  # padding of buffers to a multiple of dp
            )
        # Distributed: the shards partition the params exactly, each rank ~1/d.
        assert sum(m["local_numel"] for m in sharded) == count
        for measured in sharded:
            assert measured["local_numel"] <= measured["padded_numel"] // d
            assert measured["state"] == 8 * measured["local_numel"]
            assert sum(_bytes_per_param(measured, count).values()) == pytest.approx(
                dist_formula, rel=2e-2
            )
        total_state = sum(m["state"] for m in sharded)
        assert total_state == plain[0]["state"]  # sharded, not duplicated
