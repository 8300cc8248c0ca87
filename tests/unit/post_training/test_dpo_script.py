"""scripts/dpo_llama.sh, checked without a launch (a stub interpreter records each step's
command line): preprocess chats and pairs, convert once, SFT over the converted base, LoRA DPO
over the SFT checkpoint (adapters-off reference), export the SFT and DPO models and the PEFT
adapter; the SFT and DPO flags parse and validate at the script's world size."""
import os
import stat
import subprocess

from tests.unit.training.test_launch_scripts import ROOT


def _steps(tmp_path, extra_env=()):
    stub = tmp_path / "python"
    stub.write_text('#!/bin/sh\nprintf "%s\\n" "$@" ---- >> "$STUB_OUT"\n')
    stub.chmod(stub.stat().st_mode | stat.S_IEXEC)
    out = tmp_path / "argv.txt"
    out.write_text("")
    subprocess.run(["bash", os.path.join(ROOT, "scripts", "dpo_llama.sh"), "--seed", "3"],
                   check=True, timeout=30,
                   env=dict(os.environ, PYTHON=str(stub), GPUS_PER_NODE="0", NPROC_PER_NODE="2",
                            STUB_OUT=str(out), OUT=str(tmp_path / "run"), **dict(extra_env)))
    return [step.strip("\n").splitlines() for step in out.read_text().split("----")[:-1]]


def _entry_flags(step, entry):
    return step[step.index(entry) + 1:]


def test_dpo_script_steps(tmp_path):
    from megatron_smp.post_training.dpo_training import add_dpo_args, dpo_config
    from megatron_smp.training.arguments import parse_args, validate_configs
    from pretrain_llama import LLAMA_DEFAULTS

    run = tmp_path / "run"
    chats, pairs, convert, sft, dpo, export_sft, export_dpo = _steps(
        tmp_path, {"HF_MODEL": "hf/llama"})
    assert chats[0] == pairs[0] == "tools/preprocess_sft_data.py"
    assert "--preference" in pairs and "--preference" not in chats
    assert pairs[pairs.index("--input") + 1] == "data/chat/tiny_preference.jsonl"
    assert convert[convert.index("--loader") + 1] == "hf"
    shape = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]
    sft_flags = _entry_flags(sft, "pretrain_llama.py")
    assert sft_flags[sft_flags.index("--load") + 1] == str(run / "base")
    dpo_flags = _entry_flags(dpo, "train_dpo.py")
    assert dpo_flags[dpo_flags.index("--pretrained-checkpoint") + 1] == str(run / "sft")
    assert dpo_flags[dpo_flags.index("--load") + 1] == str(run / "dpo")
    assert dpo_flags[-2:] == ["--seed", "3"]
    for flags, extra, defaults in ((sft_flags, None, LLAMA_DEFAULTS),
                                   (dpo_flags, add_dpo_args, {**LLAMA_DEFAULTS, "sft": True})):
        flags = [f for f in flags if f != "--use-checkpoint-args"] + shape
        configs = parse_args(flags, extra, defaults)
        configs.model.vocab_size = 512
        validate_configs(configs, 2)
    config = dpo_config(configs)
    assert (config.reference, config.loss_type, configs.training.lora_rank) == (
        "adapters-off", "sigmoid", 16)
    assert export_sft[export_sft.index("--load-dir") + 1] == str(run / "sft")
    assert export_dpo[export_dpo.index("--peft-dir") + 1] == str(run / "peft_adapter")
    # Without HF_MODEL the small Llama is written first; with the SFT checkpoint there, SFT
    # is not run again.
    (run / "sft").mkdir(parents=True)
    (run / "sft" / "latest_checkpointed_iteration.txt").write_text("60")
    steps = _steps(tmp_path)
    assert steps[0][0] == "tools/make_tiny_llama.py"
    assert not any("pretrain_llama.py" in step for step in steps)
    assert sum("train_dpo.py" in step for step in steps) == 1


def test_frozen_reference_starting_point(tmp_path):
    """What a full fine-tuning run records as its frozen reference's source: the --finetune
    checkpoint, the --seed initialisation, or why a resume cannot rebuild it (--save is the
    directory it started from, whose checkpoint its own saves may replace)."""
    import os
    from types import SimpleNamespace

    from megatron_smp.post_training.reference import starting_point

    sft = tmp_path / "sft"
    sft.mkdir()
    (sft / "latest_checkpointed_iteration.txt").write_text("40")

    def configs(load, save):
        return SimpleNamespace(checkpoint=SimpleNamespace(load=load, save=save),
                               training=SimpleNamespace(seed=3))

    assert starting_point(configs(str(sft), str(tmp_path / "dpo"))) == {
        "load": os.path.abspath(sft), "iteration": 40}
    assert starting_point(configs(None, str(tmp_path / "dpo"))) == {"seed": 3}
    assert starting_point(configs(str(tmp_path / "empty"), None)) == {"seed": 3}
    why = starting_point(configs(str(sft), str(sft)))["unavailable"]
    assert why.startswith(f"the run started from iteration 40 of its own --save directory {sft}")
