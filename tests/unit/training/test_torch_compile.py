"""--torch-compile: each transformer layer compiled with inductor trains to the eager losses
(with selective recompute inside the layer, as the 1B benchmark runs), and the state-dict
keys stay the eager ones."""
import pytest

from megatron_smp.config import ConfigError
from megatron_smp.testing import run_distributed
from tests.functional.test_training_parity import COMMON, LLAMA

ARGV = [a if a != "10" else "4" for a in COMMON] + LLAMA + ["--num-layers", "1",
                                                            "--recompute-activations"]


def _train(rank, world_size, argv):
    import sys

    import pretrain_llama as entry
    from megatron_smp.training import pretrain

    # The module that builds the chunks (Trainer.build calls it there).
    pretrain_module = sys.modules["megatron_smp.training.trainer"]
    built = []
    build = pretrain_module.build_model_chunks

    def keep(*args, **kwargs):
        built.extend(build(*args, **kwargs))
        return built

    pretrain_module.build_model_chunks = keep
    result = pretrain(entry.train_valid_test_datasets_provider, entry.model_provider,
                      entry.forward_step, argv=argv, args_defaults=entry.LLAMA_DEFAULTS)
    layers = [m for m in built[0].modules() if type(m).__name__ == "TransformerLayer"]
    compiled = [getattr(layer, "_compiled_call_impl", None) is not None for layer in layers]
    keys = sorted(built[0].state_dict())
    return [result.train_losses[i]["lm loss"] for i in sorted(result.train_losses)], compiled, keys


def test_compiled_layers_train_to_eager_losses():
    eager, eager_compiled, eager_keys = run_distributed(_train, 1, args=(ARGV,))[0]
    losses, compiled, keys = run_distributed(_train, 1, args=(ARGV + ["--torch-compile"],),
                                             timeout=600)[0]
    assert eager_compiled == [False] and compiled == [True]
    assert keys == eager_keys
    assert len(losses) == 4 and max(abs(a - b) for a, b in zip(eager, eager[1:])) > 1e-3
    for got, want in zip(losses, eager):
        assert abs(got - want) <= 1e-5 * abs(want), (losses, eager)


def test_unknown_backend_is_a_config_error():
    from megatron_smp.training.compile import compile_transformer_layers

    with pytest.raises(ConfigError, match="--torch-compile no_such_backend"):
        compile_transformer_layers(None, "no_such_backend")
