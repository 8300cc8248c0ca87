"""Whole training runs: every parallel layout follows the single-process trajectory."""
import os
import subprocess
import sys

import pytest

from megatron_smp.testing import run_distributed

COMMON = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 8 --train-iters 10 "
    "--mock-data --tokenizer-type NullTokenizer --vocab-size 1000 --hidden-dropout 0 "
    "--attention-dropout 0 --lr 1e-3 --lr-warmup-iters 2 --log-interval 5 --eval-interval 100 "
    "--eval-iters 1 --seed 7"
).split()
LLAMA = (
    "--normalization RMSNorm --swiglu --position-embedding-type rope "
    "--untie-embeddings-and-output-weights --disable-bias-linear "
    "--group-query-attention --num-query-groups 2"
).split()
MODELS = {"gpt": [], "llama": LLAMA}


def _train(rank, world_size, argv, script="pretrain_gpt"):
    """Per-iteration lm loss of the entry script `script` (its providers and its
    `args_defaults`, e.g. pretrain_llama's LLAMA_DEFAULTS) run with `argv`."""
    import importlib

    from megatron_smp.training import pretrain

    entry = importlib.import_module(script)
    result = pretrain(
        entry.train_valid_test_datasets_provider, entry.model_provider, entry.forward_step,
        argv=argv, args_defaults=getattr(entry, "LLAMA_DEFAULTS", None),
    )
    return [result.train_losses[i]["lm loss"] for i in sorted(result.train_losses)]


_BASELINES = {}


def baseline(model):
    if model not in _BASELINES:
        _BASELINES[model] = run_distributed(_train, 1, args=(COMMON + MODELS[model],))[0]
    return _BASELINES[model]


LAYOUTS = {
    "tp2": (2, "--tensor-model-parallel-size 2"),
    "tp2_sp": (2, "--tensor-model-parallel-size 2 --sequence-parallel"),
    "dp2": (2, ""),
    "tp2_dp2": (4, "--tensor-model-parallel-size 2"),
}


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_layout_matches_single_process(model, layout):
    world_size, flags = LAYOUTS[layout]
    reference = baseline(model)
    results = run_distributed(
        _train, world_size, args=(COMMON + MODELS[model] + flags.split(),), timeout=300
    )
    assert len(reference) == 10 and reference[-1] < reference[0]
    for losses in results:
        assert losses == pytest.approx(reference, rel=1e-4), (layout, losses, reference)


def test_bad_config_exits_on_every_rank_with_one_message(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    argv = COMMON + ["--tensor-model-parallel-size", "2", "--num-attention-heads", "3",
                     "--hidden-size", "66"]
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "pretrain_gpt.py", *argv],
        capture_output=True, text=True, timeout=120, env=env,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )
    assert proc.returncode != 0
    message = "--num-attention-heads (3) must be divisible by --tensor-model-parallel-size (2)"
    assert (proc.stdout + proc.stderr).count(message) == 1, proc.stderr[-3000:]
    assert "megatron_smp/config/" not in proc.stderr  # no stack trace, just the message


def _train_with_eval(rank, world_size, argv):
    from megatron_smp.training import pretrain
    from pretrain_gpt import forward_step, model_provider, train_valid_test_datasets_provider

    result = pretrain(train_valid_test_datasets_provider, model_provider, forward_step, argv=argv)
    return result.valid_losses, result.log_lines


def test_validation_log_line_and_tensorboard(tmp_path):
    import re

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    argv = [a if a != "100" else "5" for a in COMMON]  # --eval-interval 5
    single = run_distributed(_train_with_eval, 1, args=(argv,))[0][0]
    board = str(tmp_path / "tb")
    results = run_distributed(
        _train_with_eval, 2,
        args=(argv + ["--pipeline-model-parallel-size", "2", "--tensorboard-dir", board,
                      "--log-validation-ppl-to-tensorboard", "--tensorboard-log-interval", "2"],),
    )
    for valid, _ in results:
        assert sorted(valid) == [5, 10]
        for it in valid:
            assert valid[it]["lm loss"] == pytest.approx(single[it]["lm loss"], rel=1e-5)
    lines = results[1][1]
    train_line = next(line for line in lines if line.startswith(" iteration"))
    assert re.match(
        r" iteration +5/ +10 \| consumed samples: +40 \| elapsed time per iteration \(ms\): "
        r"[\d.]+ \|.* learning rate: [\d.]+E[-+]\d+ \| global batch size: +8 \| "
        r"lm loss: [\d.]+E\+00 \| loss scale: 1\.0 \| grad norm: [\d.]+ \| "
        r"number of skipped iterations: +0 \| number of nan iterations: +0 \|", train_line)
    assert any("validation loss at iteration 10 | lm loss value:" in line for line in lines)
    events = EventAccumulator(board)
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"lm loss", "learning-rate", "grad-norm", "loss-scale", "lm loss validation",
            "lm loss validation ppl"} <= tags
    assert [e.step for e in events.Scalars("lm loss")] == [2, 4, 6, 8, 10]
