"""Megatron's --check-for-nan-in-loss-and-grad under each --rerun-mode, through pretrain_gpt
at DP=2: a NaN loss (and the NaN grads it makes) stops the run on every rank before the
weights change; validate_results reruns the iteration, tells a transient fault (exit 17) from
a reproducible result (checkpoint, exit 16, then the resumed job's second rerun); the flag's
opposite lets the NaN train on."""
import contextlib
import io
import os

import pytest

from megatron_smp.testing import run_distributed
from tests.functional.test_run_control import ARGV


def _run(rank, world_size, argv, nan_at=(), other_device=False):
    """pretrain_gpt's run; the loss of rank 1's forward calls in `nan_at` (1-based, counted
    over the run, reruns included) is NaN. Returns (exit code or None, printed text, log
    lines, forward calls, losses)."""
    from megatron_smp.training import pretrain, result_validation
    from pretrain_gpt import forward_step, model_provider, train_valid_test_datasets_provider

    if other_device:  # the resumed job runs on another node or device
        result_validation.device_identity = lambda device: 12345
    calls = {"forward": 0}

    def forward(data_iterator, model):
        calls["forward"] += 1
        output, loss_func = forward_step(data_iterator, model)
        if rank != 1 or calls["forward"] not in nan_at:
            return output, loss_func

        def nan_loss(output_tensor):
            loss, report = loss_func(output_tensor)
            return loss * float("nan"), report
        return output, nan_loss

    printed = io.StringIO()
    code, lines, losses = None, [], {}
    with contextlib.redirect_stdout(printed):
        try:
            result = pretrain(train_valid_test_datasets_provider, model_provider, forward,
                              argv=argv)
            lines = result.log_lines
            losses = {i: v["lm loss"] for i, v in result.train_losses.items()}
        except SystemExit as exit:
            code = exit.code
    return code, printed.getvalue(), lines, calls["forward"], losses


def _tracker(save):
    with open(os.path.join(save, "latest_checkpointed_iteration.txt")) as handle:
        return handle.read().strip()


def test_disabled_mode_stops_every_rank_at_the_nan_iteration():
    # Rank 1's 5th forward: the first microbatch of iteration 3 (2 per rank per iteration).
    errors = run_distributed(_run, 2, args=(ARGV + ["--rerun-mode", "disabled"],),
                             kwargs={"nan_at": (5,)}, allow_errors=True)
    for rank, error in enumerate(errors):
        assert isinstance(error, str), rank
        assert "RuntimeError: iteration 3: found NaN in local forward loss calculation on 1 " \
               "rank(s)" in error, error
        # The NaN loss's grads, in rank 1's bucket before the data-parallel reduction.
        assert "found NaN in local grad norm in backward pass before data-parallel " \
               "communication collective on 1 rank(s)" in error
    # Without the check the NaN trains on: iteration 3's NaN grads make the weights NaN, so
    # iterations 4-6 report NaN losses (the NaN above was the loss's, not its report's).
    code, _, lines, _, _ = run_distributed(
        _run, 2, args=(ARGV + ["--no-check-for-nan-in-loss-and-grad", "--log-interval", "6"],),
        kwargs={"nan_at": (5,)})[1]
    assert code is None
    assert "number of nan iterations:   3 |" in lines[0], lines[0]


def test_fsdp2_checks_the_reduced_grad_shards():
    errors = run_distributed(_run, 2, args=(ARGV + ["--rerun-mode", "disabled",
                                                    "--use-torch-fsdp2"],),
                             kwargs={"nan_at": (5,)}, allow_errors=True)
    for error in errors:
        assert "iteration 3: found NaN in local forward loss calculation on 1 rank(s); found " \
               "NaN in local grad norm in backward pass after the data-parallel " \
               "reduce-scatter (FSDP2) on 2 rank(s)" in error, error


def test_disabled_mode_checks_the_first_iteration_and_validate_results_does_not():
    errors = run_distributed(_run, 2, args=(ARGV + ["--rerun-mode", "disabled"],),
                             kwargs={"nan_at": (1,)}, allow_errors=True)
    assert all("iteration 1: found NaN" in error for error in errors)
    # Megatron's validate_results leaves the job's first iteration unchecked: its NaN grads
    # update the weights, and iteration 2 finds NaN losses on both ranks (and reproduces them).
    results = run_distributed(_run, 2, args=(ARGV,), kwargs={"nan_at": (1,)})
    assert [r[0] for r in results] == [16, 16]
    assert "iteration 2: found NaN in local forward loss calculation on 2 rank(s)" in results[0][1]
    assert [r[3] for r in results] == [6, 6]  # iterations 1 and 2, and 2's rerun


def test_validate_results_transient_error_saves_and_exits_17(tmp_path):
    save = str(tmp_path / "ckpt")
    # NaN only in iteration 3's first pass; the rerun (calls 7, 8) is clean.
    results = run_distributed(_run, 2, args=(ARGV + ["--save", save, "--save-interval", "100"],),
                              kwargs={"nan_at": (5,)})
    for code, printed, _, forwards, _ in results:
        assert code == 17
        assert forwards == 8  # 3 iterations' 2 microbatches + the rerun's 2
    assert "Possible transient error!" in results[0][1]
    assert "Unexpected result" not in results[0][1] and "unexpected result" in results[1][1]
    assert _tracker(save) == "2"  # the starting point of the failed iteration


def test_validate_results_reproducible_result_is_rerun_after_resume(tmp_path):
    save = str(tmp_path / "ckpt")
    argv = ARGV + ["--save", save, "--save-interval", "100"]
    results = run_distributed(_run, 2, args=(argv,), kwargs={"nan_at": (5, 7)})
    assert [r[0] for r in results] == [16, 16]
    assert "unexpected result is reproducible" in results[0][1]
    assert _tracker(save) == "2"
    resume = argv + ["--load", save]
    # Same node and device: exit 16 again, before the optimizer step, saving nothing new.
    results = run_distributed(_run, 2, args=(resume,), kwargs={"nan_at": (1,)})
    assert [r[0] for r in results] == [16, 16]
    assert "Got rescheduled on the same GPU" in results[0][1]
    assert _tracker(save) == "2"
    # Elsewhere and reproduced: the result was likely right.
    results = run_distributed(_run, 2, args=(resume,),
                              kwargs={"nan_at": (1,), "other_device": True})
    assert [r[0] for r in results] == [17, 17]
    assert "Correct result (but possible Application error)" in results[0][1]
    # Elsewhere and not reproduced: the first device was likely at fault.
    results = run_distributed(_run, 2, args=(resume,), kwargs={"other_device": True})
    assert [r[0] for r in results] == [17, 17]
    assert "Possible persistent error!" in results[0][1]
    assert [r[3] for r in results] == [2, 2]  # only the rerun iteration ran


def test_a_finite_run_is_unchanged_by_the_checks():
    plain = run_distributed(_run, 2, args=(ARGV,))[0]
    unchecked = run_distributed(_run, 2, args=(ARGV + ["--no-check-for-nan-in-loss-and-grad"],))[0]
    assert plain[0] is None and sorted(plain[4]) == list(range(1, 7))
    assert plain[4] == unchecked[4]


def test_result_validation_flag_errors():
    from megatron_smp.config import ConfigError
    from megatron_smp.training.arguments import parse_args, validate_configs

    with pytest.raises(ConfigError, match="report_stats .*not supported"):
        validate_configs(parse_args(ARGV + ["--rerun-mode", "report_stats"]), world_size=1)
    with pytest.raises(SystemExit):  # argparse: invalid choice
        parse_args(ARGV + ["--rerun-mode", "sometimes"])


def _runs(rank, world_size, plans):
    return [_run(rank, world_size, argv, **kwargs) for argv, kwargs in plans]


def test_injected_errors_take_megatrons_three_paths(tmp_path):
    """--error-injection-rate 1 (Megatron's RerunErrorInjector: every rank rejects its first
    check of iteration 2, the first checked one): a transient error is not reproduced in
    place (exit 17); a persistent error and a correct result are (checkpoint, exit 16), and
    the resumed job's rerun on another device tells them apart."""
    def argv(kind, ckpt):
        return ARGV + ["--save", str(tmp_path / ckpt), "--save-interval", "100",
                       "--error-injection-rate", "1", "--error-injection-type", kind]

    plans = [(argv("transient_error", "t"), {}), (argv("persistent_error", "p"), {}),
             (argv("correct_result", "c"), {}),
             (argv("persistent_error", "p") + ["--load", str(tmp_path / "p")],
              {"other_device": True}),
             (argv("correct_result", "c") + ["--load", str(tmp_path / "c")],
              {"other_device": True})]
    results = run_distributed(_runs, 2, args=(plans,), timeout=240)
    for rank, (transient, persistent, correct, resumed_p, resumed_c) in enumerate(results):
        assert [transient[0], persistent[0], correct[0]] == [17, 16, 16]
        assert [resumed_p[0], resumed_c[0]] == [17, 17]
        assert transient[3] == 6  # two iterations' 2 microbatches + the rerun's 2
        assert "Injecting error type Transient error" in transient[1] + "".join(transient[2])
    printed = [run[1] for run in results[0]]
    assert "Possible transient error!" in printed[0]
    assert "unexpected result is reproducible within the tolerance" in printed[1]
    assert "injected error (--error-injection-rate) on 2 rank(s)" in printed[1]
    assert "Possible persistent error!" in printed[3]
    assert "Correct result (but possible Application error)" in printed[4]
    assert all(_tracker(str(tmp_path / name)) == "1" for name in "tpc")
