"""Megatron's flags -> an inference engine: what `tools/generate.py` and
`tools/run_text_generation_server.py` share.

    configs, state, engine, tokenizer = build_inference_engine(argv, extra_args_provider)

parses the flags (`--load`, `--use-checkpoint-args`, the model and parallel sizes, the
tokenizer, the --inference-* flags), validates them once before any process group, and hands
the configs to `inference.launcher.launch_inference_engine`, which builds the model and the
engine (the inference package itself reads no flags).
"""
from __future__ import annotations

import sys
from typing import Callable, Optional, Sequence

from megatron_smp.config import ParallelConfig
from megatron_smp.inference.launcher import (
    check_inference_layout, launch_inference_engine, speculative_config_of,
)
from megatron_smp.training.arguments import parse_args
from megatron_smp.training.arguments.modes import add_inference_args
from megatron_smp.training.pretrain import build_configs

# Training's required numbers, at values every layout divides (the engine's own limits are the
# --inference-* flags).
_DEFAULTS = {"micro_batch_size": 1, "train_iters": 1, "seq_length": 8, "mock_data": True}


def _draft_argv(argv: Sequence[str], path: str) -> list:
    """The flags with --load PATH (and --use-checkpoint-args): the draft checkpoint's model
    with the same tokenizer."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--load":
            skip = True
        elif not arg.startswith("--load="):
            out.append(str(arg))
    out += ["--load", path]
    return out if "--use-checkpoint-args" in out else out + ["--use-checkpoint-args"]


def build_inference_engine(argv: Optional[Sequence[str]] = None,
                           extra_args_provider: Optional[Callable] = None,
                           model_provider: Optional[Callable] = None):
    """(configs, state, engine, tokenizer) from Megatron flags; collective (every check runs
    first, on every rank)."""
    from megatron_smp.checkpointing.loop import model_vocab_size

    def providers(parser):
        for action in parser._actions:  # a training length means nothing here
            if action.dest == "training__seq_length":
                action.required = False
        parser = add_inference_args(parser)
        if extra_args_provider is not None:
            parser = extra_args_provider(parser) or parser
        return parser

    argv = list(argv) if argv is not None else sys.argv[1:]
    # The --inference-* flags are checked with the rest (configs.inference).
    configs, tokenizer = build_configs(argv, providers, _DEFAULTS)
    speculative = speculative_config_of(configs.inference)
    check_inference_layout(configs)
    draft_configs = None
    if speculative is not None and speculative.method == "draft_model":
        draft_configs = parse_args(_draft_argv(argv, speculative.model), providers, _DEFAULTS)
        draft_configs.model.vocab_size = model_vocab_size(draft_configs.model.vocab_size,
                                                          tokenizer.vocab_size)
        # The draft runs whole on every rank (one process's layout).
        draft_configs.model.validate(ParallelConfig())
    state, engine = launch_inference_engine(configs, model_provider, draft_configs)
    return configs, state, engine, tokenizer


__all__ = ["build_inference_engine"]
