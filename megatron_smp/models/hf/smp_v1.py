"""SMP v1's state-dict translators, on SMP v1's own layout.

SMP v1 (`smdistributed.modelparallel.torch`) replaced a Hugging Face GPT-2 / GPT-NeoX / GPT-J
by its `DistributedTransformerLMHead`; `model.state_dict(gather_to_rank0=True)` then holds

    word_embedding.weight                          [vocab, h]
    position_embedding.weight                      [positions, h]       (GPT-2)
    transformer.seq_layers.N.attention.{query,key,value}.{weight [heads*d, h], bias}
    transformer.seq_layers.N.attention.dense.{weight [h, h], bias}
    transformer.seq_layers.N.attention.pre_layernorm.*  (GPT-2, GPT-NeoX: the attention norm)
    transformer.seq_layers.N.attention.rotary_emb.inv_freq              (GPT-NeoX buffer)
    transformer.seq_layers.N.output.pre_layernorm.*     (GPT-2, GPT-NeoX: the MLP norm)
    transformer.seq_layers.N.pre_layernorm.*            (GPT-J: one norm for both branches)
    transformer.seq_layers.N.output.dense1.{weight [ffn, h], bias}
    transformer.seq_layers.N.output.dense2.{weight [h, ffn], bias}
    transformer.seq_layers.<last>.output.layernorm.*    (GPT-2's final norm)
    layernorm.*                                         (GPT-NeoX's and GPT-J's final norm)
    lm_head.weight, lm_head.bias (GPT-J)

every linear in nn.Linear's [out, in] layout (GPT-2's Conv1D weights transposed) and q/k/v
unfused. GPT-J has no attention biases; its rotary frequencies are not a buffer.

    hf_sd = translate_state_dict_to_hf_gpt2(v1_sd, max_seq_len=None)
    v1_sd = translate_hf_state_dict_to_smdistributed_gptj(hf_model.state_dict())

These are v1's signatures. GPT-NeoX alone takes `config=` (the model's HF config or a
`TransformerConfig`): its fused `query_key_value` rows are per head, and no tensor shape says
how many heads there are (v1 read the count from the model it had built). `max_seq_len` is
v1's length of GPT-2/NeoX/J's causal-mask buffers (`attn.bias`); transformers 5 builds the
mask itself and has no such buffer, so there is nothing to write: it is checked (a positive
int) and changes nothing. Both directions fail on a missing or unexpected tensor, naming it
(GPT-NeoX's also on q/k/v rows that do not fit the config); `module.`-prefixed keys (a wrapped
model's) are read as the plain ones.
"""
from __future__ import annotations

import re
from typing import Any, Callable, Dict, Mapping, Optional

import torch

from megatron_smp.config import ConfigError, TransformerConfig
from megatron_smp.config.errors import format_listing

StateDict = Dict[str, torch.Tensor]

_V1_LAYER = re.compile(r"^transformer\.seq_layers\.(\d+)\.")


def strip_module_prefix(state_dict: Mapping[str, Any]) -> StateDict:
    """Keys without the leading `module.` (one or more) that wrapping a model adds."""
    out = {}
    for name, value in state_dict.items():
        while name.startswith("module."):
            name = name[len("module."):]
        out[name] = value
    return out


def count_layers(state_dict: Mapping[str, torch.Tensor], pattern: re.Pattern,
                 what: str = "the state dict") -> int:
    """The number of layers whose names `pattern` matches (group 1: the index), which must be
    0..n-1."""
    indices = {int(m.group(1)) for m in map(pattern.match, state_dict) if m}
    if not indices or indices != set(range(len(indices))):
        shown = format_listing([str(i) for i in sorted(indices)])
        raise ConfigError(f"{what}: its layer indices [{shown}] are not 0..n-1")
    return len(indices)


class _Reader:
    """Takes tensors out of a state dict by name; `finish` fails on what was never taken."""

    def __init__(self, state_dict: Mapping[str, torch.Tensor], what: str,
                 ignored: Callable[[str], bool] = lambda name: False) -> None:
        self.remaining = {k: v for k, v in state_dict.items() if not ignored(k)}
        self.what = what

    def take(self, name: str) -> torch.Tensor:
        if name not in self.remaining:
            raise ConfigError(f"{self.what}: no tensor {name!r} (is this the right model type?)")
        return self.remaining.pop(name)

    def take_optional(self, name: str) -> Optional[torch.Tensor]:
        return self.remaining.pop(name, None)

    def finish(self) -> None:
        if self.remaining:
            raise ConfigError(
                f"{self.what}: unexpected tensors {format_listing(sorted(self.remaining))}")


def _check_max_seq_len(max_seq_len: Optional[int]) -> None:
    if max_seq_len is not None and (isinstance(max_seq_len, bool)
                                    or not isinstance(max_seq_len, int) or max_seq_len < 1):
        raise ConfigError(f"max_seq_len must be a positive int or None, got {max_seq_len!r}")


def _linear(tensor: torch.Tensor) -> torch.Tensor:
    """A Conv1D [in, out] weight as nn.Linear's [out, in], or back (its own inverse)."""
    return tensor.t().contiguous()


def _v1_layer(i: int) -> str:
    return f"transformer.seq_layers.{i}."


def is_derived_hf_buffer(name: str) -> bool:
    """Buffers older transformers (and v1's translators) put in HF state dicts that are derived
    from the config, not weights: causal masks and rotary frequencies."""
    return name.endswith((".attn.bias", ".attn.masked_bias", ".attention.bias",
                          ".attention.masked_bias", ".rotary_emb.inv_freq"))


# --------------------------------------------------------------------------------- GPT-2

_HF_H_LAYER = re.compile(r"^transformer\.h\.(\d+)\.")  # GPT-2's and GPT-J's HF layers
_GPT2_LINEARS = (("attention.dense", "attn.c_proj"), ("output.dense1", "mlp.c_fc"),
                 ("output.dense2", "mlp.c_proj"))


def _gpt2_layer_to_hf(v1: _Reader, src: str, dst: str, out: StateDict) -> None:
    """One v1 DistributedTransformerLayer (names under `src`) -> HF GPT2Block under `dst`."""
    for part in ("weight", "bias"):
        out[dst + f"ln_1.{part}"] = v1.take(src + f"attention.pre_layernorm.{part}")
        out[dst + f"ln_2.{part}"] = v1.take(src + f"output.pre_layernorm.{part}")
    qkv = [v1.take(src + f"attention.{n}.weight") for n in ("query", "key", "value")]
    out[dst + "attn.c_attn.weight"] = _linear(torch.cat(qkv, dim=0))
    qkv = [v1.take(src + f"attention.{n}.bias") for n in ("query", "key", "value")]
    out[dst + "attn.c_attn.bias"] = torch.cat(qkv, dim=0)
    for v1_name, hf_name in _GPT2_LINEARS:
        out[dst + f"{hf_name}.weight"] = _linear(v1.take(src + f"{v1_name}.weight"))
        out[dst + f"{hf_name}.bias"] = v1.take(src + f"{v1_name}.bias")


def _gpt2_layer_from_hf(hf: _Reader, src: str, dst: str, out: StateDict) -> None:
    """Inverse of `_gpt2_layer_to_hf`."""
    for part in ("weight", "bias"):
        out[dst + f"attention.pre_layernorm.{part}"] = hf.take(src + f"ln_1.{part}")
        out[dst + f"output.pre_layernorm.{part}"] = hf.take(src + f"ln_2.{part}")
    weight = _linear(hf.take(src + "attn.c_attn.weight"))  # [3h, h]
    bias = hf.take(src + "attn.c_attn.bias")
    for n, w, b in zip(("query", "key", "value"), weight.chunk(3, dim=0), bias.chunk(3)):
        out[dst + f"attention.{n}.weight"] = w.contiguous()
        out[dst + f"attention.{n}.bias"] = b.contiguous()
    for v1_name, hf_name in _GPT2_LINEARS:
        out[dst + f"{v1_name}.weight"] = _linear(hf.take(src + f"{hf_name}.weight"))
        out[dst + f"{v1_name}.bias"] = hf.take(src + f"{hf_name}.bias")


def translate_state_dict_to_hf_gpt2(
    state_dict: Mapping[str, torch.Tensor], max_seq_len: Optional[int] = None
) -> StateDict:
    """SMP v1 GPT-2 state dict -> GPT2LMHeadModel state dict (c_attn = [q | k | v] of all
    heads, Conv1D [in, out] weights, so no head count is needed)."""
    _check_max_seq_len(max_seq_len)
    v1 = _Reader(strip_module_prefix(state_dict), "SMP v1 GPT-2 state dict")
    num_layers = count_layers(v1.remaining, _V1_LAYER, v1.what)
    out: StateDict = {
        "transformer.wte.weight": v1.take("word_embedding.weight"),
        "transformer.wpe.weight": v1.take("position_embedding.weight"),
    }
    for i in range(num_layers):
        _gpt2_layer_to_hf(v1, _v1_layer(i), f"transformer.h.{i}.", out)
    last = _v1_layer(num_layers - 1)
    out["transformer.ln_f.weight"] = v1.take(last + "output.layernorm.weight")
    out["transformer.ln_f.bias"] = v1.take(last + "output.layernorm.bias")
    head = v1.take_optional("lm_head.weight")
    out["lm_head.weight"] = out["transformer.wte.weight"] if head is None else head
    v1.finish()
    return out


def translate_hf_state_dict_to_smdistributed_gpt2(state_dict: Mapping[str, torch.Tensor]
                                                  ) -> StateDict:
    """GPT2LMHeadModel state dict -> SMP v1 GPT-2 state dict (inverse of
    `translate_state_dict_to_hf_gpt2`)."""
    hf = _Reader(strip_module_prefix(state_dict), "Hugging Face GPT-2 state dict",
                 ignored=is_derived_hf_buffer)
    num_layers = count_layers(hf.remaining, _HF_H_LAYER, hf.what)
    out: StateDict = {
        "word_embedding.weight": hf.take("transformer.wte.weight"),
        "position_embedding.weight": hf.take("transformer.wpe.weight"),
    }
    for i in range(num_layers):
        _gpt2_layer_from_hf(hf, f"transformer.h.{i}.", _v1_layer(i), out)
    last = _v1_layer(num_layers - 1)
    out[last + "output.layernorm.weight"] = hf.take("transformer.ln_f.weight")
    out[last + "output.layernorm.bias"] = hf.take("transformer.ln_f.bias")
    head = hf.take_optional("lm_head.weight")
    out["lm_head.weight"] = out["word_embedding.weight"] if head is None else head
    hf.finish()
    return out


# v1's "custom GPT-2": the HF model with only its GPT2Blocks replaced by
# DistributedTransformerLayers (smp.tp_register), so the layers keep HF's place
# (transformer.h.N.attention.query.weight, ...) and everything else HF's names.
_GPT2_OUTSIDE_LAYERS = ("transformer.wte.weight", "transformer.wpe.weight",
                        "transformer.ln_f.weight", "transformer.ln_f.bias")


def _gpt2_layer_translation(state_dict, what: str, to_hf: bool,
                            ignored=lambda name: False) -> StateDict:
    source = _Reader(strip_module_prefix(state_dict), what, ignored=ignored)
    num_layers = count_layers(source.remaining, _HF_H_LAYER, what)
    out: StateDict = {name: source.take(name) for name in _GPT2_OUTSIDE_LAYERS}
    translate = _gpt2_layer_to_hf if to_hf else _gpt2_layer_from_hf
    for i in range(num_layers):
        translate(source, f"transformer.h.{i}.", f"transformer.h.{i}.", out)
    head = source.take_optional("lm_head.weight")
    out["lm_head.weight"] = out["transformer.wte.weight"] if head is None else head
    source.finish()
    return out


def translate_state_dict_to_hf_gpt2_layer(
    state_dict: Mapping[str, torch.Tensor], max_seq_len: Optional[int] = None
) -> StateDict:
    """SMP v1 custom-GPT-2 state dict (GPT2Blocks replaced by DistributedTransformerLayers)
    -> GPT2LMHeadModel state dict."""
    _check_max_seq_len(max_seq_len)
    return _gpt2_layer_translation(state_dict, "SMP v1 custom GPT-2 state dict", to_hf=True)


def translate_hf_state_dict_to_smdistributed_gpt2_layer(
    state_dict: Mapping[str, torch.Tensor]
) -> StateDict:
    """GPT2LMHeadModel state dict -> SMP v1 custom-GPT-2 state dict (inverse of
    `translate_state_dict_to_hf_gpt2_layer`)."""
    return _gpt2_layer_translation(state_dict, "Hugging Face GPT-2 state dict", to_hf=False,
                                   ignored=is_derived_hf_buffer)


# ------------------------------------------------------------------------------ GPT-NeoX

def _neox_config(config: Any) -> TransformerConfig:
    if config is None:
        raise ConfigError(
            "translating a GPT-NeoX state dict needs config= (the model's GPTNeoXConfig or a "
            "TransformerConfig): its fused query_key_value rows are ordered per attention head, "
            "and the number of heads cannot be read from the tensor shapes"
        )
    if isinstance(config, TransformerConfig):
        return config
    from megatron_smp.models.hf import gpt_neox

    return gpt_neox.config_from_hf(config)


def _neox_inv_freq(config: TransformerConfig) -> torch.Tensor:
    # v1's RotaryEmbedding: rotary_dim = int(head_dim * rotary_pct) channels, base rope_theta.
    dim = int(config.kv_channels * config.rotary_percent)
    return 1.0 / (config.rotary_base ** (torch.arange(0, dim, 2).float() / dim))


def translate_state_dict_to_hf_gptneox(
    state_dict: Mapping[str, torch.Tensor], max_seq_len: Optional[int] = None, *, config=None
) -> StateDict:
    """SMP v1 GPT-NeoX state dict -> GPTNeoXForCausalLM state dict. `config` (required): the
    model's GPTNeoXConfig or TransformerConfig, for the head count; v1's per-layer rotary
    `inv_freq` buffers must agree with it (transformers 5 recomputes them, so they are not
    copied)."""
    _check_max_seq_len(max_seq_len)
    config = _neox_config(config)
    v1 = _Reader(strip_module_prefix(state_dict), "SMP v1 GPT-NeoX state dict")
    num_layers = count_layers(v1.remaining, _V1_LAYER, v1.what)
    heads, head_dim = config.num_attention_heads, config.kv_channels
    expected_inv_freq = _neox_inv_freq(config)
    out: StateDict = {"gpt_neox.embed_in.weight": v1.take("word_embedding.weight")}
    for i in range(num_layers):
        src, dst = _v1_layer(i), f"gpt_neox.layers.{i}."
        for part in ("weight", "bias"):
            out[dst + f"input_layernorm.{part}"] = v1.take(src + f"attention.pre_layernorm.{part}")
            out[dst + f"post_attention_layernorm.{part}"] = v1.take(
                src + f"output.pre_layernorm.{part}")
            q, k, v = (v1.take(src + f"attention.{n}.{part}") for n in ("query", "key", "value"))
            if q.shape[0] != heads * head_dim:
                raise ConfigError(
                    f"{v1.what}: {src}attention.query.{part} has {q.shape[0]} rows, but config "
                    f"says {heads} heads x {head_dim} channels; pass the model's own config"
                )
            # HF's fused rows: for each head, its q, k and v rows.
            per_head = [t.reshape((heads, head_dim) + tuple(t.shape[1:])) for t in (q, k, v)]
            out[dst + f"attention.query_key_value.{part}"] = torch.stack(per_head, dim=1).reshape(
                (3 * heads * head_dim,) + tuple(q.shape[1:]))
            out[dst + f"attention.dense.{part}"] = v1.take(src + f"attention.dense.{part}")
            out[dst + f"mlp.dense_h_to_4h.{part}"] = v1.take(src + f"output.dense1.{part}")
            out[dst + f"mlp.dense_4h_to_h.{part}"] = v1.take(src + f"output.dense2.{part}")
        inv_freq = v1.take_optional(src + "attention.rotary_emb.inv_freq")
        if inv_freq is not None and (
                inv_freq.shape != expected_inv_freq.shape
                or not torch.allclose(inv_freq.float(), expected_inv_freq, rtol=1e-5, atol=0)):
            raise ConfigError(
                f"{v1.what}: {src}attention.rotary_emb.inv_freq ({inv_freq.numel()} frequencies) "
                f"differs from the config's rotary settings (rotary_pct {config.rotary_percent}, "
                f"base {config.rotary_base}, head dim {head_dim}); pass the model's own config"
            )
    out["gpt_neox.final_layer_norm.weight"] = v1.take("layernorm.weight")
    out["gpt_neox.final_layer_norm.bias"] = v1.take("layernorm.bias")
    head = v1.take_optional("lm_head.weight")
    out["lm_head.weight"] = out["gpt_neox.embed_in.weight"] if head is None else head
    v1.finish()
    return out


def translate_hf_state_dict_to_smdistributed_gptneox(
    state_dict: Mapping[str, torch.Tensor], *, config=None
) -> StateDict:
    """GPTNeoXForCausalLM state dict -> SMP v1 GPT-NeoX state dict, with v1's per-layer
    rotary `inv_freq` buffers. `config` (required): as for `translate_state_dict_to_hf_gptneox`.
    """
    config = _neox_config(config)
    hf = _Reader(strip_module_prefix(state_dict), "Hugging Face GPT-NeoX state dict",
                 ignored=is_derived_hf_buffer)
    num_layers = count_layers(hf.remaining, re.compile(r"^gpt_neox\.layers\.(\d+)\."), hf.what)
    heads, head_dim = config.num_attention_heads, config.kv_channels
    out: StateDict = {"word_embedding.weight": hf.take("gpt_neox.embed_in.weight")}
    for i in range(num_layers):
        src, dst = f"gpt_neox.layers.{i}.", _v1_layer(i)
        for part in ("weight", "bias"):
            out[dst + f"attention.pre_layernorm.{part}"] = hf.take(src + f"input_layernorm.{part}")
            out[dst + f"output.pre_layernorm.{part}"] = hf.take(
                src + f"post_attention_layernorm.{part}")
            fused = hf.take(src + f"attention.query_key_value.{part}")
            if fused.shape[0] != 3 * heads * head_dim:
                raise ConfigError(
                    f"{hf.what}: {src}attention.query_key_value.{part} has {fused.shape[0]} rows, "
                    f"not 3 x {heads} heads x {head_dim}; pass the model's own config"
                )
            per_head = fused.reshape((heads, 3, head_dim) + tuple(fused.shape[1:]))
            for j, n in enumerate(("query", "key", "value")):
                out[dst + f"attention.{n}.{part}"] = per_head[:, j].reshape(
                    (heads * head_dim,) + tuple(fused.shape[1:])).contiguous()
            out[dst + f"attention.dense.{part}"] = hf.take(src + f"attention.dense.{part}")
            out[dst + f"output.dense1.{part}"] = hf.take(src + f"mlp.dense_h_to_4h.{part}")
            out[dst + f"output.dense2.{part}"] = hf.take(src + f"mlp.dense_4h_to_h.{part}")
        out[dst + "attention.rotary_emb.inv_freq"] = _neox_inv_freq(config)
    out["layernorm.weight"] = hf.take("gpt_neox.final_layer_norm.weight")
    out["layernorm.bias"] = hf.take("gpt_neox.final_layer_norm.bias")
    # transformers 5 names the head lm_head; older files (and v1's output) embed_out.
    head = hf.take_optional("lm_head.weight")
    old_head = hf.take_optional("embed_out.weight")
    head = head if head is not None else old_head
    out["lm_head.weight"] = out["word_embedding.weight"] if head is None else head
    hf.finish()
    return out


# --------------------------------------------------------------------------------- GPT-J

_GPTJ_ATTENTION = (("query", "q_proj"), ("key", "k_proj"), ("value", "v_proj"),
                   ("dense", "out_proj"))


def translate_state_dict_to_hf_gptj(
    state_dict: Mapping[str, torch.Tensor], max_seq_len: Optional[int] = None
) -> StateDict:
    """SMP v1 GPT-J state dict -> GPTJForCausalLM state dict (q/k/v stay separate, so no
    head count is needed)."""
    _check_max_seq_len(max_seq_len)
    v1 = _Reader(strip_module_prefix(state_dict), "SMP v1 GPT-J state dict")
    num_layers = count_layers(v1.remaining, _V1_LAYER, v1.what)
    out: StateDict = {"transformer.wte.weight": v1.take("word_embedding.weight")}
    for i in range(num_layers):
        src, dst = _v1_layer(i), f"transformer.h.{i}."
        out[dst + "ln_1.weight"] = v1.take(src + "pre_layernorm.weight")
        out[dst + "ln_1.bias"] = v1.take(src + "pre_layernorm.bias")
        for v1_name, hf_name in _GPTJ_ATTENTION:
            out[dst + f"attn.{hf_name}.weight"] = v1.take(src + f"attention.{v1_name}.weight")
        for part in ("weight", "bias"):
            out[dst + f"mlp.fc_in.{part}"] = v1.take(src + f"output.dense1.{part}")
            out[dst + f"mlp.fc_out.{part}"] = v1.take(src + f"output.dense2.{part}")
    out["transformer.ln_f.weight"] = v1.take("layernorm.weight")
    out["transformer.ln_f.bias"] = v1.take("layernorm.bias")
    head = v1.take_optional("lm_head.weight")
    out["lm_head.weight"] = out["transformer.wte.weight"] if head is None else head
    out["lm_head.bias"] = v1.take("lm_head.bias")
    v1.finish()
    return out


def translate_hf_state_dict_to_smdistributed_gptj(state_dict: Mapping[str, torch.Tensor]
                                                  ) -> StateDict:
    """GPTJForCausalLM state dict -> SMP v1 GPT-J state dict (inverse of
    `translate_state_dict_to_hf_gptj`)."""
    hf = _Reader(strip_module_prefix(state_dict), "Hugging Face GPT-J state dict",
                 ignored=is_derived_hf_buffer)
    num_layers = count_layers(hf.remaining, _HF_H_LAYER, hf.what)
    out: StateDict = {"word_embedding.weight": hf.take("transformer.wte.weight")}
    for i in range(num_layers):
        src, dst = f"transformer.h.{i}.", _v1_layer(i)
        out[dst + "pre_layernorm.weight"] = hf.take(src + "ln_1.weight")
        out[dst + "pre_layernorm.bias"] = hf.take(src + "ln_1.bias")
        for v1_name, hf_name in _GPTJ_ATTENTION:
            out[dst + f"attention.{v1_name}.weight"] = hf.take(src + f"attn.{hf_name}.weight")
        for part in ("weight", "bias"):
            out[dst + f"output.dense1.{part}"] = hf.take(src + f"mlp.fc_in.{part}")
            out[dst + f"output.dense2.{part}"] = hf.take(src + f"mlp.fc_out.{part}")
    out["layernorm.weight"] = hf.take("transformer.ln_f.weight")
    out["layernorm.bias"] = hf.take("transformer.ln_f.bias")
    head = hf.take_optional("lm_head.weight")
    out["lm_head.weight"] = out["word_embedding.weight"] if head is None else head
    out["lm_head.bias"] = hf.take("lm_head.bias")
    hf.finish()
    return out


# v1's older names for the HF -> v1 direction (kept by v1 "for backward compatibility"); they
# took a max_seq_len that v1 itself did not use.
def translate_hf_state_dict_to_smdistributed(state_dict, max_seq_len=None) -> StateDict:
    """v1's old name of `translate_hf_state_dict_to_smdistributed_gpt2`."""
    _check_max_seq_len(max_seq_len)
    return translate_hf_state_dict_to_smdistributed_gpt2(state_dict)


def translate_hf_gptneox_state_dict_to_smdistributed(state_dict, max_seq_len=None, *,
                                                     config=None) -> StateDict:
    """v1's old name of `translate_hf_state_dict_to_smdistributed_gptneox`."""
    _check_max_seq_len(max_seq_len)
    return translate_hf_state_dict_to_smdistributed_gptneox(state_dict, config=config)


def translate_hf_gptj_state_dict_to_smdistributed(state_dict, max_seq_len=None) -> StateDict:
    """v1's old name of `translate_hf_state_dict_to_smdistributed_gptj`."""
    _check_max_seq_len(max_seq_len)
    return translate_hf_state_dict_to_smdistributed_gptj(state_dict)


# v1 family name -> (v1 -> HF, HF -> v1, whether `config=` is required).
TRANSLATORS = {
    "gpt2": (translate_state_dict_to_hf_gpt2, translate_hf_state_dict_to_smdistributed_gpt2,
             False),
    "gpt_neox": (translate_state_dict_to_hf_gptneox,
                 translate_hf_state_dict_to_smdistributed_gptneox, True),
    "gptj": (translate_state_dict_to_hf_gptj, translate_hf_state_dict_to_smdistributed_gptj,
             False),
}

__all__ = [
    "translate_state_dict_to_hf_gpt2",
    "translate_state_dict_to_hf_gptneox",
    "translate_state_dict_to_hf_gptj",
    "translate_hf_state_dict_to_smdistributed_gpt2",
    "translate_hf_state_dict_to_smdistributed_gptneox",
    "translate_hf_state_dict_to_smdistributed_gptj",
    "translate_state_dict_to_hf_gpt2_layer",
    "translate_hf_state_dict_to_smdistributed_gpt2_layer",
]  # v1's older names are exported by the mirror modules only (megatron_smp.smp.nn.huggingface)
