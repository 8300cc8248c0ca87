import json

import pytest

from megatron_smp.checkpointing import COMMON_FILENAME
from megatron_smp.config import ConfigError, TransformerConfig
from megatron_smp.checkpointing.loop import check_architecture_matches


def _config(**changes):
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=1000,
                max_position_embeddings=32)
    base.update(changes)
    return TransformerConfig(**base)


def test_non_shape_architecture_change_is_an_error(tmp_path):
    saved = _config(normalization="RMSNorm", rotary_base=500000.0)
    common = {"config": {"model": {"normalization": saved.normalization,
                                   "rotary_base": saved.rotary_base,
                                   "activation": saved.activation}}}
    (tmp_path / COMMON_FILENAME).write_text(json.dumps(common))
    check_architecture_matches(str(tmp_path), saved)  # same: fine
    with pytest.raises(ConfigError) as info:
        check_architecture_matches(str(tmp_path), _config(activation="gelu_tanh"))
    message = str(info.value)
    assert "normalization: checkpoint 'RMSNorm' vs flags 'LayerNorm'" in message
    assert "rotary_base: checkpoint 500000.0 vs flags 10000.0" in message
    assert "activation: checkpoint 'gelu' vs flags 'gelu_tanh'" in message


def test_checkpoint_without_model_config_is_not_checked(tmp_path):
    """A checkpoint that recorded no configuration (a converted one) loads under any flags;
    the same flags against a recorded configuration are an error."""
    flags = _config(normalization="RMSNorm")
    (tmp_path / COMMON_FILENAME).write_text(json.dumps({"config": None}))
    check_architecture_matches(str(tmp_path), flags)
    recorded = {"config": {"model": {"normalization": "LayerNorm"}}}
    (tmp_path / COMMON_FILENAME).write_text(json.dumps(recorded))
    with pytest.raises(ConfigError, match="normalization: checkpoint 'LayerNorm' vs flags"):
        check_architecture_matches(str(tmp_path), flags)


def test_sliding_window_is_part_of_the_architecture(tmp_path):
    windowed = _config(window_size=[4, 0])  # as JSON gives it back
    assert windowed.window_size == (4, 0)
    common = {"config": {"model": json.loads(json.dumps({"window_size": windowed.window_size}))}}
    (tmp_path / COMMON_FILENAME).write_text(json.dumps(common))
    check_architecture_matches(str(tmp_path), windowed)
    with pytest.raises(ConfigError, match=r"window_size: checkpoint \[4, 0\] vs flags None"):
        check_architecture_matches(str(tmp_path), _config())


def test_window_size_flag_and_validation():
    from megatron_smp.config import ParallelConfig
    from megatron_smp.training.arguments import parse_args

    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "32", "--max-position-embeddings", "32", "--vocab-size", "100",
            "--mock-data", "--tokenizer-type", "NullTokenizer", "--train-iters", "1"]
    configs = parse_args(base + ["--window-size", "(7,0)"])
    assert configs.model.window_size == (7, 0)
    with pytest.raises(SystemExit):
        parse_args(base + ["--window-size", "7"])
    with pytest.raises(ConfigError, match="--window-size 7,3"):
        _config(window_size=(7, 3)).validate(ParallelConfig())


class _Optimizer:
    def __init__(self):
        self.param_groups = [{"lr": 0.0}]


def _scheduler(**changes):
    from megatron_smp.config import OptimizerConfig
    from megatron_smp.training.optimizer_param_scheduler import OptimizerParamScheduler

    base = dict(lr=1e-3, min_lr=1e-5, lr_warmup_iters=2, lr_decay_iters=20,
                lr_decay_style="cosine")
    base.update(changes)
    return OptimizerParamScheduler(_Optimizer(), OptimizerConfig(**base), train_iters=20)


def test_checkpoint_schedule_differences_need_a_flag_that_picks_a_side():
    saved = _scheduler()
    saved.step(10)
    state = saved.state_dict()
    same = _scheduler()
    assert same.load_state_dict(state) == [] and same.state_dict() == state

    changed = dict(lr=2e-3, min_lr=0.0, lr_warmup_iters=3, lr_decay_iters=30,
                   lr_decay_style="linear")
    with pytest.raises(ConfigError) as info:
        _scheduler(**changed).load_state_dict(state)
    message = str(info.value)
    for difference in ("--lr: checkpoint 0.001, command line 0.002",
                       "--min-lr: checkpoint 1e-05, command line 0.0",
                       "--lr-warmup-iters/--lr-warmup-samples (or --lr-warmup-fraction), in "
                       "samples: checkpoint 2, command line 3",
                       "--lr-decay-iters/--lr-decay-samples (default: --train-iters/"
                       "--train-samples), in samples: checkpoint 20, command line 30",
                       "--lr-decay-style: checkpoint 'cosine', command line 'linear'",
                       "--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"):
        assert difference in message, message

    command_line = _scheduler(**changed)
    resolved = command_line.load_state_dict(state, override_opt_param_scheduler=True)
    assert len(resolved) == 5 and all("using the command line's" in r for r in resolved)
    fresh = _scheduler(**changed)
    fresh.step(10)
    assert command_line.state_dict() == fresh.state_dict()
    assert command_line.optimizer.param_groups[0]["lr"] == fresh.optimizer.param_groups[0]["lr"]

    checkpoint = _scheduler(**changed)
    resolved = checkpoint.load_state_dict(state, use_checkpoint_opt_param_scheduler=True)
    assert len(resolved) == 5 and all("using the checkpoint's" in r for r in resolved)
    assert checkpoint.state_dict() == state
    assert checkpoint.optimizer.param_groups[0]["lr"] == saved.optimizer.param_groups[0]["lr"]
