"""GPT2LMHeadModel <-> GPTModel.

HF GPT-2 stores its linears as `Conv1D` with weights [in, out] (transposed w.r.t.
nn.Linear), and its fused `c_attn` output as [q (all heads), k (all heads), v (all heads)];
ours is per head [q, k, v] (`pack_qkv` with one query per group).
"""
from __future__ import annotations

from typing import Mapping

import torch

from megatron_smp.config import ConfigError, TransformerConfig
from megatron_smp.models.hf.common import (
    FINAL_NORM,
    OUTPUT_LAYER,
    POSITION_EMBEDDINGS,
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

HF_ARCHITECTURES = ("GPT2LMHeadModel",)
MODEL_TYPES = ("gpt2",)

_ACTIVATIONS_FROM_HF = {
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu": "gelu",
}


def config_from_hf(hf_config) -> TransformerConfig:
    if hf_config.activation_function not in _ACTIVATIONS_FROM_HF:
        raise ConfigError(
            f"GPT-2 activation_function {hf_config.activation_function!r} is not supported; "
            f"use one of {sorted(_ACTIVATIONS_FROM_HF)}"
        )
    if not getattr(hf_config, "scale_attn_weights", True) or getattr(
        hf_config, "scale_attn_by_inverse_layer_idx", False
    ):
        raise ConfigError(
            "GPT-2 scale_attn_weights=False / scale_attn_by_inverse_layer_idx=True are not "
            "supported (attention is scaled by 1/sqrt(head_dim))"
        )
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
        position_embedding_type="learned_absolute",
        add_bias_linear=True,
        untie_embeddings_and_output_weights=not getattr(hf_config, "tie_word_embeddings", True),
        hidden_dropout=hf_config.resid_pdrop,
        attention_dropout=hf_config.attn_pdrop,
        init_method_std=hf_config.initializer_range,
    )


def config_to_hf(config: TransformerConfig):
    from transformers import GPT2Config

    if config.activation not in ("gelu", "gelu_tanh") or config.gated_linear_unit:
        raise ConfigError(f"GPT-2 has no {config.activation!r} (gated={config.gated_linear_unit})")
    special = min(50256, config.vocab_size - 1)  # GPT-2's eos id, kept inside small vocabs
    return GPT2Config(
        vocab_size=config.vocab_size,
        n_positions=config.max_position_embeddings,
        n_embd=config.hidden_size,
        n_layer=config.num_layers,
        n_head=config.num_attention_heads,
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


def _qkv_to_ours(c_attn: torch.Tensor, config: TransformerConfig) -> torch.Tensor:
    """HF [q; k; v] rows (weight already [3h, h], or bias [3h]) -> per-head [q, k, v]."""
    q, k, v = c_attn.chunk(3, dim=0)
    return pack_qkv(q, k, v, config)


def from_hf(hf_state_dict: Mapping[str, torch.Tensor], config: TransformerConfig) -> StateDict:
    sd = {k.removeprefix("transformer."): v for k, v in hf_state_dict.items()}
    out: StateDict = {
        WORD_EMBEDDINGS: pad_vocab(sd["wte.weight"], config),
        POSITION_EMBEDDINGS: sd["wpe.weight"].clone(),
    }
    for i in range(config.num_layers):
        hf, ours = f"h.{i}.", layer_prefix(i)
        out[ours + "input_layernorm.weight"] = sd[hf + "ln_1.weight"].clone()
        out[ours + "input_layernorm.bias"] = sd[hf + "ln_1.bias"].clone()
        out[ours + "self_attention.linear_qkv.weight"] = _qkv_to_ours(
            sd[hf + "attn.c_attn.weight"].t(), config
        )
        out[ours + "self_attention.linear_qkv.bias"] = _qkv_to_ours(
            sd[hf + "attn.c_attn.bias"], config
        )
        out[ours + "self_attention.linear_proj.weight"] = sd[hf + "attn.c_proj.weight"].t().clone()
        out[ours + "self_attention.linear_proj.bias"] = sd[hf + "attn.c_proj.bias"].clone()
        out[ours + "pre_mlp_layernorm.weight"] = sd[hf + "ln_2.weight"].clone()
        out[ours + "pre_mlp_layernorm.bias"] = sd[hf + "ln_2.bias"].clone()
        out[ours + "mlp.linear_fc1.weight"] = sd[hf + "mlp.c_fc.weight"].t().clone()
        out[ours + "mlp.linear_fc1.bias"] = sd[hf + "mlp.c_fc.bias"].clone()
        out[ours + "mlp.linear_fc2.weight"] = sd[hf + "mlp.c_proj.weight"].t().clone()
        out[ours + "mlp.linear_fc2.bias"] = sd[hf + "mlp.c_proj.bias"].clone()
    out[FINAL_NORM + ".weight"] = sd["ln_f.weight"].clone()
    out[FINAL_NORM + ".bias"] = sd["ln_f.bias"].clone()
    if config.untie_embeddings_and_output_weights:
        out[OUTPUT_LAYER] = pad_vocab(sd["lm_head.weight"], config)
    return norms_from_hf(out, config)


def to_hf(state_dict: Mapping[str, torch.Tensor], config: TransformerConfig) -> StateDict:
    state_dict = norms_to_hf(state_dict, config, "gpt2")
    out: StateDict = {
        "transformer.wte.weight": unpad_vocab(state_dict[WORD_EMBEDDINGS], config),
        "transformer.wpe.weight": state_dict[POSITION_EMBEDDINGS].clone(),
    }
    for i in range(config.num_layers):
        hf, ours = f"transformer.h.{i}.", layer_prefix(i)
        out[hf + "ln_1.weight"] = state_dict[ours + "input_layernorm.weight"].clone()
        out[hf + "ln_1.bias"] = state_dict[ours + "input_layernorm.bias"].clone()
        q, k, v = unpack_qkv(state_dict[ours + "self_attention.linear_qkv.weight"], config)
        out[hf + "attn.c_attn.weight"] = torch.cat([q, k, v], dim=0).t().contiguous()
        q, k, v = unpack_qkv(state_dict[ours + "self_attention.linear_qkv.bias"], config)
        out[hf + "attn.c_attn.bias"] = torch.cat([q, k, v], dim=0)
        out[hf + "attn.c_proj.weight"] = (
            state_dict[ours + "self_attention.linear_proj.weight"].t().contiguous()
        )
        out[hf + "attn.c_proj.bias"] = state_dict[ours + "self_attention.linear_proj.bias"].clone()
        out[hf + "ln_2.weight"] = state_dict[ours + "pre_mlp_layernorm.weight"].clone()
        out[hf + "ln_2.bias"] = state_dict[ours + "pre_mlp_layernorm.bias"].clone()
        out[hf + "mlp.c_fc.weight"] = state_dict[ours + "mlp.linear_fc1.weight"].t().contiguous()
        out[hf + "mlp.c_fc.bias"] = state_dict[ours + "mlp.linear_fc1.bias"].clone()
        out[hf + "mlp.c_proj.weight"] = state_dict[ours + "mlp.linear_fc2.weight"].t().contiguous()
        out[hf + "mlp.c_proj.bias"] = state_dict[ours + "mlp.linear_fc2.bias"].clone()
    out["transformer.ln_f.weight"] = state_dict[FINAL_NORM + ".weight"].clone()
    out["transformer.ln_f.bias"] = state_dict[FINAL_NORM + ".bias"].clone()
    head = OUTPUT_LAYER if config.untie_embeddings_and_output_weights else WORD_EMBEDDINGS
    out["lm_head.weight"] = unpad_vocab(state_dict[head], config)
    return out
