"""Pretrain a hybrid model (Mamba-2, Gated DeltaNet, attention, MLP and MoE layers) with
Megatron-LM main's flags: `--hybrid-layer-pattern "M-M*-..."` gives one symbol per layer and
the layer count (Megatron's pretrain_hybrid.py; see docs/models.md "Hybrid models")."""
import sys

from megatron_smp.config import ConfigError
from megatron_smp.training import main, pretrain
from megatron_smp.training.arguments import hybrid_pattern_given
from pretrain_gpt import forward_step, model_provider, train_valid_test_datasets_provider


def run(argv=None):
    if not hybrid_pattern_given(sys.argv[1:] if argv is None else argv):
        raise ConfigError("pretrain_hybrid.py builds the stack of --hybrid-layer-pattern: give "
                          "it (e.g. \"M-M*-\"), or train a GPT with pretrain_gpt.py")
    return pretrain(train_valid_test_datasets_provider, model_provider, forward_step, argv=argv)


if __name__ == "__main__":
    main(run)
