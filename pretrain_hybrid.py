"""Pretrain a hybrid model (Mamba-2, Gated DeltaNet, attention, MLP and MoE layers) with
Megatron-LM main's flags: `--hybrid-layer-pattern "M-M*-..."` gives one symbol per layer and
the layer count (Megatron's pretrain_hybrid.py; see docs/models.md "Hybrid models"). With
`--use-checkpoint-args` the stack comes from the --load checkpoint (e.g. one converted from a
Hugging Face Nemotron-H or Qwen3.5)."""
import sys

from megatron_smp.config import ConfigError
from megatron_smp.training import main, pretrain
from megatron_smp.training.arguments import hybrid_pattern_given
from pretrain_gpt import forward_step, model_provider, train_valid_test_datasets_provider

NOT_HYBRID = ("pretrain_hybrid.py builds the stack of --hybrid-layer-pattern: give it (e.g. "
              "\"M-M*-\"), or --use-checkpoint-args with a hybrid --load checkpoint; train "
              "other models with pretrain_gpt.py")


def hybrid_model_provider(configs, state, **kwargs):
    """pretrain_gpt.py's model, once the config (from the flags or the checkpoint) is known
    to be a hybrid stack: a pattern, or Gated DeltaNet layers placed by
    --linear-attention-freq."""
    model = configs.model
    if model.hybrid_layer_pattern is None and model.linear_attention_freq is None:
        raise ConfigError(NOT_HYBRID)
    return model_provider(configs, state, **kwargs)


def run(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if not hybrid_pattern_given(argv) and "--use-checkpoint-args" not in argv:
        raise ConfigError(NOT_HYBRID)
    return pretrain(train_valid_test_datasets_provider, hybrid_model_provider, forward_step,
                    argv=argv)


if __name__ == "__main__":
    main(run)
