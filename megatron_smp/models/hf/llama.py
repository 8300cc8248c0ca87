"""LlamaForCausalLM / MistralForCausalLM <-> GPTModel (RoPE, RMSNorm, SwiGLU, GQA, no biases).

HF keeps q/k/v and gate/up as separate linears; ours are fused: qkv per query group
(`pack_qkv`) and fc1 = [gate; up] (split over TP with stride 2). HF's q/k rows are already
in the "rotate half" order our RoPE uses, so no permutation is needed.

Mistral's `sliding_window` W maps onto `TransformerConfig.window_size` = (W - 1, 0): query i
attends to keys i - W + 1 .. i, as in Hugging Face's sliding-window mask.
"""
from __future__ import annotations

from typing import Mapping

import torch

from megatron_smp.config import ConfigError, TransformerConfig
from megatron_smp.models.hf.common import (
    FINAL_NORM,
    OUTPUT_LAYER,
    WORD_EMBEDDINGS,
    StateDict,
    layer_prefix,
    pack_qkv,
    pad_vocab,
    rope_parameters,
    unpack_qkv,
    unpad_vocab,
)

HF_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")
MODEL_TYPES = ("llama", "mistral")


def config_from_hf(hf_config) -> TransformerConfig:
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise ConfigError(f"Llama hidden_act {hf_config.hidden_act!r} is not supported (silu)")
    if getattr(hf_config, "attention_bias", False) or getattr(hf_config, "mlp_bias", False):
        raise ConfigError("Llama attention_bias / mlp_bias are not supported; set them False")
    rope = rope_parameters(hf_config)
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    sliding_window = getattr(hf_config, "sliding_window", None)
    return TransformerConfig(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        num_attention_heads=heads,
        num_query_groups=getattr(hf_config, "num_key_value_heads", None) or heads,
        kv_channels=head_dim,
        vocab_size=hf_config.vocab_size,
        max_position_embeddings=hf_config.max_position_embeddings,
        ffn_hidden_size=hf_config.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        activation="silu",
        gated_linear_unit=True,
        position_embedding_type="rope",
        rotary_base=float(rope["rope_theta"]),
        window_size=None if sliding_window is None else (sliding_window - 1, 0),
        add_bias_linear=False,
        untie_embeddings_and_output_weights=not getattr(hf_config, "tie_word_embeddings", False),
        hidden_dropout=0.0,
        attention_dropout=getattr(hf_config, "attention_dropout", 0.0),
        init_method_std=hf_config.initializer_range,
        use_scaled_init_method=False,
    )


def config_to_hf(config: TransformerConfig, family: str = "llama"):
    from transformers import LlamaConfig, MistralConfig

    if not (config.gated_linear_unit and config.activation == "silu"
            and config.normalization == "RMSNorm" and config.position_embedding_type == "rope"
            and config.rotary_percent == 1.0 and not config.add_bias_linear
            and not config.add_qkv_bias):
        raise ConfigError(
            "this config is not a Llama/Mistral (SwiGLU, RMSNorm, full RoPE, no biases)"
        )
    kwargs = dict(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.ffn_hidden_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_query_groups,
        head_dim=config.kv_channels,
        max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.layernorm_epsilon,
        initializer_range=config.init_method_std,
        tie_word_embeddings=not config.untie_embeddings_and_output_weights,
        attention_dropout=config.attention_dropout,
        rope_parameters={"rope_type": "default", "rope_theta": config.rotary_base},
        bos_token_id=min(1, config.vocab_size - 1),
        eos_token_id=min(2, config.vocab_size - 1),
    )
    left = config.window_size[0] if config.window_size is not None else -1
    if family == "mistral":
        return MistralConfig(sliding_window=left + 1 if left >= 0 else None, **kwargs)
    if left >= 0:
        raise ConfigError(
            f"window_size {config.window_size}: Llama has no sliding-window attention; "
            "this is a Mistral model"
        )
    return LlamaConfig(**kwargs)


def from_hf(hf_state_dict: Mapping[str, torch.Tensor], config: TransformerConfig) -> StateDict:
    sd = hf_state_dict
    out: StateDict = {WORD_EMBEDDINGS: pad_vocab(sd["model.embed_tokens.weight"], config)}
    for i in range(config.num_layers):
        hf, ours = f"model.layers.{i}.", layer_prefix(i)
        out[ours + "input_layernorm.weight"] = sd[hf + "input_layernorm.weight"].clone()
        out[ours + "self_attention.linear_qkv.weight"] = pack_qkv(
            sd[hf + "self_attn.q_proj.weight"],
            sd[hf + "self_attn.k_proj.weight"],
            sd[hf + "self_attn.v_proj.weight"],
            config,
        )
        out[ours + "self_attention.linear_proj.weight"] = sd[hf + "self_attn.o_proj.weight"].clone()
        out[ours + "pre_mlp_layernorm.weight"] = sd[hf + "post_attention_layernorm.weight"].clone()
        out[ours + "mlp.linear_fc1.weight"] = torch.cat(
            [sd[hf + "mlp.gate_proj.weight"], sd[hf + "mlp.up_proj.weight"]], dim=0
        )
        out[ours + "mlp.linear_fc2.weight"] = sd[hf + "mlp.down_proj.weight"].clone()
    out[FINAL_NORM + ".weight"] = sd["model.norm.weight"].clone()
    if config.untie_embeddings_and_output_weights:
        out[OUTPUT_LAYER] = pad_vocab(sd["lm_head.weight"], config)
    return out


def to_hf(state_dict: Mapping[str, torch.Tensor], config: TransformerConfig) -> StateDict:
    out: StateDict = {"model.embed_tokens.weight": unpad_vocab(state_dict[WORD_EMBEDDINGS], config)}
    for i in range(config.num_layers):
        hf, ours = f"model.layers.{i}.", layer_prefix(i)
        q, k, v = unpack_qkv(state_dict[ours + "self_attention.linear_qkv.weight"], config)
        out[hf + "self_attn.q_proj.weight"] = q
        out[hf + "self_attn.k_proj.weight"] = k
        out[hf + "self_attn.v_proj.weight"] = v
        out[hf + "self_attn.o_proj.weight"] = (
            state_dict[ours + "self_attention.linear_proj.weight"].clone()
        )
        gate, up = state_dict[ours + "mlp.linear_fc1.weight"].chunk(2, dim=0)
        out[hf + "mlp.gate_proj.weight"] = gate.clone()
        out[hf + "mlp.up_proj.weight"] = up.clone()
        out[hf + "mlp.down_proj.weight"] = state_dict[ours + "mlp.linear_fc2.weight"].clone()
        out[hf + "input_layernorm.weight"] = state_dict[ours + "input_layernorm.weight"].clone()
        out[hf + "post_attention_layernorm.weight"] = (
            state_dict[ours + "pre_mlp_layernorm.weight"].clone()
        )
    out["model.norm.weight"] = state_dict[FINAL_NORM + ".weight"].clone()
    head = OUTPUT_LAYER if config.untie_embeddings_and_output_weights else WORD_EMBEDDINGS
    out["lm_head.weight"] = unpad_vocab(state_dict[head], config)
    return out
