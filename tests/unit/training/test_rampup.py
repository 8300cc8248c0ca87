"""--train-samples with --rampup-batch-size through pretrain at DP=2.

The ramp `4 4 8` towards --global-batch-size 8 over --train-samples 40 gives, by Megatron's
num_microbatches_calculator (a batch of START + INCREMENT * int(consumed / (SAMPLES /
((8 - 4) / 4))) while consumed <= SAMPLES, else 8) the global batches 4, 4, 8, 8, 8, 8 and
Megatron's update_train_iters 3 ramp iterations + (40 - 16) // 8 = 6 iterations. The ramped
run's losses must equal those of the same batches trained without a ramp: a --global-batch-size
4 run for two iterations, resumed from its checkpoint with --global-batch-size 8. With --save
the ramped run also saves where its batch grows (after iteration 2), as Megatron's loop does.

Megatron-LM main's --step-batch-size-schedule "0:4 0.256K:8" (thresholds in tokens: 256 tokens
of --seq-length 32 are 8 samples) gives the same batches, hence the same losses and learning
rates, and by main's update_train_iters (whole batches until --train-samples) 6 iterations.
"""
import os
import re

import pytest

from megatron_smp.testing import run_distributed
from tests.functional.test_training_parity import COMMON

MAX_LR, WARMUP_SAMPLES, DECAY_SAMPLES = 1e-3, 8, 40
BATCHES = [4, 4, 8, 8, 8, 8]


def _without(argv, *flags):
    out = list(argv)
    for flag in flags:
        index = out.index(flag)
        del out[index:index + 2]
    return out


BASE = _without(COMMON, "--train-iters", "--global-batch-size", "--lr-warmup-iters") + [
    "--log-interval", "1"]


def expected_lr(consumed):
    """Megatron's linear warm-up over 8 samples, then linear decay to 0 at 40 samples."""
    if consumed <= WARMUP_SAMPLES:
        return MAX_LR * consumed / WARMUP_SAMPLES
    return MAX_LR * (1.0 - (consumed - WARMUP_SAMPLES) / (DECAY_SAMPLES - WARMUP_SAMPLES))


def _train(rank, world_size, runs):
    from megatron_smp.training import pretrain
    from pretrain_gpt import forward_step, model_provider, train_valid_test_datasets_provider

    out = []
    for argv in runs:
        result = pretrain(train_valid_test_datasets_provider, model_provider, forward_step,
                          argv=argv)
        logged = {}
        for line in result.log_lines:
            match = re.match(r" iteration +(\d+)/ +(\d+) \| consumed samples: +(\d+) \|.*"
                             r"learning rate: ([-+.\dE]+) \| global batch size: +(\d+) \|", line)
            if match:
                iteration, total, consumed, lr, batch = match.groups()
                logged[int(iteration)] = (int(total), int(consumed), float(lr), int(batch))
        losses = {i: v["lm loss"] for i, v in result.train_losses.items()}
        out.append({"logged": logged, "losses": losses,
                    "consumed": result.consumed_train_samples})
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    save = str(tmp_path_factory.mktemp("rampup") / "ckpt")
    ramped_save = str(tmp_path_factory.mktemp("rampup") / "ramped")
    ramped = BASE + ["--train-samples", "40", "--global-batch-size", "8",
                     "--rampup-batch-size", "4", "4", "8", "--lr-warmup-samples", "8",
                     "--save", ramped_save]
    # The same schedule in iterations of 4 samples (warm-up 2, decay 10), then of 8 (1, 5).
    first = BASE + ["--train-iters", "2", "--global-batch-size", "4", "--lr-warmup-iters", "2",
                    "--lr-decay-iters", "10", "--save", save]
    rest = BASE + ["--train-iters", "6", "--global-batch-size", "8", "--lr-warmup-iters", "1",
                   "--lr-decay-iters", "5", "--load", save]
    stepped = BASE + ["--train-samples", "40", "--step-batch-size-schedule", "0:4 0.256K:8",
                      "--lr-warmup-samples", "8"]
    results = run_distributed(_train, 2, args=([ramped, first, rest, stepped],), timeout=600)
    return results, sorted(os.listdir(ramped_save))


def test_batch_sizes_consumed_samples_and_lr_follow_megatron(runs):
    for ramped, _, _, _ in runs[0]:
        consumed, expected = 0, {}
        for iteration, batch in enumerate(BATCHES, start=1):
            consumed += batch
            expected[iteration] = (6, consumed, expected_lr(consumed), batch)
        assert sorted(ramped["logged"]) == list(range(1, 7))
        for iteration, (total, consumed, lr, batch) in ramped["logged"].items():
            assert (total, consumed, batch) == (expected[iteration][0], expected[iteration][1],
                                                expected[iteration][3])
            assert lr == pytest.approx(expected[iteration][2], rel=1e-6)
        assert ramped["consumed"] == 40


def test_ramped_losses_equal_the_same_batches_without_a_ramp(runs):
    for ramped, first, rest, _ in runs[0]:
        assert sorted(first["losses"]) == [1, 2] and sorted(rest["losses"]) == [3, 4, 5, 6]
        assert rest["consumed"] == 40
        unramped = {**first["losses"], **rest["losses"]}
        for iteration in range(1, 7):
            assert ramped["losses"][iteration] == pytest.approx(unramped[iteration], rel=1e-5)
        # The losses move: the equality is not of constants.
        assert len({round(v, 6) for v in unramped.values()}) == 6


def test_a_checkpoint_is_saved_where_the_batch_size_changes(runs):
    # As Megatron: the batch grows from 4 to 8 after iteration 2; the run ends at 6.
    assert runs[1] == ["iter_0000002", "iter_0000006", "latest_checkpointed_iteration.txt"]


def test_step_batch_size_schedule_gives_the_same_batches_and_losses(runs):
    for ramped, _, _, stepped in runs[0]:
        assert stepped["logged"] == ramped["logged"]  # batch, consumed samples, lr, length
        assert stepped["losses"] == ramped["losses"]
        assert stepped["consumed"] == 40


@pytest.mark.parametrize("flags, message", [
    (["--train-samples", "40", "--step-batch-size-schedule", "1K:4 2K:8"], "first threshold"),
    (["--train-samples", "40", "--step-batch-size-schedule", "0:4 0:8"], "strictly increasing"),
    (["--train-samples", "40", "--step-batch-size-schedule", "0:4 x:8"], "not a number"),
    (["--train-samples", "40", "--step-batch-size-schedule", "0:3"], "does not divide"),
    (["--train-samples", "40", "--step-batch-size-schedule", "0:4", "--global-batch-size", "4"],
     "--global-batch-size"),
    (["--train-iters", "4", "--step-batch-size-schedule", "0:4"], "--train-samples"),
])
def test_step_batch_size_schedule_errors_name_the_flag(flags, message):
    from megatron_smp.config import ConfigError
    from megatron_smp.training.arguments import parse_args, validate_configs

    with pytest.raises(ConfigError, match="--step-batch-size-schedule") as error:
        validate_configs(parse_args(BASE + flags), world_size=2)
    assert message in str(error.value)
