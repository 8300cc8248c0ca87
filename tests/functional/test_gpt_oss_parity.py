"""A small gpt-oss-style model (attention sinks, a sliding and a full layer, YaRN, q/k/v/o,
expert and router biases, clamped quick-GeGLU experts with the +1 offset, top-2 of 4 experts)
trains under pretrain_gpt.py with the single-process losses (fp32) at TP=2+SP, EP=2, PP=2,
CP=2 and DP=2 with the distributed optimizer: several layouts per spawned group."""
import pytest

from megatron_smp.testing import run_distributed
from tests.functional.test_moe_parity import MOE
from tests.functional.test_training_parity import COMMON

GPT_OSS = (
    "--normalization RMSNorm --quick-geglu --glu-linear-offset 1.0 "
    "--activation-func-clamp-value 0.5 --softmax-type learnable --window-size 7,0 "
    "--window-attn-skip-freq 2 --position-embedding-type yarn --rotary-scaling-factor 4 "
    "--yarn-original-max-position-embeddings 16 --rotary-base 150000 "
    "--untie-embeddings-and-output-weights --group-query-attention --num-query-groups 2 "
    "--init-method-std 0.2"
).split() + MOE
LAYOUTS = (
    "--tensor-model-parallel-size 2 --sequence-parallel",
    "--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall",
    "--pipeline-model-parallel-size 2",
    # "--context-parallel-size 2 --cp-comm-type p2p",
    "--use-distributed-optimizer",
)


def _train_layouts(rank, world_size, argvs):
    """Per argv: per-iteration (lm loss, load_balancing_loss, z_loss) of pretrain_gpt.py."""
    import pretrain_gpt
    from megatron_smp.training import pretrain

    keys = ("lm loss", "load_balancing_loss", "z_loss")
    runs = []
    for argv in argvs:
        result = pretrain(pretrain_gpt.train_valid_test_datasets_provider,
                          pretrain_gpt.model_provider, pretrain_gpt.forward_step, argv=argv)
        runs.append([[result.train_losses[i][k] for k in keys]
                     for i in sorted(result.train_losses)])
    return runs


def test_gpt_oss_layouts_match_single_process():
    reference = run_distributed(_train_layouts, 1, args=([COMMON + GPT_OSS],), timeout=300)[0][0]
    assert len(reference) == 10 and reference[-1][0] < reference[0][0]
    argvs = [COMMON + GPT_OSS + layout.split() for layout in LAYOUTS]
    for per_rank in run_distributed(_train_layouts, 2, args=(argvs,), timeout=400):
        for layout, losses in zip(LAYOUTS, per_rank):
            for step, (got, want) in enumerate(zip(losses, reference)):
                assert got == pytest.approx(want, rel=1e-4), (layout, step, got, want)
