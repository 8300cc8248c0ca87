"""Read and write Hugging Face checkpoint directories with transformers' own reader/writer.

Reading is `from_pretrained(output_loading_info=True)`, made strict: it takes model.safetensors,
sharded indexes or pytorch_model.bin (with `weights_only=True`), applies the renames between
file and module names that transformers knows (GPT-NeoX stores `lm_head` as `embed_out`, the
original GPT-2 files lack the `transformer.` prefix) and skips derived buffers old files carry
(`attn.bias` masks); any missing, unexpected or misshapen tensor is an error listing the names.

Writing assigns the converted tensors to the HF model built on the meta device (no copy) and
calls `save_pretrained` (config.json, generation_config.json, safetensors, the file names of
the installed transformers); then the directory is loaded back with `from_pretrained` and
compared bit for bit, and mapped back to the framework and compared again.

An MXFP4 checkpoint (`quantization_config.quant_method: mxfp4`, the published gpt-oss) is read
from its safetensors files directly: each `*_blocks` + `*_scales` pair is dequantized to the
dtype of the other tensors, bf16 in the published checkpoints (`models.hf.mxfp4`), the names
and shapes are checked against the HF model of the config like any other checkpoint, and the
config loses its `quantization_config`, so what is written back (HF export) is the bf16 model;
`quantize_hf_experts` (convert.py --mxfp4-experts) writes the experts in MXFP4 instead.
"""
from __future__ import annotations

import glob
import json
import os
from typing import Callable, Dict, Iterator, List, Mapping, Optional

import torch

from megatron_smp.config import ConfigError, TransformerConfig
from megatron_smp.models.hf import config_to_hf, family_of, get_adapter
from megatron_smp.models.hf.common import vocab_tables_in_place
from megatron_smp.models.hf.mxfp4 import (
    BLOCKS_SUFFIX,
    SCALES_SUFFIX,
    dequantize_mxfp4,
    dequantize_state_dict,
    is_mxfp4,
    quantize_mxfp4,
)
from tools.checkpoint.common import (
    architecture,
    compare_state_dicts,
    listing,
    meta_hf_model,
    pad_vocab_tables,
    trim_vocab,
)

from tools.checkpoint.streaming import (  # noqa: E402
    SafetensorsSource,
    ShardedSafetensorsWriter,
    check_digests,
    digest,
    groups,
    partial,
    reread_safetensors,
    to_file_names,
    to_module_names,
    unpadded,
)

# save_pretrained's default --max-shard-size.
DEFAULT_MAX_SHARD_SIZE = 50 * 10**9

HEAD = "lm_head.weight"


def _from_pretrained(load_dir: str, what: str):
    """transformers' own reader (safetensors, sharded indexes, pytorch_model.bin with
    weights_only, its weight renames such as GPT-NeoX's embed_out), made strict."""
    from transformers import AutoModelForCausalLM

    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            load_dir, output_loading_info=True, dtype="auto"
        )
    except (OSError, RuntimeError, ValueError) as error:
        raise ConfigError(f"{what} {load_dir} cannot be loaded: {error}") from error
    problems = [f"{k}: missing" for k in sorted(info["missing_keys"])]
    problems += [f"{k}: unexpected" for k in sorted(info["unexpected_keys"])]
    problems += [f"{k}: shape mismatch" for k in sorted(map(str, info["mismatched_keys"]))]
    problems += [str(message) for message in info["error_msgs"]]
    if problems:
        raise ConfigError(
            f"{what} {load_dir} does not match its config.json ({type(model).__name__}): "
            f"{listing(problems)}"
        )
    return model


def read_hf_config(load_dir: str, family: str, model_type: str):
    """-> (hf_config, TransformerConfig, multimodal) of an HF directory's config.json."""
    from transformers import AutoConfig

    if not os.path.isfile(os.path.join(load_dir, "config.json")):
        raise ConfigError(f"--load-dir {load_dir} has no config.json: not a Hugging Face model")
    adapter = get_adapter(family)
    hf_config = AutoConfig.from_pretrained(load_dir)
    # A multimodal checkpoint whose language model is this family's (Gemma 3 4B-27B).
    multimodal = hf_config.model_type in getattr(adapter, "MULTIMODAL_MODEL_TYPES", ())
    found = family if multimodal else family_of(hf_config)
    if found != family:
        raise ConfigError(
            f"{load_dir}/config.json is a {found!r} model but --model-type is {model_type}; "
            "pass the model type of the checkpoint"
        )
    return hf_config, multimodal


def read_hf_checkpoint(load_dir: str, family: str, model_type: str):
    """-> (hf_config, TransformerConfig, HF state dict without a tied output head), the whole
    model in memory (`HFStream` converts one layer at a time)."""
    adapter = get_adapter(family)
    hf_config, multimodal = read_hf_config(load_dir, family, model_type)
    if is_mxfp4(hf_config):
        hf_config, hf_sd = _read_mxfp4(load_dir, hf_config)
    else:
        model = _from_pretrained(load_dir, "--load-dir")
        hf_config, hf_sd = model.config, dict(model.state_dict())
    if multimodal:
        hf_config, hf_sd, left_out = adapter.language_model_of(hf_config, hf_sd)
        print(f"{load_dir}: converting the language model of {type(model).__name__}; its "
              f"{len(left_out)} vision tensors ({', '.join(sorted(left_out)[:2])}, ...) are "
              "left out")
    config = adapter.config_from_hf(hf_config)
    if not config.untie_embeddings_and_output_weights:
        del hf_sd[HEAD]
    dtypes = {t.dtype for t in hf_sd.values()}
    if len(dtypes) == 1:
        config = config.replace(params_dtype=dtypes.pop())
    return hf_config, config, hf_sd


class HFStream:
    """An HF directory's safetensors converted to framework tensors one group (a layer, or a
    tensor outside the layers) at a time (`streaming`). `of` gives None for what is read
    whole instead (`read_hf_checkpoint`): pytorch_model.bin, MXFP4 experts, a multimodal
    model, names that only transformers' legacy renames match."""

    def __init__(self, load_dir, family, hf_config, config, source, meta_model, meta_hf) -> None:
        self.load_dir, self.family, self.hf_config = load_dir, family, hf_config
        self.config, self.source, self.meta_model, self.meta_hf = config, source, meta_model, \
            meta_hf
        self.adapter = get_adapter(family)
        # The adapter maps with tables of their own vocab_size rows (`unpadded`), in place.
        self.meta = self.adapter.from_hf(dict(meta_hf), unpadded(config))  # on meta

    @classmethod
    def of(cls, load_dir: str, family: str, model_type: str) -> Optional["HFStream"]:
        hf_config, multimodal = read_hf_config(load_dir, family, model_type)
        source = SafetensorsSource.of(load_dir)
        if multimodal or is_mxfp4(hf_config) or source is None:
            return None
        return cls.of_source(load_dir, family, hf_config, source)

    @classmethod
    def of_source(cls, load_dir: str, family: str, hf_config, source) -> Optional["HFStream"]:
        """The stream of `source`'s HF tensors (`.file_of`: their names, `.meta`, `.read(names)`;
        a SafetensorsSource or another reader of that form), None when they are not exactly
        the HF model's of `hf_config` (the whole-model path then says what differs)."""
        config = get_adapter(family).config_from_hf(hf_config)
        meta_model = meta_hf_model(hf_config)
        try:
            module_meta, unmatched = to_module_names(meta_model, source.meta)
        except ImportError:  # a transformers without its weight-conversion API (< 5)
            return None
        expected = meta_model.state_dict()
        tied = not config.untie_embeddings_and_output_weights
        if tied:
            expected.pop(HEAD, None)
            module_meta.pop(HEAD, None)
        if unmatched or set(module_meta) != set(expected) or any(
                module_meta[k].shape != v.shape for k, v in expected.items()):
            return None  # from_pretrained's renames and its strict error listing
        dtypes = {t.dtype for t in module_meta.values()}
        if len(dtypes) == 1:
            config = config.replace(params_dtype=dtypes.pop())
        return cls(load_dir, family, hf_config, config, source, meta_model, module_meta)

    def groups(self) -> Iterator[Dict[str, torch.Tensor]]:
        """Each group's framework tensors (vocabulary tables of vocab_size rows), after the
        group was mapped back to HF and compared with what was read, bit for bit. A
        vocabulary table is the tensor read (not copied), its tied head the same tensor."""
        config, tied = unpadded(self.config), not self.config.untie_embeddings_and_output_weights
        for names in groups(self.source.file_of):
            hf_sd, _ = to_module_names(self.meta_model, self.source.read(names))
            if tied:
                hf_sd.pop(HEAD, None)
            read = {k: digest(v) for k, v in hf_sd.items()}
            with vocab_tables_in_place():
                out = partial(lambda sd: self.adapter.from_hf(sd, config), self.meta_hf, hf_sd)
                del hf_sd
                back = partial(lambda sd: self.adapter.to_hf(sd, config), self.meta, out)
            if tied:
                back.pop(HEAD, None)
            check_digests(read, back, f"mapping {names[0]}... of {self.load_dir} to the "
                          "framework and back")
            del back
            yield out
            del out  # the writer has taken the tensors: they go before the next group comes


def _read_mxfp4(load_dir: str, hf_config):
    """(the config without its quantization, the bf16 state dict) of an MXFP4 checkpoint, its
    names and shapes checked against the HF model of that config."""
    from safetensors.torch import load_file

    files = sorted(glob.glob(os.path.join(load_dir, "*.safetensors")))
    if not files:
        raise ConfigError(f"--load-dir {load_dir}: config.json says MXFP4 (quantization_config) "
                          "but there are no *.safetensors files")
    raw: Dict[str, torch.Tensor] = {}
    for path in files:
        raw.update(load_file(path))
    # To the dtype of the tensors stored plainly (bf16 in the published checkpoints).
    plain = {t.dtype for k, t in raw.items() if t.is_floating_point()}
    dtype = plain.pop() if len(plain) == 1 else torch.bfloat16
    try:
        hf_sd = dequantize_state_dict(raw, dtype)
    except ValueError as error:
        raise ConfigError(f"--load-dir {load_dir}: {error}") from error
    del hf_config.quantization_config
    expected = meta_hf_model(hf_config).state_dict()
    if hf_config.tie_word_embeddings:  # the file need not hold the tied head
        hf_sd.setdefault(HEAD, hf_sd.get("model.embed_tokens.weight"))
    problems = [f"{k}: missing" for k in sorted(set(expected) - set(hf_sd))]
    problems += [f"{k}: unexpected" for k in sorted(set(hf_sd) - set(expected))]
    problems += [f"{k}: shape {list(hf_sd[k].shape)}, expected {list(v.shape)}"
                 for k, v in expected.items() if k in hf_sd and hf_sd[k].shape != v.shape]
    if problems:
        raise ConfigError(f"--load-dir {load_dir} does not match its config.json (MXFP4 "
                          f"dequantized): {listing(problems)}")
    return hf_config, hf_sd


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
    not model (token ids, ...)."""
    generated = config_to_hf(config, family)
    if source and source.get("model_type") == generated.model_type:
        remembered = type(generated).from_dict(dict(source))
        same = architecture(get_adapter(family).config_from_hf(remembered))
        if same == architecture(config):
            return remembered
    return generated


def write_hf_checkpoint(save_dir: str, family: str, config: TransformerConfig,
                        model: Mapping[str, torch.Tensor], source_hf_config: Optional[dict] = None,
                        max_shard_size: int = DEFAULT_MAX_SHARD_SIZE):
    """`write_hf_checkpoint_streaming` of framework tensors held in memory."""
    return write_hf_checkpoint_streaming(
        save_dir, family, config, {k: torch.empty(v.shape, dtype=v.dtype, device="meta")
                                   for k, v in model.items()},
        lambda names: {k: model[k] for k in names}, source_hf_config, max_shard_size)


def write_hf_checkpoint_streaming(save_dir: str, family: str, config: TransformerConfig,
                                  meta: Mapping[str, torch.Tensor],
                                  read: Callable[[List[str]], Dict[str, torch.Tensor]],
                                  source_hf_config: Optional[dict] = None,
                                  max_shard_size: int = DEFAULT_MAX_SHARD_SIZE):
    """Write the framework tensors `read(names)` gives (those of `meta`, checkpoint form) as
    an HF directory, one group (a layer, or a tensor outside the layers) at a time: the
    family adapter's `to_hf`, then transformers' own conversion to the names save_pretrained
    writes (per-expert tensors of its fused MoE modules), into safetensors shards of at most
    `max_shard_size` bytes as save_pretrained lays them out, with config.json and
    generation_config.json. Each group is mapped back (transformers' conversion for
    from_pretrained, the adapter's `from_hf`) and compared with what was read; the written
    files are re-read one tensor at a time and compared with what was written."""
    adapter = get_adapter(family)
    tied = not config.untie_embeddings_and_output_weights
    hf_config = _hf_config_for(config, family, source_hf_config)
    # The adapter maps with tables of their own vocab_size rows (`unpadded`), in place: a
    # vocabulary table (and a tied head) is the tensor read, not a copy.
    table_config = unpadded(config)
    meta_hf = adapter.to_hf(dict(meta), table_config)
    if tied:
        meta_hf.pop(HEAD, None)
    dtypes = {t.dtype for t in meta_hf.values()}
    hf_config.dtype = dtypes.pop() if len(dtypes) == 1 else config.params_dtype
    meta_model = meta_hf_model(hf_config)
    expected = meta_model.state_dict()
    if tied:
        expected.pop(HEAD, None)
    wrong = [f"{k}: missing" for k in sorted(set(expected) - set(meta_hf))]
    wrong += [f"{k}: unexpected" for k in sorted(set(meta_hf) - set(expected))]
    wrong += [f"{k}: shape {list(meta_hf[k].shape)}, expected {list(v.shape)}"
              for k, v in expected.items() if k in meta_hf and meta_hf[k].shape != v.shape]
    if wrong:
        raise ConfigError(f"the converted tensors do not fit {type(meta_model).__name__}: "
                          f"{listing(wrong)}")
    writer = ShardedSafetensorsWriter(save_dir, max_shard_size)
    for names in groups(meta):
        ours = read(names)
        read_digests = {k: digest(v) for k, v in ours.items()}
        with vocab_tables_in_place():
            hf_sd = partial(lambda sd: adapter.to_hf(sd, table_config), meta, ours)
        del ours
        if tied:
            hf_sd.pop(HEAD, None)
        files = to_file_names(meta_model, hf_sd)
        del hf_sd
        module, unmatched = to_module_names(meta_model, files)
        if unmatched:
            raise ConfigError(f"verification failed: transformers does not read back "
                              f"{listing(unmatched)} of {save_dir}")
        with vocab_tables_in_place():
            back = partial(lambda sd: adapter.from_hf(sd, table_config), meta_hf, module)
        del module
        check_digests(read_digests, back,
                      f"mapping {names[0]}... to {save_dir} and back to the framework")
        del back
        for name in list(files):
            writer.add(name, files.pop(name))
    writer.finish()
    meta_model.config.architectures = [type(meta_model).__name__]
    meta_model.config.save_pretrained(save_dir)
    if meta_model.can_generate():
        meta_model.generation_config.save_pretrained(save_dir)
    reread_safetensors(save_dir, writer.digests)
    return meta_model.config


# The expert projections gpt-oss checkpoints store in MXFP4, and what stays bf16 (the
# published checkpoints' quantization_config).
MXFP4_EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
MXFP4_NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                       "model.embed_tokens", "lm_head"]


def quantize_hf_experts(save_dir: str) -> None:
    """Rewrite a written gpt-oss HF checkpoint with its expert projections in MXFP4 (as the
    published checkpoints store them): each `P` of every safetensors file becomes `P_blocks`
    + `P_scales` (the index updated), config.json gains the quantization_config; then the
    directory is read back through the MXFP4 reader and compared bit for bit with the
    dequantized quantization of the tensors it replaced."""
    from safetensors.torch import load_file, save_file

    expected: Dict[str, torch.Tensor] = {}
    renames: Dict[str, str] = {}
    for path in sorted(glob.glob(os.path.join(save_dir, "*.safetensors"))):
        tensors = load_file(path)
        for name in [k for k in tensors if k.endswith(MXFP4_EXPERTS)]:
            weight = tensors.pop(name)
            if weight.shape[1] % 32:
                raise ConfigError(f"--mxfp4-experts: {name} has {weight.shape[1]} inputs, not a "
                                  "multiple of 32 (MXFP4's block); export without it")
            blocks, scales = quantize_mxfp4(weight)
            tensors[name + BLOCKS_SUFFIX], tensors[name + SCALES_SUFFIX] = blocks, scales
            expected[name] = dequantize_mxfp4(blocks, scales, weight.dtype)
            renames[name] = os.path.basename(path)
        save_file(tensors, path, metadata={"format": "pt"})
    if not expected:
        raise ConfigError(f"--mxfp4-experts: {save_dir} holds no gpt-oss expert projections")
    index_path = os.path.join(save_dir, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        with open(index_path) as handle:
            index = json.load(handle)
        for name, file in renames.items():
            del index["weight_map"][name]
            index["weight_map"][name + BLOCKS_SUFFIX] = file
            index["weight_map"][name + SCALES_SUFFIX] = file
        with open(index_path, "w") as handle:
            json.dump(index, handle, indent=2)
    config_path = os.path.join(save_dir, "config.json")
    with open(config_path) as handle:
        config = json.load(handle)
    config["quantization_config"] = {"quant_method": "mxfp4",
                                     "modules_to_not_convert": MXFP4_NOT_CONVERTED}
    with open(config_path, "w") as handle:
        json.dump(config, handle, indent=2)
    from transformers import AutoConfig

    _, reread = _read_mxfp4(save_dir, AutoConfig.from_pretrained(save_dir))
    compare_state_dicts(expected, {k: reread[k] for k in expected},
                        f"reading the MXFP4 experts written to {save_dir}")
