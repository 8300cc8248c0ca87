"""--recompute-activations is Megatron's shorthand for --recompute-granularity selective:
the core attention of every layer runs again in backward, and the losses stay the same."""
from megatron_smp.testing import run_distributed
from tests.functional.test_training_parity import COMMON

ITERATIONS, MICRO_BATCHES_PER_RANK, LAYERS = 2, 2, 2  # COMMON: global batch 8, micro 2, DP 2


def _train(rank, world_size, runs):
    from megatron_smp.training import pretrain
    from megatron_smp.transformer.attention import DotProductAttention
    from pretrain_gpt import forward_step, model_provider, train_valid_test_datasets_provider

    calls = [0]
    original = DotProductAttention.forward

    def counted(self, *args, **kwargs):
        calls[0] += 1
        return original(self, *args, **kwargs)

    DotProductAttention.forward = counted
    out = []
    for argv in runs:
        calls[0] = 0
        result = pretrain(train_valid_test_datasets_provider, model_provider, forward_step,
                          argv=argv)
        out.append((calls[0], {i: v["lm loss"] for i, v in result.train_losses.items()}))
    return out


def test_recompute_activations_recomputes_core_attention_with_equal_losses():
    argv = COMMON + ["--train-iters", str(ITERATIONS)]
    results = run_distributed(_train, 2, args=([argv, argv + ["--recompute-activations"]],),
                              timeout=300)
    for (plain_calls, plain_losses), (recompute_calls, recompute_losses) in results:
        assert recompute_calls - plain_calls == ITERATIONS * MICRO_BATCHES_PER_RANK * LAYERS
        assert sorted(plain_losses) == [1, 2]
        assert recompute_losses == plain_losses  # bit-identical: the same ops run again
