"""parse_args: Megatron flags (and --smp-config) -> typed `Configs`, before any process group."""
from __future__ import annotations

import argparse
import re
import sys
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence

from megatron_smp.checkpointing.loop import checkpoint_model_fields
from megatron_smp.config import ConfigError
from megatron_smp.config.sections import SECTIONS as _SECTIONS, Configs
from megatron_smp.training.arguments.compat import (
    _activation_fields,
    _apply_hybrid_flags,
    _apply_megatron_fsdp,
    _apply_megatron_main_flags,
    _apply_optimizer_choice,
    _apply_smp_config,
    _check_rope_scaling_flags,
    _model_fields,
    _position_fields,
    hybrid_pattern_given,
)
from megatron_smp.training.arguments.flags import (
    _FLAGS,
    _reject_not_supported_yet,
    build_parser,
)
from megatron_smp.training.arguments import megatron_lm
from megatron_smp.training.arguments.modes import mode_sections


# Flags that are not model fields themselves but decide these model fields.
_DERIVED_MODEL_FLAGS = {
    "--group-query-attention": ("num_query_groups",), "--num-query-groups": ("num_query_groups",),
    "--swiglu": ("activation", "gated_linear_unit"), "--openai-gelu": ("activation",),
    "--squared-relu": ("activation",), "--quick-geglu": ("activation", "gated_linear_unit"),
    "--geglu": ("activation", "gated_linear_unit"),
    "--use-rotary-position-embeddings": ("position_embedding_type",),
    "--no-position-embedding": ("position_embedding_type",),
    "--rope-type": ("position_embedding_type",), "--disable-bias-linear": ("add_bias_linear",),
    "--hybrid-override-pattern": ("hybrid_layer_pattern", "num_layers"),
    "--hybrid-layer-pattern": ("hybrid_layer_pattern", "num_layers"),
}
# Fields given as Megatron's layer-frequency text ("([1]*3+[0])*2") or as its list.
_FREQUENCY_FIELDS = ("moe_layer_freq", "linear_attention_freq", "window_attn_skip_freq")


def _comparable(name: str, value: Any) -> Any:
    if name in _FREQUENCY_FIELDS and isinstance(value, str):
        from megatron_smp.config import parse_moe_layer_freq

        try:
            return parse_moe_layer_freq(value)
        except (ConfigError, TypeError, ValueError):
            return value
    return list(value) if isinstance(value, tuple) else value


# The model flags Megatron-LM's --use-checkpoint-args leaves as given (load_args_from_checkpoint
# sets them only when absent): weight shapes, which a checkpoint of another shape cannot fill.
# It overrides every other model flag with the checkpoint's value.
_FLAGS_KEPT_BY_MEGATRON = ("num_layers", "hidden_size", "ffn_hidden_size",
                           "num_attention_heads", "kv_channels", "max_position_embeddings")


def _check_against_checkpoint(argv: Sequence[str], model: Dict[str, Any],
                              saved: Dict[str, Any]) -> Dict[str, Any]:
    """--use-checkpoint-args: the checkpoint's model fields, checked against the model flags
    given on the command line. A weight shape that differs is a ConfigError naming both
    values (Megatron-LM keeps the flag and then fails to load); another field that differs
    takes the checkpoint's value, as in Megatron-LM, with a warning naming both. Returns the
    fields to apply."""
    flag_fields = {spec.flag: (spec.field,) for spec in _FLAGS if spec.section == "model"}
    flag_fields.update(_DERIVED_MODEL_FLAGS)
    given = {}
    for token in argv:
        flag = token.split("=", 1)[0]
        for name in flag_fields.get(flag, ()):
            given.setdefault(name, flag)
    differing = {name: flag for name, flag in given.items() if name in saved
                 and _comparable(name, model.get(name)) != _comparable(name, saved[name])}
    fields = dict(saved)
    learned_positions = saved.get("position_embedding_type") == "learned_absolute"
    if "max_position_embeddings" in differing and not learned_positions:
        # No weights depend on it without a learned position table: the flag stays, as in
        # Megatron-LM.
        del differing["max_position_embeddings"]
        fields["max_position_embeddings"] = model["max_position_embeddings"]
    shapes = [f"{flag} gives {name}={model.get(name)!r}, the checkpoint {saved[name]!r}"
              for name, flag in differing.items() if name in _FLAGS_KEPT_BY_MEGATRON]
    if shapes:
        raise ConfigError("--use-checkpoint-args: the --load checkpoint holds another model "
                          "than the flags describe: " + "; ".join(shapes) + ". Drop those "
                          "flags (the checkpoint gives them), or load a checkpoint of that shape")
    others = [f"{flag} ({name}={model.get(name)!r}) gives way to the checkpoint's "
              f"{saved[name]!r}" for name, flag in differing.items()
              if name not in _FLAGS_KEPT_BY_MEGATRON]
    if others:
        warnings.warn("--use-checkpoint-args: " + "; ".join(others))
    return fields


def _parse_namespace(argv: List[str], extra_args_provider: Optional[Callable],
                     args_defaults: Optional[Dict[str, Any]]) -> argparse.Namespace:
    """The argparse namespace of `argv`, with the entry script's defaults."""
    parser = build_parser(extra_args_provider)
    # A mode's own flags (e.g. the inference tools' --inference-max-seq-length) are not the
    # Megatron-LM options of the same name that the training scripts refuse.
    mode_flags = (set(parser._option_string_actions)
                  - set(build_parser()._option_string_actions)) if extra_args_provider else set()
    _reject_not_supported_yet([token for token in argv
                               if token.split("=", 1)[0] not in mode_flags])
    if args_defaults:
        by_field = {}
        for spec in _FLAGS:
            key = spec.flag.lstrip("-").replace("-", "_")
            by_field[key] = spec.field if spec.section is None else f"{spec.section}__{spec.field}"
        parser.set_defaults(**{by_field.get(k, k): v for k, v in args_defaults.items()})
    if hybrid_pattern_given(argv):  # the pattern gives the layer count, as in Megatron
        parser._option_string_actions["--num-layers"].required = False
    if "--use-checkpoint-args" in argv:
        # As in Megatron, the model's shape may come from the --load checkpoint alone.
        for action in parser._actions:
            if action.dest.startswith("model__"):
                action.required = False
    return parser.parse_args(argv)


def parse_args(
    argv: Optional[Sequence[str]] = None,
    extra_args_provider: Optional[Callable] = None,
    args_defaults: Optional[Dict[str, Any]] = None,
) -> Configs:
    """Parse Megatron flags into `Configs`; `validate_configs` checks them (once the tokenizer
    has given the vocabulary size). Raises ConfigError for flags that contradict each other
    or name a capability that does not exist yet; argparse exits for malformed values.

    `args_defaults` maps flag destinations without dashes (e.g. "tokenizer_type") to defaults
    an entry script wants (Megatron's convention).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parse_namespace(argv, extra_args_provider, args_defaults)
    sections: Dict[str, Dict[str, Any]] = {name: {} for name in _SECTIONS}
    for spec in _FLAGS:
        if spec.section is None:
            continue
        value = getattr(args, f"{spec.section}__{spec.field}")
        if value is not None:
            sections[spec.section][spec.field] = value
    modes = mode_sections(args, sections["training"])

    model = sections["model"]
    training = sections["training"]
    _apply_hybrid_flags(args, model)
    _position_fields(args, model)
    _check_rope_scaling_flags(argv, model, args.enable_gpt_oss)
    _activation_fields(args, argv, model)
    _model_fields(args, argv, sections)
    if args.moe_enable_deepep:
        # Megatron-LM main's deprecated switch, with its checks.
        if model.get("moe_token_dispatcher_type") != "flex":
            raise ConfigError("--moe-enable-deepep: DeepEP is only supported with "
                              "--moe-token-dispatcher-type flex")
        if model.get("moe_flex_dispatcher_backend", "deepep") != "deepep":
            raise ConfigError("--moe-enable-deepep with --moe-flex-dispatcher-backend "
                              f"{model['moe_flex_dispatcher_backend']}: give one backend")
        model["moe_flex_dispatcher_backend"] = "deepep"
    _apply_optimizer_choice(args, sections["optimizer"], argv)
    _apply_megatron_fsdp(args, sections)
    _apply_megatron_main_flags(args, sections)
    megatron_lm.apply(args, sections)
    if sections["checkpoint"].get("ckpt_format") == "fsdp_dtensor":
        # Megatron-FSDP's format is DCP over the sharded DTensors; ours (torch_dist) is DCP
        # with global tensor names and shapes, which FSDP2 runs write and read already.
        if not sections["parallel"].get("use_torch_fsdp2"):
            raise ConfigError("--ckpt-format fsdp_dtensor is Megatron-FSDP's format: add "
                              "--use-megatron-fsdp --data-parallel-sharding-strategy "
                              "optim_grads_params (or --use-torch-fsdp2), or use torch_dist")
        sections["checkpoint"]["ckpt_format"] = "torch_dist"
    setting_names: Dict[str, str] = {}
    if args.smp_config:
        _apply_smp_config(args.smp_config, sections, setting_names)

    # Given by --train-samples instead: pretrain derives it (see NumMicrobatchesCalculator).
    training.setdefault("train_iters", None)
    if model.get("recompute_modules") is not None:
        model["recompute_modules"] = [
            name for token in model["recompute_modules"]
            for name in re.split(r"[\s,\[\]]+", token) if name]
    if args.recompute_activations:
        if model.get("recompute_granularity", "selective") != "selective":
            raise ConfigError("--recompute-activations is --recompute-granularity selective; "
                              f"drop one (--recompute-granularity is "
                              f"{model['recompute_granularity']})")
        model["recompute_granularity"] = "selective"

    if args.use_checkpoint_args:
        saved = checkpoint_model_fields(sections["checkpoint"].get("load"),
                                        sections["checkpoint"].get("pretrained_checkpoint"))
        model.update(_check_against_checkpoint(argv, model, saved))
        missing = [f"--{name.replace('_', '-')}" for name in
                   ("num_layers", "hidden_size", "num_attention_heads") if model.get(name) is None]
        if missing:
            raise ConfigError(f"--use-checkpoint-args: the --load checkpoint gives no "
                              f"{', '.join(missing)}; pass {'it' if len(missing) == 1 else 'them'}")
    if training.get("skip_train"):
        # Megatron's --skip-train only evaluates: the optimizer state is never needed.
        sections["checkpoint"]["no_load_optim"] = True
    built = {name: cls(**sections[name]) for name, cls in _SECTIONS.items()}
    given_flags = frozenset(token.split("=", 1)[0] for token in argv if token.startswith("--"))
    return Configs(args=args, setting_names=setting_names, given_flags=given_flags, **built,
                   **modes)

