"""Read the full-model checkpoint SMP v1 wrote (`--loader smp_v1`).

SMP v1 saved a full model with

    state_dict = model.state_dict(gather_to_rank0=True)
    smp.save({"model_state_dict": state_dict}, path, partial=False)   # torch.save on rank 0

(v1's example scripts also used the key "model"), or with
`smp.save_checkpoint(path, tag, partial=False, model=model)`: the bare state dict in the file
`{path}/{tag}` (translated to HF's layout unless `translate_if_full=False`, which marks it
`_smp_is_partial: False`), its `user_content_{tag}` beside it. The state dict is either v1's own
DistributedTransformer layout (`word_embedding.weight`, `transformer.seq_layers.N....`, or a
custom GPT-2's `transformer.h.N.attention....`), read with v1's translators
(`models.hf.smp_v1`), or already Hugging Face's (the migration guide
translates before saving); `module.`-prefixed keys read as the plain ones. The file is loaded
with `weights_only=True`. Its shape (heads, rotary fraction, ...) comes from the model's Hugging
Face config: `--hf-config` (a config.json or a directory holding one), by default the
config.json beside the checkpoint file.

v1's partial checkpoints (`partial=True`: one file per rank, `{path}_{pp_rank}_{tp_rank}`, each
a `local_state_dict()`) are not read: the files do not record along which dimension each
tensor was split (v1 kept that on the live parameters) nor v1's `optimize` mode, which changes
the split, so no reader can join them safely. They are a clear error saying to save the full
model with v1 instead.
"""
from __future__ import annotations

import glob
import json
import os
import re
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

import torch

from megatron_smp.checkpointing.megatron_lm import (copy_into, load_mapped, release_mapped_files,
                                                     release_pages)
from megatron_smp.config import ConfigError, TransformerConfig
from megatron_smp.models.hf import family_of, get_adapter
from megatron_smp.models.hf.smp_v1 import (
    TRANSLATORS,
    is_derived_hf_buffer,
    strip_module_prefix,
    translate_state_dict_to_hf_gpt2_layer,
)
from tools.checkpoint.common import listing, meta_hf_model
from tools.checkpoint.streaming import meta_like, partial

HEAD = "lm_head.weight"
# Keys that only v1's own layout has (the HF layouts of these families have none of them).
_V1_ROOTS = ("word_embedding.", "position_embedding.", "transformer.seq_layers.", "layernorm.")
_PARTIAL_SUFFIX = re.compile(r"_\d+_\d+(_\d+)?$")
# v1's custom GPT-2: HF's model with DistributedTransformerLayers in place of its blocks.
_V1_GPT2_BLOCK = re.compile(r"^transformer\.h\.\d+\.(attention|output)\.")


def _partial_error(path: str) -> ConfigError:
    return ConfigError(
        f"{path} is SMP v1's partial checkpoint (smp.save(..., partial=True): one file per "
        "pipeline x tensor-parallel rank). Those files do not record how v1 split each tensor, "
        "so they cannot be joined here; in SMP v1 save the full model instead: "
        "sd = model.state_dict(gather_to_rank0=True); "
        "smp.save({'model_state_dict': sd}, path, partial=False)"
    )


def _checkpoint_file(load_dir: str) -> str:
    """The file v1 wrote: `load_dir` itself, or the one checkpoint file inside it."""
    if os.path.isfile(load_dir):
        if _PARTIAL_SUFFIX.search(load_dir):
            raise _partial_error(load_dir)
        return load_dir
    if not os.path.isdir(load_dir):
        if glob.glob(glob.escape(load_dir) + "_*"):
            raise _partial_error(load_dir + "_*")
        raise ConfigError(f"--load-dir {load_dir} does not exist")
    # config.json, and smp.save_checkpoint's user_content_{tag} beside its {tag} file.
    names = sorted(n for n in os.listdir(load_dir)
                   if os.path.isfile(os.path.join(load_dir, n)) and not n.endswith(".json")
                   and not n.startswith("user_content"))
    if len(names) > 1 and all(_PARTIAL_SUFFIX.search(n) for n in names):
        raise _partial_error(os.path.join(load_dir, names[0]))
    if len(names) != 1:
        raise ConfigError(
            f"--load-dir {load_dir} holds {len(names)} candidate checkpoint files "
            f"({listing(names) or 'none'}); give the file smp.save wrote as --load-dir"
        )
    return os.path.join(load_dir, names[0])


def _read_hf_config(hf_config_path: Optional[str], checkpoint_file: str):
    from transformers import AutoConfig

    path = hf_config_path or os.path.join(os.path.dirname(checkpoint_file), "config.json")
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise ConfigError(
            f"--loader smp_v1 needs the model's Hugging Face config (the one the v1 model was "
            f"built from) for its head count and shape: {path} does not exist; save it with "
            "hf_config.save_pretrained(DIR) and pass --hf-config DIR"
        )
    try:
        with open(path) as handle:
            fields = json.load(handle)
        return AutoConfig.for_model(fields.pop("model_type"), **fields)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ConfigError(f"--hf-config {path} is not a Hugging Face config.json: {error!r}"
                          ) from error


def _model_state_dict(saved: Any, path: str) -> Dict[str, torch.Tensor]:
    """The state dict inside what smp.save wrote, keys without `module.`."""
    if not isinstance(saved, Mapping):
        raise ConfigError(f"{path} holds a {type(saved).__name__}, not the dict smp.save wrote")
    if saved.get("_smp_is_partial"):
        raise _partial_error(path)
    for key in ("model_state_dict", "model"):
        if isinstance(saved.get(key), Mapping):
            saved = saved[key]
            break
    state_dict = strip_module_prefix(saved)
    if state_dict.get("_smp_is_partial"):
        raise _partial_error(path)
    # v1's bookkeeping: smp.save_checkpoint(partial=False, translate_if_full=False) marks its
    # full state dict `_smp_is_partial: False`; `_smp_load_info` records the saving layout.
    state_dict.pop("_smp_is_partial", None)
    state_dict.pop("_smp_load_info", None)
    others = sorted(k for k, v in state_dict.items() if not isinstance(v, torch.Tensor))
    if others or not state_dict:
        raise ConfigError(
            f"{path}: expected {{'model_state_dict': state_dict}} (or a state dict) of tensors; "
            f"found non-tensor entries {listing(others) or '(empty)'}"
        )
    return state_dict


def _check_against_model(hf_sd: Mapping[str, torch.Tensor], hf_config, path: str,
                         tied: bool) -> None:
    """Names and shapes as the HF model of `hf_config` has them (a tied head left out)."""
    expected = {k: v.shape for k, v in meta_hf_model(hf_config).state_dict().items()
                if not (tied and k == HEAD)}
    problems = [f"{k}: missing" for k in sorted(set(expected) - set(hf_sd))]
    problems += [f"{k}: unexpected" for k in sorted(set(hf_sd) - set(expected))]
    problems += [f"{k}: {list(hf_sd[k].shape)}, the config says {list(expected[k])}"
                 for k in sorted(set(expected) & set(hf_sd)) if hf_sd[k].shape != expected[k]]
    if problems:
        raise ConfigError(f"{path} does not match its Hugging Face config "
                          f"({type(hf_config).__name__}): {listing(problems)}")


def read_smp_v1_checkpoint(load_dir: str, family: str, model_type: str,
                           hf_config_path: Optional[str] = None
                           ) -> Tuple[Any, TransformerConfig, Dict[str, torch.Tensor]]:
    """-> (hf_config, TransformerConfig, HF state dict without a tied output head), as
    `read_hf_checkpoint` gives for a Hugging Face directory."""
    if family not in TRANSLATORS:
        raise ConfigError(
            f"--loader smp_v1 reads SMP v1's GPT-2, GPT-NeoX and GPT-J checkpoints (the models "
            f"v1 had translators for); --model-type {model_type} is not one: use gpt2, gpt_neox "
            "or gptj"
        )
    path = _checkpoint_file(load_dir)
    hf_config = _read_hf_config(hf_config_path, path)
    found = family_of(hf_config)
    if found != family:
        raise ConfigError(f"the Hugging Face config for {path} is a {found!r} model but "
                          f"--model-type is {model_type}; pass the model type of the checkpoint")
    state_dict = _load(path)
    hf_sd = _translator(family, hf_config, state_dict)(state_dict)
    config = get_adapter(family).config_from_hf(hf_config)
    tied = not config.untie_embeddings_and_output_weights
    if tied:
        hf_sd.pop(HEAD, None)  # the word embedding table itself
    _check_against_model(hf_sd, hf_config, path, tied)
    dtypes = {t.dtype for t in hf_sd.values()}
    if len(dtypes) == 1:
        config = config.replace(params_dtype=dtypes.pop())
    return hf_config, config, hf_sd


def _load(path: str) -> Dict[str, torch.Tensor]:
    """The model state dict of the file, its tensors memory-mapped (`load_mapped`: read from
    the file when touched)."""
    try:
        saved = load_mapped(path)
    except Exception as error:  # unpickling refused or a corrupt file: both the user's input
        raise ConfigError(f"{path} cannot be read as a torch.save file with weights_only=True "
                          f"({error})") from error
    return _model_state_dict(saved, path)


def _translator(family: str, hf_config, state_dict: Mapping[str, torch.Tensor]
                ) -> Callable[[Mapping[str, torch.Tensor]], Dict[str, torch.Tensor]]:
    """v1's state dict -> Hugging Face's, for the layout `state_dict` is in."""
    if any(k.startswith(_V1_ROOTS) for k in state_dict):
        to_hf, _, needs_config = TRANSLATORS[family]
        return lambda sd: to_hf(sd, **({"config": hf_config} if needs_config else {}))
    if family == "gpt2" and any(map(_V1_GPT2_BLOCK.match, state_dict)):
        return translate_state_dict_to_hf_gpt2_layer
    # Already translated to HF's layout before saving (the v1 -> v2 migration guide): v1's
    # translators also wrote causal-mask buffers, and NeoX's head as embed_out.
    return lambda sd: {("lm_head.weight" if k == "embed_out.weight" else k): v
                       for k, v in sd.items() if not is_derived_hf_buffer(k)}


# A transformer layer's index in v1's names (transformer.seq_layers.3., transformer.h.3.)
# and HF's.
_ANY_LAYER = re.compile(r"(?:^|\.)(?:seq_layers|layers|h)\.(\d+)\.")


def _meta_inputs(state_dict: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """`state_dict` as meta tensors, less v1's optional rotary buffers (GPT-NeoX's
    `inv_freq`), which the translator compares by value with the config's: each layer's is
    given real with that layer's tensors, so it is still checked."""
    return meta_like({k: v for k, v in state_dict.items()
                      if not k.endswith("rotary_emb.inv_freq")})


class _V1Source:
    """The HF tensors of a v1 file, translated one layer at a time: `read(names)` runs v1's
    translator on the memory-mapped tensors of those names' layers (every other tensor a meta
    tensor, `streaming.partial`), then releases the pages read."""

    def __init__(self, state_dict, translate, hf_meta) -> None:
        self.state_dict, self.translate = state_dict, translate
        self.meta = hf_meta
        self.file_of = dict.fromkeys(hf_meta)
        self.v1_meta = _meta_inputs(state_dict)
        self.held: Dict[str, torch.Tensor] = {}

    @staticmethod
    def _layer(name: str):
        match = _ANY_LAYER.search(name)
        return int(match.group(1)) if match else None

    def read(self, names) -> Dict[str, torch.Tensor]:
        out = {name: self.held.pop(name) for name in names if name in self.held}
        layers = {self._layer(name) for name in names if name not in out}
        if layers:
            real = {k: v for k, v in self.state_dict.items() if self._layer(k) in layers}
            translated = partial(self.translate, self.v1_meta, real)
            inputs = {v.untyped_storage().data_ptr() for v in real.values()}
            for name, tensor in translated.items():
                if name in names and name not in out:
                    keep = out
                elif self._layer(name) is None and None not in layers:
                    # A tensor outside the layers kept in one (GPT-2's final norm in v1's
                    # last layer): held until asked for.
                    keep = self.held
                else:
                    continue
                if tensor.untyped_storage().data_ptr() in inputs:
                    # Its own memory, copied a piece at a time with the pages read released.
                    copy = torch.empty(tensor.shape, dtype=tensor.dtype)
                    copy_into(copy, tensor)
                    tensor = copy
                keep[name] = tensor
            release_pages(real.values())
            release_mapped_files()
        missing = [name for name in names if name not in out]
        if missing:
            raise ConfigError(f"SMP v1's translator computes {listing(missing)} from tensors of "
                              "other layers: this checkpoint cannot be converted a layer at a "
                              "time")
        return out


def open_smp_v1_stream(load_dir: str, family: str, model_type: str,
                       hf_config_path: Optional[str] = None):
    """The v1 file as an `HFStream` (framework tensors one layer at a time), or None when
    its translation cannot be run on meta tensors (`read_smp_v1_checkpoint` then reads it
    whole)."""
    from tools.checkpoint.hf_format import HFStream

    if family not in TRANSLATORS:
        return None  # read_smp_v1_checkpoint says which families are read
    path = _checkpoint_file(load_dir)
    hf_config = _read_hf_config(hf_config_path, path)
    if family_of(hf_config) != family:
        return None
    state_dict = _load(path)
    translate = _translator(family, hf_config, state_dict)
    try:
        hf_meta = {k: v for k, v in translate(_meta_inputs(state_dict)).items()
                   if v.device.type == "meta"}
    except Exception:  # noqa: BLE001 -- a translator that needs the values: read whole
        return None
    config = get_adapter(family).config_from_hf(hf_config)
    tied = not config.untie_embeddings_and_output_weights
    if tied:
        hf_meta.pop(HEAD, None)
    _check_against_model(hf_meta, hf_config, path, tied)
    return HFStream.of_source(path, family, hf_config, _V1Source(state_dict, translate, hf_meta))


__all__ = ["read_smp_v1_checkpoint", "open_smp_v1_stream"]
