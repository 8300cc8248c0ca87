"""async_save(stage_in_background=True): returns before the CPU copy; wait_for_staging blocks
until that copy is complete, after which the caller may modify the tensors."""
import os
import time

import pytest
import torch

from megatron_smp.testing import run_distributed
from test_dcp_api import hold_writer  # this folder is on sys.path (no __init__.py)

STAGING_DELAY_S = 0.15  # per tensor, through the staging test hook
NUM_TENSORS = 3


def _state_dict(rank, fill):
    from megatron_smp.checkpointing.engine import tp_sharded_tensor

    generator = torch.Generator().manual_seed(99)
    weight = torch.randn(8, 4, generator=generator).chunk(2)[rank].clone()
    bias = torch.randn(4, generator=generator, dtype=torch.float64)
    step = torch.tensor(5, dtype=torch.int64)
    hyper = {"lr": 1e-3, "names": ["a", "b"]}
    if not fill:
        weight.zero_(), bias.zero_(), step.zero_()
        hyper = {"lr": None, "names": None}
    state_dict = {
        "model": {"weight": tp_sharded_tensor(weight, rank, 2, partition_dim=0), "bias": bias},
        "optimizer": {"step": step, "hyper": hyper},
    }
    return state_dict, [weight, bias, step]


def _load(path, rank):
    from megatron_smp.checkpointing import engine as dcp

    template, tensors = _state_dict(rank, fill=False)
    dcp.load(template, checkpoint_id=path)
    return [t.tolist() for t in tensors], template["optimizer"]["hyper"]


def _background(rank, world_size, root):
    from megatron_smp.checkpointing import engine as dcp
    from megatron_smp.checkpointing.engine.storage import TEST_STAGING_DELAY_ENV

    queue = dcp.DEFAULT_ASYNC_QUEUE
    out = {}
    state_dict, tensors = _state_dict(rank, fill=True)
    expected = [t.tolist() for t in tensors]
    # Waited for, then modified: the checkpoint holds the values at call time. The writer is
    # held, so the copy cannot have started when async_save returns.
    os.environ[TEST_STAGING_DELAY_ENV] = str(STAGING_DELAY_S)
    released = hold_writer(queue)
    dcp.async_save(state_dict, checkpoint_id=os.path.join(root, "waited"),
                   stage_in_background=True)
    request = queue._pending[-1]
    state_dict["optimizer"]["hyper"]["lr"] = 7.0  # plain values are captured at call time
    out["unchecked_before"] = queue.has_unchecked_staging()
    out["staged_at_return"] = request.staged.done()
    start = time.perf_counter()
    released.set()
    dcp.wait_for_staging()
    out["waited_s"] = time.perf_counter() - start
    out["staged_after_wait"] = request.staged.done()
    out["unchecked_after"] = queue.has_unchecked_staging()
    for t in tensors:
        t.add_(1000)
    dcp.maybe_finalize_async_calls(blocking=True)
    out["waited"] = _load(os.path.join(root, "waited"), rank)

    # Modified without waiting: the copy, held until then, reads the new values -- what the
    # wait prevents.
    at_call = [t.tolist() for t in tensors]
    released = hold_writer(queue)
    dcp.async_save(state_dict, checkpoint_id=os.path.join(root, "unwaited"),
                   stage_in_background=True)
    for t in tensors:
        t.sub_(1000)
    released.set()
    dcp.maybe_finalize_async_calls(blocking=True)
    del os.environ[TEST_STAGING_DELAY_ENV]
    out["unwaited"] = _load(os.path.join(root, "unwaited"), rank)
    out["expected"], out["at_call"] = expected, at_call
    out["after_call"] = [t.tolist() for t in tensors]
    return out


def test_wait_for_staging_protects_the_saved_values(tmp_path):
    results = run_distributed(_background, 2, args=(str(tmp_path),))
    staging_s = STAGING_DELAY_S * NUM_TENSORS
    for rank, out in enumerate(results):
        assert out["unchecked_before"] and not out["staged_at_return"]
        # wait_for_staging blocked until every (slowed) copy was done: a lower bound on time
        # that sleeps guarantee, however loaded the machine.
        assert out["waited_s"] >= staging_s * 0.95, (rank, out["waited_s"])
        assert out["staged_after_wait"] and not out["unchecked_after"]
        assert out["waited"] == (out["expected"], {"lr": 1e-3, "names": ["a", "b"]})
        assert out["unwaited"][0] == out["after_call"] != out["at_call"]
        assert out["unwaited"][1] == {"lr": 7.0, "names": ["a", "b"]}


def test_failed_staging_is_raised_once_and_fails_the_request():
    from megatron_smp.checkpointing.engine import AsyncCallsQueue, AsyncRequest, CheckpointError

    queue = AsyncCallsQueue()
    written = []

    def stage():
        raise MemoryError("no pinned memory left")

    queue.schedule_async_request(AsyncRequest(
        async_fn=lambda: written.append(1), stage_fn=stage, description="save of ckpt"))
    with pytest.raises(CheckpointError, match="save of ckpt: copying the state to CPU memory "
                                              "failed: MemoryError: no pinned memory left"):
        queue.wait_for_staging()
    queue.wait_for_staging()  # reported once; the finalisation reports it again
    with pytest.raises(CheckpointError, match="save of ckpt failed on rank.*MemoryError"):
        queue.maybe_finalize_async_calls(blocking=True)
    assert written == [] and queue.get_num_unfinalized_calls() == 0
    queue.close()
