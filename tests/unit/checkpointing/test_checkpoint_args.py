"""--use-checkpoint-args restores the checkpoint's whole model: on checkpoints converted from
Hugging Face (hybrid stacks, MLA, Gemma 3), every architecture field of the parsed config
equals the adapter's config of the HF model, whatever the entry script's defaults; the
vocabulary is the checkpoint's when it has more rows than the tokenizer has ids."""
import dataclasses

import pytest

from megatron_smp.checkpointing.loop import (
    CHECKPOINT_ARGS_FIELDS, RUN_FIELDS, model_vocab_size,
)
from megatron_smp.config import TransformerConfig
from megatron_smp.models.hf import get_adapter
from tests.functional.test_family_workflow import build_hf
from tests.unit.tools.test_convert import _convert_ok

RUN = ("--seq-length 16 --micro-batch-size 1 --global-batch-size 1 --train-iters 1 "
       "--mock-data --tokenizer-type NullTokenizer --vocab-size 99 --lr 1e-3 "
       "--use-checkpoint-args --load").split()


def test_every_config_field_is_architecture_or_run():
    names = [field.name for field in dataclasses.fields(TransformerConfig)]
    assert RUN_FIELDS <= set(names)
    assert set(CHECKPOINT_ARGS_FIELDS) == set(names) - RUN_FIELDS
    for shape in ("hybrid_layer_pattern", "mamba_num_heads", "mamba_num_groups",
                  "experimental_attention_variant", "linear_attention_freq", "vocab_size"):
        assert shape in CHECKPOINT_ARGS_FIELDS


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe", "nemotron_h", "deepseek_v3",
                                    "gemma3"])
def test_converted_checkpoint_gives_the_whole_model(family, tmp_path):
    from megatron_smp.training.arguments import parse_args
    from pretrain_llama import LLAMA_DEFAULTS

    hf = build_hf(family)
    hf.save_pretrained(tmp_path / "hf")
    _convert_ok(family, "hf", "megatron_smp", tmp_path / "hf", tmp_path / "ckpt")
    expected = get_adapter(hf).config_from_hf(hf.config)
    # pretrain_llama.py's defaults (RMSNorm, SwiGLU, RoPE, no biases) give way too.
    for defaults in ({}, LLAMA_DEFAULTS):
        model = parse_args(RUN + [str(tmp_path / "ckpt")], args_defaults=defaults).model
        differing = {name: (getattr(model, name), getattr(expected, name))
                     for name in CHECKPOINT_ARGS_FIELDS
                     if getattr(model, name) != getattr(expected, name)}
        assert not differing, differing
    assert model.vocab_size == 1003
    assert model_vocab_size(model.vocab_size, 300) == 1003  # the checkpoint's rows are kept
    assert model_vocab_size(0, 300) == 300  # no checkpoint: the tokenizer's


def test_contradicting_hybrid_flags(tmp_path):
    from megatron_smp.config import ConfigError
    from megatron_smp.training.arguments import parse_args

    hf = build_hf("nemotron_h")
    hf.save_pretrained(tmp_path / "hf")
    _convert_ok("nemotron_h", "hf", "megatron_smp", tmp_path / "hf", tmp_path / "ckpt")
    load = [str(tmp_path / "ckpt")]
    with pytest.raises(ConfigError, match=r"--hidden-size gives hidden_size=96, the checkpoint "
                                          r"64"):
        parse_args(["--hidden-size", "96"] + RUN + load)
    with pytest.warns(UserWarning, match=r"--mamba-num-groups \(mamba_num_groups=8\) gives way "
                                         r"to the checkpoint's 2"):
        model = parse_args(["--mamba-num-groups", "8"] + RUN + load).model
    assert model.mamba_num_groups == 2 and model.mamba_num_heads == 8
