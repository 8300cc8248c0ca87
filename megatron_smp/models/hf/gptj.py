"""GPTJForCausalLM <-> GPTModel.

GPT-J is a parallel-residual decoder whose attention and MLP read one LayerNorm's output
(`parallel_residual_shared_norm`: the layer has no pre_mlp_layernorm), with rotary embeddings
on the first `rotary_dim` channels of each head, rotating channel pairs (2i, 2i + 1)
(`rotary_interleaved`, `rotary_percent = rotary_dim / head_dim`, base 10000). Its q/k/v/out
projections have no bias (`add_attention_bias=False`), its MLP and LM head have one
(`add_output_layer_bias`). HF keeps q, k and v as separate [h, h] matrices; ours is the fused
per-head [q, k, v] (`pack_qkv` with one query per group).
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
    pack_qkv,
    pad_vocab,
    unpack_qkv,
    unpad_vocab,
)

HF_ARCHITECTURES = ("GPTJForCausalLM",)
MODEL_TYPES = ("gptj",)

OUTPUT_LAYER_BIAS = "output_layer.bias"
_ACTIVATIONS_FROM_HF = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
# (ours, HF) names inside one layer, copied as they are.
_LAYER_NAMES = (
    ("input_layernorm.weight", "ln_1.weight"),
    ("input_layernorm.bias", "ln_1.bias"),
    ("self_attention.linear_proj.weight", "attn.out_proj.weight"),
    ("mlp.linear_fc1.weight", "mlp.fc_in.weight"),
    ("mlp.linear_fc1.bias", "mlp.fc_in.bias"),
    ("mlp.linear_fc2.weight", "mlp.fc_out.weight"),
    ("mlp.linear_fc2.bias", "mlp.fc_out.bias"),
)


def config_from_hf(hf_config) -> TransformerConfig:
    if hf_config.activation_function not in _ACTIVATIONS_FROM_HF:
        raise ConfigError(
            f"GPT-J activation_function {hf_config.activation_function!r} is not supported; "
            f"use one of {sorted(_ACTIVATIONS_FROM_HF)}"
        )
    head_dim = hf_config.n_embd // hf_config.n_head
    rotary_dim = hf_config.rotary_dim
    # transformers sizes its sin/cos table by hidden_size when rotary_dim is None, which only
    # fits a one-head model: a real GPT-J always sets it.
    if rotary_dim is None or not 0 < rotary_dim <= head_dim or rotary_dim % 2:
        raise ConfigError(
            f"GPT-J rotary_dim {rotary_dim!r} is not supported: it must be an even number of "
            f"channels in 2..head_dim ({head_dim})"
        )
    rotary_percent = rotary_dim / head_dim
    if int(head_dim * rotary_percent) != rotary_dim:
        raise ConfigError(f"GPT-J rotary_dim {rotary_dim} of head_dim {head_dim} is not exactly "
                          "representable as rotary_percent")
    return TransformerConfig(
        num_layers=hf_config.n_layer,
        hidden_size=hf_config.n_embd,
        num_attention_heads=hf_config.n_head,
        vocab_size=hf_config.vocab_size,
        max_position_embeddings=hf_config.n_positions,
        ffn_hidden_size=hf_config.n_inner or 4 * hf_config.n_embd,
        normalization="LayerNorm",
        layernorm_epsilon=hf_config.layer_norm_epsilon,
        activation=_ACTIVATIONS_FROM_HF[hf_config.activation_function],
        position_embedding_type="rope",
        rotary_base=10000.0,
        rotary_percent=rotary_percent,
        rotary_interleaved=True,
        parallel_residual=True,
        parallel_residual_shared_norm=True,
        add_bias_linear=True,
        add_attention_bias=False,
        add_output_layer_bias=True,
        untie_embeddings_and_output_weights=not getattr(hf_config, "tie_word_embeddings", False),
        hidden_dropout=hf_config.resid_pdrop,
        attention_dropout=hf_config.attn_pdrop,
        init_method_std=hf_config.initializer_range,
    )


def config_to_hf(config: TransformerConfig):
    from transformers import GPTJConfig

    if not (config.parallel_residual and config.parallel_residual_shared_norm
            and config.rotary_interleaved and config.position_embedding_type == "rope"
            and config.normalization == "LayerNorm" and config.add_bias_linear
            and not config.add_attention_bias and config.add_output_layer_bias
            and not config.gated_linear_unit and config.rotary_base == 10000.0
            and config.num_query_groups == config.num_attention_heads):
        raise ConfigError(
            "this config is not a GPT-J (parallel attention + MLP on one LayerNorm, interleaved "
            "RoPE of base 10000, MHA, biased MLP and LM head, unbiased attention)"
        )
    if config.activation not in ("gelu", "gelu_tanh"):
        raise ConfigError(f"GPT-J has no {config.activation!r} activation; it takes gelu, "
                          "gelu_tanh")
    special = min(50256, config.vocab_size - 1)  # GPT-J's eos id, kept inside small vocabs
    return GPTJConfig(
        vocab_size=config.vocab_size,
        n_positions=config.max_position_embeddings,
        n_embd=config.hidden_size,
        n_layer=config.num_layers,
        n_head=config.num_attention_heads,
        rotary_dim=int(config.kv_channels * config.rotary_percent),
        n_inner=config.ffn_hidden_size,
        activation_function="gelu_new" if config.activation == "gelu_tanh" else "gelu",
        resid_pdrop=config.hidden_dropout,
        embd_pdrop=config.hidden_dropout,
        attn_pdrop=config.attention_dropout,
        layer_norm_epsilon=config.layernorm_epsilon,
        initializer_range=config.init_method_std,
        tie_word_embeddings=not config.untie_embeddings_and_output_weights,
        bos_token_id=special,
        eos_token_id=special,
    )


def from_hf(hf_state_dict: Mapping[str, torch.Tensor], config: TransformerConfig) -> StateDict:
    sd = {k.removeprefix("transformer."): v for k, v in hf_state_dict.items()}
    out: StateDict = {WORD_EMBEDDINGS: pad_vocab(sd["wte.weight"], config)}
    for i in range(config.num_layers):
        hf, ours = f"h.{i}.", layer_prefix(i)
        for our_name, hf_name in _LAYER_NAMES:
            out[ours + our_name] = sd[hf + hf_name].clone()
        out[ours + "self_attention.linear_qkv.weight"] = pack_qkv(
            sd[hf + "attn.q_proj.weight"], sd[hf + "attn.k_proj.weight"],
            sd[hf + "attn.v_proj.weight"], config)
    out[FINAL_NORM + ".weight"] = sd["ln_f.weight"].clone()
    out[FINAL_NORM + ".bias"] = sd["ln_f.bias"].clone()
    if config.untie_embeddings_and_output_weights:
        out[OUTPUT_LAYER] = pad_vocab(sd["lm_head.weight"], config)
    out[OUTPUT_LAYER_BIAS] = pad_vocab(sd["lm_head.bias"], config)
    return norms_from_hf(out, config)


def to_hf(state_dict: Mapping[str, torch.Tensor], config: TransformerConfig) -> StateDict:
    state_dict = norms_to_hf(state_dict, config, "gptj")
    out: StateDict = {"transformer.wte.weight": unpad_vocab(state_dict[WORD_EMBEDDINGS], config)}
    for i in range(config.num_layers):
        hf, ours = f"transformer.h.{i}.", layer_prefix(i)
        for our_name, hf_name in _LAYER_NAMES:
            out[hf + hf_name] = state_dict[ours + our_name].clone()
        q, k, v = unpack_qkv(state_dict[ours + "self_attention.linear_qkv.weight"], config)
        out[hf + "attn.q_proj.weight"], out[hf + "attn.k_proj.weight"] = q, k
        out[hf + "attn.v_proj.weight"] = v
    out["transformer.ln_f.weight"] = state_dict[FINAL_NORM + ".weight"].clone()
    out["transformer.ln_f.bias"] = state_dict[FINAL_NORM + ".bias"].clone()
    head = OUTPUT_LAYER if config.untie_embeddings_and_output_weights else WORD_EMBEDDINGS
    out["lm_head.weight"] = unpad_vocab(state_dict[head], config)
    out["lm_head.bias"] = unpad_vocab(state_dict[OUTPUT_LAYER_BIAS], config)
    return out
