"""Qwen2ForCausalLM (Qwen2 / Qwen2.5) <-> GPTModel: Llama's layout with biases on q, k and v
only (our --add-qkv-bias with --disable-bias-linear), a tied or untied head, and any RoPE the
config asks for (Qwen2.5's long-context configs use YaRN).

transformers 5 turns `use_sliding_window=True` into sliding windows on the layers from
`max_window_layers` on (`layer_types`); every released Qwen2/2.5 checkpoint has it off, and
per-layer windows are not modelled here, so it is a clear error.
"""
from __future__ import annotations

from typing import Mapping

import torch

from megatron_smp.config import ConfigError, TransformerConfig
from megatron_smp.models.hf import llama
from megatron_smp.models.hf.common import StateDict

HF_ARCHITECTURES = ("Qwen2ForCausalLM",)
MODEL_TYPES = ("qwen2",)


def check_full_attention(hf_config, family: str) -> None:
    """Qwen's sliding windows cover only some layers (`layer_types`): refused."""
    layer_types = set(getattr(hf_config, "layer_types", None) or ["full_attention"])
    if getattr(hf_config, "use_sliding_window", False) or layer_types != {"full_attention"}:
        raise ConfigError(f"{family} use_sliding_window=True (sliding windows on the layers "
                          "from max_window_layers on) is not supported; set it False (every "
                          "released checkpoint has it off)")


def config_from_hf(hf_config) -> TransformerConfig:
    check_full_attention(hf_config, "Qwen2")
    return llama.config_from_hf(hf_config).replace(add_qkv_bias=True, window_size=None)


def config_to_hf(config: TransformerConfig):
    from transformers import Qwen2Config

    if not (config.gated_linear_unit and config.activation == "silu"
            and config.normalization == "RMSNorm" and config.uses_rotary_embedding()
            and config.rotary_percent == 1.0 and not config.add_bias_linear
            and config.add_qkv_bias and config.num_moe_experts is None
            and not config.qk_layernorm and config.window_size is None):
        raise ConfigError(
            "this config is not a Qwen2 (SwiGLU, RMSNorm, full RoPE, q/k/v biases only "
            "(--add-qkv-bias --disable-bias-linear), no query/key norms, no experts, no "
            "sliding window)"
        )
    return Qwen2Config(use_sliding_window=False, **llama.hf_config_kwargs(config))


def from_hf(hf_state_dict: Mapping[str, torch.Tensor], config: TransformerConfig) -> StateDict:
    return llama.from_hf(hf_state_dict, config)


def to_hf(state_dict: Mapping[str, torch.Tensor], config: TransformerConfig) -> StateDict:
    return llama.to_hf(state_dict, config, family="qwen2")
