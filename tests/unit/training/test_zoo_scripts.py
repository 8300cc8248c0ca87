"""The example scripts of the new families (scripts/pretrain_{llama31_8b,qwen25_7b,
qwen3_moe_30b_a3b,gpt_oss_20b}.sh and scripts/small/) pass flags that parse and validate at
their world size and build the model they say (checked without a launch: a stub torchrun
records the command line)."""
import os
import stat
import subprocess

import pytest

from megatron_smp.training.arguments import parse_args, validate_configs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__)))))
SCRIPTS = {
    "pretrain_llama31_8b.sh": dict(use_rope_scaling=True, rope_scaling_factor=8.0,
                                   rotary_base=500000.0, num_query_groups=8),
    "pretrain_qwen25_7b.sh": dict(add_qkv_bias=True, add_bias_linear=False,
                                  position_embedding_type="rope", num_query_groups=4),
    "pretrain_qwen3_moe_30b_a3b.sh": dict(qk_layernorm=True, kv_channels=128,
                                          num_moe_experts=128, moe_router_topk=8,
                                          moe_router_pre_softmax=False),
    "small/pretrain_llama31_small.sh": dict(use_rope_scaling=True,
                                            rope_scaling_original_max_position_embeddings=64),
    "small/pretrain_qwen25_small.sh": dict(
        add_qkv_bias=True, position_embedding_type="yarn", yarn_rotary_scaling_factor=4.0,
        untie_embeddings_and_output_weights=False),
    "small/pretrain_qwen3_moe_small.sh": dict(qk_layernorm=True, kv_channels=48,
                                              num_moe_experts=8),
    "pretrain_gpt_oss_20b.sh": dict(softmax_type="learnable", window_attn_skip_freq=2,
                                    activation="quick_gelu", glu_linear_offset=1.0,
                                    activation_func_clamp_value=7.0, num_moe_experts=32,
                                    position_embedding_type="yarn"),
    "small/pretrain_gpt_oss_small.sh": dict(softmax_type="learnable", window_size=(15, 0),
                                            activation="quick_gelu", num_moe_experts=4),
}


def _command_line(script, tmp_path, env=()):
    stub = tmp_path / "torchrun"
    stub.write_text('#!/bin/sh\nprintf "%s\\n" "$@" > "$STUB_OUT"\n')
    stub.chmod(stub.stat().st_mode | stat.S_IEXEC)
    out = tmp_path / "argv.txt"
    environment = dict(os.environ, TORCHRUN=str(stub), STUB_OUT=str(out), DATA_PATH="data",
                       TOKENIZER_MODEL="tokenizer", CHECKPOINT_PATH=str(tmp_path / "ckpt"),
                       OUT=str(tmp_path / "out"), **dict(env))
    subprocess.run(["bash", os.path.join(ROOT, "scripts", script)], env=environment,
                   check=True, timeout=30)
    return out.read_text().splitlines()


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_script_flags_validate(script, tmp_path):
    from pretrain_llama import LLAMA_DEFAULTS

    argv = _command_line(script, tmp_path)
    index = next(i for i, token in enumerate(argv) if token.endswith(".py"))
    launcher, entry, flags = argv[:index], argv[index], argv[index + 1:]
    world_size = int(launcher[launcher.index("--nproc-per-node") + 1])
    if "--nnodes" in launcher:
        world_size *= int(launcher[launcher.index("--nnodes") + 1])
    defaults = LLAMA_DEFAULTS if entry == "pretrain_llama.py" else None
    configs = parse_args(flags, args_defaults=defaults)
    configs.model.vocab_size = 151936  # the tokenizer's, in a run
    validate_configs(configs, world_size)
    for field, value in SCRIPTS[script].items():
        assert getattr(configs.model, field) == value, (script, field)


def test_qwen25_yarn_knob(tmp_path):
    flags = _command_line("pretrain_qwen25_7b.sh", tmp_path, {"YARN": "1"})
    configs = parse_args(flags[flags.index("pretrain_llama.py") + 1:])
    assert configs.model.position_embedding_type == "yarn"
    assert configs.model.yarn_original_max_position_embeddings == 32768
