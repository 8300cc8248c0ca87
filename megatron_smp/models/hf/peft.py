"""Export of our LoRA adapters as a PEFT adapter directory for the HF Llama family.

    adapter_config.json         {"peft_type": "LORA", "r", "lora_alpha", "target_modules", ...}
    adapter_model.safetensors   base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight ...

Our fused layers map onto HF's separate ones exactly: the adapter of linear_qkv gives
q_proj, k_proj and v_proj the same A and their rows of B (delta W_q = B_q A, ...); the adapter
of the gated linear_fc1 gives gate_proj and up_proj the same A and their halves of B;
linear_proj -> o_proj, linear_fc2 -> down_proj. PEFT then adds (alpha / r) B A x per layer.
"""
from __future__ import annotations

import json
import os
from typing import Dict, Mapping

import torch

from megatron_smp.config import ConfigError, TransformerConfig
from megatron_smp.models.hf.common import layer_prefix, unpack_qkv
from megatron_smp.models.hf.llama import _reorder_heads, _rope_order

_PEFT_PREFIX = "base_model.model.model.layers."
_HF_TARGETS = {
    "linear_qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "linear_proj": ("self_attn.o_proj",),
    "linear_fc1": ("mlp.gate_proj", "mlp.up_proj"),
    "linear_fc2": ("mlp.down_proj",),
}
_OURS = {"linear_qkv": "self_attention.linear_qkv", "linear_proj": "self_attention.linear_proj",
         "linear_fc1": "mlp.linear_fc1", "linear_fc2": "mlp.linear_fc2"}


def lora_to_peft(state_dict: Mapping[str, torch.Tensor], config: TransformerConfig,
                 targets) -> Dict[str, torch.Tensor]:
    """PEFT-named adapter tensors from our full (TP=1, merged) state dict."""
    if config.num_moe_experts or not config.gated_linear_unit:
        raise ConfigError("PEFT export supports the dense Llama family (gated MLP, no MoE)")
    order = _rope_order(config, to_hf=True)
    out: Dict[str, torch.Tensor] = {}
    for i in range(config.num_layers):
        for target in targets:
            ours = layer_prefix(i) + _OURS[target] + ".lora."
            a, b = state_dict[ours + "lora_A"], state_dict[ours + "lora_B"]
            if target == "linear_qkv":
                q, k, v = unpack_qkv(b, config)
                pieces = (_reorder_heads(q, order), _reorder_heads(k, order), v)
            elif target == "linear_fc1":
                pieces = b.chunk(2, dim=0)
            else:
                pieces = (b,)
            for hf, piece in zip(_HF_TARGETS[target], pieces):
                key = f"{_PEFT_PREFIX}{i}.{hf}."
                out[key + "lora_A.weight"] = a.detach().clone().contiguous()
                out[key + "lora_B.weight"] = piece.detach().clone().contiguous()
    return out


def save_peft_adapter(directory: str, state_dict: Mapping[str, torch.Tensor],
                      config: TransformerConfig, rank: int, alpha: float, dropout: float,
                      targets, base_model_name_or_path: str = None) -> None:
    """Write `adapter_config.json` and `adapter_model.safetensors` into `directory`."""
    from safetensors.torch import save_file

    tensors = lora_to_peft(state_dict, config, targets)
    os.makedirs(directory, exist_ok=True)
    save_file(tensors, os.path.join(directory, "adapter_model.safetensors"))
    hf_targets = sorted({name.rsplit(".", 1)[-1] for t in targets for name in _HF_TARGETS[t]})
    adapter_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": int(rank),
        "lora_alpha": float(alpha), "lora_dropout": float(dropout),
        "target_modules": hf_targets, "bias": "none", "fan_in_fan_out": False,
        "use_rslora": False, "inference_mode": True,
        "base_model_name_or_path": base_model_name_or_path,
    }
    with open(os.path.join(directory, "adapter_config.json"), "w") as handle:
        json.dump(adapter_config, handle, indent=2)


__all__ = ["lora_to_peft", "save_peft_adapter"]
