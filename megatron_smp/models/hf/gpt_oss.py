"""GptOssForCausalLM <-> GPTModel: an MoE model in every layer with

* attention sinks: `self_attn.sinks` [nh] is our `self_attention.core_attention.softmax_offset`
  (--softmax-type learnable), split over TP with the heads;
* q/k/v/o biases, expert biases and a router bias (our add_bias_linear);
* sliding and full attention layers (`layer_types`): --window-size (W - 1, 0) for
  `sliding_window` W, on the layers --window-attn-skip-freq selects (2 for the published
  alternation, sliding first; a 0/1 list otherwise);
* the clamped GLU of the experts, (up + 1) * gate * sigmoid(1.702 gate) with gate <= limit and
  |up| <= limit: --quick-geglu --glu-linear-offset 1 --activation-func-clamp-value limit;
* top-k of the router logits, then softmax over the k chosen (our default routing);
* YaRN RoPE (rope_parameters rope_type "yarn").

HF stores a layer's experts fused and transposed: `experts.gate_up_proj` [E, H, 2F] with gate
and up *interleaved* along the last dim (columns 0::2 gate, 1::2 up), `gate_up_proj_bias`
[E, 2F] likewise, `down_proj` [E, F, H], `down_proj_bias` [E, H]. Ours per expert:
linear_fc1.weight [2F, H] = [gate; up], linear_fc2.weight [H, F]. The published checkpoints
keep gate_up_proj / down_proj in MXFP4 (`*_blocks` + `*_scales`, see `mxfp4`): `from_hf`
dequantizes them on read.
"""
from __future__ import annotations

from typing import Mapping

import torch

from megatron_smp.config import ConfigError, TransformerConfig
from megatron_smp.models.hf import llama
from megatron_smp.models.hf.common import (
    StateDict, rope_fields_from_hf, shape_fields_from_hf, windows_from_hf, windows_to_hf,
)
from megatron_smp.models.hf.mixtral import check_moe_config
from megatron_smp.models.hf.mxfp4 import dequantize_state_dict

HF_ARCHITECTURES = ("GptOssForCausalLM",)
MODEL_TYPES = ("gpt_oss",)
# transformers 5.x's GptOssModel builds its masks without position_ids, so under sdpa / eager
# restarting position ids do not separate packed documents (flash attention's cu_seq_lens do):
# transform decides padding-free batches the same way (smp.hf_contract.packed_document_ids).
# Families without this attribute read documents from position ids, as HF's masks do.
HF_MASKS_READ_POSITION_IDS = False

SINKS = ("self_attention.core_attention.softmax_offset", "self_attn.sinks")
# The sigmoid gain of gpt-oss's GLU; Megatron's quick_gelu has it built in.
QUICK_GELU_ALPHA = 1.702


def config_from_hf(hf_config) -> TransformerConfig:
    alpha = float(getattr(hf_config, "swiglu_alpha", QUICK_GELU_ALPHA))
    if alpha != QUICK_GELU_ALPHA:
        raise ConfigError(f"gpt-oss swiglu_alpha {alpha}: only {QUICK_GELU_ALPHA} (Megatron's "
                          "quick_gelu, as published) is supported")
    if not getattr(hf_config, "attention_bias", True):
        raise ConfigError("gpt-oss attention_bias=False is not supported: the experts and the "
                          "router have biases, and so do the attention projections here "
                          "(add_bias_linear)")
    window_size, skip_freq = windows_from_hf(hf_config, "gpt-oss")
    return TransformerConfig(
        **shape_fields_from_hf(hf_config),
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        activation="quick_gelu",
        gated_linear_unit=True,
        glu_linear_offset=1.0,
        activation_func_clamp_value=float(hf_config.swiglu_limit),
        softmax_type="learnable",
        window_size=window_size,
        window_attn_skip_freq=skip_freq,
        add_bias_linear=True,
        untie_embeddings_and_output_weights=not getattr(hf_config, "tie_word_embeddings", False),
        hidden_dropout=0.0,
        attention_dropout=float(getattr(hf_config, "attention_dropout", 0.0)),
        init_method_std=hf_config.initializer_range,
        use_scaled_init_method=False,
        num_moe_experts=hf_config.num_local_experts,
        moe_router_topk=hf_config.num_experts_per_tok,
        moe_ffn_hidden_size=hf_config.intermediate_size,
        moe_aux_loss_coeff=float(getattr(hf_config, "router_aux_loss_coef", 0.0)),
        **rope_fields_from_hf(hf_config),
    )


def config_to_hf(config: TransformerConfig):
    from transformers import GptOssConfig

    check_moe_config(config, "gpt-oss")
    problems = []
    if not (config.gated_linear_unit and config.activation == "quick_gelu"
            and config.glu_linear_offset == 1.0 and config.activation_func_clamp_value):
        problems.append("the experts' GLU is --quick-geglu --glu-linear-offset 1 "
                        "--activation-func-clamp-value LIMIT")
    if config.softmax_type != "learnable":
        problems.append("attention sinks (--softmax-type learnable)")
    if not config.add_bias_linear or config.normalization != "RMSNorm":
        problems.append("biases (no --disable-bias-linear) and RMSNorm")
    if (config.moe_shared_expert_intermediate_size is not None or config.moe_router_pre_softmax
            or config.moe_layer_pattern() != [1] * config.num_layers
            or config.moe_ffn_hidden_size != config.ffn_hidden_size
            or config.moe_input_jitter_eps or config.rotary_percent != 1.0):
        problems.append("experts in every layer (--moe-layer-freq 1) with --moe-ffn-hidden-size "
                        "= --ffn-hidden-size, softmax after top-k, no shared experts, no jitter, "
                        "full RoPE")
    if problems:
        raise ConfigError("this config is not a gpt-oss model: it needs " + "; ".join(problems))
    kwargs = llama.hf_config_kwargs(config)
    kwargs.update(
        num_local_experts=config.num_moe_experts,
        num_experts_per_tok=config.moe_router_topk,
        router_aux_loss_coef=config.moe_aux_loss_coeff,
        swiglu_limit=config.activation_func_clamp_value,
        **windows_to_hf(config),
        attention_bias=True,
    )
    return GptOssConfig(**kwargs)


def _experts_from_hf(sd: Mapping[str, torch.Tensor], hf: str, ours: str,
                     num_experts: int) -> StateDict:
    gate_up, down = sd[hf + "experts.gate_up_proj"], sd[hf + "experts.down_proj"]
    if gate_up.shape[0] != num_experts:
        raise ConfigError(
            f"{hf}experts.gate_up_proj holds {gate_up.shape[0]} experts, the config {num_experts}"
        )
    gate_up_bias = sd[hf + "experts.gate_up_proj_bias"]
    out = {ours + "router.weight": sd[hf + "router.weight"].clone(),
           ours + "router.bias": sd[hf + "router.bias"].clone()}
    for index in range(num_experts):
        expert = f"{ours}experts.local_experts.{index}."
        columns = gate_up[index]  # [H, 2F], gate and up interleaved
        out[expert + "linear_fc1.weight"] = torch.cat([columns[:, 0::2].t(),
                                                       columns[:, 1::2].t()]).contiguous()
        bias = gate_up_bias[index]
        out[expert + "linear_fc1.bias"] = torch.cat([bias[0::2], bias[1::2]])
        out[expert + "linear_fc2.weight"] = down[index].t().contiguous()
        out[expert + "linear_fc2.bias"] = sd[hf + "experts.down_proj_bias"][index].clone()
    return out


def _experts_to_hf(state_dict: Mapping[str, torch.Tensor], hf: str, ours: str,
                   num_experts: int) -> StateDict:
    fc1, fc1_bias, fc2, fc2_bias = [], [], [], []
    for index in range(num_experts):
        expert = f"{ours}experts.local_experts.{index}."
        gate, up = state_dict[expert + "linear_fc1.weight"].chunk(2)
        fc1.append(torch.stack([gate.t(), up.t()], dim=-1).flatten(-2))  # interleave columns
        gate_bias, up_bias = state_dict[expert + "linear_fc1.bias"].chunk(2)
        fc1_bias.append(torch.stack([gate_bias, up_bias], dim=-1).flatten(-2))
        fc2.append(state_dict[expert + "linear_fc2.weight"].t())
        fc2_bias.append(state_dict[expert + "linear_fc2.bias"])
    return {
        hf + "router.weight": state_dict[ours + "router.weight"].clone(),
        hf + "router.bias": state_dict[ours + "router.bias"].clone(),
        hf + "experts.gate_up_proj": torch.stack(fc1).contiguous(),
        hf + "experts.gate_up_proj_bias": torch.stack(fc1_bias),
        hf + "experts.down_proj": torch.stack(fc2).contiguous(),
        hf + "experts.down_proj_bias": torch.stack(fc2_bias),
    }


def from_hf(hf_state_dict: Mapping[str, torch.Tensor], config: TransformerConfig) -> StateDict:
    """HF state dict (MXFP4 experts dequantized to bf16 first) -> full framework state dict."""
    sd = dequantize_state_dict(hf_state_dict)

    def mlp(sd, hf, ours, index):
        out = _experts_from_hf(sd, hf + "mlp.", ours + "mlp.", config.num_moe_experts)
        out[ours + SINKS[0]] = sd[hf + SINKS[1]].clone()
        return out

    return llama.from_hf(sd, config, mlp_from_hf=mlp)


def to_hf(state_dict: Mapping[str, torch.Tensor], config: TransformerConfig) -> StateDict:
    def mlp(sd, hf, ours, index):
        out = _experts_to_hf(sd, hf + "mlp.", ours + "mlp.", config.num_moe_experts)
        out[hf + SINKS[1]] = sd[ours + SINKS[0]].clone()
        return out

    return llama.to_hf(state_dict, config, mlp_to_hf=mlp)
