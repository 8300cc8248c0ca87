"""LoRA fine-tuning of a small MoE Llama (4 experts, adapters on attention, the experts and
the dense projections): expert parallelism (EP=2), pipeline parallelism (PP=2) and TP=2 follow the
single-process losses, which needs the adapters to start from the same values at every layout
(tensor_parallel.lora)."""
import os

import pytest

from megatron_smp.testing import run_distributed
from tests.functional.test_training_parity import COMMON, LLAMA

MOE = "--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 32".split()
LORA = "--lora-rank 4 --lora-alpha 32 --lr 5e-2".split()
ITERS = ["--train-iters", "3", "--log-interval", "1"]


def _train(rank, world_size, argv):
    """Per-iteration lm losses of pretrain_gpt.py."""
    import pretrain_gpt
    from megatron_smp.training import pretrain

    result = pretrain(pretrain_gpt.train_valid_test_datasets_provider,
                      pretrain_gpt.model_provider, pretrain_gpt.forward_step, argv=argv)
    return [result.train_losses[i]["lm loss"] for i in sorted(result.train_losses)]


def test_lora_moe_layouts_match_single_process(tmp_path):
    """EP=2 (grouped GEMM), PP=2 (built on the meta device) and TP=2 with sequence
    parallelism (the experts' adapters then sum their whole matrices' partial gradients over
    TP) give one process's losses; the EP=2 run's checkpoint of iteration 2 (the experts'
    adapters under their global indices) resumes in one process to the same iteration 3."""
    argv = COMMON + LLAMA + MOE + LORA + ITERS
    reference = run_distributed(_train, 1, args=(argv,), timeout=300)[0]
    assert len(reference) == 3 and len(set(reference)) == 3, reference
    save = str(tmp_path / "ep2")
    for flags in (f"--expert-model-parallel-size 2 --moe-grouped-gemm --save {save} "
                  "--save-interval 2",
                  "--pipeline-model-parallel-size 2 --init-model-with-meta-device",
                  "--tensor-model-parallel-size 2 --sequence-parallel"):
        for losses in run_distributed(_train, 2, args=(argv + flags.split(),), timeout=300):
            assert losses == pytest.approx(reference, rel=1e-5), (flags, losses, reference)
    with open(os.path.join(save, "latest_checkpointed_iteration.txt"), "w") as handle:
        handle.write("2")
    resumed = run_distributed(_train, 1, args=(argv + ["--load", save],), timeout=300)[0]
    assert resumed == pytest.approx(reference[2:], rel=1e-5), (resumed, reference)
