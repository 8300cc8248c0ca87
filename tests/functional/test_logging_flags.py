"""Megatron's logging flags change the log line and the TensorBoard scalars as they say."""
import pytest

from megatron_smp.testing import run_distributed
from tests.functional.test_training_parity import COMMON


def _run(rank, world_size, argv, probe_gc=False):
    import gc

    from megatron_smp.training import pretrain
    from pretrain_gpt import forward_step, model_provider, train_valid_test_datasets_provider

    gc_states = []
    collections = []

    def forward(data_iterator, model):
        gc_states.append(gc.isenabled())
        return forward_step(data_iterator, model)

    if probe_gc:
        gc.callbacks.append(lambda phase, info: phase == "start" and collections.append(
            (len(gc_states), info["generation"])))
    result = pretrain(train_valid_test_datasets_provider, model_provider, forward, argv=argv)
    return result.log_lines, gc_states, collections, gc.isenabled()


def _train_lines(lines):
    return [line for line in lines if line.startswith(" iteration")]


def _scalars(board):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(board)
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)]
            for tag in events.Tags()["scalars"]}


ARGV = [a if a != "100" else "5" for a in COMMON]  # --eval-interval 5, --log-interval 5


def test_defaults_log_megatron_fields_only(tmp_path):
    board = str(tmp_path / "tb")
    lines, gc_states, _, _ = run_distributed(_run, 1, args=(ARGV + ["--tensorboard-dir", board],))[0]
    line = _train_lines(lines)[0]
    assert "throughput" not in line and "num zeros" not in line
    tags = set(_scalars(board))
    assert {"lm loss", "learning-rate", "grad-norm", "lm loss validation"} <= tags
    assert not tags & {"iteration-time", "num-zeros", "throughput", "lm loss validation ppl",
                       "mem-max-rss-bytes"}
    assert all(gc_states)  # the garbage collector stays on without --manual-gc


def test_logging_flags_take_effect(tmp_path):
    board = str(tmp_path / "tb")
    flags = ["--tensorboard-dir", board, "--tensorboard-log-interval", "3", "--log-throughput",
             "--log-num-zeros-in-grad", "--log-timers-to-tensorboard",
             "--log-validation-ppl-to-tensorboard", "--log-memory-to-tensorboard"]
    lines, _, _, _ = run_distributed(_run, 1, args=(ARGV + flags,))[0]
    line = _train_lines(lines)[0]
    assert " throughput per GPU (TFLOP/s/GPU): " in line and " throughput (tokens/s): " in line
    zeros = float(line.split(" num zeros: ")[1].split(" |")[0])
    # NullTokenizer: 1000 + EOD = 1001 ids in a table padded to 1024 rows of 64: the 23
    # padding rows of the tied embedding never get a gradient.
    assert zeros >= 23 * 64
    scalars = _scalars(board)
    assert [step for step, _ in scalars["lm loss"]] == [3, 6, 9]
    assert [step for step, _ in scalars["num-zeros"]] == [3, 6, 9]
    assert [step for step, _ in scalars["iteration-time"]] == [5, 10]
    assert all(value > 0 for _, value in scalars["iteration-time"])
    # 5 and 10 inside training, then the validation and test sets after it (Megatron writes
    # both evaluations "after training is done" to the validation tags).
    assert [step for step, _ in scalars["lm loss validation ppl"]] == [5, 10, 10, 10]
    assert all(value > 50e6 for _, value in scalars["mem-max-rss-bytes"])  # bytes, not KiB


def test_num_zeros_counts_each_element_once_across_tensor_parallel_ranks():
    # No biases: the key bias's grad is zero analytically (softmax ignores a per-query
    # constant), so its float value is noise that is exactly 0.0 by chance in some layouts.
    flags = ["--log-num-zeros-in-grad", "--log-interval", "1", "--train-iters", "2",
             "--disable-bias-linear"]
    single = run_distributed(_run, 1, args=(ARGV + flags,))[0][0]
    tp2 = run_distributed(_run, 2, args=(ARGV + flags + ["--tensor-model-parallel-size", "2"],))
    zeros = [[line.split(" num zeros: ")[1].split(" |")[0] for line in _train_lines(result[0])]
             for result in [(single,)] + tp2]
    # Exactly the 23 padding rows of the tied 1024 x 64 table, at TP=1 and on both TP=2 ranks.
    assert zeros == [["1472.0", "1472.0"]] * 3


def test_manual_gc_disables_automatic_collection_and_collects_on_interval():
    flags = ["--manual-gc", "--manual-gc-interval", "4", "--eval-interval", "100"]
    _, gc_states, collections, enabled_after = run_distributed(
        _run, 1, args=(ARGV + flags,), kwargs={"probe_gc": True})[0]
    assert gc_states and not any(gc_states)
    assert enabled_after
    # Full collections (generation 2) at the start and after iterations 4 and 8 (the forward
    # counter is 4 microbatches per iteration): no others while training.
    during = [(forwards, generation) for forwards, generation in collections
              if 0 < forwards < len(gc_states)]
    assert during == [(16, 2), (32, 2)], collections


def test_manual_gc_flags_need_manual_gc():
    from megatron_smp.config import ConfigError
    from megatron_smp.training.arguments import parse_args, validate_configs

    configs = parse_args(ARGV + ["--manual-gc-interval", "2"])
    with pytest.raises(ConfigError, match="--manual-gc"):
        validate_configs(configs)
