"""NemotronHForCausalLM (Nemotron-H / Nemotron 3) <-> GPTModel with --hybrid-layer-pattern.

Each HF block is one part behind a pre-norm and a residual, named by `layers_block_type`:
`linear_attention` a Mamba-2 mixer (M), `full_attention` attention without positions (*),
`mlp` a squared-ReLU MLP (-), `moe` sigmoid-routed squared-ReLU experts with expert bias,
group-limited top-k, `routed_scaling_factor`, a shared expert and, with `moe_latent_size`
(Nemotron 3 Super), routed experts between latent projections `fc1_latent_proj` /
`fc2_latent_proj` (our --moe-latent-size) (E). HF clamps the Mamba time step from below at
`time_step_min` (our `mamba_dt_min`).

Layouts: HF's Mamba in_proj rows [z | x | B | C | dt] and conv channels [x | B | C] are
regrouped per Mamba group (transformer/ssm/mamba_mixer.py); attention q/k/v are packed per
query group as in every family. HF's group score is the sum of its 2 best experts, ours
topk / topk_group: grouped configs need topk = 2 x topk_group (as DeepSeek-V3's adapter).
"""
from __future__ import annotations

from typing import Mapping

import torch

from megatron_smp.config import ConfigError, TransformerConfig
from megatron_smp.models.hf.common import (
    FINAL_NORM,
    OUTPUT_LAYER,
    WORD_EMBEDDINGS,
    StateDict,
    layer_prefix,
    pack_qkv,
    pad_vocab,
    unpack_qkv,
    unpad_vocab,
)
from megatron_smp.models.hf.mixtral import experts_from_hf, experts_to_hf

HF_ARCHITECTURES = ("NemotronHForCausalLM",)
MODEL_TYPES = ("nemotron_h",)

_SYMBOLS = {"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E"}
_BLOCKS = {symbol: block for block, symbol in _SYMBOLS.items()}
# Latent MoE: the same names on both sides (biases are rejected with the other biases).
_LATENT = ("fc1_latent_proj.weight", "fc2_latent_proj.weight")


def config_from_hf(hf_config) -> TransformerConfig:
    types = list(hf_config.layers_block_type)
    unknown = sorted(set(types) - set(_SYMBOLS))
    problems = [f"layers_block_type {unknown}" for _ in [0] if unknown]
    problems += [name for name, bad in (
        ("mamba_hidden_act != silu", getattr(hf_config, "mamba_hidden_act", "silu") != "silu"),
        ("mlp_hidden_act != relu2", hf_config.mlp_hidden_act != "relu2"),
        ("use_conv_bias=False", not hf_config.use_conv_bias),
        ("use_bias / mlp_bias / attention_bias", hf_config.use_bias or hf_config.mlp_bias
         or getattr(hf_config, "attention_bias", False)),
        ("num_nextn_predict_layers (multi-token prediction)",
         getattr(hf_config, "num_nextn_predict_layers", 0)),
        ("sliding_window", getattr(hf_config, "sliding_window", None) is not None),
    ) if bad]
    moe = {}
    if "moe" in types:
        topk, groups, group_topk = (hf_config.num_experts_per_tok, hf_config.n_group,
                                    hf_config.topk_group)
        if groups and groups > 1 and topk != 2 * group_topk:
            problems.append(f"num_experts_per_tok {topk} != 2 x topk_group {group_topk} (HF "
                            "scores a group by its 2 best experts, Megatron by topk/topk_group)")
        if not hf_config.norm_topk_prob and topk > 1:
            problems.append("norm_topk_prob=False (the sigmoid router renormalises)")
        moe = dict(
            num_moe_experts=hf_config.n_routed_experts, moe_router_topk=topk,
            moe_ffn_hidden_size=hf_config.moe_intermediate_size,
            moe_shared_expert_intermediate_size=(
                hf_config.moe_shared_expert_intermediate_size * hf_config.n_shared_experts
                if hf_config.n_shared_experts else None),
            moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
            moe_router_num_groups=groups if groups and groups > 1 else None,
            moe_router_group_topk=group_topk if groups and groups > 1 else None,
            moe_router_topk_scaling_factor=float(hf_config.routed_scaling_factor),
            moe_router_dtype="fp32", moe_router_load_balancing_type="none",
            moe_latent_size=hf_config.moe_latent_size)
    if problems:
        raise ConfigError(f"Nemotron-H: {', '.join(problems)} not supported")
    heads = hf_config.num_attention_heads
    return TransformerConfig(
        num_layers=len(types),
        hidden_size=hf_config.hidden_size,
        num_attention_heads=heads,
        num_query_groups=hf_config.num_key_value_heads,
        kv_channels=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
        vocab_size=hf_config.vocab_size,
        max_position_embeddings=hf_config.max_position_embeddings,
        ffn_hidden_size=hf_config.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.layer_norm_epsilon,
        activation="squared_relu",
        position_embedding_type="none",
        add_bias_linear=False,
        untie_embeddings_and_output_weights=not hf_config.tie_word_embeddings,
        hidden_dropout=0.0,
        attention_dropout=hf_config.attention_dropout,
        init_method_std=hf_config.initializer_range,
        use_scaled_init_method=False,
        hybrid_layer_pattern="".join(_SYMBOLS[t] for t in types),
        mamba_state_dim=hf_config.ssm_state_size,
        mamba_head_dim=hf_config.mamba_head_dim,
        mamba_num_groups=hf_config.n_groups,
        mamba_num_heads=hf_config.mamba_num_heads,
        mamba_chunk_size=hf_config.chunk_size,
        mamba_conv_kernel_dim=hf_config.conv_kernel,
        mamba_dt_min=float(hf_config.time_step_min),
        **moe,
    )


def config_to_hf(config: TransformerConfig):
    from transformers import NemotronHConfig

    symbols = config.hybrid_layer_symbols()
    if (symbols is None or "G" in symbols or config.gated_linear_unit
            or config.activation != "squared_relu" or config.normalization != "RMSNorm"
            or config.position_embedding_type != "none" or config.add_bias_linear
            or config.layernorm_zero_centered_gamma or config.qk_layernorm
            or config.attention_output_gate or config.window_size is not None
            or ("E" in symbols and not (config.moe_router_score_function == "sigmoid"
                                         and config.moe_router_enable_expert_bias))):
        raise ConfigError(
            "this config is not a Nemotron-H: it needs --hybrid-layer-pattern of M, *, -, E "
            "(no G), squared-ReLU ungated MLPs, RMSNorm, no position embedding, no biases and "
            "sigmoid-routed experts with expert bias")
    kwargs = {}
    if config.num_moe_experts is not None:
        kwargs = dict(
            n_routed_experts=config.num_moe_experts, num_experts_per_tok=config.moe_router_topk,
            moe_intermediate_size=config.moe_ffn_hidden_size,
            moe_shared_expert_intermediate_size=config.moe_shared_expert_intermediate_size or 0,
            n_shared_experts=1 if config.moe_shared_expert_intermediate_size else 0,
            n_group=config.moe_router_num_groups or 1,
            topk_group=config.moe_router_group_topk or 1,
            routed_scaling_factor=config.moe_router_topk_scaling_factor or 1.0,
            norm_topk_prob=True, moe_latent_size=config.moe_latent_size)
    return NemotronHConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        layers_block_type=[_BLOCKS[s] for s in symbols],
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_query_groups, head_dim=config.kv_channels,
        max_position_embeddings=config.max_position_embeddings,
        attention_dropout=config.attention_dropout, intermediate_size=config.ffn_hidden_size,
        mlp_hidden_act="relu2", ssm_state_size=config.mamba_state_dim,
        mamba_num_heads=config.mamba_heads(), mamba_head_dim=config.mamba_head_dim,
        n_groups=config.mamba_num_groups, conv_kernel=config.mamba_conv_kernel_dim,
        chunk_size=config.mamba_chunk_size, time_step_min=config.mamba_dt_min,
        layer_norm_epsilon=config.layernorm_epsilon, initializer_range=config.init_method_std,
        tie_word_embeddings=not config.untie_embeddings_and_output_weights,
        bos_token_id=min(1, config.vocab_size - 1), eos_token_id=min(2, config.vocab_size - 1),
        **kwargs)


def _mamba_sizes(config: TransformerConfig):
    heads, groups = config.mamba_heads(), config.mamba_num_groups
    per_group = heads // groups
    width = per_group * config.mamba_head_dim
    n = config.mamba_state_dim
    return groups, width, n, per_group


def _mamba_from_hf(sd, hf: str, ours: str, config: TransformerConfig) -> StateDict:
    groups, width, n, per_group = _mamba_sizes(config)
    in_proj = sd[hf + "in_proj.weight"]
    z, x, B, C, dt = torch.split(in_proj, [groups * width, groups * width, groups * n,
                                           groups * n, groups * per_group])
    rest = tuple(in_proj.shape[1:])
    grouped = torch.cat([t.reshape((groups, -1) + rest) for t in (z, x, B, C, dt)], dim=1)
    out = {ours + "in_proj.weight": grouped.reshape((-1,) + rest).clone()}
    for name in ("conv1d.weight", "conv1d.bias"):
        conv = sd[hf + name]
        x, B, C = torch.split(conv, [groups * width, groups * n, groups * n])
        rest = tuple(conv.shape[1:])
        out[ours + name] = torch.cat([t.reshape((groups, -1) + rest) for t in (x, B, C)],
                                     dim=1).reshape((-1,) + rest).clone()
    for name in ("A_log", "D", "dt_bias", "out_proj.weight"):
        out[ours + name] = sd[hf + name].clone()
    out[ours + "norm_weight"] = sd[hf + "norm.weight"].clone()
    return out


def _mamba_to_hf(state_dict, hf: str, ours: str, config: TransformerConfig) -> StateDict:
    groups, width, n, per_group = _mamba_sizes(config)
    in_proj = state_dict[ours + "in_proj.weight"]
    rest = tuple(in_proj.shape[1:])
    parts = torch.split(in_proj.reshape((groups, -1) + rest), [width, width, n, n, per_group],
                        dim=1)
    out = {hf + "in_proj.weight": torch.cat([t.reshape((-1,) + rest) for t in parts]).clone()}
    for name in ("conv1d.weight", "conv1d.bias"):
        conv = state_dict[ours + name]
        rest = tuple(conv.shape[1:])
        parts = torch.split(conv.reshape((groups, -1) + rest), [width, n, n], dim=1)
        out[hf + name] = torch.cat([t.reshape((-1,) + rest) for t in parts]).clone()
    for name in ("A_log", "D", "dt_bias", "out_proj.weight"):
        out[hf + name] = state_dict[ours + name].clone()
    out[hf + "norm.weight"] = state_dict[ours + "norm_weight"].clone()
    return out


def _renamed(symbol: str, config: TransformerConfig):
    """(HF name, our name) of the layer's tensors that are copied as they are, relative to
    the layer's prefix: its norm and, per mixer symbol, the weights with a plain rename."""
    pairs = [("norm.weight", "norm.weight")]
    mixer = {
        "*": [("o_proj.weight", "linear_proj.weight")],
        "-": [("up_proj.weight", "linear_fc1.weight"),
              ("down_proj.weight", "linear_fc2.weight")],
        "E": [("gate.e_score_correction_bias", "router.expert_bias")]
        + ([(name, name) for name in _LATENT] if config.moe_latent_size is not None else [])
        + ([("shared_experts.up_proj.weight", "shared_experts.linear_fc1.weight"),
            ("shared_experts.down_proj.weight", "shared_experts.linear_fc2.weight")]
           if config.moe_shared_expert_intermediate_size else []),
    }.get(symbol, [])
    return pairs + [("mixer." + h, "mixer." + o) for h, o in mixer]


def _copies(sd, hf: str, ours: str, symbol: str, config: TransformerConfig, to_hf: bool):
    """The layer's plainly renamed tensors, cloned, in the direction asked."""
    if to_hf:
        return {hf + h: sd[ours + o].clone() for h, o in _renamed(symbol, config)}
    return {ours + o: sd[hf + h].clone() for h, o in _renamed(symbol, config)}


def from_hf(hf_state_dict: Mapping[str, torch.Tensor], config: TransformerConfig) -> StateDict:
    sd = hf_state_dict
    out: StateDict = {WORD_EMBEDDINGS: pad_vocab(sd["model.embeddings.weight"], config)}
    for i, symbol in enumerate(config.hybrid_layer_symbols()):
        hf, ours = f"model.layers.{i}.", layer_prefix(i)
        out.update(_copies(sd, hf, ours, symbol, config, to_hf=False))
        hf, ours = hf + "mixer.", ours + "mixer."
        if symbol == "M":
            out.update(_mamba_from_hf(sd, hf, ours, config))
        elif symbol == "*":
            out[ours + "linear_qkv.weight"] = pack_qkv(
                sd[hf + "q_proj.weight"], sd[hf + "k_proj.weight"], sd[hf + "v_proj.weight"],
                config)
        elif symbol == "E":  # "-" (an MLP) is all plain renames
            out.update(experts_from_hf(sd, hf, ours, config.num_moe_experts, fc1="up_proj"))
    out[FINAL_NORM + ".weight"] = sd["model.norm_f.weight"].clone()
    if config.untie_embeddings_and_output_weights:
        out[OUTPUT_LAYER] = pad_vocab(sd["lm_head.weight"], config)
    return out


def to_hf(state_dict: Mapping[str, torch.Tensor], config: TransformerConfig) -> StateDict:
    sd = state_dict
    out: StateDict = {"model.embeddings.weight": unpad_vocab(sd[WORD_EMBEDDINGS], config)}
    for i, symbol in enumerate(config.hybrid_layer_symbols()):
        hf, ours = f"model.layers.{i}.", layer_prefix(i)
        out.update(_copies(sd, hf, ours, symbol, config, to_hf=True))
        hf, ours = hf + "mixer.", ours + "mixer."
        if symbol == "M":
            out.update(_mamba_to_hf(sd, hf, ours, config))
        elif symbol == "*":
            q, k, v = unpack_qkv(sd[ours + "linear_qkv.weight"], config)
            out.update({hf + "q_proj.weight": q, hf + "k_proj.weight": k, hf + "v_proj.weight": v})
        elif symbol == "E":  # "-" (an MLP) is all plain renames
            out.update(experts_to_hf(sd, hf, ours, config.num_moe_experts, fc1="up_proj"))
    out["model.norm_f.weight"] = sd[FINAL_NORM + ".weight"].clone()
    head = OUTPUT_LAYER if config.untie_embeddings_and_output_weights else WORD_EMBEDDINGS
    out["lm_head.weight"] = unpad_vocab(sd[head], config)
    return out
