"""Qwen3MoeForCausalLM <-> GPTModel: Qwen3's attention (per-head query/key RMSNorms, our
--qk-layernorm; `head_dim` independent of hidden / heads; no biases) with MoE layers and no
shared expert (dense layers where `mlp_only_layers` / `decoder_sparse_step` say).

Routing is softmax over all experts then top-k; `norm_topk_prob=True` (the released
checkpoints) renormalises the k weights, which is our default softmax over the chosen
logits, `False` keeps them (`moe_router_pre_softmax`). Experts are fused in HF as in Mixtral
(see `mixtral.experts_from_hf`).
"""
from __future__ import annotations

from typing import Mapping

import torch

from megatron_smp.config import ConfigError, TransformerConfig
from megatron_smp.models.hf import llama
from megatron_smp.models.hf.common import StateDict
from megatron_smp.models.hf.mixtral import check_moe_config, experts_from_hf, experts_to_hf
from megatron_smp.models.hf.qwen2 import check_full_attention
from megatron_smp.models.hf.qwen2_moe import hf_moe_layers

HF_ARCHITECTURES = ("Qwen3MoeForCausalLM",)
MODEL_TYPES = ("qwen3_moe",)


def config_from_hf(hf_config) -> TransformerConfig:
    check_full_attention(hf_config, "Qwen3-MoE")
    pattern = hf_moe_layers(hf_config)
    return llama.config_from_hf(hf_config).replace(
        qk_layernorm=True,
        window_size=None,
        num_moe_experts=hf_config.num_experts,
        moe_router_topk=hf_config.num_experts_per_tok,
        moe_ffn_hidden_size=hf_config.moe_intermediate_size,
        moe_router_pre_softmax=not hf_config.norm_topk_prob,
        moe_aux_loss_coeff=float(getattr(hf_config, "router_aux_loss_coef", 0.0)),
        moe_layer_freq=1 if all(pattern) else pattern,
    )


def config_to_hf(config: TransformerConfig):
    from transformers import Qwen3MoeConfig

    check_moe_config(config, "Qwen3-MoE")
    if (not config.qk_layernorm or config.moe_shared_expert_intermediate_size is not None
            or config.moe_input_jitter_eps or config.window_size is not None
            or config.add_qkv_bias or config.add_bias_linear):
        raise ConfigError(
            "this config is not a Qwen3-MoE: it needs query/key norms (--qk-layernorm), no "
            "shared expert, no input jitter, no sliding window and no biases"
        )
    pattern = config.moe_layer_pattern()
    return Qwen3MoeConfig(
        attention_bias=False,
        num_experts=config.num_moe_experts,
        num_experts_per_tok=config.moe_router_topk,
        moe_intermediate_size=config.moe_ffn_hidden_size,
        norm_topk_prob=not config.moe_router_pre_softmax,
        router_aux_loss_coef=config.moe_aux_loss_coeff,
        decoder_sparse_step=1,
        mlp_only_layers=[index for index, moe in enumerate(pattern) if not moe],
        use_sliding_window=False,
        **llama.hf_config_kwargs(config),
    )


def from_hf(hf_state_dict: Mapping[str, torch.Tensor], config: TransformerConfig) -> StateDict:
    pattern = config.moe_layer_pattern()

    def mlp(sd, hf, ours, index):
        if not pattern[index]:
            return llama.gated_mlp_from_hf(sd, hf + "mlp.", ours + "mlp.")
        return experts_from_hf(sd, hf + "mlp.", ours + "mlp.", config.num_moe_experts)

    return llama.from_hf(hf_state_dict, config, mlp_from_hf=mlp)


def to_hf(state_dict: Mapping[str, torch.Tensor], config: TransformerConfig) -> StateDict:
    pattern = config.moe_layer_pattern()

    def mlp(sd, hf, ours, index):
        if not pattern[index]:
            return llama.gated_mlp_to_hf(sd, hf + "mlp.", ours + "mlp.")
        return experts_to_hf(sd, hf + "mlp.", ours + "mlp.", config.num_moe_experts)

    return llama.to_hf(state_dict, config, mlp_to_hf=mlp, family="qwen3_moe")
