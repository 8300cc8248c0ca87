"""A DeepSeek-V3-style model (multi-latent attention with a q latent, interleaved RoPE on the
positional channels, sigmoid routing with expert bias, a dense first layer) trains under
pretrain_gpt.py with the single-process losses at TP=2 with sequence parallelism, and at PP=2."""
import pytest

from megatron_smp.testing import run_distributed
from tests.functional.test_moe_expert_bias import DEEPSEEK_ROUTER
from tests.functional.test_moe_parity import MOE
from tests.functional.test_training_parity import COMMON, LLAMA

MLA = ("--multi-latent-attention --q-lora-rank 24 --kv-lora-rank 20 --qk-head-dim 12 "
       "--qk-pos-emb-head-dim 8 --v-head-dim 10 --rotary-interleaved").split()


def _argv():
    argv = [a for a in COMMON + LLAMA if a not in ("--group-query-attention",)]
    del argv[argv.index("--num-query-groups"):argv.index("--num-query-groups") + 2]
    argv += MOE + DEEPSEEK_ROUTER + MLA + ["--moe-layer-freq", "[0,1]", "--train-iters", "6",
                                           "--lr-decay-iters", "6", "--log-interval", "1"]
    argv[argv.index("--num-experts") + 1] = "8"
    return argv


def _train(rank, world_size, argv):
    import pretrain_gpt
    from megatron_smp.training import pretrain

    result = pretrain(pretrain_gpt.train_valid_test_datasets_provider,
                      pretrain_gpt.model_provider, pretrain_gpt.forward_step, argv=argv)
    return [result.train_losses[i]["lm loss"] for i in sorted(result.train_losses)]


@pytest.mark.parametrize("flags", ["--tensor-model-parallel-size 2 --sequence-parallel",
                                   "--pipeline-model-parallel-size 2"])
def test_deepseek_style_model_trains_like_one_process(flags):
    if "reference" not in _BASELINE:
        _BASELINE["reference"] = run_distributed(_train, 1, args=(_argv(),), timeout=300)[0]
    reference = _BASELINE["reference"]
    assert len(reference) == 6 and reference[-1] < reference[0]
    for losses in run_distributed(_train, 2, args=(_argv() + flags.split(),), timeout=300):
        assert losses == pytest.approx(reference, rel=1e-4)  # every rank logs the losses

_BASELINE = {}
