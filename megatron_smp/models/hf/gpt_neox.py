"""GPTNeoXForCausalLM <-> GPTModel (parallel residual, partial RoPE, LayerNorm, GeLU, biases).

NeoX's fused `query_key_value` rows are per head [q, k, v] -- our per-query-group layout with
one query per group -- so the QKV weight and bias copy over unchanged.
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
    norms_from_hf,
    norms_to_hf,
    pad_vocab,
    rope_fields_from_hf,
    rope_parameters,
    rope_parameters_to_hf,
    unpad_vocab,
)

HF_ARCHITECTURES = ("GPTNeoXForCausalLM",)
MODEL_TYPES = ("gpt_neox",)

_ACTIVATIONS_FROM_HF = {"gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh",
                        "relu2": "squared_relu"}
_ACTIVATIONS_TO_HF = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh",
                      "squared_relu": "relu2"}

# (ours, HF) names inside one layer, copied as they are.
_LAYER_NAMES = (
    ("input_layernorm.weight", "input_layernorm.weight"),
    ("input_layernorm.bias", "input_layernorm.bias"),
    ("pre_mlp_layernorm.weight", "post_attention_layernorm.weight"),
    ("pre_mlp_layernorm.bias", "post_attention_layernorm.bias"),
    ("self_attention.linear_qkv.weight", "attention.query_key_value.weight"),
    ("self_attention.linear_qkv.bias", "attention.query_key_value.bias"),
    ("self_attention.linear_proj.weight", "attention.dense.weight"),
    ("self_attention.linear_proj.bias", "attention.dense.bias"),
    ("mlp.linear_fc1.weight", "mlp.dense_h_to_4h.weight"),
    ("mlp.linear_fc1.bias", "mlp.dense_h_to_4h.bias"),
    ("mlp.linear_fc2.weight", "mlp.dense_4h_to_h.weight"),
    ("mlp.linear_fc2.bias", "mlp.dense_4h_to_h.bias"),
)


def config_from_hf(hf_config) -> TransformerConfig:
    if hf_config.hidden_act not in _ACTIVATIONS_FROM_HF:
        raise ConfigError(
            f"GPT-NeoX hidden_act {hf_config.hidden_act!r} is not supported; use one of "
            f"{sorted(_ACTIVATIONS_FROM_HF)}"
        )
    if not getattr(hf_config, "attention_bias", True):
        raise ConfigError("GPT-NeoX attention_bias=False is not supported")
    rope = rope_parameters(hf_config)
    rotary_percent = rope.get("partial_rotary_factor", getattr(hf_config, "rotary_pct", 1.0))
    return TransformerConfig(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        num_attention_heads=hf_config.num_attention_heads,
        vocab_size=hf_config.vocab_size,
        max_position_embeddings=hf_config.max_position_embeddings,
        ffn_hidden_size=hf_config.intermediate_size,
        normalization="LayerNorm",
        layernorm_epsilon=hf_config.layer_norm_eps,
        activation=_ACTIVATIONS_FROM_HF[hf_config.hidden_act],
        rotary_percent=float(rotary_percent),
        **rope_fields_from_hf(hf_config),
        parallel_residual=hf_config.use_parallel_residual,
        add_bias_linear=True,
        untie_embeddings_and_output_weights=not getattr(hf_config, "tie_word_embeddings", False),
        hidden_dropout=hf_config.hidden_dropout,
        attention_dropout=hf_config.attention_dropout,
        init_method_std=hf_config.initializer_range,
    )


def config_to_hf(config: TransformerConfig):
    from transformers import GPTNeoXConfig

    if config.gated_linear_unit or config.normalization != "LayerNorm" or (
        not config.uses_rotary_embedding()
    ) or config.num_query_groups != config.num_attention_heads or not config.add_bias_linear:
        raise ConfigError("this config is not a GPT-NeoX (LayerNorm, RoPE, MHA, GeLU, biases)")
    if config.activation not in _ACTIVATIONS_TO_HF:
        raise ConfigError(f"GPT-NeoX has no {config.activation!r} activation; it takes "
                          f"{sorted(_ACTIVATIONS_TO_HF)}")
    return GPTNeoXConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_attention_heads,
        intermediate_size=config.ffn_hidden_size,
        hidden_act=_ACTIVATIONS_TO_HF[config.activation],
        max_position_embeddings=config.max_position_embeddings,
        layer_norm_eps=config.layernorm_epsilon,
        use_parallel_residual=config.parallel_residual,
        hidden_dropout=config.hidden_dropout,
        attention_dropout=config.attention_dropout,
        initializer_range=config.init_method_std,
        tie_word_embeddings=not config.untie_embeddings_and_output_weights,
        rope_parameters=dict(rope_parameters_to_hf(config),
                             partial_rotary_factor=config.rotary_percent),
        bos_token_id=0,
        eos_token_id=min(2, config.vocab_size - 1),
    )


def from_hf(hf_state_dict: Mapping[str, torch.Tensor], config: TransformerConfig) -> StateDict:
    sd = hf_state_dict
    out: StateDict = {WORD_EMBEDDINGS: pad_vocab(sd["gpt_neox.embed_in.weight"], config)}
    for i in range(config.num_layers):
        hf, ours = f"gpt_neox.layers.{i}.", layer_prefix(i)
        for our_name, hf_name in _LAYER_NAMES:
            out[ours + our_name] = sd[hf + hf_name].clone()
    out[FINAL_NORM + ".weight"] = sd["gpt_neox.final_layer_norm.weight"].clone()
    out[FINAL_NORM + ".bias"] = sd["gpt_neox.final_layer_norm.bias"].clone()
    if config.untie_embeddings_and_output_weights:
        out[OUTPUT_LAYER] = pad_vocab(sd["lm_head.weight"], config)
    return norms_from_hf(out, config)


def to_hf(state_dict: Mapping[str, torch.Tensor], config: TransformerConfig) -> StateDict:
    state_dict = norms_to_hf(state_dict, config, "gpt_neox")
    out: StateDict = {"gpt_neox.embed_in.weight": unpad_vocab(state_dict[WORD_EMBEDDINGS], config)}
    for i in range(config.num_layers):
        hf, ours = f"gpt_neox.layers.{i}.", layer_prefix(i)
        for our_name, hf_name in _LAYER_NAMES:
            out[hf + hf_name] = state_dict[ours + our_name].clone()
    out["gpt_neox.final_layer_norm.weight"] = state_dict[FINAL_NORM + ".weight"].clone()
    out["gpt_neox.final_layer_norm.bias"] = state_dict[FINAL_NORM + ".bias"].clone()
    head = OUTPUT_LAYER if config.untie_embeddings_and_output_weights else WORD_EMBEDDINGS
    out["lm_head.weight"] = unpad_vocab(state_dict[head], config)
    return out
