"""Buffers, buckets, overlapped reduction and finalize_model_grads (world 2)."""
import pytest
import torch
import torch.distributed as dist

from megatron_smp.config import OptimizerConfig, ParallelConfig
from megatron_smp.distributed import (
    DistributedDataParallel,
    balanced_bucket_boundaries,
    finalize_model_grads,
)
from megatron_smp.parallel_state import build_parallel_state
from megatron_smp.testing import run_distributed
from tests.unit.distributed.toy_training import ToyModel, global_batch, loss_of


def test_balanced_bucket_boundaries():
    # 100 elements, target 35 -> 3 buckets of about 33, never one of 35/35/30... or a tail.
    assert balanced_bucket_boundaries([10] * 10, 35) == [4, 7, 10]
    assert balanced_bucket_boundaries([10] * 10, None) == [10]
    assert balanced_bucket_boundaries([10] * 10, 1000) == [10]
    # A param never spans buckets, a huge one closes several targets at once.
    assert balanced_bucket_boundaries([50, 1, 1, 1], 20) == [1, 4]
    # Params flagged own_bucket (tied embedding) sit alone.
    assert balanced_bucket_boundaries([5, 5, 5], None, [False, True, False]) == [1, 2, 3]


def _layout(model, ddp):
    names = {p: n for n, p in model.named_parameters()}
    buffer = ddp.param_and_grad_buffers[0]
    layout = {"param_dtype": str(buffer.param_data.dtype), "grad_dtype": str(buffer.grad_data.dtype)}
    layout["offsets"] = {names[p]: start for p, (start, _, _) in buffer.param_index_map.items()}
    layout["views"] = all(
        p.data_ptr() == buffer.param_data[start:].data_ptr()
        and p.main_grad.data_ptr() == buffer.grad_data[start:].data_ptr()
        and p.main_grad.dtype == torch.float32
        for p, (start, _, _) in buffer.param_index_map.items()
    )
    layout["bucket_numels"] = [b.grad_data.numel() for b in buffer.buckets]
    layout["bucket_unpadded"] = [b.numel_unpadded for b in buffer.buckets]
    return layout


def _backward_events(ddp, model, x, y, no_sync=False):
    """Order of grad arrivals and bucket launches during one backward."""
    events = []
    for buffer in ddp.param_and_grad_buffers:
        buffer.on_grad_sync_start = lambda bucket: events.append(("launch", bucket.index))
    hooks = [
        p.register_post_accumulate_grad_hook(lambda p, n=n: events.append(("grad", n)))
        for n, p in model.named_parameters()
    ]
    ddp.zero_grad_buffer()
    if no_sync:
        with ddp.no_sync():
            loss_of(ddp, x, y).backward()
    else:
        loss_of(ddp, x, y).backward()
    for hook in hooks:
        hook.remove()
    launched_during_backward = sum(1 for e in events if e[0] == "launch")
    if not no_sync:
        ddp.finish_grad_sync()
    for buffer in ddp.param_and_grad_buffers:
        buffer.on_grad_sync_start = None
    return events, launched_during_backward


def _ddp_body(rank, world_size):
    state = build_parallel_state(ParallelConfig())
    out = {}
    x, y = global_batch(0, 8)
    x, y = x[rank * 4 : (rank + 1) * 4], y[rank * 4 : (rank + 1) * 4]

    # Layout of a bf16 model with small buckets.
    model = ToyModel(dtype=torch.bfloat16)
    config = OptimizerConfig(overlap_grad_reduce=True, ddp_bucket_size=900)
    ddp = DistributedDataParallel(model, config, state)
    out["layout"] = _layout(model, ddp)

    # Overlap: buckets launch while backward still produces grads; never under no_sync.
    model = ToyModel()
    ddp = DistributedDataParallel(model, config, state)
    out["no_sync_events"], out["no_sync_launched"] = _backward_events(ddp, model, x, y, True)
    out["events"], out["launched"] = _backward_events(ddp, model, x, y)
    out["overlap_grads"] = torch.cat([p.main_grad.reshape(-1) for p in model.parameters()]).tolist()
    ddp_off = DistributedDataParallel(ToyModel(), OptimizerConfig(), state)
    _, out["launched_without_overlap"] = _backward_events(ddp_off, ddp_off.module, x, y)
    out["grads"] = torch.cat([p.main_grad.reshape(-1) for p in ddp_off.module.parameters()]).tolist()

    # AVG in the collective gives the same mean as pre-scaling by 1/dp.
    ddp_avg = DistributedDataParallel(ToyModel(), OptimizerConfig(ddp_average_in_collective=True), state)
    _backward_events(ddp_avg, ddp_avg.module, x, y)
    out["avg_grads"] = torch.cat([p.main_grad.reshape(-1) for p in ddp_avg.module.parameters()]).tolist()

    # Reference: the mean of both ranks' local grads.
    reference = ToyModel()
    loss_of(reference, x, y).backward()
    local = torch.cat([p.grad.reshape(-1) for p in reference.parameters()])
    dist.all_reduce(local)
    out["mean_grads"] = (local / world_size).tolist()

    # finalize_model_grads: sequence-parallel params summed over TP (tp=2, dp=1).
    tp_state = build_parallel_state(ParallelConfig(tensor_model_parallel_size=2))
    layer = torch.nn.Module()
    layer.norm = torch.nn.Parameter(torch.zeros(3))
    layer.norm.sequence_parallel = True
    layer.split = torch.nn.Parameter(torch.zeros(4))
    layer.split.tensor_model_parallel = True
    ddp_tp = DistributedDataParallel(layer, OptimizerConfig(), tp_state)
    layer.norm.main_grad.fill_(rank + 1.0)
    layer.split.main_grad.fill_(rank + 1.0)
    finalize_model_grads([ddp_tp], tp_state)
    out["sp_norm_grad"] = layer.norm.main_grad.tolist()
    out["tp_split_grad"] = layer.split.main_grad.tolist()

    # Tied embedding summed over first and last pipeline stage (pp=2).
    pp_state = build_parallel_state(ParallelConfig(pipeline_model_parallel_size=2))
    stage = torch.nn.Module()
    stage.word = torch.nn.Parameter(torch.zeros(5))
    stage.word.shared_embedding = True
    stage.share_embeddings_and_output_weights = True
    stage.shared_embedding_or_output_weight = lambda: stage.word
    stage.other = torch.nn.Parameter(torch.zeros(2))
    ddp_pp = DistributedDataParallel(stage, OptimizerConfig(use_distributed_optimizer=True), pp_state)
    stage.word.main_grad.fill_(10.0 * (rank + 1))
    stage.other.main_grad.fill_(rank + 1.0)
    finalize_model_grads([ddp_pp], pp_state)
    out["embedding_grad"] = stage.word.main_grad.tolist()
    out["other_grad"] = stage.other.main_grad.tolist()
    out["embedding_buckets"] = len(ddp_pp.param_and_grad_buffers[0].buckets)

    # Expert params (allreduce=False) at ep=2: not reduced (each rank has its own experts),
    # scaled by 1/dp like the dense ones; the grad norm adds the experts of both ranks.
    from megatron_smp.optimizer import get_megatron_optimizer

    ep_state = build_parallel_state(ParallelConfig(expert_model_parallel_size=2))
    moe = torch.nn.Module()
    moe.dense = torch.nn.Parameter(torch.zeros(3))
    moe.expert = torch.nn.Parameter(torch.zeros(3))
    moe.expert.allreduce = False
    ddp_ep = DistributedDataParallel(moe, OptimizerConfig(), ep_state)
    moe.dense.main_grad.fill_(rank + 1.0)
    moe.expert.main_grad.fill_(rank + 1.0)
    ddp_ep.finish_grad_sync()
    out["ep_grads"] = (moe.dense.main_grad.tolist(), moe.expert.main_grad.tolist())
    optimizer = get_megatron_optimizer(OptimizerConfig(clip_grad=0.0), [ddp_ep], ep_state)
    optimizer._copy_model_grads_to_main_grads()
    out["ep_grad_norm"] = optimizer.get_grad_norm()
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_ddp_body, 2)


def test_buffer_layout_reverse_views_padded_balanced(results):
    layout = results[0]["layout"]
    assert layout["param_dtype"] == "torch.bfloat16" and layout["grad_dtype"] == "torch.float32"
    assert layout["views"]
    offsets = layout["offsets"]
    # Reverse order: the last registered param first, the first one last.
    assert offsets["head.bias"] == 0
    assert offsets["embed.weight"] == max(offsets.values())
    numels, unpadded = layout["bucket_numels"], layout["bucket_unpadded"]
    assert len(numels) == 3  # 2543 elements, bucket size 900 -> 3 buckets of target 848
    assert all(n % 2 == 0 and 0 <= n - u < 2 for n, u in zip(numels, unpadded))
    assert sum(unpadded) == 2543
    # Each bucket closes at the first param reaching its target (params are atomic; the
    # largest is 960 elements), so no bucket overshoots by more than one param.
    assert unpadded == [1183, 1000, 360]


def test_overlap_launches_buckets_before_backward_finishes(results):
    out = results[0]
    events = out["events"]
    kinds = [kind for kind, _ in events]
    first_launch = kinds.index("launch")
    last_grad = len(kinds) - 1 - kinds[::-1].index("grad")
    assert first_launch < last_grad, events
    # Bucket 0 holds the last layers (reversed layout): it completes first.
    assert events[first_launch] == ("launch", 0)
    assert out["launched"] == 3
    assert out["no_sync_launched"] == 0
    assert out["launched_without_overlap"] == 0


def test_reduced_grads_are_the_data_parallel_mean(results):
    for out in results:
        mean = torch.tensor(out["mean_grads"])
        for key in ("grads", "overlap_grads", "avg_grads"):
            torch.testing.assert_close(torch.tensor(out[key]), mean, rtol=1e-5, atol=1e-7)
        assert out["grads"] == out["overlap_grads"]


def test_finalize_model_grads_tp_and_embedding(results):
    for rank, out in enumerate(results):
        assert out["sp_norm_grad"] == [3.0] * 3  # 1 + 2
        assert out["tp_split_grad"] == [rank + 1.0] * 4  # TP-split params are left alone
        assert out["embedding_grad"] == [30.0] * 5
        assert out["other_grad"] == [rank + 1.0] * 2
        assert out["embedding_buckets"] == 2  # the tied embedding has its own bucket
        assert out["ep_grads"] == ([1.5] * 3, [(rank + 1) / 2] * 3)
        assert out["ep_grad_norm"] == pytest.approx((3 * 1.5**2 + 3 * 0.5**2 + 3 * 1.0**2) ** 0.5)
