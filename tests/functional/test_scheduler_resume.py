"""Resuming with another learning-rate schedule, and --exit-interval with --save.

One DP=2 run trains 10 of --train-iters 20 (--exit-interval 10), which saves iteration 10.
The resumes ask for --train-iters 30, so the decay (--lr-decay-iters defaults to
--train-iters) differs from the checkpoint's: an error without a flag; with
--override-opt_param-scheduler the 30-iteration schedule, with
--use-checkpoint-opt_param-scheduler the saved 20-iteration one.
"""
import contextlib
import io
import os
import re
import subprocess
import sys

import pytest

from megatron_smp.testing import run_distributed
from tests.functional.test_training_parity import COMMON

LOGGED = COMMON + ["--log-interval", "1"]  # every iteration's learning rate in a log line
MAX_LR, WARMUP = 1e-3, 2  # COMMON's --lr and --lr-warmup-iters; linear decay to --min-lr 0
OVERRIDE = "--override-opt_param-scheduler"
USE_CHECKPOINT = "--use-checkpoint-opt_param-scheduler"
# The schedule counts samples, as Megatron's: 20 and 30 iterations of COMMON's global batch 8.
DECAY_DIFFERS = ("--lr-decay-iters/--lr-decay-samples (default: --train-iters/--train-samples), "
                 "in samples: checkpoint 160, command line 240")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def expected_lr(iteration, decay_iters):
    """Megatron's linear warm-up then linear decay, after `iteration` scheduler steps."""
    if iteration <= WARMUP:
        return MAX_LR * iteration / WARMUP
    return MAX_LR * max(0.0, 1.0 - (iteration - WARMUP) / (decay_iters - WARMUP))


def _train(rank, world_size, argv):
    """Learning rate logged at each iteration, the last iteration, and what rank 0 printed."""
    from megatron_smp.training import pretrain
    from pretrain_gpt import forward_step, model_provider, train_valid_test_datasets_provider

    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        result = pretrain(train_valid_test_datasets_provider, model_provider, forward_step,
                          argv=argv)
    lrs = {}
    for line in result.log_lines:
        match = re.match(r" iteration +(\d+)/.*\| learning rate: ([-+.\dE]+) \|", line)
        if match:
            lrs[int(match.group(1))] = float(match.group(2))
    return {"lrs": lrs, "iteration": result.iteration, "losses": sorted(result.train_losses),
            "stdout": stdout.getvalue()}


def _listing(save_dir):
    with open(os.path.join(save_dir, "latest_checkpointed_iteration.txt")) as handle:
        tracker = handle.read().strip()
    files = sorted(
        os.path.relpath(os.path.join(root, name), save_dir)
        for root, _, names in os.walk(save_dir) for name in names
    )
    return tracker, {name: os.path.getmtime(os.path.join(save_dir, name)) for name in files}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    save_dir = str(tmp_path_factory.mktemp("sched") / "ckpt")
    argv = LOGGED + ["--train-iters", "20", "--exit-interval", "10", "--save", save_dir]
    return save_dir, run_distributed(_train, 2, args=(argv,), timeout=300)


def test_exit_interval_saves_its_iteration_before_exiting(saved):
    save_dir, results = saved
    assert sorted(os.listdir(save_dir)) == ["iter_0000010", "latest_checkpointed_iteration.txt"]
    assert _listing(save_dir)[0] == "10"
    for result in results:
        assert result["iteration"] == 10 and result["losses"] == list(range(1, 11))
        # The first run's own schedule: 20 decay iterations.
        assert result["lrs"] == pytest.approx(
            {i: expected_lr(i, 20) for i in range(1, 11)}, rel=1e-6)


def test_changed_train_iters_without_a_flag_is_an_error_on_every_rank(saved):
    save_dir, _ = saved
    before = _listing(save_dir)
    argv = LOGGED + ["--train-iters", "30", "--load", save_dir, "--save", save_dir]
    errors = run_distributed(_train, 2, args=(argv,), allow_errors=True, timeout=120)
    for error in errors:
        assert "ConfigError" in error and DECAY_DIFFERS in error, error[-2000:]
        assert OVERRIDE in error and USE_CHECKPOINT in error, error[-2000:]
    assert _listing(save_dir) == before  # nothing saved is touched


def test_entry_script_exits_with_one_message(saved):
    save_dir, _ = saved
    argv = LOGGED + ["--train-iters", "30", "--load", save_dir]
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "pretrain_gpt.py", *argv],
        capture_output=True, text=True, timeout=120, cwd=REPO,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert output.count(DECAY_DIFFERS) == 1, output[-3000:]
    assert "megatron_smp/" not in output, output[-3000:]  # no stack trace of ours


@pytest.mark.parametrize("flag, decay_iters", [(OVERRIDE, 30), (USE_CHECKPOINT, 20)])
def test_each_flag_picks_its_schedule(saved, flag, decay_iters):
    save_dir, _ = saved
    argv = LOGGED + ["--train-iters", "30", "--exit-interval", "12", "--load", save_dir, flag]
    results = run_distributed(_train, 2, args=(argv,), timeout=300)
    for result in results:
        assert result["losses"] == [11, 12]
        assert result["lrs"] == pytest.approx(
            {i: expected_lr(i, decay_iters) for i in (11, 12)}, rel=1e-6)
    # The two schedules really differ at these iterations.
    assert abs(expected_lr(11, 30) - expected_lr(11, 20)) > 1e-4
    winner = "command line's" if flag == OVERRIDE else "checkpoint's"
    assert f"learning-rate schedule: {DECAY_DIFFERS}; using the {winner}" in results[0]["stdout"]
