"""Hugging Face state-dict adapters, one module per model family.

    adapter = get_adapter(hf_model)          # or "llama", "GPT2LMHeadModel", an HF config
    config = adapter.config_from_hf(hf_model.config)
    full = adapter.from_hf(hf_model.state_dict(), config)    # TP=1 GPTModel state dict
    shard = shard_state_dict(full, config, tp_size, tp_rank)

A new family is one more module listed in `_FAMILIES` (Mixtral, Qwen2-MoE and Qwen3-MoE carry
experts: their full state dicts name every expert by its global index).
"""
from __future__ import annotations

import math
from types import ModuleType
from typing import Any

from megatron_smp.config import ConfigError
from megatron_smp.models.hf import (
    deepseek_v3, gemma3, gpt2, gpt_neox, gpt_oss, gptj, llama, mixtral, nemotron_h, qwen2,
    qwen2_moe, qwen3_5, qwen3_moe, qwen3_next,
)
from megatron_smp.models.sharding import merge_state_dicts, shard_state_dict

_FAMILIES = {"gpt2": gpt2, "llama": llama, "mistral": llama, "qwen3": llama,
             "gpt_neox": gpt_neox, "gptj": gptj, "mixtral": mixtral, "qwen2": qwen2,
             "qwen2_moe": qwen2_moe, "qwen3_moe": qwen3_moe, "gpt_oss": gpt_oss,
             "deepseek_v3": deepseek_v3, "qwen3_next": qwen3_next, "qwen3_5_text": qwen3_5,
             "qwen3_5_moe_text": qwen3_5, "nemotron_h": nemotron_h,
             "gemma3_text": gemma3}


def _architecture_index() -> dict:
    index = {}
    for module in set(_FAMILIES.values()):
        for name in module.HF_ARCHITECTURES:
            index[name] = module
    return index


def get_adapter(family_or_hf_model: Any) -> ModuleType:
    """The adapter module for a family name ("gpt2", "llama", "mistral", "gpt_neox"), an HF
    architecture name ("LlamaForCausalLM"), an HF model or an HF config."""
    key = family_or_hf_model
    if isinstance(key, str):
        if key in _FAMILIES:
            return _FAMILIES[key]
        if key in _architecture_index():
            return _architecture_index()[key]
    else:
        class_name = type(key).__name__
        if class_name in _architecture_index():
            return _architecture_index()[class_name]
        model_type = getattr(getattr(key, "config", key), "model_type", None)
        if model_type in _FAMILIES:
            return _FAMILIES[model_type]
        key = class_name
    supported = sorted(_FAMILIES) + sorted(_architecture_index())
    raise ConfigError(f"no Hugging Face adapter for {key!r}; supported: {supported}")


def family_of(hf_model_or_config: Any) -> str:
    """"gpt2" | "llama" | "mistral" | "gpt_neox" of an HF model or config."""
    config = getattr(hf_model_or_config, "config", hf_model_or_config)
    model_type = getattr(config, "model_type", None)
    if model_type not in _FAMILIES:
        raise ConfigError(f"unsupported Hugging Face model_type {model_type!r}")
    return model_type


def _check_mup_expressible(config, family: str) -> None:
    """A muP model (--use-mup) converts only where its multipliers are the standard ones:
    Hugging Face's configs have no logit or embedding multiplier, nor muP's attention scale."""
    if not getattr(config, "use_mup", False):
        return
    scale = config.attention_softmax_scale()
    standard_attention = abs(scale * math.sqrt(config.kv_channels) - 1.0) < 1e-12
    if config.mup_logit_mult() != 1.0 or config.mup_embedding_mult != 1.0 or \
            not standard_attention:
        raise ConfigError(
            f"this --use-mup model multiplies its logits by {config.mup_logit_mult():g}, its "
            f"embeddings by {config.mup_embedding_mult:g} and its attention scores by "
            f"{scale:g} (standard: 1, 1, 1/sqrt({config.kv_channels})), which a Hugging Face "
            f"{family} config cannot express; only a muP model at its base width with "
            "--mup-base-head-dim equal to its head dim converts")


def config_to_hf(config, family: str):
    """The HF config of `family` for a TransformerConfig."""
    _check_mup_expressible(config, family)
    adapter = get_adapter(family)
    if adapter is llama:
        return llama.config_to_hf(config, family)
    return adapter.config_to_hf(config)


__all__ = [
    "get_adapter",
    "family_of",
    "config_to_hf",
    "shard_state_dict",
    "merge_state_dicts",
    "gpt2",
    "llama",
    "gpt_neox",
    "gptj",
    "mixtral",
    "qwen2",
    "qwen2_moe",
    "qwen3_moe",
    "gpt_oss",
    "deepseek_v3",
    "qwen3_next",
    "qwen3_5",
    "nemotron_h",
    "gemma3",
]

# translate_smp_state_dict_to_hf_<family> / translate_hf_state_dict_to_smp_<family> (our
# GPTModel layout), and SMP v1's translate_state_dict_to_hf_<family> /
# translate_hf_state_dict_to_smdistributed_<family> (v1's DistributedTransformer layout).
from megatron_smp.models.hf.smp_v1 import *  # noqa: E402,F401,F403
from megatron_smp.models.hf.smp_v1 import __all__ as _smp_v1_all  # noqa: E402
from megatron_smp.models.hf.translate import *  # noqa: E402,F401,F403
from megatron_smp.models.hf.translate import __all__ as _translate_all  # noqa: E402

__all__ += _translate_all + _smp_v1_all
