"""Pieces shared by the Hugging Face adapters: vocabulary padding, fused QKV packing,
RoPE parameters both ways (`rope_fields_from_hf`, `rope_parameters_to_hf`: default, linear,
Llama 3.x and YaRN), and the framework's parameter names.

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

import contextlib
from typing import Dict, Iterator, List, Optional, Tuple, Union

import torch

from megatron_smp.config import ConfigError, TransformerConfig
from megatron_smp.models.sharding import merge_state_dicts, shard_state_dict  # noqa: F401
from megatron_smp.transformer.rope import YarnRopeScaling, rope_scaling_of

StateDict = Dict[str, torch.Tensor]

# Framework parameter names (GPTModel at TP=1, one pipeline stage).
WORD_EMBEDDINGS = "embedding.word_embeddings.weight"
POSITION_EMBEDDINGS = "embedding.position_embeddings.weight"
OUTPUT_LAYER = "output_layer.weight"
FINAL_NORM = "decoder.final_layernorm"


def layer_prefix(index: int) -> str:
    return f"decoder.layers.{index}."


# Whether `pad_vocab` / `unpad_vocab` may give the table itself (see `vocab_tables_in_place`).
_IN_PLACE = [False]


@contextlib.contextmanager
def vocab_tables_in_place() -> Iterator[None]:
    """Within it, `pad_vocab` and `unpad_vocab` give the table itself (no copy) when no row is
    added or cut: a converter that maps a vocabulary table with a config padding it to its own
    size (make_vocab_size_divisible_by=1) then holds one copy of it, not two or three (the
    tied output head is the same table). Outside it they always copy, so that a converted
    state dict owns its tables and a tied head is a tensor of its own."""
    previous = _IN_PLACE[0]
    _IN_PLACE[0] = True
    try:
        yield
    finally:
        _IN_PLACE[0] = previous


def pad_vocab(table: torch.Tensor, config: TransformerConfig) -> torch.Tensor:
    """[vocab, h] -> [padded_vocab_size(1), h] with zero rows (the TP=1 model's table)."""
    if table.shape[0] != config.vocab_size:
        raise ConfigError(
            f"vocabulary table has {table.shape[0]} rows but the config says vocab_size="
            f"{config.vocab_size}"
        )
    padded = config.padded_vocab_size(1)
    if padded == config.vocab_size and _IN_PLACE[0]:
        return table
    out = table.new_zeros((padded,) + tuple(table.shape[1:]))
    out[: config.vocab_size] = table
    return out


def unpad_vocab(table: torch.Tensor, config: TransformerConfig) -> torch.Tensor:
    """Inverse of `pad_vocab`: the first vocab_size rows, a copy."""
    if table.shape[0] == config.vocab_size and _IN_PLACE[0]:
        return table
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


# HF families with per-head query/key RMSNorms (our --qk-layernorm).
QK_NORM_FAMILIES = ("qwen3", "qwen3_moe", "deepseek_v3")  # DeepSeek: MLA's latent norms


def norms_to_hf(state_dict: StateDict, config: TransformerConfig, family: str) -> StateDict:
    """Our full state dict with its norm weights as HF stores them: + 1 when they are stored
    zero-centred (--apply-layernorm-1p, y = norm(x) * (1 + w)); HF has no such setting.
    Raises ConfigError for numerics `family` cannot express."""
    if config.qk_layernorm and family not in QK_NORM_FAMILIES:
        raise ConfigError(f"--qk-layernorm: Hugging Face {family} models have no query/key norms;"
                          f" of the converted families only {', '.join(QK_NORM_FAMILIES)} have "
                          "them")
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


def shape_fields_from_hf(hf_config) -> dict:
    """TransformerConfig's shape fields of a Llama-style HF config: layers, hidden, heads,
    query groups (num_key_value_heads), head dim (head_dim, else hidden / heads), vocabulary,
    positions and the MLP width (intermediate_size)."""
    heads = hf_config.num_attention_heads
    return dict(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        num_attention_heads=heads,
        num_query_groups=getattr(hf_config, "num_key_value_heads", None) or heads,
        kv_channels=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
        vocab_size=hf_config.vocab_size,
        max_position_embeddings=hf_config.max_position_embeddings,
        ffn_hidden_size=hf_config.intermediate_size,
    )


def rope_parameters(hf_config) -> dict:
    """transformers 5 keeps RoPE settings in `rope_parameters`; older versions in attributes
    (`rope_theta`, `rope_scaling`). The plain dict, with rope_type and rope_theta set."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    legacy_scaling = getattr(hf_config, "rope_scaling", None)
    if legacy_scaling and "rope_type" not in params:
        params.update(legacy_scaling)
        params["rope_type"] = legacy_scaling.get("rope_type", legacy_scaling.get("type"))
    if "rope_theta" not in params and hasattr(hf_config, "rope_theta"):
        params["rope_theta"] = hf_config.rope_theta
    params.setdefault("rope_type", "default")
    params.setdefault("rope_theta", 10000.0)
    return params


def _get(params: dict, key: str, default):
    value = params.get(key)
    return default if value is None else value


def rope_fields_from_hf(hf_config) -> dict:
    """TransformerConfig fields of an HF config's RoPE: rotary_base, and linear scaling
    (rope_type "linear": rotary_seq_len_interpolation_factor), Llama 3.x scaling (rope_type
    "llama3": use_rope_scaling, rope_scaling_*) or YaRN (rope_type "yarn":
    position_embedding_type "yarn", yarn_*). ConfigError for other rope types."""
    params = rope_parameters(hf_config)
    rope_type = params["rope_type"]
    fields = {"position_embedding_type": "rope", "rotary_base": float(params["rope_theta"])}
    original = params.get("original_max_position_embeddings")
    if rope_type == "default":
        return fields
    if rope_type == "linear":
        fields["rotary_seq_len_interpolation_factor"] = float(params["factor"])
        return fields
    if rope_type == "llama3":
        fields.update(
            use_rope_scaling=True,
            rope_scaling_factor=float(params["factor"]),
            rope_scaling_low_freq_factor=float(params["low_freq_factor"]),
            rope_scaling_high_freq_factor=float(params["high_freq_factor"]),
            rope_scaling_original_max_position_embeddings=int(
                original or hf_config.max_position_embeddings),
        )
        return fields
    if rope_type == "yarn":
        original = int(original or hf_config.max_position_embeddings)
        factor = params.get("factor")
        if factor is None:  # DeepSeek-style: the ratio of the contexts
            factor = hf_config.max_position_embeddings / original
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if not (mscale and mscale_all_dim):
            # HF then uses 0.1 ln(factor) + 1 alone: Megatron's ratio with (1, 0).
            mscale, mscale_all_dim = 1.0, 0.0
        fields.update(
            position_embedding_type="yarn",
            yarn_rotary_scaling_factor=float(factor),
            yarn_original_max_position_embeddings=original,
            yarn_beta_fast=float(_get(params, "beta_fast", 32.0) or 32.0),
            yarn_beta_slow=float(_get(params, "beta_slow", 1.0) or 1.0),
            yarn_mscale=float(mscale),
            yarn_mscale_all_dim=float(mscale_all_dim),
            yarn_correction_range_round_to_int=bool(_get(params, "truncate", True)),
        )
        attention_factor = params.get("attention_factor")
        if attention_factor is not None:
            derived = YarnRopeScaling(factor=float(factor), mscale=float(mscale),
                                      mscale_all_dim=float(mscale_all_dim)).attention_scaling()
            if abs(float(attention_factor) - derived) > 1e-9:
                raise ConfigError(
                    f"YaRN attention_factor {attention_factor} differs from the one its factor "
                    f"and mscale give ({derived}); Megatron's YaRN (and ours) derive it, so an "
                    "explicit attention_factor does not convert"
                )
        return fields
    raise ConfigError(
        f"RoPE scaling {rope_type!r} is not supported; default, linear, llama3 (Llama 3.x) and "
        "yarn convert"
    )


def rope_parameters_to_hf(config: TransformerConfig) -> dict:
    """The HF `rope_parameters` dict of `config`'s RoPE (inverse of `rope_fields_from_hf`)."""
    params = {"rope_type": "default", "rope_theta": config.rotary_base}
    if config.position_embedding_type == "yarn":
        params.update(
            rope_type="yarn",
            factor=config.yarn_rotary_scaling_factor,
            original_max_position_embeddings=config.yarn_original_max_position_embeddings,
            beta_fast=config.yarn_beta_fast,
            beta_slow=config.yarn_beta_slow,
            truncate=config.yarn_correction_range_round_to_int,
        )
        if config.yarn_mscale and config.yarn_mscale_all_dim:
            params.update(mscale=config.yarn_mscale, mscale_all_dim=config.yarn_mscale_all_dim)
        elif (config.yarn_mscale, config.yarn_mscale_all_dim) != (1.0, 0.0):
            # A ratio HF's mscale fields cannot express: state the factor itself.
            params["attention_factor"] = rope_scaling_of(config).attention_scaling()
    elif config.rotary_seq_len_interpolation_factor is not None:
        params.update(rope_type="linear", factor=config.rotary_seq_len_interpolation_factor)
    elif config.use_rope_scaling:
        params.update(
            rope_type="llama3",
            factor=config.rope_scaling_factor,
            low_freq_factor=config.rope_scaling_low_freq_factor,
            high_freq_factor=config.rope_scaling_high_freq_factor,
            original_max_position_embeddings=(
                config.rope_scaling_original_max_position_embeddings),
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
    "vocab_tables_in_place",
    "pack_qkv",
    "unpack_qkv",
    "shape_fields_from_hf",
    "rope_parameters",
    "rope_fields_from_hf",
    "rope_parameters_to_hf",
    "norms_to_hf",
    "norms_from_hf",
    "shard_state_dict",
    "merge_state_dicts",
]


def windows_from_hf(hf_config, family: str) -> Tuple[Optional[Tuple[int, int]],
                                                     Union[None, int, List[int]]]:
    """(--window-size, --window-attn-skip-freq) of an HF config's sliding windows: on the
    layers its `layer_types` name `sliding_attention` (gpt-oss, Qwen2, Gemma 3), or on every layer
    when it has a `sliding_window` and no `layer_types` (Qwen3-MoE). HF's window W lets a
    token see itself and the W - 1 before it: our (W - 1, 0)."""
    window = getattr(hf_config, "sliding_window", None)
    types = getattr(hf_config, "layer_types", None)
    if types is None:
        pattern = [int(window is not None)] * hf_config.num_hidden_layers
    else:
        unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
        if unknown:
            raise ConfigError(f"{family} layer_types {unknown} are not supported "
                              "(sliding_attention, full_attention)")
        pattern = [int(kind == "sliding_attention") for kind in types]
    if window is None or not any(pattern):
        return None, None
    # --window-attn-skip-freq N: every N-th layer full, e.g. 2 for gpt-oss's alternation
    # (sliding first), 6 for Gemma 3's 5:1; else the 0/1 list.
    every_nth_full = (freq for freq in range(2, len(pattern) + 1)
                      if pattern == [int((index + 1) % freq != 0)
                                     for index in range(len(pattern))])
    skip_freq = None if all(pattern) else next(every_nth_full, pattern)
    return (window - 1, 0), skip_freq


def windows_to_hf(config: TransformerConfig) -> dict:
    """HF's `sliding_window` and `layer_types` of our per-layer windows (see windows_from_hf);
    a window that also looks ahead, or does not reach back, has no HF form."""
    pattern = config.window_layer_pattern()
    if any(pattern) and (config.window_size[1] != 0 or config.window_size[0] < 0):
        raise ConfigError(f"--window-size {config.window_size}: Hugging Face sliding windows "
                          "look back only, (W - 1, 0)")
    return {
        "sliding_window": config.window_size[0] + 1 if any(pattern) else None,
        "layer_types": ["sliding_attention" if window else "full_attention"
                        for window in pattern],
    }
