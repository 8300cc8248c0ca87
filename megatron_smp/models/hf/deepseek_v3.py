"""DeepseekV3ForCausalLM <-> GPTModel: multi-latent attention, `first_k_dense_replace` dense
layers, then MoE layers of sigmoid-routed experts (expert bias `e_score_correction_bias`,
group-limited top-k, `routed_scaling_factor`) with `n_shared_experts` shared experts.

HF's group score is the sum of each group's 2 best experts; ours (Megatron's) the sum of its
topk / topk_group best, so a grouped config must have topk = 2 x topk_group (DeepSeek-V3's
8 = 2 x 4). HF's RoPE pairing (`rope_interleave`) is our --rotary-interleaved on the positional
channels, so no row permutation is needed. YaRN (`rope_parameters` rope_type yarn) is
Megatron's MLA YaRN: the table scaled by mscale / mscale_all_dim, the scores by
mscale_all_dim's square. HF's model has no multi-token-prediction weights: ours are dropped
on the way out, with a log line, and a converted model starts without them.
"""
from __future__ import annotations

import logging
from typing import Mapping

import torch

from megatron_smp.config import ConfigError, TransformerConfig
from megatron_smp.models.hf import llama
from megatron_smp.models.hf.common import (
    FINAL_NORM,
    OUTPUT_LAYER,
    WORD_EMBEDDINGS,
    StateDict,
    layer_prefix,
    norms_from_hf,
    norms_to_hf,
    pad_vocab,
    rope_parameters,
    unpad_vocab,
)
from megatron_smp.models.hf.mixtral import experts_from_hf, experts_to_hf

logger = logging.getLogger(__name__)

HF_ARCHITECTURES = ("DeepseekV3ForCausalLM",)
MODEL_TYPES = ("deepseek_v3",)

# HF attention name -> ours (under self_attn. / self_attention.).
_ATTENTION = {"q_proj": "linear_q_proj", "q_a_proj": "linear_q_down_proj",
              "q_a_layernorm": "q_layernorm", "q_b_proj": "linear_q_up_proj",
              "kv_a_proj_with_mqa": "linear_kv_down_proj", "kv_a_layernorm": "kv_layernorm",
              "kv_b_proj": "linear_kv_up_proj", "o_proj": "linear_proj"}


def config_from_hf(hf_config) -> TransformerConfig:
    rope = rope_parameters(hf_config)
    if rope.get("rope_type", "default") not in ("default", "yarn"):
        raise ConfigError(f"DeepSeek-V3 rope_type {rope.get('rope_type')!r}: the default RoPE "
                          "and YaRN convert")
    if (rope.get("rope_type") == "yarn" and rope.get("mscale_all_dim")
            and not rope.get("mscale") and rope.get("attention_factor") is None):
        # HF then scales cos/sin by mscale(factor) but the scores by mscale_all_dim's square,
        # a pair Megatron's (mscale, mscale_all_dim) cannot express.
        raise ConfigError("DeepSeek-V3 YaRN with mscale_all_dim but without mscale: give both "
                          "(DeepSeek's configs do)")
    if getattr(hf_config, "attention_bias", False):
        raise ConfigError("DeepSeek-V3 attention_bias=True is not supported")
    topk, groups = hf_config.num_experts_per_tok, hf_config.n_group
    group_topk = hf_config.topk_group
    if groups and groups > 1 and topk != 2 * group_topk:
        raise ConfigError(
            f"DeepSeek-V3 num_experts_per_tok {topk} with topk_group {group_topk}: HF scores a "
            "group by its 2 best experts, Megatron's router by topk/topk_group; they agree only "
            "when num_experts_per_tok = 2 x topk_group")
    if not hf_config.norm_topk_prob and topk > 1:
        raise ConfigError("DeepSeek-V3 norm_topk_prob=False: the sigmoid router renormalises the "
                          "chosen scores (as Megatron's); set it True")
    dense = hf_config.first_k_dense_replace
    pattern = [int(i >= dense) for i in range(hf_config.num_hidden_layers)]
    base = llama.config_from_hf(hf_config)
    return base.replace(
        num_query_groups=hf_config.num_attention_heads,
        kv_channels=hf_config.qk_nope_head_dim + hf_config.qk_rope_head_dim,
        window_size=None,
        multi_latent_attention=True,
        qk_layernorm=True,  # the latent norms (Megatron's MLA with --qk-layernorm)
        q_lora_rank=hf_config.q_lora_rank,
        kv_lora_rank=hf_config.kv_lora_rank,
        qk_head_dim=hf_config.qk_nope_head_dim,
        qk_pos_emb_head_dim=hf_config.qk_rope_head_dim,
        v_head_dim=hf_config.v_head_dim,
        rotary_interleaved=bool(getattr(hf_config, "rope_interleave", True)),
        num_moe_experts=hf_config.n_routed_experts,
        moe_router_topk=topk,
        moe_ffn_hidden_size=hf_config.moe_intermediate_size,
        moe_shared_expert_intermediate_size=(
            hf_config.moe_intermediate_size * hf_config.n_shared_experts
            if hf_config.n_shared_experts else None),
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_num_groups=groups if groups and groups > 1 else None,
        moe_router_group_topk=group_topk if groups and groups > 1 else None,
        moe_router_topk_scaling_factor=float(hf_config.routed_scaling_factor),
        moe_router_dtype="fp32",  # HF's gate computes its logits in fp32
        moe_router_load_balancing_type="none",
        moe_layer_freq=1 if all(pattern) else pattern,
    )


def config_to_hf(config: TransformerConfig):
    from transformers import DeepseekV3Config

    if not (config.multi_latent_attention and config.qk_layernorm
            and config.num_moe_experts is not None
            and config.moe_router_score_function == "sigmoid"
            and config.moe_router_enable_expert_bias):
        raise ConfigError("this config is not a DeepSeek-V3: it needs --multi-latent-attention "
                          "with its latent norms (--qk-layernorm) and sigmoid-routed experts "
                          "with --moe-router-enable-expert-bias")
    pattern = config.moe_layer_pattern()
    dense = pattern.index(1) if 1 in pattern else len(pattern)
    if pattern != [0] * dense + [1] * (len(pattern) - dense):
        raise ConfigError(f"MoE layer pattern {pattern}: DeepSeek-V3 has dense layers first, "
                          "then only MoE layers (first_k_dense_replace)")
    shared = config.moe_shared_expert_intermediate_size or 0
    if shared % config.moe_ffn_hidden_size:
        raise ConfigError(f"shared expert width {shared} must be a multiple of "
                          f"--moe-ffn-hidden-size ({config.moe_ffn_hidden_size})")
    kwargs = llama.hf_config_kwargs(config)
    for key in ("head_dim", "num_key_value_heads"):
        kwargs.pop(key)
    return DeepseekV3Config(
        num_key_value_heads=config.num_attention_heads,
        q_lora_rank=config.q_lora_rank, kv_lora_rank=config.kv_lora_rank,
        qk_nope_head_dim=config.qk_head_dim, qk_rope_head_dim=config.qk_pos_emb_head_dim,
        v_head_dim=config.v_head_dim, rope_interleave=config.rotary_interleaved,
        n_routed_experts=config.num_moe_experts, num_experts_per_tok=config.moe_router_topk,
        moe_intermediate_size=config.moe_ffn_hidden_size,
        n_shared_experts=shared // config.moe_ffn_hidden_size,
        n_group=config.moe_router_num_groups or 1,
        topk_group=config.moe_router_group_topk or 1,
        routed_scaling_factor=config.moe_router_topk_scaling_factor or 1.0,
        norm_topk_prob=True, first_k_dense_replace=dense, attention_bias=False,
        **kwargs,
    )


def _moe(config: TransformerConfig, index: int) -> bool:
    return bool(config.moe_layer_pattern()[index])


def from_hf(hf_state_dict: Mapping[str, torch.Tensor], config: TransformerConfig) -> StateDict:
    sd = hf_state_dict
    out: StateDict = {WORD_EMBEDDINGS: pad_vocab(sd["model.embed_tokens.weight"], config)}
    for i in range(config.num_layers):
        hf, ours = f"model.layers.{i}.", layer_prefix(i)
        out[ours + "input_layernorm.weight"] = sd[hf + "input_layernorm.weight"].clone()
        out[ours + "pre_mlp_layernorm.weight"] = sd[hf + "post_attention_layernorm.weight"].clone()
        for hf_name, our_name in _ATTENTION.items():
            key = f"{hf}self_attn.{hf_name}.weight"
            if key in sd:
                out[f"{ours}self_attention.{our_name}.weight"] = sd[key].clone()
        if not _moe(config, i):
            out.update(llama.gated_mlp_from_hf(sd, hf + "mlp.", ours + "mlp."))
            continue
        out.update(experts_from_hf(sd, hf + "mlp.", ours + "mlp.", config.num_moe_experts))
        out[ours + "mlp.router.expert_bias"] = sd[hf + "mlp.gate.e_score_correction_bias"].clone()
        if config.moe_shared_expert_intermediate_size:
            out.update(llama.gated_mlp_from_hf(sd, hf + "mlp.shared_experts.",
                                               ours + "mlp.shared_experts."))
    out[FINAL_NORM + ".weight"] = sd["model.norm.weight"].clone()
    if config.untie_embeddings_and_output_weights:
        out[OUTPUT_LAYER] = pad_vocab(sd["lm_head.weight"], config)
    return norms_from_hf(out, config)


def to_hf(state_dict: Mapping[str, torch.Tensor], config: TransformerConfig) -> StateDict:
    mtp = [name for name in state_dict if name.startswith("mtp.")]
    if mtp:
        # HF's DeepseekV3ForCausalLM has no multi-token-prediction module (it ignores
        # DeepSeek's checkpoint layer 61 on load): nothing to write them to.
        logger.warning(
            "DeepSeek-V3 to HF: dropping the %d multi-token-prediction layer(s) (%d tensors, "
            "mtp.layers.*): HF's DeepseekV3ForCausalLM has no MTP weights",
            config.mtp_num_layers or 0, len(mtp))
        state_dict = {k: v for k, v in state_dict.items() if not k.startswith("mtp.")}
    sd = norms_to_hf(state_dict, config, "deepseek_v3")
    out: StateDict = {"model.embed_tokens.weight": unpad_vocab(sd[WORD_EMBEDDINGS], config)}
    for i in range(config.num_layers):
        hf, ours = f"model.layers.{i}.", layer_prefix(i)
        for hf_name, our_name in _ATTENTION.items():
            key = f"{ours}self_attention.{our_name}.weight"
            if key in sd:
                out[f"{hf}self_attn.{hf_name}.weight"] = sd[key].clone()
        if not _moe(config, i):
            out.update(llama.gated_mlp_to_hf(sd, hf + "mlp.", ours + "mlp."))
        else:
            out.update(experts_to_hf(sd, hf + "mlp.", ours + "mlp.", config.num_moe_experts))
            out[hf + "mlp.gate.e_score_correction_bias"] = (
                sd[ours + "mlp.router.expert_bias"].clone())
            if config.moe_shared_expert_intermediate_size:
                out.update(llama.gated_mlp_to_hf(sd, hf + "mlp.shared_experts.",
                                                 ours + "mlp.shared_experts."))
        out[hf + "input_layernorm.weight"] = sd[ours + "input_layernorm.weight"].clone()
        out[hf + "post_attention_layernorm.weight"] = sd[ours + "pre_mlp_layernorm.weight"].clone()
    out["model.norm.weight"] = sd[FINAL_NORM + ".weight"].clone()
    head = OUTPUT_LAYER if config.untie_embeddings_and_output_weights else WORD_EMBEDDINGS
    out["lm_head.weight"] = unpad_vocab(sd[head], config)
    return out
