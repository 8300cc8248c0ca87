"""bench_throughput.py reads our Megatron-format log line (so a change of the line cannot
silently break the benchmark) and turns an iteration time into tokens/s, TFLOP/s and MFU."""
import os
import sys

import pytest
import torch

from megatron_smp.config import TrainingConfig
from megatron_smp.training.logging import TrainingLogger

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "tools", "bench"))
import bench_throughput  # noqa: E402


def test_parses_the_training_log_line():
    logger = TrainingLogger(False, TrainingConfig(train_iters=20, log_throughput=True),
                            torch.device("cpu"))
    lines = [logger.training_line(iteration, 8 * iteration, ms, 1e-4, 8, {"lm loss": 6.9}, 1.0,
                                  0.5, None, 0, 0, 1234.5, 12.3)
             for iteration, ms in [(3, 161.25), (12, 9876.5)]]
    found = [(int(m.group(1)), float(m.group(2)))
             for m in bench_throughput._ITERATION_LINE.finditer("\n".join(lines))]
    assert found == [(3, 161.2), (12, 9876.5)]  # the line prints ms with one decimal


def test_figures_against_the_h100_peak():
    # Llama 1B preset at micro-batch 1: 33.668248633344 TFLOP per iteration (Megatron's
    # formula, see tests/unit/training/test_flops.py); 0.1 s per iteration of 4096 tokens.
    values = bench_throughput.figures(0.1, 4096, 33668248633344.0, 1, 989.0)
    assert values["tokens_per_s"] == pytest.approx(40960.0)
    assert values["tflops_per_device"] == pytest.approx(336.68248633344)
    assert values["mfu"] == pytest.approx(336.68248633344 / 989.0)
    assert bench_throughput.figures(0.1, 4096, 1e12, 2, None)["mfu"] is None
    assert bench_throughput.figures(0.1, 4096, 1e12, 2, None)["tflops_per_device"] == 5.0


@pytest.mark.parametrize("preset,micro_batch,padded_vocab,flops", [
    # The shapes of tests/unit/training/test_flops.py's GPT-2 125M and Llama 1B cases.
    ("gpt2-125m", 8, 50304, 6537477095424),
    ("llama-1b", 1, 128256, 33668248633344),
])
def test_presets_are_the_intended_models(preset, micro_batch, padded_vocab, flops):
    spec = bench_throughput.PRESETS[preset]
    argv = bench_throughput.ours_argv(spec, micro_batch, micro_batch, 13, True, [])
    config, padded, got = bench_throughput.model_flops(spec, argv, micro_batch)
    assert (padded, got) == (padded_vocab, flops)
    assert config.params_dtype == torch.bfloat16
    if preset == "llama-1b":
        assert config.recompute_granularity == "selective"
        assert (config.num_query_groups, config.gated_linear_unit) == (8, True)
