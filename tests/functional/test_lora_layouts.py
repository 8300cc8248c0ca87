"""LoRA fine-tuning of a small MoE Llama (4 experts, adapters on attention, the experts and
the dense projections): expert parallelism (EP=2) and pipeline parallelism (PP=2) follow the
single-process losses, which needs the adapters to start from the same values at every layout
(tensor_parallel.lora) and the experts' adapters to train (they move the losses)."""
import pytest

from megatron_smp.testing import run_distributed
from tests.functional.test_training_parity import COMMON, LLAMA

MOE = "--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 32".split()
LORA = "--lora-rank 4 --lora-alpha 8 --lr 1e-2".split()
ITERS = ["--train-iters", "4", "--log-interval", "1"]


def _train(rank, world_size, argv):
    """Per-iteration lm losses of pretrain_gpt.py."""
    import pretrain_gpt
    from megatron_smp.training import pretrain

    result = pretrain(pretrain_gpt.train_valid_test_datasets_provider,
                      pretrain_gpt.model_provider, pretrain_gpt.forward_step, argv=argv)
    return [result.train_losses[i]["lm loss"] for i in sorted(result.train_losses)]


def test_lora_moe_ep2_and_pp2_match_single_process():
    argv = COMMON + LLAMA + MOE + LORA + ITERS
    reference = run_distributed(_train, 1, args=(argv,), timeout=300)[0]
    # Only the experts' adapters: they alone must still move the losses.
    experts_only = run_distributed(_train, 1, args=(
        argv + "--lora-target-modules linear_fc1 linear_fc2".split(),), timeout=300)[0]
    assert len(reference) == 4 and reference[-1] < reference[0] - 0.05, reference
    assert experts_only[0] == reference[0] and experts_only[-1] < experts_only[0] - 0.01
    for flags in ("--expert-model-parallel-size 2", "--pipeline-model-parallel-size 2"):
        for losses in run_distributed(_train, 2, args=(argv + flags.split(),), timeout=300):
            assert losses == pytest.approx(reference, rel=1e-5), (flags, losses, reference)
