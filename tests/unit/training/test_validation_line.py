"""Megatron's evaluation block: every loss or metric as "<key> value: X |", a perplexity
only beside a language model's cross entropy."""
import math

import torch

from megatron_smp.config import TrainingConfig
from megatron_smp.training.logging import TrainingLogger, has_perplexity


def test_perplexity_only_for_language_model_losses(capsys):
    logger = TrainingLogger(True, TrainingConfig(), torch.device("cpu"))
    line = logger.validation_line("validation", 10, {"lm loss": 2.0, "mtp_1 loss": 3.0})
    assert line == (f" validation loss at iteration 10 | lm loss value: 2.000000E+00 | "
                    f"lm loss PPL: {math.exp(2.0):.6E} | mtp_1 loss value: 3.000000E+00 | "
                    f"mtp_1 loss PPL: {math.exp(3.0):.6E} |")
    line = logger.validation_line("validation", 10, {"dpo loss": 0.5, "rewards/margins": -0.25},
                                  dataset="test")
    assert line == (" validation loss at iteration 10 on test set | dpo loss value: "
                    "5.000000E-01 | rewards/margins value: -2.500000E-01 |")
    printed = capsys.readouterr().out.splitlines()
    assert printed[-2] == line and printed[-1] == printed[-3] == "-" * (len(line) + 1)
    assert not any(has_perplexity(key) for key in ("dpo loss", "rewards/accuracies",
                                                   "logps/chosen", "grpo loss"))
