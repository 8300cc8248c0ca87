"""scripts/grpo_addition.sh, checked without a launch (a stub interpreter records each step's
command line): the task's SFT data, the tiny Llama, preprocessing, conversion, SFT, the greedy
evaluation of the SFT model, then GRPO over it; train_rl.py's flags parse and pass train_rl's
own checks at the script's world size (two ranks)."""
import os
import stat
import subprocess

from tests.unit.training.test_launch_scripts import ROOT


def test_grpo_addition_script_steps(tmp_path):
    from megatron_smp.post_training.rl_config import rl_config
    from megatron_smp.post_training.rl_training import add_rl_training_args, check_rl_configs
    from megatron_smp.training.arguments import parse_args, validate_configs

    stub = tmp_path / "python"
    stub.write_text('#!/bin/sh\nprintf "%s\\n" "$@" ---- >> "$STUB_OUT"\n')
    stub.chmod(stub.stat().st_mode | stat.S_IEXEC)
    out = tmp_path / "argv.txt"
    out.write_text("")
    run = tmp_path / "run"
    subprocess.run(["bash", os.path.join(ROOT, "scripts", "grpo_addition.sh"), "--seed", "3"],
                   check=True, timeout=30, capture_output=True,
                   env=dict(os.environ, PYTHON=str(stub), GPUS_PER_NODE="0", NPROC_PER_NODE="2",
                            STUB_OUT=str(out), OUT=str(run)))
    steps = [step.strip("\n").splitlines() for step in out.read_text().split("----")[:-1]]
    data, make, preprocess, convert, sft, evaluation, grpo, check = steps
    assert data[:2] == ["-m", "megatron_smp.post_training.envs.addition"]
    assert make[0] == "tools/make_tiny_llama.py" and "plain" in make
    assert preprocess[0] == "tools/preprocess_sft_data.py"
    assert convert[0] == "tools/checkpoint/convert.py"
    assert "pretrain_llama.py" in sft and "--sft" in sft
    # The environment is the shipped one at one digit.
    env_file = run / "addition.yaml"
    assert env_file.read_text().count("digits: 1") == 2
    assert "--skip-train" in evaluation and "--skip-train" not in grpo
    flags = grpo[grpo.index("train_rl.py") + 1:]
    assert flags[-2:] == ["--seed", "3"]
    assert flags[flags.index("--load") + 1] == str(run / "sft")
    defaults = {"mock_data": True, "tokenizer_type": "HuggingFaceTokenizer"}
    flags = [f for f in flags if f != "--use-checkpoint-args"] + [
        "--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4"]
    config = rl_config(parse_args(flags, add_rl_training_args, defaults).args)
    assert (config.group_size, config.prompts_per_step, config.kl_beta) == (8, 32, 0.3)
    assert config.sequence_packing
    configs = parse_args(flags, add_rl_training_args,
                         {**defaults, "global_batch_size": config.rollouts_per_step})
    configs.model.vocab_size = 259
    validate_configs(configs, 2)
    check_rl_configs(configs, config)
    assert check[0] == "-" and check[1:] == [str(run / "rl_start.log"), str(run / "rl.log")]
