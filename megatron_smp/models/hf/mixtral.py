"""MixtralForCausalLM <-> GPTModel with an MoE layer in every layer (Llama's attention).

transformers 5 stores a layer's experts fused: `mlp.experts.gate_up_proj` [E, 2F, H] (rows
[gate; up], our fc1 layout) and `mlp.experts.down_proj` [E, H, F]; the router is
`mlp.gate.weight` [E, H]. Ours are per expert, `mlp.experts.local_experts.{e}.linear_fc1 /
linear_fc2` (global index e in a full state dict), and `mlp.router.weight`.

Mixtral's routing (softmax over all experts, top-k, renormalised) is our default softmax over
the k chosen logits; `router_jitter_noise` is `moe_input_jitter_eps`, `router_aux_loss_coef`
is `moe_aux_loss_coeff` (our loss uses Megatron's normalisation, which is HF's per-layer
`load_balancing_loss_func` divided by top-k).
"""
from __future__ import annotations

from typing import Mapping

import torch

from megatron_smp.config import ConfigError, TransformerConfig
from megatron_smp.models.hf import llama
from megatron_smp.models.hf.common import StateDict

HF_ARCHITECTURES = ("MixtralForCausalLM",)
MODEL_TYPES = ("mixtral",)


def experts_from_hf(sd: Mapping[str, torch.Tensor], hf: str, ours: str,
                    num_experts: int, fc1: str = "gate_up_proj") -> StateDict:
    """HF `{hf}gate.weight`, `{hf}experts.gate_up_proj / down_proj` -> our router and experts
    under `ours` (e.g. "decoder.layers.0.mlp."); `fc1` names HF's first expert projection
    (Nemotron-H's ungated experts: "up_proj")."""
    gate_up, down = sd[hf + "experts." + fc1], sd[hf + "experts.down_proj"]
    if gate_up.shape[0] != num_experts:
        raise ConfigError(
            f"{hf}experts.{fc1} holds {gate_up.shape[0]} experts, the config {num_experts}"
        )
    out = {ours + "router.weight": sd[hf + "gate.weight"].clone()}
    for index in range(num_experts):
        expert = f"{ours}experts.local_experts.{index}."
        out[expert + "linear_fc1.weight"] = gate_up[index].clone()
        out[expert + "linear_fc2.weight"] = down[index].clone()
    return out


def experts_to_hf(state_dict: Mapping[str, torch.Tensor], hf: str, ours: str,
                  num_experts: int, fc1: str = "gate_up_proj") -> StateDict:
    experts = [f"{ours}experts.local_experts.{index}." for index in range(num_experts)]
    return {
        hf + "gate.weight": state_dict[ours + "router.weight"].clone(),
        hf + "experts." + fc1: torch.stack(
            [state_dict[e + "linear_fc1.weight"] for e in experts]),
        hf + "experts.down_proj": torch.stack(
            [state_dict[e + "linear_fc2.weight"] for e in experts]),
    }


def config_from_hf(hf_config) -> TransformerConfig:
    return llama.config_from_hf(hf_config).replace(
        num_moe_experts=hf_config.num_local_experts,
        moe_router_topk=hf_config.num_experts_per_tok,
        moe_ffn_hidden_size=hf_config.intermediate_size,
        moe_aux_loss_coeff=float(getattr(hf_config, "router_aux_loss_coef", 0.0)),
        moe_input_jitter_eps=getattr(hf_config, "router_jitter_noise", 0.0) or None,
    )


def check_moe_config(config: TransformerConfig, family: str) -> None:
    """What every MoE family's HF config can express: top-k routing with the auxiliary loss,
    dropless, no z-loss (training-only settings beyond these have no HF field)."""
    problems = []
    if config.num_moe_experts is None:
        problems.append("it has no experts (--num-experts)")
    if config.moe_router_load_balancing_type != "aux_loss":
        problems.append(f"load balancing {config.moe_router_load_balancing_type!r} (aux_loss)")
    if config.moe_expert_capacity_factor is not None:
        problems.append("a capacity factor (dropless)")
    if config.moe_z_loss_coeff is not None:
        problems.append("a z-loss")
    if problems:
        raise ConfigError(f"this config is not a {family} model: " + "; ".join(problems))


def config_to_hf(config: TransformerConfig):
    from transformers import MixtralConfig

    check_moe_config(config, "Mixtral")
    if (config.moe_shared_expert_intermediate_size is not None or config.moe_router_pre_softmax
            or config.moe_layer_pattern() != [1] * config.num_layers
            or config.add_qkv_bias or config.moe_ffn_hidden_size != config.ffn_hidden_size):
        raise ConfigError(
            "this config is not a Mixtral: Mixtral has experts in every layer "
            "(--moe-layer-freq 1), no shared experts, softmax after top-k, no qkv bias and "
            "--moe-ffn-hidden-size equal to --ffn-hidden-size"
        )
    kwargs = llama.hf_config_kwargs(config)
    left = config.window_size[0] if config.window_size is not None else -1
    return MixtralConfig(
        num_local_experts=config.num_moe_experts,
        num_experts_per_tok=config.moe_router_topk,
        router_jitter_noise=config.moe_input_jitter_eps or 0.0,
        router_aux_loss_coef=config.moe_aux_loss_coeff,
        sliding_window=left + 1 if left >= 0 else None,
        **kwargs,
    )


def _mlp_from_hf(config):
    def convert(sd, hf, ours, index):
        return experts_from_hf(sd, hf + "mlp.", ours + "mlp.", config.num_moe_experts)
    return convert


def _mlp_to_hf(config):
    def convert(state_dict, hf, ours, index):
        return experts_to_hf(state_dict, hf + "mlp.", ours + "mlp.", config.num_moe_experts)
    return convert


def from_hf(hf_state_dict: Mapping[str, torch.Tensor], config: TransformerConfig) -> StateDict:
    return llama.from_hf(hf_state_dict, config, mlp_from_hf=_mlp_from_hf(config))


def to_hf(state_dict: Mapping[str, torch.Tensor], config: TransformerConfig) -> StateDict:
    return llama.to_hf(state_dict, config, mlp_to_hf=_mlp_to_hf(config))
