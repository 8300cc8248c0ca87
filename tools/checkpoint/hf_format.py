"""Read and write Hugging Face checkpoint directories (config.json + weights).

Reading takes model.safetensors, a sharded model.safetensors.index.json, or pytorch_model.bin
(plus its index), the latter with `torch.load(weights_only=True)`. Every tensor must be one
the transformers class of the config expects, with its shape; derived buffers older
checkpoints carry (GPT-2's causal mask `attn.bias`, `rotary_emb.inv_freq`) are dropped with a
note, anything else unexpected or missing is an error listing the names.

Writing produces what `save_pretrained` would: config.json, generation_config.json and one
model.safetensors (tied output weights are not stored, as transformers does).
"""
from __future__ import annotations

import json
import os
import re
from typing import Dict, List, Mapping, Optional, Tuple

import torch

from megatron_smp.config import ConfigError, TransformerConfig
from megatron_smp.models.hf import config_to_hf, family_of, get_adapter
from tools.checkpoint.common import (
    architecture,
    compare_state_dicts,
    hf_shapes,
    listing,
    meta_hf_model,
    pad_vocab_tables,
    trim_vocab,
)

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
PYTORCH_BIN = "pytorch_model.bin"
PYTORCH_BIN_INDEX = "pytorch_model.bin.index.json"
HEAD = "lm_head.weight"
# Buffers recomputed by the model (causal masks, RoPE frequencies), not weights.
_DERIVED_BUFFERS = re.compile(r"(\.attn\.(masked_)?bias|\.attention\.(masked_)?bias|"
                              r"\.crossattention\.bias|rotary_emb\.inv_freq)$")


def _weight_files(load_dir: str) -> List[str]:
    for index_name in (SAFETENSORS_INDEX, PYTORCH_BIN_INDEX):
        index_path = os.path.join(load_dir, index_name)
        if os.path.isfile(index_path):
            with open(index_path) as f:
                weight_map = json.load(f).get("weight_map", {})
            return [os.path.join(load_dir, name) for name in sorted(set(weight_map.values()))]
    for name in (SAFETENSORS, PYTORCH_BIN):
        if os.path.isfile(os.path.join(load_dir, name)):
            return [os.path.join(load_dir, name)]
    raise ConfigError(
        f"--load-dir {load_dir} holds no {SAFETENSORS}, {SAFETENSORS_INDEX}, {PYTORCH_BIN} or "
        f"{PYTORCH_BIN_INDEX} (found: {listing(sorted(os.listdir(load_dir)))})"
    )


def _read_file(path: str) -> Dict[str, torch.Tensor]:
    if not os.path.isfile(path):
        raise ConfigError(f"{path} is named in the checkpoint index but does not exist")
    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file

            return load_file(path)
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:
        raise ConfigError(f"{path} cannot be read ({type(error).__name__}: {error})") from error
    if not isinstance(loaded, dict) or not all(torch.is_tensor(v) for v in loaded.values()):
        raise ConfigError(f"{path} is not a state dict of tensors")
    return loaded


def _input_embedding_name(hf_config) -> str:
    model = meta_hf_model(hf_config)
    table = model.get_input_embeddings().weight
    return next(name for name, param in model.named_parameters() if param is table)


def _normalise_names(raw: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Size],
                     base_prefix: str) -> Tuple[Dict[str, torch.Tensor], List[str]]:
    """Add the base-model prefix where a checkpoint of the bare base model omits it (the
    original GPT-2 files say "h.0..." for "transformer.h.0..."); drop derived buffers."""
    sd, dropped = {}, []
    for name, tensor in raw.items():
        if name not in expected and f"{base_prefix}.{name}" in expected:
            name = f"{base_prefix}.{name}"
        if name not in expected and _DERIVED_BUFFERS.search(name):
            dropped.append(name)
            continue
        sd[name] = tensor
    return sd, dropped


def read_hf_checkpoint(load_dir: str, family: str, model_type: str):
    """-> (hf_config, TransformerConfig, HF state dict); every name and shape checked."""
    from transformers import AutoConfig

    if not os.path.isfile(os.path.join(load_dir, "config.json")):
        raise ConfigError(f"--load-dir {load_dir} has no config.json: not a Hugging Face model")
    hf_config = AutoConfig.from_pretrained(load_dir)
    found = family_of(hf_config)
    if found != family:
        raise ConfigError(
            f"{load_dir}/config.json is a {found!r} model but --model-type is {model_type}; "
            f"pass the model type of the checkpoint"
        )
    config = get_adapter(family).config_from_hf(hf_config)

    raw: Dict[str, torch.Tensor] = {}
    for path in _weight_files(load_dir):
        part = _read_file(path)
        repeated = sorted(set(part) & set(raw))
        if repeated:
            raise ConfigError(f"{path} repeats tensors of another file: {listing(repeated)}")
        raw.update(part)

    expected = hf_shapes(hf_config)
    base_prefix = meta_hf_model(hf_config).base_model_prefix
    hf_sd, dropped = _normalise_names(raw, expected, base_prefix)
    if dropped:
        print(f"note: ignoring {len(dropped)} derived buffers ({listing(dropped)})")
    tied = not config.untie_embeddings_and_output_weights
    problems = [f"{k}: unexpected" for k in sorted(set(hf_sd) - set(expected))]
    problems += [f"{k}: missing" for k in sorted(set(expected) - set(hf_sd))
                 if not (tied and k == HEAD)]
    problems += [f"{k}: shape {list(hf_sd[k].shape)}, the config says {list(expected[k])}"
                 for k in sorted(set(hf_sd) & set(expected)) if hf_sd[k].shape != expected[k]]
    if problems:
        raise ConfigError(
            f"{load_dir} does not match its config.json ({type(meta_hf_model(hf_config)).__name__}"
            f"): {listing(problems)}"
        )
    if tied and HEAD in hf_sd:
        # Stored anyway (pytorch_model.bin does): it must be the embedding table it is tied to.
        if not torch.equal(hf_sd.pop(HEAD), hf_sd[_input_embedding_name(hf_config)]):
            raise ConfigError(
                f"{load_dir}: tie_word_embeddings is true but {HEAD} differs from the input "
                "embeddings; fix config.json (tie_word_embeddings=false) or the weights"
            )
    dtypes = {t.dtype for t in hf_sd.values()}
    if len(dtypes) == 1:
        config = config.replace(params_dtype=dtypes.pop())
    return hf_config, config, hf_sd


def hf_state_dict_from_framework(family: str, config: TransformerConfig,
                                 model: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Checkpoint-form framework tensors -> HF state dict as stored (tied head left out)."""
    hf_sd = get_adapter(family).to_hf(pad_vocab_tables(model, config), config)
    if not config.untie_embeddings_and_output_weights:
        del hf_sd[HEAD]
    return hf_sd


def framework_from_hf_state_dict(family: str, config: TransformerConfig,
                                 hf_sd: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """HF state dict (tied head absent) -> checkpoint-form framework tensors."""
    return trim_vocab(get_adapter(family).from_hf(hf_sd, config), config)


def _hf_config_for(config: TransformerConfig, family: str, source: Optional[dict]):
    """The HF config to write. A checkpoint converted from HF remembers the source config;
    when the model still has that architecture it is reused, keeping what the framework does
    not model (token ids, Mistral's sliding_window, ...)."""
    generated = config_to_hf(config, family)
    if source and source.get("model_type") == generated.model_type:
        remembered = type(generated).from_dict(dict(source))
        same = architecture(get_adapter(family).config_from_hf(remembered))
        if same == architecture(config):
            return remembered
    return generated


def write_hf_checkpoint(save_dir: str, family: str, config: TransformerConfig,
                        model: Mapping[str, torch.Tensor], source_hf_config: Optional[dict] = None):
    """Write a from_pretrained-loadable directory, re-read it and compare bit for bit."""
    from safetensors.torch import load_file, save_file
    from transformers import GenerationConfig

    hf_config = _hf_config_for(config, family, source_hf_config)
    hf_sd = {k: v.contiguous() for k, v in hf_state_dict_from_framework(family, config, model).items()}
    expected = hf_shapes(hf_config)
    if not config.untie_embeddings_and_output_weights:
        del expected[HEAD]
    wrong = sorted(set(expected) ^ set(hf_sd))
    wrong += [k for k in sorted(set(expected) & set(hf_sd)) if expected[k] != hf_sd[k].shape]
    if wrong:
        raise ConfigError(f"the converted tensors do not fit the {family} model: {listing(wrong)}")
    hf_config.architectures = [type(meta_hf_model(hf_config)).__name__]
    dtypes = {t.dtype for t in hf_sd.values()}
    hf_config.dtype = dtypes.pop() if len(dtypes) == 1 else config.params_dtype

    os.makedirs(save_dir, exist_ok=True)
    hf_config.save_pretrained(save_dir)
    try:
        GenerationConfig.from_model_config(hf_config).save_pretrained(save_dir)
    except Exception as error:  # optional file: a config transformers cannot derive one from
        print(f"note: no generation_config.json ({type(error).__name__}: {error})")
    path = os.path.join(save_dir, SAFETENSORS)
    save_file(hf_sd, path, metadata={"format": "pt"})

    reread = load_file(path)
    compare_state_dicts(hf_sd, reread, f"re-reading {path}")
    compare_state_dicts(model, framework_from_hf_state_dict(family, config, reread),
                        f"mapping {path} back to the framework")
    return hf_config
