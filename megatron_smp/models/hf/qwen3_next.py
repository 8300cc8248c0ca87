"""Qwen3NextForCausalLM <-> GPTModel, and the pieces Qwen3.5 (`qwen3_5`) shares.

The Qwen3-Next / Qwen3.5 stack: GPT layers whose attention is a Gated DeltaNet on the
`linear_attention` layers (our --linear-attention-freq with --experimental-attention-variant
gated_delta_net) and gated full attention on the others (--attention-output-gate: q_proj gives
[q, gate] per head, the output is multiplied by sigmoid(gate); per-head query/key norms; partial
RoPE, `partial_rotary_factor` = --rotary-percent); every RMSNorm but the Gated DeltaNet's output
norm is zero-centred, `y = norm(x) * (1 + w)`, stored as w on both sides
(--apply-layernorm-1p). MLPs are SwiGLU, or Qwen-MoE blocks (softmax top-k, a shared expert
behind a sigmoid gate) where `decoder_sparse_step` / `mlp_only_layers` say.

Layouts: our fused QKV holds per query group [q heads, their gates, k, v]; our Gated DeltaNet
in_proj holds per key head [q, k, v, z, b, a] and its conv channels [q, k, v] (see
transformer/ssm/gated_delta_net.py). Qwen3-Next's `in_proj_qkvz` / `in_proj_ba` are already
grouped per key head; Qwen3.5 keeps `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`
whole (`split_projections`).
"""
from __future__ import annotations

from typing import List, Mapping, Union

import torch

from megatron_smp.config import ConfigError, TransformerConfig
from megatron_smp.models.hf import llama
from megatron_smp.models.hf.common import (
    FINAL_NORM,
    OUTPUT_LAYER,
    WORD_EMBEDDINGS,
    StateDict,
    layer_prefix,
    pad_vocab,
    rope_fields_from_hf,
    rope_parameters,
    rope_parameters_to_hf,
    unpad_vocab,
)
from megatron_smp.models.hf.qwen2_moe import (
    hf_moe_layers,
    shared_expert_moe_from_hf,
    shared_expert_moe_to_hf,
)

HF_ARCHITECTURES = ("Qwen3NextForCausalLM",)
MODEL_TYPES = ("qwen3_next",)

LINEAR, FULL = "linear_attention", "full_attention"


def linear_attention_freq_of(layer_types: List[str]) -> Union[int, List[int]]:
    """--linear-attention-freq of HF `layer_types`: N where every N-th layer is full
    attention, else the 0/1 list."""
    unknown = sorted(set(layer_types) - {LINEAR, FULL})
    if unknown:
        raise ConfigError(f"Qwen3-Next/3.5 layer_types {unknown} are not supported "
                          f"({LINEAR}, {FULL})")
    pattern = [int(kind == LINEAR) for kind in layer_types]
    if FULL in layer_types:
        every = layer_types.index(FULL) + 1
        if pattern == [int((index + 1) % every != 0) for index in range(len(pattern))]:
            return every
    return pattern


def config_from_hf(hf_config, moe_layers: List[int] = None) -> TransformerConfig:
    """`moe_layers`: 1 per MoE layer (default: Qwen3-Next's decoder_sparse_step /
    mlp_only_layers when it has experts)."""
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise ConfigError(f"Qwen3-Next/3.5 hidden_act {hf_config.hidden_act!r} is not supported"
                          " (silu)")
    if getattr(hf_config, "attention_bias", False):
        raise ConfigError("Qwen3-Next/3.5 attention_bias=True is not supported")
    heads = hf_config.num_attention_heads
    experts = getattr(hf_config, "num_experts", 0) or 0
    if moe_layers is None:
        moe_layers = hf_moe_layers(hf_config) if experts else [0] * hf_config.num_hidden_layers
    moe = {}
    if any(moe_layers):
        moe = dict(
            num_moe_experts=experts,
            moe_router_topk=hf_config.num_experts_per_tok,
            moe_ffn_hidden_size=hf_config.moe_intermediate_size,
            moe_router_pre_softmax=not getattr(hf_config, "norm_topk_prob", True),
            moe_shared_expert_intermediate_size=hf_config.shared_expert_intermediate_size,
            moe_shared_expert_gate=True,
            moe_aux_loss_coeff=float(getattr(hf_config, "router_aux_loss_coef", 0.0)),
            moe_layer_freq=1 if all(moe_layers) else moe_layers,
        )
    ffn = getattr(hf_config, "intermediate_size", None) or hf_config.moe_intermediate_size
    return TransformerConfig(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        num_attention_heads=heads,
        num_query_groups=hf_config.num_key_value_heads,
        kv_channels=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
        vocab_size=hf_config.vocab_size,
        max_position_embeddings=hf_config.max_position_embeddings,
        ffn_hidden_size=ffn,
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        layernorm_zero_centered_gamma=True,
        qk_layernorm=True,
        attention_output_gate=True,
        activation="silu",
        gated_linear_unit=True,
        **rope_fields_from_hf(hf_config),
        rotary_percent=float(rope_parameters(hf_config).get("partial_rotary_factor", 1.0)),
        add_bias_linear=False,
        untie_embeddings_and_output_weights=not getattr(hf_config, "tie_word_embeddings", False),
        hidden_dropout=0.0,
        attention_dropout=getattr(hf_config, "attention_dropout", 0.0),
        init_method_std=hf_config.initializer_range,
        use_scaled_init_method=False,
        experimental_attention_variant="gated_delta_net",
        linear_attention_freq=linear_attention_freq_of(list(hf_config.layer_types)),
        linear_conv_kernel_dim=hf_config.linear_conv_kernel_dim,
        linear_key_head_dim=hf_config.linear_key_head_dim,
        linear_value_head_dim=hf_config.linear_value_head_dim,
        linear_num_key_heads=hf_config.linear_num_key_heads,
        linear_num_value_heads=hf_config.linear_num_value_heads,
        **moe,
    )


def check_config(config: TransformerConfig, family: str) -> None:
    """ConfigError unless `config` is a Qwen3-Next / Qwen3.5 stack."""
    if not (config.attention_output_gate and config.qk_layernorm
            and config.layernorm_zero_centered_gamma and config.gated_linear_unit
            and config.activation == "silu" and config.normalization == "RMSNorm"
            and config.position_embedding_type == "rope" and not config.add_bias_linear
            and config.linear_attention_freq is not None and config.window_size is None
            and config.hybrid_layer_pattern is None
            and (config.num_moe_experts is None
                 or (config.moe_shared_expert_gate
                     and config.moe_shared_expert_intermediate_size))):
        raise ConfigError(
            f"this config is not a {family}: it needs --linear-attention-freq with Gated "
            "DeltaNet layers, --attention-output-gate, --qk-layernorm, --apply-layernorm-1p, "
            "RMSNorm, SwiGLU, RoPE, no biases and (with experts) a gated shared expert")


def hf_config_kwargs(config: TransformerConfig) -> dict:
    """The HF config fields Qwen3-Next and Qwen3.5 share."""
    kwargs = llama.hf_config_kwargs(config)
    kwargs["rope_parameters"] = dict(rope_parameters_to_hf(config),
                                     partial_rotary_factor=config.rotary_percent)
    pattern = config.linear_attention_pattern()
    kwargs.update(
        layer_types=[LINEAR if linear else FULL for linear in pattern],
        linear_conv_kernel_dim=config.linear_conv_kernel_dim,
        linear_key_head_dim=config.linear_key_head_dim,
        linear_value_head_dim=config.linear_value_head_dim,
        linear_num_key_heads=config.linear_num_key_heads,
        linear_num_value_heads=config.linear_num_value_heads,
        attention_bias=False,
    )
    if config.num_moe_experts is not None:
        kwargs.update(
            num_experts=config.num_moe_experts,
            num_experts_per_tok=config.moe_router_topk,
            moe_intermediate_size=config.moe_ffn_hidden_size,
            shared_expert_intermediate_size=config.moe_shared_expert_intermediate_size,
            router_aux_loss_coef=config.moe_aux_loss_coeff,
        )
    return kwargs


def config_to_hf(config: TransformerConfig):
    from transformers import Qwen3NextConfig

    check_config(config, "Qwen3-Next")
    kwargs = hf_config_kwargs(config)
    if config.num_moe_experts is not None:
        pattern = config.moe_layer_pattern()
        kwargs.update(norm_topk_prob=not config.moe_router_pre_softmax, decoder_sparse_step=1,
                      mlp_only_layers=[index for index, moe in enumerate(pattern) if not moe])
    else:
        kwargs.update(num_experts=0)
    return Qwen3NextConfig(**kwargs)


# Attention: q_proj [nh * 2d] (per head [q, gate]) <-> our per-group [q heads, gates, k, v].

def _gated_qkv_from_hf(q_proj, k_proj, v_proj, config: TransformerConfig) -> torch.Tensor:
    ng, d = config.num_query_groups, config.kv_channels
    per_group = config.num_attention_heads // ng
    rest = tuple(q_proj.shape[1:])
    heads = q_proj.reshape((ng, per_group, 2, d) + rest)
    return torch.cat([heads[:, :, 0].reshape((ng, -1) + rest),
                      heads[:, :, 1].reshape((ng, -1) + rest),
                      k_proj.reshape((ng, d) + rest), v_proj.reshape((ng, d) + rest)],
                     dim=1).reshape((-1,) + rest).clone()


def _gated_qkv_to_hf(qkv, config: TransformerConfig):
    ng, d = config.num_query_groups, config.kv_channels
    per_group = config.num_attention_heads // ng
    rest = tuple(qkv.shape[1:])
    grouped = qkv.reshape((ng, 2 * per_group + 2, d) + rest)
    q, gate, k, v = torch.split(grouped, [per_group, per_group, 1, 1], dim=1)
    q_proj = torch.stack([q, gate], dim=2).reshape((-1,) + rest)
    return q_proj.clone(), k.reshape((-1,) + rest).clone(), v.reshape((-1,) + rest).clone()


# Gated DeltaNet: HF projections <-> our per-key-head rows.

def _gdn_sizes(config: TransformerConfig):
    nk = config.linear_num_key_heads
    r = config.linear_num_value_heads // nk
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
    return nk, [dk, dk, r * dv, r * dv, r, r]  # q, k, v, z, b, a per key head


def _gdn_from_hf(sd, hf: str, ours: str, config: TransformerConfig,
                 split_projections: bool) -> StateDict:
    nk, sizes = _gdn_sizes(config)
    hidden = config.hidden_size
    if split_projections:  # Qwen3.5: whole q | k | v, z, b, a
        q, k, v = torch.split(sd[hf + "in_proj_qkv.weight"],
                              [nk * sizes[0], nk * sizes[1], nk * sizes[2]])
        pieces = [q, k, v, sd[hf + "in_proj_z.weight"], sd[hf + "in_proj_b.weight"],
                  sd[hf + "in_proj_a.weight"]]
        in_proj = torch.cat([p.reshape(nk, -1, hidden) for p in pieces], dim=1)
    else:  # Qwen3-Next: already per key head
        in_proj = torch.cat([sd[hf + "in_proj_qkvz.weight"].reshape(nk, -1, hidden),
                             sd[hf + "in_proj_ba.weight"].reshape(nk, -1, hidden)], dim=1)
    conv = sd[hf + "conv1d.weight"]  # [q all, k all, v all] channels
    q, k, v = torch.split(conv, [nk * sizes[0], nk * sizes[1], nk * sizes[2]])
    conv = torch.cat([t.reshape((nk, -1) + tuple(conv.shape[1:])) for t in (q, k, v)], dim=1)
    return {
        ours + "in_proj.weight": in_proj.reshape(-1, hidden).clone(),
        ours + "conv1d.weight": conv.reshape((-1,) + tuple(conv.shape[2:])).clone(),
        ours + "A_log": sd[hf + "A_log"].clone(),
        ours + "dt_bias": sd[hf + "dt_bias"].clone(),
        ours + "out_norm_weight": sd[hf + "norm.weight"].clone(),
        ours + "out_proj.weight": sd[hf + "out_proj.weight"].clone(),
    }


def _gdn_to_hf(state_dict, hf: str, ours: str, config: TransformerConfig,
               split_projections: bool) -> StateDict:
    nk, sizes = _gdn_sizes(config)
    hidden = config.hidden_size
    in_proj = state_dict[ours + "in_proj.weight"].reshape(nk, -1, hidden)
    q, k, v, z, b, a = (t.reshape(-1, hidden) for t in torch.split(in_proj, sizes, dim=1))
    out = {}
    if split_projections:
        out.update({hf + "in_proj_qkv.weight": torch.cat([q, k, v]), hf + "in_proj_z.weight": z,
                    hf + "in_proj_b.weight": b, hf + "in_proj_a.weight": a})
    else:
        qkvz = torch.split(in_proj, [sum(sizes[:4]), sum(sizes[4:])], dim=1)
        out.update({hf + "in_proj_qkvz.weight": qkvz[0].reshape(-1, hidden),
                    hf + "in_proj_ba.weight": qkvz[1].reshape(-1, hidden)})
    conv = state_dict[ours + "conv1d.weight"]
    grouped = conv.reshape((nk, -1) + tuple(conv.shape[1:]))
    channels = torch.split(grouped, sizes[:3], dim=1)
    out[hf + "conv1d.weight"] = torch.cat([t.reshape((-1,) + tuple(conv.shape[1:]))
                                           for t in channels])
    out.update({hf + "A_log": state_dict[ours + "A_log"],
                hf + "dt_bias": state_dict[ours + "dt_bias"],
                hf + "norm.weight": state_dict[ours + "out_norm_weight"],
                hf + "out_proj.weight": state_dict[ours + "out_proj.weight"]})
    return {name: tensor.clone() for name, tensor in out.items()}


_NORMS = (("input_layernorm.weight", "input_layernorm.weight"),
          ("pre_mlp_layernorm.weight", "post_attention_layernorm.weight"))
_QK_NORMS = (("q_layernorm.weight", "q_norm.weight"), ("k_layernorm.weight", "k_norm.weight"))


def from_hf(hf_state_dict: Mapping[str, torch.Tensor], config: TransformerConfig,
            split_projections: bool = False) -> StateDict:
    """HF state dict -> our full (TP=1) one. Norm weights are zero-centred on both sides."""
    sd = hf_state_dict
    linear = config.linear_attention_pattern()
    moe = config.moe_layer_pattern()
    out: StateDict = {WORD_EMBEDDINGS: pad_vocab(sd["model.embed_tokens.weight"], config)}
    for i in range(config.num_layers):
        hf, ours = f"model.layers.{i}.", layer_prefix(i)
        for ours_norm, hf_norm in _NORMS:
            out[ours + ours_norm] = sd[hf + hf_norm].clone()
        if linear[i]:
            out.update(_gdn_from_hf(sd, hf + "linear_attn.", ours + "self_attention.", config,
                                    split_projections))
        else:
            attn = hf + "self_attn."
            out[ours + "self_attention.linear_qkv.weight"] = _gated_qkv_from_hf(
                sd[attn + "q_proj.weight"], sd[attn + "k_proj.weight"], sd[attn + "v_proj.weight"],
                config)
            out[ours + "self_attention.linear_proj.weight"] = sd[attn + "o_proj.weight"].clone()
            for ours_norm, hf_norm in _QK_NORMS:
                out[ours + "self_attention." + ours_norm] = sd[attn + hf_norm].clone()
        if moe[i]:
            out.update(shared_expert_moe_from_hf(sd, hf + "mlp.", ours + "mlp.",
                                                 config.num_moe_experts))
        else:
            out.update(llama.gated_mlp_from_hf(sd, hf + "mlp.", ours + "mlp."))
    out[FINAL_NORM + ".weight"] = sd["model.norm.weight"].clone()
    if config.untie_embeddings_and_output_weights:
        out[OUTPUT_LAYER] = pad_vocab(sd["lm_head.weight"], config)
    return out


def to_hf(state_dict: Mapping[str, torch.Tensor], config: TransformerConfig,
          split_projections: bool = False) -> StateDict:
    """Inverse of `from_hf`."""
    linear = config.linear_attention_pattern()
    moe = config.moe_layer_pattern()
    out: StateDict = {"model.embed_tokens.weight": unpad_vocab(state_dict[WORD_EMBEDDINGS],
                                                               config)}
    for i in range(config.num_layers):
        hf, ours = f"model.layers.{i}.", layer_prefix(i)
        if linear[i]:
            out.update(_gdn_to_hf(state_dict, hf + "linear_attn.", ours + "self_attention.",
                                  config, split_projections))
        else:
            attn = hf + "self_attn."
            q, k, v = _gated_qkv_to_hf(state_dict[ours + "self_attention.linear_qkv.weight"],
                                       config)
            out.update({attn + "q_proj.weight": q, attn + "k_proj.weight": k,
                        attn + "v_proj.weight": v,
                        attn + "o_proj.weight":
                            state_dict[ours + "self_attention.linear_proj.weight"].clone()})
            for ours_norm, hf_norm in _QK_NORMS:
                out[attn + hf_norm] = state_dict[ours + "self_attention." + ours_norm].clone()
        if moe[i]:
            out.update(shared_expert_moe_to_hf(state_dict, hf + "mlp.", ours + "mlp.",
                                               config.num_moe_experts))
        else:
            out.update(llama.gated_mlp_to_hf(state_dict, hf + "mlp.", ours + "mlp."))
        for ours_norm, hf_norm in _NORMS:
            out[hf + hf_norm] = state_dict[ours + ours_norm].clone()
    out["model.norm.weight"] = state_dict[FINAL_NORM + ".weight"].clone()
    head = OUTPUT_LAYER if config.untie_embeddings_and_output_weights else WORD_EMBEDDINGS
    out["lm_head.weight"] = unpad_vocab(state_dict[head], config)
    return out
