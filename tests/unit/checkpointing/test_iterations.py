"""save_checkpoint / load_checkpoint: iteration dirs, tracker, RNG, formats, crashes, errors."""
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
import types

import pytest
import torch

from megatron_smp.testing import run_distributed

PAYLOAD = {"consumed_samples": 4096, "loss_scale": 65536.0, "tokenizer": "gpt2", "ranks": [0, 1]}


def _state_dict(tp_rank, tp_size, scale):
    from megatron_smp.checkpointing.engine import tp_sharded_tensor

    weight = (torch.arange(8.0).reshape(4, 2) * scale).chunk(tp_size)[tp_rank].clone()
    bias = torch.full((3,), float(scale))
    if tp_size > 1:
        weight_entry = tp_sharded_tensor(weight, tp_rank, tp_size, partition_dim=0)
    else:
        weight_entry = weight
    state_dict = {
        "model": {"weight": weight_entry, "bias": bias},
        "args": dict(PAYLOAD) if scale else {k: None for k in PAYLOAD},
    }
    return state_dict, {"weight": weight, "bias": bias}


def _lists(tensors):
    # Lists, not tensors, cross the result queue (tensors would use shared memory that dies
    # with the child).
    return {k: v.tolist() for k, v in tensors.items()}


def _draws():
    import numpy as np

    return [random.random(), float(np.random.rand()), torch.rand(2).tolist()]


def _training(rank, world_size, save_dir):
    from megatron_smp.checkpointing import (
        load_checkpoint,
        maybe_finalize_async_calls,
        read_tracker,
        save_checkpoint,
    )
    from megatron_smp.config import ParallelConfig
    from megatron_smp.parallel_state import build_parallel_state

    import numpy as np

    state = build_parallel_state(ParallelConfig(tensor_model_parallel_size=2))
    out = {}
    random.seed(rank), np.random.seed(rank), torch.manual_seed(rank)
    for iteration, fmt in ((1, "torch_dist"), (3, "torch")):
        # Synchronous save, then the draws a resumed run must reproduce bit-exactly.
        state_dict, _ = _state_dict(rank, 2, scale=iteration)
        save_checkpoint(
            iteration, state_dict, save_dir, state, config=ParallelConfig(), ckpt_format=fmt
        )
        out[f"tracker_{iteration}"] = read_tracker(save_dir)
        after_save = _draws()
        _draws()  # training goes on
        template, tensors = _state_dict(rank, 2, scale=0)
        out[f"loaded_{iteration}"] = load_checkpoint(template, save_dir, state)
        out[f"rng_exact_{iteration}"] = _draws() == after_save
        out[f"values_{iteration}"] = (_lists(tensors), template["args"])

        # Asynchronous save of the next iteration: not current until finalised on all ranks.
        state_dict, tensors = _state_dict(rank, 2, scale=iteration + 1)
        save_checkpoint(
            iteration + 1, state_dict, save_dir, state, async_save=True, ckpt_format=fmt
        )
        for t in tensors.values():
            t.mul_(-1)  # training modifies params right away
        out[f"tracker_before_finalize_{iteration + 1}"] = read_tracker(save_dir)
        out[f"finalized_{iteration + 1}"] = maybe_finalize_async_calls(blocking=True)
        out[f"tracker_after_finalize_{iteration + 1}"] = read_tracker(save_dir)
        template, tensors = _state_dict(rank, 2, scale=0)
        load_checkpoint(template, save_dir, state, load_rng=False)
        out[f"values_{iteration + 1}"] = (_lists(tensors), template["args"])
    template, tensors = _state_dict(rank, 2, scale=0)
    out["explicit"] = load_checkpoint(template, save_dir, state, iteration=1)
    out["values_explicit"] = _lists(tensors)
    return out


def test_save_load_sync_async_both_formats(tmp_path):
    save_dir = str(tmp_path / "ckpt")
    results = run_distributed(_training, 2, args=(save_dir,))
    for rank, out in enumerate(results):
        for iteration in (1, 2, 3, 4):
            expected_tensors = _lists(_state_dict(rank, 2, iteration)[1])
            assert out[f"values_{iteration}"] == (expected_tensors, PAYLOAD), (rank, iteration)
        for iteration in (1, 3):
            assert out[f"tracker_{iteration}"] == iteration == out[f"loaded_{iteration}"]
            assert out[f"rng_exact_{iteration}"], (rank, iteration)
            assert out[f"tracker_before_finalize_{iteration + 1}"] == iteration
            assert out[f"tracker_after_finalize_{iteration + 1}"] == iteration + 1
        assert out["finalized_2"] == [0] and out["finalized_4"] == [1]
        assert out["explicit"] == 1
        assert out["values_explicit"] == _lists(_state_dict(rank, 2, 1)[1])
    names = sorted(os.listdir(save_dir))
    tracker = "latest_checkpointed_iteration.txt"
    assert names == [f"iter_000000{i}" for i in (1, 2, 3, 4)] + [tracker]


# -- single process: errors -----------------------------------------------------------------


def _single_state():
    return types.SimpleNamespace(
        rank=0, world_size=1, sizes={"tp": 1, "cp": 1, "dp": 1, "pp": 1}, ep_size=1
    )


def test_errors_name_the_file_key_and_shapes(tmp_path):
    from megatron_smp.checkpointing import CheckpointError, load_checkpoint, save_checkpoint

    state = _single_state()
    missing = str(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match=f"{missing} does not exist"):
        load_checkpoint({}, missing, state)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="latest_checkpointed_iteration.txt does not exist"):
        load_checkpoint({}, str(empty), state)
    (empty / "latest_checkpointed_iteration.txt").write_text("garbage")
    with pytest.raises(CheckpointError, match="holds 'garbage', not an iteration"):
        load_checkpoint({}, str(empty), state)

    for fmt in ("torch_dist", "torch"):
        save_dir = str(tmp_path / fmt)
        state_dict, _ = _state_dict(0, 1, scale=1)
        save_checkpoint(5, state_dict, save_dir, state, ckpt_format=fmt)
        template, _ = _state_dict(0, 1, scale=0)
        template["model"]["weight"] = torch.zeros(4, 3)
        expected = r"model.weight: checkpoint shape \[4, 2\] vs model shape \[4, 3\]"
        with pytest.raises(CheckpointError, match=expected):
            load_checkpoint(template, save_dir, state)
        with pytest.raises(CheckpointError, match="iter_0000009 is not a complete checkpoint"):
            load_checkpoint(template, save_dir, state, iteration=9)

    rank_file = tmp_path / "torch" / "iter_0000005" / "rank_00000.pt"
    os.truncate(rank_file, os.path.getsize(rank_file) - 100)
    template, _ = _state_dict(0, 1, scale=0)
    with pytest.raises(CheckpointError, match=f"{rank_file} is truncated or corrupted"):
        load_checkpoint(template, str(tmp_path / "torch"), state)


# -- a save killed mid-write ----------------------------------------------------------------

_KILLED_SAVE = textwrap.dedent(
    """
    import os, sys
    sys.path.insert(0, {test_dir!r})
    from megatron_smp.testing import run_distributed
    from test_iterations import _save_then_hang

    if __name__ == "__main__":
        run_distributed(_save_then_hang, 2, args=({save_dir!r}, {marker!r}), timeout=300)
    """
)


def _save_then_hang(rank, world_size, save_dir, marker):
    from megatron_smp.checkpointing import save_checkpoint
    from megatron_smp.config import ParallelConfig
    from megatron_smp.checkpointing.engine.storage import (
        TEST_WRITE_DELAY_ENV,
        TEST_WRITE_MARKER_ENV,
    )
    from megatron_smp.parallel_state import build_parallel_state

    state = build_parallel_state(ParallelConfig(tensor_model_parallel_size=2))
    state_dict, _ = _state_dict(rank, 2, scale=1)
    save_checkpoint(1, state_dict, save_dir, state)
    # Iteration 2 stalls inside the write: the test kills the whole job there.
    os.environ[TEST_WRITE_DELAY_ENV] = "30"
    os.environ[TEST_WRITE_MARKER_ENV] = marker
    state_dict, _ = _state_dict(rank, 2, scale=2)
    save_checkpoint(2, state_dict, save_dir, state)


def test_killed_save_leaves_previous_checkpoint_loadable(tmp_path):
    from megatron_smp.checkpointing import load_checkpoint, read_tracker

    save_dir, marker = str(tmp_path / "ckpt"), str(tmp_path / "writing")
    script = tmp_path / "killed_save.py"
    script.write_text(
        _KILLED_SAVE.format(test_dir=os.path.dirname(__file__), save_dir=save_dir, marker=marker)
    )
    job = subprocess.Popen(
        [sys.executable, str(script)], start_new_session=True, cwd=os.getcwd(),
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    try:
        deadline = time.monotonic() + 120
        while not all(os.path.exists(f"{marker}.rank{r}") for r in range(2)):
            assert job.poll() is None, "the save job exited before it started writing"
            assert time.monotonic() < deadline, "the save job never started writing"
            time.sleep(0.1)
        staging = os.path.join(save_dir, "iter_0000002.incomplete")
        assert any(name.endswith(".distcp") for name in os.listdir(staging))
    finally:
        os.killpg(job.pid, signal.SIGKILL)  # the job's own process group: parent and ranks
        job.wait()

    assert read_tracker(save_dir) == 1
    assert sorted(os.listdir(save_dir)) == [
        "iter_0000001", "iter_0000002.incomplete", "latest_checkpointed_iteration.txt"
    ]
    # Resume (here at world 1: DCP reshards the TP=2 weight) from iteration 1.
    template, tensors = _state_dict(0, 1, scale=0)
    with pytest.warns(UserWarning, match="RNG states are not restored"):
        assert load_checkpoint(template, save_dir, _single_state()) == 1
    assert tensors["weight"].tolist() == (torch.arange(8.0).reshape(4, 2)).tolist()
    assert template["args"] == PAYLOAD


# -- --save-retain-interval -----------------------------------------------------------------


def _saved(save_dir):
    from megatron_smp.checkpointing import complete_iterations

    return complete_iterations(save_dir)


@pytest.mark.parametrize("async_save", [False, True])
def test_retain_interval_deletes_the_previous_checkpoint_unless_retained(tmp_path, async_save):
    """Megatron-LM's rule: publishing N deletes the tracker's previous P unless P % interval
    == 0. Saves every 10 iterations, retaining multiples of 30; the tracker's checkpoint (what
    a resume loads) is complete and loadable after every save."""
    from megatron_smp.checkpointing import (
        load_checkpoint,
        maybe_finalize_async_calls,
        read_tracker,
        save_checkpoint,
        wait_for_deletions,
    )

    save_dir, state = str(tmp_path / "ckpt"), _single_state()
    kept = []
    for iteration in range(10, 80, 10):
        state_dict, _ = _state_dict(0, 1, scale=iteration)
        save_checkpoint(iteration, state_dict, save_dir, state, async_save=async_save,
                        save_rng=False, retain_interval=30)
        if async_save:
            # Not yet published: the previous checkpoint is still there, and current.
            assert iteration == 10 or read_tracker(save_dir) == iteration - 10
            maybe_finalize_async_calls(blocking=True)
        template, tensors = _state_dict(0, 1, scale=0)
        assert load_checkpoint(template, save_dir, state, load_rng=False) == iteration
        assert tensors["bias"].tolist() == [float(iteration)] * 3
        wait_for_deletions()
        kept.append(_saved(save_dir))
    assert kept == [[10], [20], [30], [30, 40], [30, 50], [30, 60], [30, 60, 70]]


def test_retain_interval_on_resume_same_iteration_and_symlinks(tmp_path):
    """A run resumed from a directory saved without the flag deletes only the tracker's
    checkpoint (the one it resumed from) when it publishes its next, never older ones;
    saving the tracker's iteration again deletes nothing; a symbolic link is left alone."""
    from megatron_smp.checkpointing import save_checkpoint, wait_for_deletions
    from megatron_smp.checkpointing.iterations import superseded

    save_dir, state = str(tmp_path / "ckpt"), _single_state()

    def save(iteration, retain=20):
        save_checkpoint(iteration, _state_dict(0, 1, scale=iteration)[0], save_dir, state,
                        save_rng=False, retain_interval=retain)
        wait_for_deletions()

    for iteration in (5, 10, 15):  # the first run, without the flag
        save(iteration, retain=None)
    save(15)  # the same iteration again: kept
    assert _saved(save_dir) == [5, 10, 15]
    save(25)  # resumed from 15: 15 goes, 5 and 10 (never the tracker's) stay
    assert _saved(save_dir) == [5, 10, 25]
    # A symbolic link named as the previous checkpoint is not followed into.
    target = tmp_path / "elsewhere"
    os.rename(os.path.join(save_dir, "iter_0000025"), target)
    os.symlink(target, os.path.join(save_dir, "iter_0000025"))
    save(30)
    assert _saved(save_dir) == [5, 10, 25, 30] and os.path.isdir(target)
    assert [superseded(p, 50, 20) for p in (0, 20, 40, 50, 45)] == [False] * 4 + [True]
