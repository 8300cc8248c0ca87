"""Megatron's --recompute-modules under --recompute-granularity selective: each named module
runs again in backward (layernorm: its output's storage is empty between forward and
backward), and losses stay bit-identical through pretrain_gpt at TP=2 with sequence parallel
and at DP=2, dropout on."""
import pytest
import torch

from megatron_smp.testing import run_distributed
from tests.functional.test_training_parity import COMMON

ITERATIONS, LAYERS = 2, 2
SELECTIVE = ["--recompute-granularity", "selective", "--recompute-modules"]


def _train(rank, world_size, runs):
    """Each run's (calls of core attention, MLP and norms, losses, emptied norm outputs)."""
    from megatron_smp.training import pretrain
    from megatron_smp.transformer.attention import DotProductAttention
    from megatron_smp.transformer.layer import TransformerLayer
    from megatron_smp.transformer.mlp import MLP
    from pretrain_gpt import forward_step, model_provider, train_valid_test_datasets_provider

    calls = {}
    emptied = []

    def counted(cls, name):
        original = cls.forward

        def forward(self, *args, **kwargs):
            calls[name] += 1
            return original(self, *args, **kwargs)
        cls.forward = forward

    counted(DotProductAttention, "core_attn")
    counted(MLP, "mlp")
    original_normed = TransformerLayer._normed

    def normed(self, norm, hidden_states, recompute, consumer):
        def watched(x):
            calls["layernorm"] += 1
            out = norm(x)
            if torch.is_grad_enabled() or recompute:
                outputs.append(out)
            return out
        outputs = []
        result = original_normed(self, watched, hidden_states, recompute, consumer)
        # After the consumer ran: is the norm's output storage freed until backward?
        emptied.extend(out.untyped_storage().size() == 0 for out in outputs)
        return result

    TransformerLayer._normed = normed
    out = []
    for argv in runs:
        calls.update(core_attn=0, mlp=0, layernorm=0)
        emptied.clear()
        result = pretrain(train_valid_test_datasets_provider, model_provider, forward_step,
                          argv=argv)
        out.append((dict(calls), {i: v["lm loss"] for i, v in result.train_losses.items()},
                    list(emptied)))
    return out


@pytest.mark.parametrize("layout,micro_batches", [
    (["--tensor-model-parallel-size", "2", "--sequence-parallel"], 4),
    ([], 2),
])
def test_each_module_is_recomputed_and_losses_are_unchanged(layout, micro_batches):
    argv = COMMON + ["--train-iters", str(ITERATIONS), "--hidden-dropout", "0.1",
                     "--attention-dropout", "0.1", "--eval-interval", "100"] + layout
    runs = [argv,
            argv + SELECTIVE + ["mlp"],
            argv + SELECTIVE + ["layernorm"],
            argv + SELECTIVE + ["core_attn", "layernorm,mlp"]]
    results = run_distributed(_train, 2, args=(runs,), timeout=300)
    forwards = ITERATIONS * micro_batches * LAYERS  # training forwards per module, per rank

    def extra(run, plain):  # calls beyond the plain run's (evaluations included in both)
        return {name: run[0][name] - plain[0][name] for name in plain[0]}

    for plain, mlp, layernorm, everything in results:
        assert extra(mlp, plain) == {"core_attn": 0, "mlp": forwards, "layernorm": 0}
        assert extra(layernorm, plain) == {"core_attn": 0, "mlp": 0, "layernorm": 2 * forwards}
        assert extra(everything, plain) == {"core_attn": forwards, "mlp": forwards,
                                            "layernorm": 2 * forwards}
        assert not any(plain[2]) and all(layernorm[2]) and len(layernorm[2]) == 2 * forwards
        assert sorted(plain[1]) == [1, 2]
        for run in (mlp, layernorm, everything):
            assert run[1] == plain[1]  # bit-identical: the same ops run again


def test_recompute_modules_errors():
    from megatron_smp.config import ConfigError
    from megatron_smp.training.arguments import parse_args, validate_configs

    argv = COMMON + ["--train-iters", "1"]
    cases = {
        "--recompute-modules mlp": "add --recompute-granularity selective",
        "--recompute-granularity full --recompute-modules mlp": "selective",
        "--recompute-activations --recompute-modules attn": "unknown attn",
        "--recompute-activations --recompute-modules moe_act": "--moe-grouped-gemm",
        "--recompute-activations --recompute-modules mla_up_proj": "multi-latent",
        "--recompute-activations --recompute-modules moe": "not supported yet",
        "--recompute-activations --recompute-modules layernorm --torch-compile": "drop one",
    }
    for flags, message in cases.items():
        with pytest.raises(ConfigError, match=message):
            validate_configs(parse_args(argv + flags.split()), world_size=1)
    # --recompute-activations alone keeps Megatron's default: core attention only.
    configs = parse_args(argv + ["--recompute-activations"])
    from megatron_smp.config import recompute_modules

    assert recompute_modules(configs.model) == ("core_attn",)
