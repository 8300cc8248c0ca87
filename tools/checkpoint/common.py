"""Pieces the checkpoint converters share: model types, expected names and shapes, checks.

Expected names and shapes come from the Hugging Face model class itself, built on the meta
device (no memory, no weights): its state dict says what an HF checkpoint of this config must
hold, and the family adapter's `from_hf` of it says what the framework checkpoint must hold.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import warnings
from typing import Dict, Iterator, List, Mapping

import torch
import torch.distributed as dist

from megatron_smp.config import FUNCTION_FIELDS, ConfigError, TransformerConfig
from megatron_smp.models.hf import config_to_hf, get_adapter
from megatron_smp.models.hf.common import pad_vocab, unpad_vocab
from megatron_smp.models.sharding import VOCAB_PARALLEL_SUFFIXES
from megatron_smp.parallel_state import build_parallel_state, destroy_parallel_state

# --model-type (Megatron's names) -> adapter family.
MODEL_TYPES = {"gpt2": "gpt2", "gptneox": "gpt_neox", "gpt_neox": "gpt_neox", "gptj": "gptj",
               "llama": "llama", "mistral": "mistral", "mixtral": "mixtral", "qwen2": "qwen2",
               "qwen2_moe": "qwen2_moe", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe",
               "gpt_oss": "gpt_oss",
               "deepseek_v3": "deepseek_v3",
               "qwen3_next": "qwen3_next", "qwen3_5": "qwen3_5_text",
               "qwen3_5_moe": "qwen3_5_moe_text", "nemotron_h": "nemotron_h",
               "gemma3": "gemma3_text"}

# TransformerConfig fields that decide the weights' meaning; a checkpoint and the family it is
# converted to must agree on all of them (dropout, init, precision flags do not matter).
ARCHITECTURE_FIELDS = (
    "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
    "vocab_size", "max_position_embeddings", "ffn_hidden_size", "add_bias_linear",
    "add_qkv_bias", "untie_embeddings_and_output_weights", "num_moe_experts",
) + tuple(name for name in FUNCTION_FIELDS
          # HF has no zero-centred norms nor interleaved RoPE: the adapters add the 1 to
          # the norm weights and reorder the q/k rows instead.
          if name not in ("layernorm_zero_centered_gamma", "rotary_interleaved"))
_LISTED = 20


def family_for(model_type: str) -> str:
    family = MODEL_TYPES.get(model_type)
    if family is None:
        raise ConfigError(f"--model-type {model_type!r}: use one of {sorted(MODEL_TYPES)}")
    return family


def listing(items: List[str]) -> str:
    shown = ", ".join(items[:_LISTED])
    return shown + (f" ... and {len(items) - _LISTED} more" if len(items) > _LISTED else "")


def architecture(config: TransformerConfig) -> Dict[str, object]:
    return {name: getattr(config, name) for name in ARCHITECTURE_FIELDS}


def check_family(config: TransformerConfig, family: str, model_type: str) -> None:
    """`config` must be expressible as `family` exactly (its HF config maps back onto it)."""
    try:
        back = get_adapter(family).config_from_hf(config_to_hf(config, family))
    except ConfigError as error:
        raise ConfigError(f"the checkpoint's model is not a {model_type}: {error}; pass the "
                          "--model-type it was trained as") from error
    differing = [
        f"{name}={getattr(config, name)!r} (as {model_type}: {getattr(back, name)!r})"
        for name in ARCHITECTURE_FIELDS if getattr(config, name) != getattr(back, name)
    ]
    if differing:
        raise ConfigError(
            f"the checkpoint's model is not a {model_type}: {listing(differing)}; pass the "
            "--model-type it was trained as"
        )


def meta_hf_model(hf_config) -> torch.nn.Module:
    """The HF causal LM of `hf_config` on the meta device (from_config mutates its config)."""
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_config(copy.deepcopy(hf_config))


def framework_shapes(family: str, config: TransformerConfig) -> Dict[str, torch.Size]:
    """Names and global shapes of the "model" entry of a framework checkpoint (trimmed vocab)."""
    meta = meta_hf_model(config_to_hf(config, family)).state_dict()
    full = trim_vocab(get_adapter(family).from_hf(meta, config), config)
    shapes = {k: v.shape for k, v in full.items()}
    # Multi-token-prediction layers (no HF model has them): norms, eh_proj and a decoder
    # layer of the last layer's kind each.
    last = f"decoder.layers.{config.num_layers - 1}."
    norm_params = ("weight", "bias") if config.normalization == "LayerNorm" else ("weight",)
    h = config.hidden_size
    for k in range(config.mtp_num_layers or 0):
        prefix = f"mtp.layers.{k}."
        for norm in ("enorm", "hnorm", "final_layernorm"):
            for param in norm_params:
                shapes[f"{prefix}{norm}.{param}"] = torch.Size([h])
        shapes[prefix + "eh_proj.weight"] = torch.Size([h, 2 * h])
        for name, shape in list(shapes.items()):
            if name.startswith(last):
                shapes[prefix + "mtp_model_layer." + name[len(last):]] = shape
    return shapes


def _is_vocab_table(name: str) -> bool:
    return name.endswith(VOCAB_PARALLEL_SUFFIXES)


def trim_vocab(state_dict: Mapping[str, torch.Tensor], config) -> Dict[str, torch.Tensor]:
    """Full (TP=1, padded) state dict -> checkpoint form: tables of exactly vocab_size rows."""
    return {k: unpad_vocab(v, config) if _is_vocab_table(k) else v for k, v in state_dict.items()}


def pad_vocab_tables(state_dict: Mapping[str, torch.Tensor], config) -> Dict[str, torch.Tensor]:
    """Inverse of `trim_vocab` (what the adapters' `to_hf` take)."""
    return {k: pad_vocab(v, config) if _is_vocab_table(k) else v for k, v in state_dict.items()}


def compare_state_dicts(
    expected: Mapping[str, torch.Tensor], actual: Mapping[str, torch.Tensor], what: str
) -> None:
    """Raise unless both have the same keys and bit-identical tensors (dtype included)."""
    problems = [f"{k}: missing" for k in sorted(set(expected) - set(actual))]
    problems += [f"{k}: unexpected" for k in sorted(set(actual) - set(expected))]
    for name in sorted(set(expected) & set(actual)):
        a, b = expected[name], actual[name]
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
            problems.append(f"{name}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
                            + ("" if a.shape != b.shape else " (values differ)"))
    if problems:
        raise ConfigError(f"verification failed, {what}: {listing(problems)}")


def config_to_json(config: TransformerConfig) -> Dict[str, object]:
    """TransformerConfig -> the "model" entry of common.json (dtype as its string)."""
    return {k: str(v) if isinstance(v, torch.dtype) else v
            for k, v in dataclasses.asdict(config).items()}


def config_from_json(fields: Mapping[str, object], where: str) -> TransformerConfig:
    known = {f.name for f in dataclasses.fields(TransformerConfig)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ConfigError(f"{where}: unknown TransformerConfig fields {listing(unknown)}")
    values = dict(fields)
    dtype = values.get("params_dtype")
    if isinstance(dtype, str):
        values["params_dtype"] = getattr(torch, dtype.removeprefix("torch."))
    try:
        return TransformerConfig(**values)
    except TypeError as error:
        raise ConfigError(f"{where}: the model config is incomplete ({error})") from error


@contextlib.contextmanager
def world_one_state() -> Iterator:
    """A world-size-1 ParallelState for the checkpoint API (no launcher needed)."""
    created = not dist.is_initialized()
    state = build_parallel_state()
    try:
        if state.world_size != 1:
            raise ConfigError(
                f"convert.py runs as one process (found world size {state.world_size}); run it "
                "with plain python, not torchrun: checkpoints are resharded when loaded"
            )
        yield state
    finally:
        if created:
            destroy_parallel_state()
