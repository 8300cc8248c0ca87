"""Conversion at bounded memory: one layer's tensors at a time.

A model is converted in groups: the tensors of one transformer layer, or one tensor outside
the layers (embedding, final norm, output head). For each group only its own tensors are in
memory; the family adapter's whole-model `from_hf` / `to_hf` is run on a state dict where
every other tensor is a `meta` tensor (shape and dtype, no memory), and what comes out on the
CPU is that group's result -- the adapters stay the one implementation of each mapping.

Hugging Face files are read lazily (`safetensors.safe_open`, one group's tensors, the file
closed after each read); transformers' own weight conversions (per-expert files <-> the fused
expert tensors of its MoE modules, renames) are applied to each group as `from_pretrained` and
`save_pretrained` apply them to the whole model. Written tensors are hashed (SHA-256 of their
bytes, dtype and shape) as they are written, and the written checkpoint is re-read one tensor
at a time and compared with those hashes.
"""
from __future__ import annotations

import ctypes
import hashlib
import json
import os
import re
import shutil
from typing import Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch

from megatron_smp.config import ConfigError

# A transformer layer's index in a parameter name, ours (decoder.layers.3.) or HF's
# (model.layers.3., transformer.h.3., gpt_neox.layers.3., backbone.layers.3.).
_LAYER = re.compile(r"(?:^|\.)(?:layers|h)\.(\d+)\.")
_EMBEDDING = ("embed", "wte.", "wpe.", "word_embeddings", "position_embeddings")


def group_of(name: str) -> Tuple[int, object]:
    """The group `name` is converted in, and its place in the order: embeddings first, then
    layer by layer, then what follows the layers (final norm, output head); tensors outside
    the layers are groups of their own."""
    match = _LAYER.search(name)
    if match:
        return (1, int(match.group(1)))
    return (0 if any(part in name for part in _EMBEDDING) else 2, name)


def groups(names: Iterable[str]) -> List[List[str]]:
    """`names` split into groups (see `group_of`), in conversion order."""
    grouped: Dict[Tuple[int, object], List[str]] = {}
    for name in names:
        grouped.setdefault(group_of(name), []).append(name)
    def order(key):
        return (key[0], key[1] if key[0] == 1 else 0, "" if key[0] == 1 else key[1])

    return [grouped[key] for key in sorted(grouped, key=order)]


def meta_like(tensors: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    return {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in tensors.items()}


def unpadded(config):
    """`config` with its vocabulary tables padded to their own vocab_size rows: what the
    converters map with, inside `models.hf.common.vocab_tables_in_place`, so that an adapter
    gives a table (and a tied output head) as the very tensor it was given, not a copy. The
    framework checkpoint holds tables of vocab_size rows either way."""
    return config.replace(make_vocab_size_divisible_by=1)


def partial(fn: Callable[[Dict[str, torch.Tensor]], Mapping[str, torch.Tensor]],
            meta: Mapping[str, torch.Tensor], real: Mapping[str, torch.Tensor]
            ) -> Dict[str, torch.Tensor]:
    """`fn` (a whole-model mapping) on `real` with every other input a meta tensor: the
    outputs that come out real, i.e. those computed from `real` alone."""
    inputs = dict(meta)
    inputs.update(real)
    try:
        out = fn(inputs)
    except RuntimeError as error:  # an output mixing this group's tensors with another's
        raise ConfigError(f"converting {sorted(real)[:3]}...: the mapping combines tensors of "
                          f"different layers ({error})") from error
    return {k: v for k, v in out.items() if v.device.type != "meta"}


def digest(tensor: torch.Tensor) -> str:
    """SHA-256 of a tensor's dtype, shape and bytes. The bytes are read in place (a CPU
    tensor's memory, not through `.numpy()`, which would leave its storage unresizable: the
    DCP writer then has to copy each tensor before it can free it, see `_ProducingPlanner`)."""
    data = tensor.detach().cpu().contiguous()
    h = hashlib.sha256(f"{tensor.dtype}{list(tensor.shape)}".encode())
    if data.numel():
        h.update(memoryview((ctypes.c_char * data.nbytes).from_address(data.data_ptr())))
    return h.hexdigest()


def check_digests(expected: Mapping[str, str], actual: Mapping[str, torch.Tensor],
                  what: str) -> None:
    """Raise unless `actual` holds exactly the names of `expected`, with those digests."""
    from tools.checkpoint.common import listing

    problems = [f"{k}: missing" for k in sorted(set(expected) - set(actual))]
    problems += [f"{k}: unexpected" for k in sorted(set(actual) - set(expected))]
    problems += [f"{k}: {actual[k].dtype}{list(actual[k].shape)} (values, dtype or shape differ)"
                 for k in sorted(set(expected) & set(actual)) if digest(actual[k]) != expected[k]]
    if problems:
        raise ConfigError(f"verification failed, {what}: {listing(problems)}")


# -- Hugging Face safetensors, read lazily ---------------------------------------------------


class SafetensorsSource:
    """The tensors of a directory's safetensors files (model.safetensors or the shards of
    model.safetensors.index.json), read on demand: each file's header once, then each tensor
    read from the file straight into a tensor of its own (no memory mapping, whose pages
    would stay in the process while the mapping lives), in pieces of 1 MiB."""

    PIECE = 1 << 20

    def __init__(self, directory: str, files: Sequence[str]) -> None:
        self.directory = directory
        self.file_of: Dict[str, str] = {}
        self.meta: Dict[str, torch.Tensor] = {}
        self.offset: Dict[str, int] = {}
        for file in files:
            path = os.path.join(directory, file)
            try:
                with open(path, "rb") as handle:
                    length = int.from_bytes(handle.read(8), "little")
                    header = json.loads(handle.read(length))
            except (OSError, ValueError) as error:
                raise ConfigError(f"{path} is not a safetensors file: {error}") from error
            header.pop("__metadata__", None)
            for name, info in header.items():
                dtype = _SAFETENSORS_DTYPES.get(info["dtype"])
                if dtype is None:
                    raise ConfigError(f"{path}: {name} has dtype {info['dtype']}, which torch "
                                      "cannot hold")
                begin, end = info["data_offsets"]
                meta = torch.empty(info["shape"], dtype=dtype, device="meta")
                if end - begin != meta.numel() * meta.element_size():
                    raise ConfigError(f"{path}: {name} holds {end - begin} bytes, not those of "
                                      f"{info['dtype']}{info['shape']}")
                self.file_of[name] = file
                self.meta[name] = meta
                self.offset[name] = 8 + length + begin

    @classmethod
    def of(cls, directory: str) -> Optional["SafetensorsSource"]:
        """The source for a directory save_pretrained wrote, or None when it holds no
        safetensors (pytorch_model.bin)."""
        index = os.path.join(directory, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as handle:
                files = sorted(set(json.load(handle)["weight_map"].values()))
            return cls(directory, files)
        if os.path.isfile(os.path.join(directory, "model.safetensors")):
            return cls(directory, ["model.safetensors"])
        return None

    def read(self, names: Sequence[str]) -> Dict[str, torch.Tensor]:
        out: Dict[str, torch.Tensor] = {}
        by_file: Dict[str, List[str]] = {}
        for name in names:
            by_file.setdefault(self.file_of[name], []).append(name)
        for file, keys in by_file.items():
            path = os.path.join(self.directory, file)
            with open(path, "rb", buffering=0) as handle:
                for name in sorted(keys, key=self.offset.__getitem__):
                    meta = self.meta[name]
                    tensor = torch.empty(meta.shape, dtype=meta.dtype)
                    flat = tensor.reshape(-1).view(torch.uint8)
                    handle.seek(self.offset[name])
                    buffer = bytearray(min(self.PIECE, flat.numel()))
                    done = 0
                    while done < flat.numel():
                        count = handle.readinto(memoryview(buffer)[:flat.numel() - done])
                        if not count:
                            raise ConfigError(f"{path} ends inside {name}: the file is "
                                              "truncated")
                        flat[done:done + count].copy_(torch.frombuffer(buffer, dtype=torch.uint8,
                                                                       count=count))
                        done += count
                    out[name] = tensor
        return out


_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_SAFETENSORS_NAMES = {v: k for k, v in _SAFETENSORS_DTYPES.items()}


# -- transformers' weight conversions (file names <-> module names), per group ----------------


def to_module_names(meta_model, file_tensors: Mapping[str, torch.Tensor]
                    ) -> Tuple[Dict[str, torch.Tensor], List[str]]:
    """Tensors as a checkpoint file names them -> as the HF model's state dict does (what
    `from_pretrained` does to them: renames, per-expert tensors fused), and the file names that
    match nothing of the model."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (
        WeightConverter,
        WeightRenaming,
        dot_natural_key,
        rename_source_key,
    )

    transforms = get_model_conversion_mapping(meta_model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
    expected = _meta_state_dict(meta_model)
    prefix = meta_model.base_model_prefix
    mappings: Dict[str, object] = {}
    unmatched: List[str] = []
    for original, tensor in sorted(file_tensors.items(), key=lambda kv: dot_natural_key(kv[0])):
        renamed, pattern = rename_source_key(original, renamings, converters, prefix, expected)
        if renamed not in expected and original in expected:
            renamed, pattern = rename_source_key(original, [], [], prefix, expected)
        if renamed not in expected:
            unmatched.append(original)
            continue
        if pattern is not None:
            import copy

            mapping = mappings.setdefault(renamed, copy.deepcopy(by_pattern[pattern]))
        else:
            mapping = mappings.setdefault(renamed, WeightRenaming(original, renamed))
            pattern = original
        mapping.add_tensor(renamed, original, pattern, tensor)
    out: Dict[str, torch.Tensor] = {}
    for first, mapping in mappings.items():
        for name, value in mapping.convert(first, model=meta_model,
                                           config=meta_model.config).items():
            out[name] = value[0] if isinstance(value, list) else value
    return out, unmatched


def to_file_names(meta_model, module_tensors: Mapping[str, torch.Tensor]
                  ) -> Dict[str, torch.Tensor]:
    """Inverse of `to_module_names`: the names (and per-expert tensors) save_pretrained
    writes."""
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(meta_model, dict(module_tensors))


def _meta_state_dict(meta_model) -> Dict[str, torch.Tensor]:
    """The meta model's state dict, taken once per model."""
    cached = getattr(meta_model, "_streaming_state_dict", None)
    if cached is None:
        cached = meta_model.state_dict()
        meta_model._streaming_state_dict = cached
    return cached


# -- safetensors written as they go ----------------------------------------------------------


def parse_size(size: str) -> int:
    """"5GB" / "500MB" / "2000000" -> bytes (save_pretrained's units: 1 GB = 10^9 bytes)."""
    units = {"TB": 10**12, "GB": 10**9, "MB": 10**6, "KB": 10**3}
    text = str(size).strip().upper()
    try:
        if text[-2:] in units:
            value = int(float(text[:-2]) * units[text[-2:]])
        else:
            value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise ConfigError(f"--max-shard-size {size!r}: give a positive size such as 5GB, 500MB "
                          "or a number of bytes")
    return value


class ShardedSafetensorsWriter:
    """Writes tensors into safetensors shards as they come, as save_pretrained lays them out:
    model.safetensors when one shard holds them all, else model-0000k-of-0000n.safetensors and
    model.safetensors.index.json. A shard is closed once adding the next tensor would take it
    over `max_shard_size` (a tensor larger than that gets a shard of its own). Each shard's
    data goes to a temporary file first; closing writes the header, then copies the data
    after it in 4 MiB pieces."""

    COPY = 4 << 20

    def __init__(self, directory: str, max_shard_size: int) -> None:
        self.directory = directory
        self.max_shard_size = max_shard_size
        self.shards: List[Tuple[str, Dict[str, dict]]] = []  # (temporary file, header)
        self.digests: Dict[str, str] = {}
        self.total = 0
        self._data = None
        self._size = 0
        os.makedirs(directory, exist_ok=True)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.digests:
            raise ConfigError(f"{name} is written twice")
        tensor = tensor.detach().contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        if self._data is None or (self._size and self._size + nbytes > self.max_shard_size):
            self._open()
        header = self.shards[-1][1]
        header[name] = {"dtype": _SAFETENSORS_NAMES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [self._size, self._size + nbytes]}
        if nbytes:
            self._data.write(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))
        self._size += nbytes
        self.total += nbytes
        self.digests[name] = digest(tensor)

    def _open(self) -> None:
        self._close_data()
        path = os.path.join(self.directory, f".shard-{len(self.shards):05d}.tmp")
        self.shards.append((path, {}))
        self._data = open(path, "wb")
        self._size = 0

    def _close_data(self) -> None:
        if self._data is not None:
            self._data.close()
            self._data = None

    def finish(self) -> List[str]:
        """Write the shard files and the index; returns the shard file names."""
        self._close_data()
        count = len(self.shards)
        names = (["model.safetensors"] if count == 1 else
                 [f"model-{k + 1:05d}-of-{count:05d}.safetensors" for k in range(count)])
        weight_map = {}
        for (tmp, header), file in zip(self.shards, names):
            meta = {"__metadata__": {"format": "pt"}, **header}
            text = json.dumps(meta, separators=(",", ":")).encode()
            text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors'
            with open(os.path.join(self.directory, file), "wb") as out, open(tmp, "rb") as data:
                out.write(len(text).to_bytes(8, "little"))
                out.write(text)
                shutil.copyfileobj(data, out, self.COPY)
            os.remove(tmp)
            weight_map.update({name: file for name in header})
        if count > 1:
            index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
            with open(os.path.join(self.directory, "model.safetensors.index.json"), "w",
                      encoding="utf-8") as handle:
                handle.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
        return names


def reread_safetensors(directory: str, digests: Mapping[str, str]) -> None:
    """Read every tensor of the safetensors files in `directory` back, one at a time, and
    compare it with the digest taken when it was written."""
    source = SafetensorsSource.of(directory)
    if source is None:
        raise ConfigError(f"verification failed: {directory} holds no safetensors files")
    names = set(source.file_of)
    missing = sorted(set(digests) - names)
    unexpected = sorted(names - set(digests))
    if missing or unexpected:
        check_digests({k: digests[k] for k in missing}, {k: source.meta[k] for k in unexpected},
                      f"re-reading {directory}")
    for name in sorted(names):
        check_digests({name: digests[name]}, source.read([name]), f"re-reading {directory}")


class Producer:
    """Hands out a stream of converted groups tensor by tensor, in any order: a tensor not
    produced yet advances the stream, keeping the other tensors of the groups it passes until
    they are asked for (in the order the groups come, only the current group is held)."""

    def __init__(self, stream: Iterator[Dict[str, torch.Tensor]]) -> None:
        self.stream = stream
        self.held: Dict[str, torch.Tensor] = {}
        self.produced: Dict[str, str] = {}

    def __call__(self, name: str) -> torch.Tensor:
        while name not in self.held:
            try:
                group = next(self.stream)
            except StopIteration:
                raise ConfigError(f"the conversion produced no tensor {name}") from None
            for key, value in group.items():
                if key in self.produced:
                    raise ConfigError(f"the conversion produced {key} twice")
                self.produced[key] = digest(value)
                self.held[key] = value
        return self.held.pop(name)

    def drain(self) -> None:
        """Run the stream to its end (what nothing asked for is an error of the caller)."""
        for group in self.stream:
            for key, value in group.items():
                self.produced[key] = digest(value)
                self.held[key] = value


__all__ = ["group_of", "groups", "meta_like", "unpadded", "partial", "digest", "check_digests",
           "SafetensorsSource", "to_module_names", "to_file_names", "parse_size",
           "ShardedSafetensorsWriter", "reread_safetensors", "Producer"]
