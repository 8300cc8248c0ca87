"""Qwen2MoeForCausalLM <-> GPTModel: Llama's attention with q/k/v biases, MoE layers with a
gated shared expert (dense layers where `mlp_only_layers` / `decoder_sparse_step` say).

Routing: `norm_topk_prob=False` (Qwen1.5-MoE) is softmax over all experts then top-k without
renormalising (`moe_router_pre_softmax`); `True` renormalises, which is our default softmax
over the chosen logits. The shared expert is `moe_shared_expert_intermediate_size` with
`moe_shared_expert_gate` (sigmoid(x . w) per token). Expert weights are fused in HF as in
Mixtral (see `mixtral.experts_from_hf`).
"""
from __future__ import annotations

from typing import List, Mapping

import torch

from megatron_smp.config import ConfigError, TransformerConfig
from megatron_smp.models.hf import llama
from megatron_smp.models.hf.common import StateDict
from megatron_smp.models.hf.mixtral import check_moe_config, experts_from_hf, experts_to_hf

HF_ARCHITECTURES = ("Qwen2MoeForCausalLM",)
MODEL_TYPES = ("qwen2_moe",)


def hf_moe_layers(hf_config) -> List[int]:
    """1 per MoE layer, 0 per dense one, from `mlp_only_layers` and `decoder_sparse_step`
    (Qwen2-MoE and Qwen3-MoE)."""
    skip = set(getattr(hf_config, "mlp_only_layers", None) or [])
    step = getattr(hf_config, "decoder_sparse_step", 1) or 1
    return [int(index not in skip and (index + 1) % step == 0)
            for index in range(hf_config.num_hidden_layers)]


def config_from_hf(hf_config) -> TransformerConfig:
    if getattr(hf_config, "use_sliding_window", False):
        raise ConfigError("Qwen2-MoE use_sliding_window=True (windows on some layers only) is "
                          "not supported; set it False")
    if not hf_config.shared_expert_intermediate_size:
        raise ConfigError("Qwen2-MoE shared_expert_intermediate_size must be > 0")
    pattern = hf_moe_layers(hf_config)
    return llama.config_from_hf(hf_config).replace(
        add_qkv_bias=bool(getattr(hf_config, "qkv_bias", True)),
        window_size=None,
        num_moe_experts=hf_config.num_experts,
        moe_router_topk=hf_config.num_experts_per_tok,
        moe_ffn_hidden_size=hf_config.moe_intermediate_size,
        moe_router_pre_softmax=not hf_config.norm_topk_prob,
        moe_shared_expert_intermediate_size=hf_config.shared_expert_intermediate_size,
        moe_shared_expert_gate=True,
        moe_aux_loss_coeff=float(getattr(hf_config, "router_aux_loss_coef", 0.0)),
        moe_layer_freq=1 if all(pattern) else pattern,
    )


def config_to_hf(config: TransformerConfig):
    from transformers import Qwen2MoeConfig

    check_moe_config(config, "Qwen2-MoE")
    if (config.moe_shared_expert_intermediate_size is None or not config.moe_shared_expert_gate
            or config.moe_input_jitter_eps or config.window_size is not None):
        raise ConfigError(
            "this config is not a Qwen2-MoE: it needs a gated shared expert "
            "(--moe-shared-expert-intermediate-size, --moe-shared-expert-gate), no input "
            "jitter and no sliding window"
        )
    pattern = config.moe_layer_pattern()
    kwargs = llama.hf_config_kwargs(config)
    return Qwen2MoeConfig(
        qkv_bias=config.add_qkv_bias,
        num_experts=config.num_moe_experts,
        num_experts_per_tok=config.moe_router_topk,
        moe_intermediate_size=config.moe_ffn_hidden_size,
        shared_expert_intermediate_size=config.moe_shared_expert_intermediate_size,
        norm_topk_prob=not config.moe_router_pre_softmax,
        router_aux_loss_coef=config.moe_aux_loss_coeff,
        decoder_sparse_step=1,
        mlp_only_layers=[index for index, moe in enumerate(pattern) if not moe],
        use_sliding_window=False,
        **kwargs,
    )


def _is_moe(config: TransformerConfig, index: int) -> bool:
    return bool(config.moe_layer_pattern()[index])


def shared_expert_moe_from_hf(sd: Mapping[str, torch.Tensor], hf: str, ours: str,
                              num_experts: int) -> StateDict:
    """A Qwen-MoE block under `hf` (router `gate`, fused `experts`, `shared_expert` and its
    sigmoid `shared_expert_gate`) -> our MoE layer's tensors under `ours`."""
    out = experts_from_hf(sd, hf, ours, num_experts)
    out.update(llama.gated_mlp_from_hf(sd, hf + "shared_expert.", ours + "shared_experts."))
    out[ours + "shared_experts.gate_weight"] = sd[hf + "shared_expert_gate.weight"].clone()
    return out


def shared_expert_moe_to_hf(state_dict: Mapping[str, torch.Tensor], hf: str, ours: str,
                            num_experts: int) -> StateDict:
    """Inverse of `shared_expert_moe_from_hf`."""
    out = experts_to_hf(state_dict, hf, ours, num_experts)
    out.update(llama.gated_mlp_to_hf(state_dict, hf + "shared_expert.", ours + "shared_experts."))
    out[hf + "shared_expert_gate.weight"] = state_dict[ours + "shared_experts.gate_weight"].clone()
    return out


def from_hf(hf_state_dict: Mapping[str, torch.Tensor], config: TransformerConfig) -> StateDict:
    def mlp(sd, hf, ours, index):
        if not _is_moe(config, index):
            return llama.gated_mlp_from_hf(sd, hf + "mlp.", ours + "mlp.")
        return shared_expert_moe_from_hf(sd, hf + "mlp.", ours + "mlp.", config.num_moe_experts)

    return llama.from_hf(hf_state_dict, config, mlp_from_hf=mlp)


def to_hf(state_dict: Mapping[str, torch.Tensor], config: TransformerConfig) -> StateDict:
    def mlp(sd, hf, ours, index):
        if not _is_moe(config, index):
            return llama.gated_mlp_to_hf(sd, hf + "mlp.", ours + "mlp.")
        return shared_expert_moe_to_hf(sd, hf + "mlp.", ours + "mlp.", config.num_moe_experts)

    return llama.to_hf(state_dict, config, mlp_to_hf=mlp)
