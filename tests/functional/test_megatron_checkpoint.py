"""pretrain --load of real Megatron-LM checkpoints (megatron-core 0.16.1, tests/fixtures/megatron):
detected by itself, loaded with --finetune at TP=2 as at TP=1, resumed with --no-load-optim,
and the flags that decide what happens on a mismatch."""
import os

import pytest

from megatron_smp.checkpointing import CheckpointError
from megatron_smp.testing import run_distributed
from tests.functional.test_training_parity import _train

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "megatron")
# The fixtures' shape: 2 layers, hidden 64, 4 heads, 32 positions, 100 tokens (NullTokenizer:
# 99 + eod).
BASE = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 16 "
    "--max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 4 --train-iters 2 "
    "--mock-data --tokenizer-type NullTokenizer --vocab-size 99 --hidden-dropout 0 "
    "--attention-dropout 0 --lr 1e-3 --log-interval 1 --eval-interval 100 --eval-iters 1 "
    "--seed 7"
).split()
GPT = BASE + ["--ffn-hidden-size", "256"]
LLAMA = BASE + ("--normalization RMSNorm --swiglu --ffn-hidden-size 128 --position-embedding-type "
                "rope --untie-embeddings-and-output-weights --disable-bias-linear "
                "--group-query-attention --num-query-groups 2").split()
CASES = {
    "gpt_torch_dist": ("pretrain_gpt", GPT),
    "llama_torch_dist": ("pretrain_llama", LLAMA),
    "llama_legacy_tp2": ("pretrain_llama", LLAMA),
    "llama_torch_dist_0192": ("pretrain_llama", LLAMA),  # megatron-core 0.19.2: no common.pt
}


def _losses(world_size, script, argv):
    return run_distributed(_train, world_size, args=(argv,), kwargs={"script": script},
                           timeout=240)[0]


@pytest.mark.parametrize("fixture", sorted(CASES))
def test_finetune_from_megatron_checkpoint_tp2_equals_tp1(fixture):
    script, argv = CASES[fixture]
    argv = argv + ["--load", os.path.join(FIXTURES, fixture), "--finetune"]
    tp1 = _losses(1, script, argv)
    tp2 = _losses(2, script, argv + ["--tensor-model-parallel-size", "2"])
    scratch = _losses(1, script, CASES[fixture][1])
    assert len(tp1) == 2
    assert tp2[0] == pytest.approx(tp1[0], abs=1e-5)
    # The weights came from the checkpoint: not those a fresh run draws.
    assert abs(tp1[0] - scratch[0]) > 1e-3


def test_finetune_tied_gpt_at_pp2_equals_tp1():
    """The last stage's copy of the tied embedding comes from the checkpoint's table too."""
    argv = GPT + ["--load", os.path.join(FIXTURES, "gpt_torch_dist"), "--finetune"]
    tp1 = _losses(1, "pretrain_gpt", argv)
    pp2 = _losses(2, "pretrain_gpt", argv + ["--pipeline-model-parallel-size", "2"])
    assert pp2 == pytest.approx(tp1, abs=1e-5)


def _error_of(rank, world_size, argv, script):
    try:
        _train(rank, world_size, argv, script=script)
    except CheckpointError as error:
        return str(error)
    return None


def _error(argv, script="pretrain_llama"):
    return run_distributed(_error_of, 1, args=(argv, script), timeout=120)[0]


def test_resume_needs_finetune_or_no_load_optim_and_no_load_rng():
    load = ["--load", os.path.join(FIXTURES, "llama_legacy_tp2")]
    message = _error(LLAMA + load)
    assert "--finetune" in message and "--no-load-optim" in message
    message = _error(LLAMA + load + ["--no-load-optim"])
    assert "--no-load-rng" in message


def test_no_load_optim_resumes_at_the_checkpoint_iteration():
    # The legacy fixture is iteration 5: with --train-iters 7 two iterations remain.
    argv = LLAMA + ["--load", os.path.join(FIXTURES, "llama_legacy_tp2"), "--no-load-optim",
                    "--no-load-rng", "--train-iters", "7"]
    assert len(_losses(1, "pretrain_llama", argv)) == 2


def test_ckpt_format_torch_needs_auto_detect_for_torch_dist():
    load = ["--load", os.path.join(FIXTURES, "llama_torch_dist"), "--finetune"]
    message = _error(LLAMA + load + ["--ckpt-format", "torch"])
    assert "--auto-detect-ckpt-format" in message
    losses = _losses(1, "pretrain_llama", LLAMA + load + ["--ckpt-format", "torch",
                                                          "--auto-detect-ckpt-format"])
    assert losses == pytest.approx(_losses(1, "pretrain_llama", LLAMA + load), abs=0)


def test_mismatched_model_names_the_fields_and_use_checkpoint_args_fixes_it():
    load = ["--load", os.path.join(FIXTURES, "llama_torch_dist"), "--finetune"]
    wrong = [a if a != "128" else "192" for a in LLAMA]  # --ffn-hidden-size 192
    message = _error(wrong + load)
    assert "ffn_hidden_size: checkpoint 128 vs flags 192" in message
    assert "--use-checkpoint-args" in message
    # With --use-checkpoint-args a contradicting weight shape is an error naming both values
    # (Megatron-LM keeps a given --ffn-hidden-size, then fails to load); without the flag
    # the checkpoint gives the whole model.
    from megatron_smp.config import ConfigError
    from megatron_smp.training.arguments import parse_args

    with pytest.raises(ConfigError, match="--ffn-hidden-size gives ffn_hidden_size=192, the "
                                          "checkpoint 128"):
        parse_args(wrong + load + ["--use-checkpoint-args"])
    at = wrong.index("--ffn-hidden-size")
    fixed = _losses(1, "pretrain_llama",
                    wrong[:at] + wrong[at + 2:] + load + ["--use-checkpoint-args"])
    assert fixed == pytest.approx(_losses(1, "pretrain_llama", LLAMA + load), abs=0)


def test_ckpt_fully_parallel_save_holds_both_replicas_write(tmp_path):
    """What --ckpt-fully-parallel-save asks (and Megatron 0.16.1 does by default): at DP=2 the
    replicated model is not written by rank 0 alone, each replica writes about half."""
    save = str(tmp_path / "ckpt")
    argv = GPT + ["--train-iters", "1", "--save", save, "--ckpt-fully-parallel-save",
                  "--ckpt-fully-parallel-load"]
    run_distributed(_train, 2, args=(argv,), kwargs={"script": "pretrain_gpt"}, timeout=240)
    path = os.path.join(save, "iter_0000001")
    sizes = {}
    for name in os.listdir(path):
        if name.endswith(".distcp"):
            rank = int(name.split("_")[2])
            sizes[rank] = sizes.get(rank, 0) + os.path.getsize(os.path.join(path, name))
    assert sorted(sizes) == [0, 1]
    assert min(sizes.values()) > 0.3 * sum(sizes.values()), sizes


def _without_args(tmp_path, fixture):
    import shutil

    import torch

    from megatron_smp.checkpointing.megatron_lm import safe_load

    target = tmp_path / fixture
    shutil.copytree(os.path.join(FIXTURES, fixture), target)
    common_path = target / "iter_0000010" / "common.pt"
    common = safe_load(str(common_path))
    del common["args"]
    torch.save(common, common_path)
    return str(target)


def test_dist_ckpt_strictness_decides_about_tensors_the_checkpoint_lacks(tmp_path):
    """A tied GPT checkpoint (no args) loaded into an untied model: the output layer is an
    "unexpected" key. The default (assume_ok_unexpected) refuses; log_unexpected keeps the
    output layer's initial values, so the first loss is the same as with ignore_all."""
    argv = GPT + ["--load", _without_args(tmp_path, "gpt_torch_dist"), "--finetune",
                  "--untie-embeddings-and-output-weights"]
    message = _error(argv, script="pretrain_gpt")
    assert "lacks tensors the model has: output_layer.weight" in message
    assert "--dist-ckpt-strictness log_unexpected" in message
    logged = _losses(1, "pretrain_gpt", argv + ["--dist-ckpt-strictness", "log_unexpected"])
    ignored = _losses(1, "pretrain_gpt", argv + ["--dist-ckpt-strictness", "ignore_all"])
    tied = _losses(1, "pretrain_gpt", GPT + ["--load", os.path.join(FIXTURES, "gpt_torch_dist"),
                                             "--finetune"])
    assert logged == ignored
    assert abs(logged[0] - tied[0]) > 1e-3  # the untied head is not the loaded table


def test_ckpt_format_torch_saves_megatron_legacy_layout_too(tmp_path):
    """--ckpt-format torch at TP=2 writes mp_rank_0X/model_optim_rng.pt beside our per-rank
    files; that Megatron-LM layout alone (our files removed) finetunes at TP=1 to the same
    first loss as our own checkpoint of the run at TP=2."""
    import shutil

    from megatron_smp.checkpointing.megatron_lm import find_megatron_checkpoint, read_args

    save = str(tmp_path / "run")
    _losses(2, "pretrain_llama", LLAMA + ["--tensor-model-parallel-size", "2", "--save", save,
                                          "--ckpt-format", "torch", "--train-iters", "1"])
    legacy = str(tmp_path / "legacy")
    os.makedirs(os.path.join(legacy, "iter_0000001"))
    for name in ("mp_rank_00", "mp_rank_01"):
        shutil.copytree(os.path.join(save, "iter_0000001", name),
                        os.path.join(legacy, "iter_0000001", name))
    shutil.copy(os.path.join(save, "latest_checkpointed_iteration.txt"), legacy)
    found = find_megatron_checkpoint(legacy)
    assert found.ckpt_format == "torch" and read_args(found)["tensor_model_parallel_size"] == 2
    ours = _losses(2, "pretrain_llama", LLAMA + ["--tensor-model-parallel-size", "2", "--load",
                                                 save, "--finetune"])
    megatron = _losses(1, "pretrain_llama", LLAMA + ["--load", legacy, "--finetune"])
    assert megatron[0] == pytest.approx(ours[0], abs=1e-5)
