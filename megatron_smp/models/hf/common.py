"""Pieces shared by the Hugging Face adapters: vocabulary padding, fused QKV packing,
rope-parameter reading, and the framework's parameter names.

Every adapter module (gpt2, llama, gpt_neox, ...) provides

    config_from_hf(hf_config) -> TransformerConfig
    config_to_hf(config) -> transformers config
    from_hf(hf_state_dict, config) -> full (TP=1) framework state dict
    to_hf(full_state_dict, config) -> HF state dict
    HF_ARCHITECTURES (class names it serves) and MODEL_TYPES (config.model_type values)

and the TP helpers `shard_state_dict` / `merge_state_dicts` (from `models.sharding`) work on
the framework side for every family.
"""
from __future__ import annotations

from typing import Dict, Tuple

import torch

from megatron_smp.config import ConfigError, TransformerConfig
from megatron_smp.models.sharding import merge_state_dicts, shard_state_dict  # noqa: F401

StateDict = Dict[str, torch.Tensor]

# Framework parameter names (GPTModel at TP=1, one pipeline stage).
WORD_EMBEDDINGS = "embedding.word_embeddings.weight"
POSITION_EMBEDDINGS = "embedding.position_embeddings.weight"
OUTPUT_LAYER = "output_layer.weight"
FINAL_NORM = "decoder.final_layernorm"


def layer_prefix(index: int) -> str:
    return f"decoder.layers.{index}."


def pad_vocab(table: torch.Tensor, config: TransformerConfig) -> torch.Tensor:
    """[vocab, h] -> [padded_vocab_size(1), h] with zero rows (the TP=1 model's table)."""
    if table.shape[0] != config.vocab_size:
        raise ConfigError(
            f"vocabulary table has {table.shape[0]} rows but the config says vocab_size="
            f"{config.vocab_size}"
        )
    padded = config.padded_vocab_size(1)
    out = table.new_zeros((padded,) + tuple(table.shape[1:]))
    out[: config.vocab_size] = table
    return out


def unpad_vocab(table: torch.Tensor, config: TransformerConfig) -> torch.Tensor:
    return table[: config.vocab_size].clone()


def pack_qkv(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, config: TransformerConfig
) -> torch.Tensor:
    """q [nh*d, ...], k/v [ng*d, ...] -> fused [ng * (q_per_group + 2) * d, ...] per group."""
    ng, d = config.num_query_groups, config.kv_channels
    rest = tuple(query.shape[1:])
    q = query.reshape((ng, -1, d) + rest)
    k = key.reshape((ng, 1, d) + rest)
    v = value.reshape((ng, 1, d) + rest)
    return torch.cat([q, k, v], dim=1).reshape((-1,) + rest).clone()


def unpack_qkv(
    qkv: torch.Tensor, config: TransformerConfig
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `pack_qkv`."""
    ng, d = config.num_query_groups, config.kv_channels
    q_per_group = config.num_attention_heads // ng
    rest = tuple(qkv.shape[1:])
    grouped = qkv.reshape((ng, q_per_group + 2, d) + rest)
    q, k, v = torch.split(grouped, [q_per_group, 1, 1], dim=1)
    return (
        q.reshape((-1,) + rest).clone(),
        k.reshape((-1,) + rest).clone(),
        v.reshape((-1,) + rest).clone(),
    )


def norms_to_hf(state_dict: StateDict, config: TransformerConfig, family: str) -> StateDict:
    """Our full state dict with its norm weights as HF stores them: + 1 when they are stored
    zero-centred (--apply-layernorm-1p, y = norm(x) * (1 + w)); HF has no such setting.
    Raises ConfigError for numerics `family` cannot express."""
    if config.qk_layernorm and family != "qwen3":
        raise ConfigError(f"--qk-layernorm: Hugging Face {family} models have no query/key norms;"
                          " of the converted families only qwen3 has them")
    # GPT-J's own RoPE is interleaved, DeepSeek-V3's (rope_interleave): nothing to reorder.
    if config.rotary_interleaved and family not in ("llama", "qwen3", "gptj", "deepseek_v3"):
        raise ConfigError(f"--rotary-interleaved: Hugging Face {family} rotates channel halves; "
                          "reordering its q/k rows is built for the Llama-style families only")
    if not config.layernorm_zero_centered_gamma:
        return state_dict
    return {name: value + 1 if name.endswith("layernorm.weight") else value
            for name, value in state_dict.items()}


def norms_from_hf(state_dict: StateDict, config: TransformerConfig) -> StateDict:
    """Inverse of `norms_to_hf` on a converted (framework) state dict, in place."""
    if config.layernorm_zero_centered_gamma:
        for name in state_dict:
            if name.endswith("layernorm.weight"):
                state_dict[name] = state_dict[name] - 1
    return state_dict


def rope_parameters(hf_config) -> dict:
    """transformers 5 keeps RoPE settings in `rope_parameters`; older versions in attributes."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if "rope_theta" not in params and hasattr(hf_config, "rope_theta"):
        params["rope_theta"] = hf_config.rope_theta
    legacy_scaling = getattr(hf_config, "rope_scaling", None)
    if legacy_scaling and "rope_type" not in params:
        params["rope_type"] = legacy_scaling.get("rope_type", legacy_scaling.get("type"))
    params.setdefault("rope_type", "default")
    params.setdefault("rope_theta", 10000.0)
    if params["rope_type"] != "default":
        raise ConfigError(
            f"RoPE scaling {params['rope_type']!r} is not supported; only the default RoPE "
            "(rope_type='default') converts"
        )
    return params


__all__ = [
    "StateDict",
    "WORD_EMBEDDINGS",
    "POSITION_EMBEDDINGS",
    "OUTPUT_LAYER",
    "FINAL_NORM",
    "layer_prefix",
    "pad_vocab",
    "unpad_vocab",
    "pack_qkv",
    "unpack_qkv",
    "rope_parameters",
    "norms_to_hf",
    "norms_from_hf",
    "shard_state_dict",
    "merge_state_dicts",
]
