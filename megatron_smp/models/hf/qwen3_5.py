"""Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM (the Qwen3.5 language models) <-> GPTModel.

The Qwen3-Next stack (see `qwen3_next`): Gated DeltaNet and gated full attention 3:1, partial
RoPE, zero-centred norms; the dense model has SwiGLU MLPs, the MoE model a Qwen-MoE block
(softmax top-k, renormalised, and a sigmoid-gated shared expert) on every layer. Its Gated
DeltaNet keeps the projections whole (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`).
Text positions only: for text, Qwen3.5's multimodal RoPE sections all see the same position,
which is plain (partial) RoPE.
"""
from __future__ import annotations

from typing import Mapping

import torch

from megatron_smp.config import TransformerConfig
from megatron_smp.models.hf import qwen3_next
from megatron_smp.models.hf.common import StateDict

HF_ARCHITECTURES = ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM")
MODEL_TYPES = ("qwen3_5_text", "qwen3_5_moe_text")


def config_from_hf(hf_config) -> TransformerConfig:
    moe = getattr(hf_config, "model_type", None) == "qwen3_5_moe_text"
    layers = [int(moe)] * hf_config.num_hidden_layers
    return qwen3_next.config_from_hf(hf_config, moe_layers=layers)


def config_to_hf(config: TransformerConfig):
    from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig

    qwen3_next.check_config(config, "Qwen3.5")
    kwargs = qwen3_next.hf_config_kwargs(config)
    if config.num_moe_experts is None:
        return Qwen3_5TextConfig(**kwargs)
    from megatron_smp.config import ConfigError

    if config.moe_router_pre_softmax or not all(config.moe_layer_pattern()):
        raise ConfigError("this config is not a Qwen3.5-MoE: it has an MoE block on every layer "
                          "with renormalised top-k weights (no --moe-router-pre-softmax)")
    kwargs.pop("intermediate_size")
    return Qwen3_5MoeTextConfig(**kwargs)


def from_hf(hf_state_dict: Mapping[str, torch.Tensor], config: TransformerConfig) -> StateDict:
    return qwen3_next.from_hf(hf_state_dict, config, split_projections=True)


def to_hf(state_dict: Mapping[str, torch.Tensor], config: TransformerConfig) -> StateDict:
    return qwen3_next.to_hf(state_dict, config, split_projections=True)
