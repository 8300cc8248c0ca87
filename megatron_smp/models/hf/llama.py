"""LlamaForCausalLM / MistralForCausalLM / Qwen3ForCausalLM <-> GPTModel (RoPE, RMSNorm, SwiGLU,
GQA, no biases; Qwen3 adds RMSNorms of each head's query and key, our --qk-layernorm).
A model trained with --rotary-interleaved exports with its q/k head channels reordered to
HF's rotate-half pairing (as Meta-format Llama checkpoints are converted).

HF keeps q/k/v and gate/up as separate linears; ours are fused: qkv per query group
(`pack_qkv`) and fc1 = [gate; up] (split over TP with stride 2). HF's q/k rows are already
in the "rotate half" order our RoPE uses, so no permutation is needed.

Mistral's `sliding_window` W maps onto `TransformerConfig.window_size` = (W - 1, 0): query i
attends to keys i - W + 1 .. i, as in Hugging Face's sliding-window mask.
"""
from __future__ import annotations

from typing import Mapping, Optional

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
    rope_fields_from_hf,
    rope_parameters_to_hf,
    unpack_qkv,
    unpad_vocab,
)

HF_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen3ForCausalLM")
MODEL_TYPES = ("llama", "mistral", "qwen3")


# Qwen3's per-head query/key RMSNorms.
_QK_NORMS = (("self_attention.q_layernorm.weight", "self_attn.q_norm.weight"),
             ("self_attention.k_layernorm.weight", "self_attn.k_norm.weight"))


def _rope_order(config: TransformerConfig, to_hf: bool):
    """Head-channel order taking our --rotary-interleaved q/k rows to HF's rotate-half rows
    (channels 0, 2, 4, ... then 1, 3, 5, ...: pair (2i, 2i+1) becomes (i, i + d/2); scores
    q.k do not change when q and k are permuted alike), or back; None for rotate-half."""
    if not config.rotary_interleaved:
        return None
    d = config.kv_channels
    order = torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])
    return order if to_hf else torch.argsort(order)


def _reorder_heads(rows: torch.Tensor, order) -> torch.Tensor:
    """rows [n * d, ...] (or a head-dim norm weight [d]) with each head's channels in `order`."""
    if order is None:
        return rows
    d = order.numel()
    return rows.reshape((-1, d) + tuple(rows.shape[1:]))[:, order].reshape(rows.shape).clone()


def config_from_hf(hf_config) -> TransformerConfig:
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise ConfigError(f"Llama hidden_act {hf_config.hidden_act!r} is not supported (silu)")
    if getattr(hf_config, "attention_bias", False) or getattr(hf_config, "mlp_bias", False):
        raise ConfigError("Llama attention_bias / mlp_bias are not supported; set them False")
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    sliding_window = getattr(hf_config, "sliding_window", None)
    qwen3 = getattr(hf_config, "model_type", None) == "qwen3"
    if qwen3:
        if getattr(hf_config, "use_sliding_window", False):
            raise ConfigError("Qwen3 use_sliding_window=True (windows on some layers only) is "
                              "not supported; set it False")
        sliding_window = None
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
        **rope_fields_from_hf(hf_config),
        window_size=None if sliding_window is None else (sliding_window - 1, 0),
        add_bias_linear=False,
        untie_embeddings_and_output_weights=not getattr(hf_config, "tie_word_embeddings", False),
        hidden_dropout=0.0,
        attention_dropout=getattr(hf_config, "attention_dropout", 0.0),
        init_method_std=hf_config.initializer_range,
        use_scaled_init_method=False,
        qk_layernorm=qwen3,
    )


def config_to_hf(config: TransformerConfig, family: str = "llama"):
    from transformers import LlamaConfig, MistralConfig, Qwen3Config

    if not (config.gated_linear_unit and config.activation == "silu"
            and config.normalization == "RMSNorm" and config.uses_rotary_embedding()
            and config.rotary_percent == 1.0 and not config.add_bias_linear
            and not config.add_qkv_bias and config.num_moe_experts is None):
        raise ConfigError(
            "this config is not a Llama/Mistral (SwiGLU, RMSNorm, full RoPE, no biases, no "
            "experts)"
        )
    kwargs = hf_config_kwargs(config)
    left = config.window_size[0] if config.window_size is not None else -1
    if config.qk_layernorm != (family == "qwen3"):
        raise ConfigError(f"qk_layernorm={config.qk_layernorm}: Qwen3 has query/key norms, "
                          f"{family} has not; convert as qwen3 exactly when --qk-layernorm is set")
    if family == "qwen3":
        if left >= 0:
            raise ConfigError(f"window_size {config.window_size}: Qwen3 is converted without "
                              "sliding windows")
        return Qwen3Config(attention_bias=False, **kwargs)
    if family == "mistral":
        return MistralConfig(sliding_window=left + 1 if left >= 0 else None, **kwargs)
    if left >= 0:
        raise ConfigError(
            f"window_size {config.window_size}: Llama has no sliding-window attention; "
            "this is a Mistral model"
        )
    return LlamaConfig(**kwargs)


def hf_config_kwargs(config: TransformerConfig) -> dict:
    """The HF config fields every Llama-style family shares (Mistral, Mixtral, Qwen-MoE)."""
    return dict(
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
        rope_parameters=rope_parameters_to_hf(config),
        bos_token_id=min(1, config.vocab_size - 1),
        eos_token_id=min(2, config.vocab_size - 1),
    )


def gated_mlp_from_hf(sd: Mapping[str, torch.Tensor], hf: str, ours: str) -> StateDict:
    """HF gate_proj / up_proj / down_proj under `hf` -> our fused fc1 [gate; up] and fc2."""
    return {
        ours + "linear_fc1.weight": torch.cat(
            [sd[hf + "gate_proj.weight"], sd[hf + "up_proj.weight"]], dim=0
        ),
        ours + "linear_fc2.weight": sd[hf + "down_proj.weight"].clone(),
    }


def gated_mlp_to_hf(state_dict: Mapping[str, torch.Tensor], hf: str, ours: str) -> StateDict:
    gate, up = state_dict[ours + "linear_fc1.weight"].chunk(2, dim=0)
    return {
        hf + "gate_proj.weight": gate.clone(),
        hf + "up_proj.weight": up.clone(),
        hf + "down_proj.weight": state_dict[ours + "linear_fc2.weight"].clone(),
    }


def from_hf(hf_state_dict: Mapping[str, torch.Tensor], config: TransformerConfig,
            mlp_from_hf=None) -> StateDict:
    """`mlp_from_hf(sd, hf_layer_prefix, our_layer_prefix, layer_index)` converts a layer's
    MLP (default: the gated MLP); the MoE families pass their own."""
    sd = hf_state_dict
    order = _rope_order(config, to_hf=False)
    out: StateDict = {WORD_EMBEDDINGS: pad_vocab(sd["model.embed_tokens.weight"], config)}
    for i in range(config.num_layers):
        hf, ours = f"model.layers.{i}.", layer_prefix(i)
        out[ours + "input_layernorm.weight"] = sd[hf + "input_layernorm.weight"].clone()
        out[ours + "self_attention.linear_qkv.weight"] = pack_qkv(
            _reorder_heads(sd[hf + "self_attn.q_proj.weight"], order),
            _reorder_heads(sd[hf + "self_attn.k_proj.weight"], order),
            sd[hf + "self_attn.v_proj.weight"],
            config,
        )
        if config.add_qkv_bias or config.add_bias_linear:  # Qwen, gpt-oss
            out[ours + "self_attention.linear_qkv.bias"] = pack_qkv(
                _reorder_heads(sd[hf + "self_attn.q_proj.bias"], order),
                _reorder_heads(sd[hf + "self_attn.k_proj.bias"], order),
                sd[hf + "self_attn.v_proj.bias"],
                config,
            )
        out[ours + "self_attention.linear_proj.weight"] = sd[hf + "self_attn.o_proj.weight"].clone()
        if config.add_bias_linear:  # gpt-oss
            out[ours + "self_attention.linear_proj.bias"] = sd[hf + "self_attn.o_proj.bias"].clone()
        if config.qk_layernorm:  # Qwen3
            for ours_norm, hf_norm in _QK_NORMS:
                out[ours + ours_norm] = _reorder_heads(sd[hf + hf_norm], order)
        out[ours + "pre_mlp_layernorm.weight"] = sd[hf + "post_attention_layernorm.weight"].clone()
        if mlp_from_hf is None:
            out.update(gated_mlp_from_hf(sd, hf + "mlp.", ours + "mlp."))
        else:
            out.update(mlp_from_hf(sd, hf, ours, i))
    out[FINAL_NORM + ".weight"] = sd["model.norm.weight"].clone()
    if config.untie_embeddings_and_output_weights:
        out[OUTPUT_LAYER] = pad_vocab(sd["lm_head.weight"], config)
    return norms_from_hf(out, config)


def to_hf(state_dict: Mapping[str, torch.Tensor], config: TransformerConfig,
          mlp_to_hf=None, family: Optional[str] = None) -> StateDict:
    """Inverse of `from_hf`; `mlp_to_hf(state_dict, hf_prefix, our_prefix, layer_index)`;
    `family` names the HF family for the numerics check (default: qwen3 for a dense model with
    query/key norms, else llama)."""
    if family is None:
        family = "qwen3" if config.qk_layernorm and mlp_to_hf is None else "llama"
    state_dict = norms_to_hf(state_dict, config, family)
    order = _rope_order(config, to_hf=True)
    out: StateDict = {"model.embed_tokens.weight": unpad_vocab(state_dict[WORD_EMBEDDINGS], config)}
    for i in range(config.num_layers):
        hf, ours = f"model.layers.{i}.", layer_prefix(i)
        q, k, v = unpack_qkv(state_dict[ours + "self_attention.linear_qkv.weight"], config)
        out[hf + "self_attn.q_proj.weight"] = _reorder_heads(q, order)
        out[hf + "self_attn.k_proj.weight"] = _reorder_heads(k, order)
        out[hf + "self_attn.v_proj.weight"] = v
        if config.add_qkv_bias or config.add_bias_linear:
            q, k, v = unpack_qkv(state_dict[ours + "self_attention.linear_qkv.bias"], config)
            out[hf + "self_attn.q_proj.bias"] = _reorder_heads(q, order)
            out[hf + "self_attn.k_proj.bias"] = _reorder_heads(k, order)
            out[hf + "self_attn.v_proj.bias"] = v
        out[hf + "self_attn.o_proj.weight"] = (
            state_dict[ours + "self_attention.linear_proj.weight"].clone()
        )
        if config.add_bias_linear:
            out[hf + "self_attn.o_proj.bias"] = (
                state_dict[ours + "self_attention.linear_proj.bias"].clone()
            )
        if config.qk_layernorm:
            for ours_norm, hf_norm in _QK_NORMS:
                out[hf + hf_norm] = _reorder_heads(state_dict[ours + ours_norm], order)
        if mlp_to_hf is None:
            out.update(gated_mlp_to_hf(state_dict, hf + "mlp.", ours + "mlp."))
        else:
            out.update(mlp_to_hf(state_dict, hf, ours, i))
        out[hf + "input_layernorm.weight"] = state_dict[ours + "input_layernorm.weight"].clone()
        out[hf + "post_attention_layernorm.weight"] = (
            state_dict[ours + "pre_mlp_layernorm.weight"].clone()
        )
    out["model.norm.weight"] = state_dict[FINAL_NORM + ".weight"].clone()
    head = OUTPUT_LAYER if config.untie_embeddings_and_output_weights else WORD_EMBEDDINGS
    out["lm_head.weight"] = unpad_vocab(state_dict[head], config)
    return out
