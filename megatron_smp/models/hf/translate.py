"""State-dict translation between our own full `GPTModel` layout and Hugging Face's, as
functions in SMP v1's style, thin wrappers over the family adapters:

    hf_state_dict = translate_smp_state_dict_to_hf_gptneox(full_state_dict)
    full_state_dict = translate_hf_state_dict_to_smp_gptneox(hf_state_dict)

The full state dict is the TP=1 `GPTModel` one (`merge_state_dicts` of the shards, or the
"model" entry of a converted checkpoint), and the key mapping is the adapter's
(`models.hf.<family>`): nothing is mapped twice. SMP v1's own names
(`translate_state_dict_to_hf_<family>`, `translate_hf_state_dict_to_smdistributed_<family>`)
take v1's DistributedTransformer layout: they are in `models.hf.smp_v1`.

`config` (keyword, optional) is a `TransformerConfig` or the model's Hugging Face
config. Without it the shapes are read from the tensors, which works for GPT-NeoX only: GPT-2,
Llama and Mistral need the head count to (un)fuse q/k/v, and no tensor shape tells it. Without a
config the vocabulary is the table's row count (no padding added or removed); with one, tables
are padded to `config.padded_vocab_size(1)` on the way in and trimmed to `vocab_size` on the
way out, so either way a round trip is exact.
"""
from __future__ import annotations

import re
from typing import Any, Mapping

import torch

import megatron_smp.models.hf as hf_adapters  # get_adapter, looked up at call time
from megatron_smp.config import ConfigError, TransformerConfig
from megatron_smp.models.hf.common import OUTPUT_LAYER, WORD_EMBEDDINGS, StateDict
from megatron_smp.models.hf.smp_v1 import count_layers

_FRAMEWORK_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_NEOX_LAYER = re.compile(r"^gpt_neox\.layers\.(\d+)\.")
_NEOX_EMBEDDINGS = "gpt_neox.embed_in.weight"


def _tied(hf_state_dict: Mapping[str, torch.Tensor], embeddings: str) -> bool:
    head = hf_state_dict.get("lm_head.weight")
    if head is None:
        return True
    table = hf_state_dict[embeddings]
    return head.data_ptr() == table.data_ptr() or torch.equal(head, table)


def _inferred_neox_config(state_dict: Mapping[str, torch.Tensor], hf_side: bool):
    if hf_side:
        table = state_dict[_NEOX_EMBEDDINGS]
        num_layers = count_layers(state_dict, _NEOX_LAYER)
        fc1 = state_dict["gpt_neox.layers.0.mlp.dense_h_to_4h.weight"]
        untied = not _tied(state_dict, _NEOX_EMBEDDINGS)
    else:
        table = state_dict[WORD_EMBEDDINGS]
        num_layers = count_layers(state_dict, _FRAMEWORK_LAYER)
        fc1 = state_dict["decoder.layers.0.mlp.linear_fc1.weight"]
        untied = OUTPUT_LAYER in state_dict
    rows, hidden = table.shape
    # NeoX's fused QKV copies over unchanged, so the head count is irrelevant to the weights:
    # one head stands in for it. A vocabulary multiple of 1 means no padding.
    return TransformerConfig(
        num_layers=num_layers, hidden_size=hidden, num_attention_heads=1, vocab_size=rows,
        max_position_embeddings=1, ffn_hidden_size=fc1.shape[0], normalization="LayerNorm",
        position_embedding_type="rope", untie_embeddings_and_output_weights=untied,
        make_vocab_size_divisible_by=1,
    )


def _resolve_config(family: str, state_dict, config: Any, hf_side: bool) -> TransformerConfig:
    if isinstance(config, TransformerConfig):
        return config
    if config is not None:  # a Hugging Face config
        return hf_adapters.get_adapter(family).config_from_hf(config)
    if family != "gpt_neox":
        raise ConfigError(
            f"translating a {family} state dict needs config= (a TransformerConfig or the "
            "Hugging Face config): the number of attention heads, which orders the fused q/k/v "
            "rows, cannot be read from the tensor shapes"
        )
    return _inferred_neox_config(state_dict, hf_side)


def _to_hf(family: str, state_dict, config) -> StateDict:
    config = _resolve_config(family, state_dict, config, hf_side=False)
    return hf_adapters.get_adapter(family).to_hf(state_dict, config)


def _from_hf(family: str, state_dict, config) -> StateDict:
    config = _resolve_config(family, state_dict, config, hf_side=True)
    return hf_adapters.get_adapter(family).from_hf(state_dict, config)


def translate_smp_state_dict_to_hf_gpt2(
    state_dict: Mapping[str, torch.Tensor], *, config=None
) -> StateDict:
    """Full GPTModel state dict -> GPT2LMHeadModel state dict (HF names and shapes)."""
    return _to_hf("gpt2", state_dict, config)


def translate_smp_state_dict_to_hf_llama(
    state_dict: Mapping[str, torch.Tensor], *, config=None
) -> StateDict:
    """Full GPTModel state dict -> LlamaForCausalLM state dict."""
    return _to_hf("llama", state_dict, config)


def translate_smp_state_dict_to_hf_mistral(
    state_dict: Mapping[str, torch.Tensor], *, config=None
) -> StateDict:
    """Full GPTModel state dict -> MistralForCausalLM state dict."""
    return _to_hf("mistral", state_dict, config)


def translate_smp_state_dict_to_hf_gptneox(
    state_dict: Mapping[str, torch.Tensor], *, config=None
) -> StateDict:
    """Full GPTModel state dict -> GPTNeoXForCausalLM state dict (config optional)."""
    return _to_hf("gpt_neox", state_dict, config)


def translate_hf_state_dict_to_smp_gpt2(state_dict: Mapping[str, torch.Tensor], *, config=None):
    """GPT2LMHeadModel state dict -> full GPTModel state dict."""
    return _from_hf("gpt2", state_dict, config)


def translate_hf_state_dict_to_smp_llama(state_dict: Mapping[str, torch.Tensor], *, config=None):
    """LlamaForCausalLM state dict -> full GPTModel state dict."""
    return _from_hf("llama", state_dict, config)


def translate_hf_state_dict_to_smp_mistral(
    state_dict: Mapping[str, torch.Tensor], *, config=None
) -> StateDict:
    """MistralForCausalLM state dict -> full GPTModel state dict."""
    return _from_hf("mistral", state_dict, config)


def translate_hf_state_dict_to_smp_gptneox(
    state_dict: Mapping[str, torch.Tensor], *, config=None
) -> StateDict:
    """GPTNeoXForCausalLM state dict -> full GPTModel state dict (config optional)."""
    return _from_hf("gpt_neox", state_dict, config)


__all__ = [
    "translate_smp_state_dict_to_hf_gpt2",
    "translate_smp_state_dict_to_hf_llama",
    "translate_smp_state_dict_to_hf_mistral",
    "translate_smp_state_dict_to_hf_gptneox",
    "translate_hf_state_dict_to_smp_gpt2",
    "translate_hf_state_dict_to_smp_llama",
    "translate_hf_state_dict_to_smp_mistral",
    "translate_hf_state_dict_to_smp_gptneox",
]
