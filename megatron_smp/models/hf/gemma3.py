"""Gemma3ForCausalLM (Gemma 3 text, HF model_type "gemma3_text") <-> GPTModel.

What Gemma 3 adds to a Llama-style decoder, and where it lives here (config, not new modules):

* sliding and full attention layers (`layer_types`, 5:1 in the published models: every sixth
  layer full): --window-size (W - 1, 0) for `sliding_window` W on the layers
  --window-attn-skip-freq selects (6, or a 0/1 list);
* sandwich norms (--sandwich-norm): `post_attention_layernorm` normalises the attention's
  output and `post_feedforward_layernorm` the MLP's before each residual add; HF's
  `pre_feedforward_layernorm` is our `pre_mlp_layernorm` (in Llama it is HF's
  `post_attention_layernorm`: the names do not carry over);
* every RMSNorm scales by (1 + w) and HF stores w: our --apply-layernorm-1p, so the weights
  copy as they are (a model trained without it gets 1 subtracted on export);
* per-head query/key RMSNorms (--qk-layernorm);
* attention scores scaled by `query_pre_attn_scalar`**-0.5 (--softmax-scale);
* word embeddings times sqrt(hidden) (--apply-embedding-scaling);
* RoPE per layer type: the full-attention layers with `rope_parameters["full_attention"]`
  (theta 1e6, linear x8 in the 4B-27B models: --rotary-base with
  --rotary-seq-len-interpolation-factor, or Llama 3 / YaRN scaling), the sliding layers with
  their own unscaled theta (10k: --local-rotary-base);
* GeGLU with the tanh GeLU (--geglu; HF's gelu_pytorch_tanh), no biases;
* final logit soft-capping when the config has it (--final-logit-softcapping);
* tied embeddings by default.

HF settings with no counterpart here are an error naming them: attn_logit_softcapping,
use_bidirectional_attention, attention_bias, another hidden_activation, scaled RoPE on the
sliding layers. (HF's embedding keeps the pad token's row out of its gradient; ours trains
every row, which changes no logit.) Of the multimodal Gemma3ForConditionalGeneration (4B-27B)
convert.py reads the language model (`language_model_of`), leaving the vision tower out; the
export is then a Gemma3ForCausalLM.
"""
from __future__ import annotations

from types import SimpleNamespace
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
    rope_fields_from_hf,
    shape_fields_from_hf,
    unpack_qkv,
    unpad_vocab,
    windows_from_hf,
    windows_to_hf,
)
from megatron_smp.models.hf.llama import gated_mlp_from_hf, gated_mlp_to_hf, hf_config_kwargs

HF_ARCHITECTURES = ("Gemma3ForCausalLM",)
MODEL_TYPES = ("gemma3_text",)
# Gemma3ForConditionalGeneration (4B-27B: a SigLIP vision tower, a projector and this
# language model): convert.py reads its language model (`language_model_of`).
MULTIMODAL_MODEL_TYPES = ("gemma3",)
_LANGUAGE_MODEL = "model.language_model."

HIDDEN_ACTIVATION = "gelu_pytorch_tanh"  # torch's gelu(approximate="tanh"): our gelu_tanh

# (ours, HF) per layer: every one an RMSNorm whose scale is 1 + w.
_NORMS = (("input_layernorm", "input_layernorm"),
          ("post_self_attn_layernorm", "post_attention_layernorm"),
          ("pre_mlp_layernorm", "pre_feedforward_layernorm"),
          ("post_mlp_layernorm", "post_feedforward_layernorm"),
          ("self_attention.q_layernorm", "self_attn.q_norm"),
          ("self_attention.k_layernorm", "self_attn.k_norm"))


def _unsupported(hf_config) -> list:
    """The HF settings this adapter cannot express, as 'field=value (what works)'."""
    problems = []
    activation = getattr(hf_config, "hidden_activation", HIDDEN_ACTIVATION)
    if activation != HIDDEN_ACTIVATION:
        problems.append(f"hidden_activation={activation!r} (only {HIDDEN_ACTIVATION!r})")
    if getattr(hf_config, "attn_logit_softcapping", None) is not None:
        problems.append(f"attn_logit_softcapping={hf_config.attn_logit_softcapping} (soft-"
                        "capped attention scores are not supported; Gemma 3 has None)")
    if getattr(hf_config, "use_bidirectional_attention", False):
        problems.append("use_bidirectional_attention=True (decoders attend causally here)")
    if getattr(hf_config, "attention_bias", False):
        problems.append("attention_bias=True (Gemma 3 has no biases)")
    if (getattr(hf_config, "sliding_window", None) is None
            and "sliding_attention" in (getattr(hf_config, "layer_types", None) or ())):
        problems.append("sliding_window=None with sliding_attention layers (give the window)")
    return problems


def _rope_fields(hf_config, sliding_layers: bool) -> dict:
    """RoPE fields of the per-layer-type `rope_parameters` ({"full_attention": ...,
    "sliding_attention": ...}): the full layers' as any RoPE of `rope_fields_from_hf`, the
    sliding layers' base as --local-rotary-base (None where the two tables are the same)."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    full = params.get("full_attention")
    if full is None:  # a flat dict: one RoPE for every layer
        full = params
    full = dict(full)
    full.setdefault("rope_type", "default")
    fields = rope_fields_from_hf(SimpleNamespace(
        rope_parameters=full, max_position_embeddings=hf_config.max_position_embeddings))
    sliding = params.get("sliding_attention")
    if not sliding_layers or sliding is None or dict(sliding) == full:
        return fields
    sliding = dict(sliding)
    if sliding.get("rope_type", "default") != "default":
        raise ConfigError(f"Gemma 3 rope_parameters['sliding_attention'] {sliding}: scaled RoPE "
                          "on the sliding-window layers is not supported (only the "
                          "full-attention layers' RoPE is scaled; published Gemma 3 has the "
                          "default rope_type there)")
    fields["local_rotary_base"] = float(sliding["rope_theta"])
    return fields


def language_model_of(hf_config, hf_state_dict: Mapping[str, torch.Tensor]):
    """(text config, state dict in Gemma3ForCausalLM's names, the names left out) of a
    Gemma3ForConditionalGeneration: its language model and LM head; the vision tower and the
    multimodal projector are what is left out."""
    text = {}
    left_out = []
    for name, tensor in hf_state_dict.items():
        if name.startswith(_LANGUAGE_MODEL):
            text["model." + name[len(_LANGUAGE_MODEL):]] = tensor
        elif name == "lm_head.weight":
            text[name] = tensor
        else:
            left_out.append(name)
    if not text:
        raise ConfigError(f"no {_LANGUAGE_MODEL}* tensors: not a Gemma3ForConditionalGeneration "
                          "state dict")
    return hf_config.text_config, text, left_out


def config_from_hf(hf_config) -> TransformerConfig:
    problems = _unsupported(hf_config)
    if problems:
        raise ConfigError("Gemma 3 config fields not supported: " + "; ".join(problems))
    window_size, skip_freq = windows_from_hf(hf_config, "Gemma 3")
    return TransformerConfig(
        **shape_fields_from_hf(hf_config),
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        layernorm_zero_centered_gamma=True,
        qk_layernorm=True,
        sandwich_norm=True,
        apply_embedding_scaling=True,
        # The same float HF computes: int ** -0.5 and float ** -0.5 round alike.
        softmax_scale=float(hf_config.query_pre_attn_scalar) ** -0.5,
        final_logit_softcapping=getattr(hf_config, "final_logit_softcapping", None),
        activation="gelu_tanh",
        gated_linear_unit=True,
        window_size=window_size,
        window_attn_skip_freq=skip_freq,
        **_rope_fields(hf_config, window_size is not None),
        add_bias_linear=False,
        untie_embeddings_and_output_weights=not getattr(hf_config, "tie_word_embeddings", True),
        hidden_dropout=0.0,
        attention_dropout=float(getattr(hf_config, "attention_dropout", 0.0) or 0.0),
        init_method_std=hf_config.initializer_range,
        use_scaled_init_method=False,
    )


def _query_pre_attn_scalar(config: TransformerConfig) -> int:
    """HF's integer query_pre_attn_scalar S with S**-0.5 == config's softmax scale."""
    if config.softmax_scale is None:
        return config.kv_channels
    scalar = round(config.softmax_scale ** -2)
    if scalar < 1 or abs(float(scalar) ** -0.5 - config.softmax_scale) > 1e-12:
        raise ConfigError(f"--softmax-scale {config.softmax_scale}: Gemma 3 states the scale as "
                          "an integer query_pre_attn_scalar S (scale S**-0.5); use 1/sqrt(S)")
    return scalar


def config_to_hf(config: TransformerConfig):
    from transformers import Gemma3TextConfig

    problems = []
    if not (config.gated_linear_unit and config.activation == "gelu_tanh"):
        problems.append("the GeGLU MLP with the tanh GeLU (--geglu)")
    if not (config.normalization == "RMSNorm" and config.qk_layernorm and config.sandwich_norm
            and config.apply_embedding_scaling):
        problems.append("RMSNorm with --qk-layernorm and --sandwich-norm, and "
                        "--apply-embedding-scaling")
    if (config.add_bias_linear or config.add_qkv_bias or config.num_moe_experts is not None
            or config.multi_latent_attention or config.softmax_type != "vanilla"
            or config.rotary_percent != 1.0 or not config.uses_rotary_embedding()):
        problems.append("no biases, experts, latent attention or sinks, and full RoPE")
    if problems:
        raise ConfigError("this config is not a Gemma 3 model: it needs " + "; ".join(problems))
    kwargs = hf_config_kwargs(config)
    for token in ("bos_token_id", "eos_token_id"):  # Gemma's own defaults (2 and 1)
        kwargs.pop(token)
    full = kwargs["rope_parameters"]
    sliding = dict(full)
    if config.local_rotary_base is not None:
        sliding = {"rope_type": "default", "rope_theta": config.local_rotary_base}
    kwargs["rope_parameters"] = {"full_attention": full, "sliding_attention": sliding}
    windows = windows_to_hf(config)
    return Gemma3TextConfig(
        **kwargs,
        hidden_activation=HIDDEN_ACTIVATION,
        attention_bias=False,
        query_pre_attn_scalar=_query_pre_attn_scalar(config),
        sliding_window=windows["sliding_window"],
        layer_types=windows["layer_types"],
        final_logit_softcapping=config.final_logit_softcapping,
        attn_logit_softcapping=None,
    )


def _norm_weight(weight: torch.Tensor, config: TransformerConfig, to_hf: bool) -> torch.Tensor:
    """HF stores Gemma's w of (1 + w): ours as it is with --apply-layernorm-1p, else 1 + w."""
    if config.layernorm_zero_centered_gamma:
        return weight.clone()
    return weight - 1 if to_hf else weight + 1


def from_hf(hf_state_dict: Mapping[str, torch.Tensor], config: TransformerConfig) -> StateDict:
    sd = hf_state_dict
    out: StateDict = {WORD_EMBEDDINGS: pad_vocab(sd["model.embed_tokens.weight"], config)}
    for i in range(config.num_layers):
        hf, ours = f"model.layers.{i}.", layer_prefix(i)
        out[ours + "self_attention.linear_qkv.weight"] = pack_qkv(
            sd[hf + "self_attn.q_proj.weight"], sd[hf + "self_attn.k_proj.weight"],
            sd[hf + "self_attn.v_proj.weight"], config)
        out[ours + "self_attention.linear_proj.weight"] = sd[hf + "self_attn.o_proj.weight"].clone()
        out.update(gated_mlp_from_hf(sd, hf + "mlp.", ours + "mlp."))
        for ours_norm, hf_norm in _NORMS:
            out[ours + ours_norm + ".weight"] = _norm_weight(sd[hf + hf_norm + ".weight"],
                                                             config, to_hf=False)
    out[FINAL_NORM + ".weight"] = _norm_weight(sd["model.norm.weight"], config, to_hf=False)
    if config.untie_embeddings_and_output_weights:
        out[OUTPUT_LAYER] = pad_vocab(sd["lm_head.weight"], config)
    return out


def to_hf(state_dict: Mapping[str, torch.Tensor], config: TransformerConfig) -> StateDict:
    sd = state_dict
    out: StateDict = {"model.embed_tokens.weight": unpad_vocab(sd[WORD_EMBEDDINGS], config)}
    for i in range(config.num_layers):
        hf, ours = f"model.layers.{i}.", layer_prefix(i)
        q, k, v = unpack_qkv(sd[ours + "self_attention.linear_qkv.weight"], config)
        out[hf + "self_attn.q_proj.weight"] = q
        out[hf + "self_attn.k_proj.weight"] = k
        out[hf + "self_attn.v_proj.weight"] = v
        out[hf + "self_attn.o_proj.weight"] = sd[ours + "self_attention.linear_proj.weight"].clone()
        out.update(gated_mlp_to_hf(sd, hf + "mlp.", ours + "mlp."))
        for ours_norm, hf_norm in _NORMS:
            out[hf + hf_norm + ".weight"] = _norm_weight(sd[ours + ours_norm + ".weight"],
                                                         config, to_hf=True)
    out["model.norm.weight"] = _norm_weight(sd[FINAL_NORM + ".weight"], config, to_hf=True)
    head = OUTPUT_LAYER if config.untie_embeddings_and_output_weights else WORD_EMBEDDINGS
    out["lm_head.weight"] = unpad_vocab(sd[head], config)
    return out
