import json

import pytest

from megatron_smp.checkpointing import COMMON_FILENAME
from megatron_smp.config import ConfigError, TransformerConfig
from megatron_smp.training.checkpointing import check_architecture_matches


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
    (tmp_path / COMMON_FILENAME).write_text(json.dumps({"config": None}))
    check_architecture_matches(str(tmp_path), _config())


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
