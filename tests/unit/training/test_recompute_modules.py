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
        "--recompute-activations --recompute-modules moe": "add --num-experts",
        "--recompute-activations --recompute-modules shared_experts":
            "--moe-shared-expert-intermediate-size",
        "--recompute-activations --recompute-modules layernorm --torch-compile": "drop one",
    }
    for flags, message in cases.items():
        with pytest.raises(ConfigError, match=message):
            validate_configs(parse_args(argv + flags.split()), world_size=1)
    # --recompute-activations alone keeps Megatron's default: core attention only.
    configs = parse_args(argv + ["--recompute-activations"])
    from megatron_smp.config import recompute_modules

    assert recompute_modules(configs.model) == ("core_attn",)


def _train_moe(rank, world_size, runs):
    """Each run's per-iteration (lm loss, grad norm, load_balancing_loss, z_loss), its calls
    of the MoE layer's forward, the shared experts' and the experts' activation, and the
    routers' token counts at each metrics reset (what the layer routed since the previous
    one)."""
    import contextlib
    import io

    from megatron_smp.training import logging as training_logging
    from megatron_smp.training import pretrain
    from megatron_smp.transformer.moe.experts import MoEExperts
    from megatron_smp.transformer.moe.moe_layer import MoELayer
    from megatron_smp.transformer.moe.router import TopKRouter
    from megatron_smp.transformer.moe.shared_experts import SharedExpertMLP
    from pretrain_gpt import forward_step, model_provider, train_valid_test_datasets_provider

    calls, counts, norms = {}, [], {}

    def counted(cls, method, name):
        original = getattr(cls, method)

        def wrapper(self, *args, **kwargs):
            calls[name] += 1
            return original(self, *args, **kwargs)
        setattr(cls, method, wrapper)

    counted(MoELayer, "_forward", "moe")
    counted(SharedExpertMLP, "forward", "shared_experts")
    counted(MoEExperts, "_contiguous_activation", "moe_act")
    original_reset = TopKRouter.reset_metrics

    def reset_metrics(self):
        counts.append(self.tokens_per_expert.tolist())
        original_reset(self)

    TopKRouter.reset_metrics = reset_metrics
    original_scalars = training_logging.TrainingLogger.iteration_scalars

    def scalars(self, iteration, lr, batch, losses, loss_scale, grad_norm, *args, **kwargs):
        norms[iteration] = grad_norm
        return original_scalars(self, iteration, lr, batch, losses, loss_scale, grad_norm,
                                *args, **kwargs)

    training_logging.TrainingLogger.iteration_scalars = scalars
    out = []
    for argv in runs:
        calls.update(moe=0, shared_experts=0, moe_act=0)
        counts.clear()
        with contextlib.redirect_stdout(io.StringIO()):
            result = pretrain(train_valid_test_datasets_provider, model_provider, forward_step,
                              argv=argv)
        losses = result.train_losses
        balancing = [key for key in losses[1] if key.endswith("load_balancing_loss")]
        out.append(({i: (losses[i]["lm loss"], norms[i], losses[i][balancing[0]],
                         losses[i]["z_loss"]) for i in sorted(losses)},
                    dict(calls), list(counts)))
    return out


def test_moe_recompute_records_router_statistics_once():
    """--recompute-modules moe reruns each MoE layer in backward (shared_experts: its shared
    expert; moe_act: the grouped experts' activation) with the losses, grad norms, logged
    router losses and token counts of the run without recompute, bit for bit, at one process
    (also with global_aux_loss, and so at PP=2) and at EP=2 (and under FSDP2 at EP=2)."""
    from tests.functional.test_moe_parity import MOE
    from tests.functional.test_training_parity import LLAMA

    argv = (COMMON + LLAMA + MOE + ["--train-iters", str(ITERATIONS), "--log-interval", "1",
                                    "--moe-shared-expert-intermediate-size", "32",
                                    "--moe-token-dispatcher-type", "alltoall",
                                    "--moe-grouped-gemm"])
    moe, shared = SELECTIVE + ["moe"], SELECTIVE + ["shared_experts"]
    # global_aux_loss: the recompute must see the running counts its first run saw.
    global_aux = argv + ["--moe-router-load-balancing-type", "global_aux_loss"]
    single = run_distributed(
        _train_moe, 1, args=([argv, argv + moe, argv + shared, argv + SELECTIVE + ["moe_act"],
                              global_aux, global_aux + moe],), timeout=300)[0]
    ep2 = ["--expert-model-parallel-size", "2"]
    fsdp = ep2 + ["--use-torch-fsdp2"]
    # PP=2: later micro-batches' first runs come before a recompute (1F1B's warm-up).
    pp2 = global_aux + ["--pipeline-model-parallel-size", "2"]
    layouts = run_distributed(
        _train_moe, 2, args=([argv + ep2, argv + ep2 + moe, argv + fsdp, argv + fsdp + moe,
                              pp2, pp2 + moe],), timeout=300)

    def check(plain, recomputed, module, micro_batches, layers=LAYERS):
        forwards = ITERATIONS * micro_batches * layers  # training forwards, per rank
        extra = {name: recomputed[1][name] - plain[1][name] for name in plain[1]}
        rerun = {"moe": ("moe", "shared_experts", "moe_act")}.get(module, (module,))
        assert extra == {name: forwards if name in rerun else 0 for name in extra}
        assert recomputed[0] == plain[0]  # losses, grad norm, router losses
        assert recomputed[2] == plain[2] and plain[2]  # tokens routed to each expert

    check(single[0], single[1], "moe", 4)
    check(single[0], single[2], "shared_experts", 4)
    check(single[0], single[3], "moe_act", 4)
    check(single[4], single[5], "moe", 4)
    for plain, recomputed, fsdp_plain, fsdp_recomputed, pp_plain, pp_recomputed in layouts:
        check(plain, recomputed, "moe", 2)
        check(fsdp_plain, fsdp_recomputed, "moe", 2)
        check(pp_plain, pp_recomputed, "moe", 4, layers=1)  # one layer per stage
        for iteration, values in single[0][0].items():
            assert fsdp_recomputed[0][iteration] == pytest.approx(values, rel=1e-5)
