"""Qwen2ForCausalLM (Qwen2 / Qwen2.5) <-> GPTModel: Llama's layout with biases on q, k and v
only (our --add-qkv-bias with --disable-bias-linear), a tied or untied head, and any RoPE the
config asks for (Qwen2.5's long-context configs use YaRN).

transformers 5 turns `use_sliding_window=True` into sliding windows on the layers from
`max_window_layers` on (`layer_types`): --window-size (W - 1, 0) on the layers
--window-attn-skip-freq selects (every released Qwen2/2.5 checkpoint has it off).
"""
from __future__ import annotations

from typing import Mapping

import torch

from megatron_smp.config import ConfigError, TransformerConfig
from megatron_smp.models.hf import llama
from megatron_smp.models.hf.common import StateDict, windows_from_hf, windows_to_hf

HF_ARCHITECTURES = ("Qwen2ForCausalLM",)
MODEL_TYPES = ("qwen2",)


def config_from_hf(hf_config) -> TransformerConfig:
    window_size, skip_freq = windows_from_hf(hf_config, "Qwen2")
    return llama.config_from_hf(hf_config).replace(
        add_qkv_bias=True, window_size=window_size, window_attn_skip_freq=skip_freq)


def config_to_hf(config: TransformerConfig):
    from transformers import Qwen2Config

    if not (config.gated_linear_unit and config.activation == "silu"
            and config.normalization == "RMSNorm" and config.uses_rotary_embedding()
            and config.rotary_percent == 1.0 and not config.add_bias_linear
            and config.add_qkv_bias and config.num_moe_experts is None
            and not config.qk_layernorm):
        raise ConfigError(
            "this config is not a Qwen2 (SwiGLU, RMSNorm, full RoPE, q/k/v biases only "
            "(--add-qkv-bias --disable-bias-linear), no query/key norms, no experts)"
        )
    windows = windows_to_hf(config)
    sliding = [kind == "sliding_attention" for kind in windows["layer_types"]]
    kwargs = llama.hf_config_kwargs(config)
    kwargs.pop("sliding_window", None)
    if any(sliding):
        # Qwen2Config keeps sliding_window only with use_sliding_window; max_window_layers is
        # the number of leading full-attention layers of its own default layout.
        kwargs.update(use_sliding_window=True, max_window_layers=sliding.index(True))
    else:
        kwargs.update(use_sliding_window=False)
    return Qwen2Config(**windows, **kwargs)


def from_hf(hf_state_dict: Mapping[str, torch.Tensor], config: TransformerConfig) -> StateDict:
    return llama.from_hf(hf_state_dict, config)


def to_hf(state_dict: Mapping[str, torch.Tensor], config: TransformerConfig) -> StateDict:
    return llama.to_hf(state_dict, config, family="qwen2")
