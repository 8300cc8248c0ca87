"""Storage reader/writer and planners on top of DCP's file system format, made safe to load.

What DCP (torch 2.13) unpickles when it loads a checkpoint directory, and what we do about it:

* tensor data (``*.distcp``): ``torch.load(..., weights_only=True)`` -- already safe;
* non-tensor values (BYTE_IO items): ``DefaultLoadPlanner.load_bytes`` calls
  ``torch.load(..., weights_only=False)`` -- arbitrary code. `SafeLoadPlanner` reloads them
  with ``weights_only=True`` (tensors and plain data only), and `check_plain_data` refuses
  at save time anything that could not be loaded that way;
* ``.metadata``: ``FileSystemReader.read_metadata`` calls ``pickle.load`` -- arbitrary code.
  `SafeFileSystemReader` unpickles it with an allow-list of DCP's own metadata classes.

The reader also checks, before any byte is read, that every file the metadata names exists and
is long enough, and names the file when torch fails to decode one.

Every data file gets a CRC-32 sidecar (`<file>.crc32`, written and fsynced before the save
can be published); the reader verifies each file it reads against it, so a flipped byte in
tensor payload -- which decodes without complaint -- is an error naming the file. Files
without a sidecar (checkpoints from elsewhere) are read unverified.
"""
from __future__ import annotations

import collections
import dataclasses
import io
import json
import os
import pathlib
import pickle
import time
import zlib
from typing import Any, Dict, Set

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import Metadata
from torch.futures import Future

from megatron_smp.config import ConfigError

METADATA_FILE = ".metadata"
# Test hook: when set, every rank touches `{marker}.rank{r}` once it starts writing its data
# file and then sleeps this many seconds per item, so a test can kill a save mid-write.
TEST_WRITE_DELAY_ENV = "MEGATRON_SMP_CKPT_TEST_WRITE_DELAY"
TEST_WRITE_MARKER_ENV = "MEGATRON_SMP_CKPT_TEST_WRITE_MARKER"
# Test hook: when set, the staging copy to CPU memory sleeps this many seconds per tensor.
TEST_STAGING_DELAY_ENV = "MEGATRON_SMP_CKPT_TEST_STAGING_DELAY"


class CheckpointError(ConfigError):
    """A checkpoint that cannot be loaded or saved; the message names the file or key."""


# Modules whose classes may appear in a DCP .metadata pickle.
_METADATA_MODULES = (
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.filesystem",
    "torch.distributed.checkpoint.planner",
    "torch.distributed.checkpoint._extension",
)
_METADATA_GLOBALS = {
    ("torch", "Size"),
    ("torch", "device"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "slice"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib._local", "PosixPath"),
    # Maps a layout's name back to torch.strided etc.; TensorProperties pickles through it.
    ("torch.serialization", "_get_layout"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _METADATA_GLOBALS:
            return super().find_class(module, name)
        if module in _METADATA_MODULES and "." not in name:
            # Only classes defined there: those modules also hold `os`, `pickle`, functions.
            obj = super().find_class(module, name)
            if isinstance(obj, type) and obj.__module__ == module:
                return obj
        # dtypes, layouts and memory formats pickle as attributes of the torch module.
        if module == "torch" and isinstance(
            getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)
        ):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in DCP metadata")


def read_dcp_metadata(checkpoint_dir: str) -> Metadata:
    """Unpickle `checkpoint_dir/.metadata` allowing only DCP's metadata classes."""
    path = os.path.join(os.fspath(checkpoint_dir), METADATA_FILE)
    if not os.path.isfile(path):
        raise CheckpointError(
            f"{path} does not exist: {checkpoint_dir} is not a complete distributed checkpoint"
        )
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except Exception as error:
        raise CheckpointError(
            f"{path} is truncated or corrupted and cannot be read ({type(error).__name__}: "
            f"{error}); load an earlier iteration"
        ) from error
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path} holds a {type(metadata).__name__}, not DCP Metadata")
    return metadata


def validate_data_files(checkpoint_dir: str, metadata: Metadata) -> None:
    """Every data file named in the metadata exists and is long enough for its items."""
    needed: Dict[str, int] = collections.defaultdict(int)
    for info in (metadata.storage_data or {}).values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed[info.relative_path], end)
    for relative_path, end in sorted(needed.items()):
        path = os.path.join(os.fspath(checkpoint_dir), relative_path)
        if not os.path.isfile(path):
            raise CheckpointError(f"{path} is missing: the checkpoint is incomplete")
        size = os.path.getsize(path)
        if size < end:
            raise CheckpointError(
                f"{path} is truncated: {size} bytes on disk, the metadata needs {end}; "
                "load an earlier iteration"
            )


CHECKSUM_SUFFIX = ".crc32"
_CHECKSUM_BLOCK = 16 * 2**20


def file_crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(_CHECKSUM_BLOCK):
            crc = zlib.crc32(block, crc)
    return crc


def write_checksum(path: str) -> None:
    """Record `path`'s CRC-32 and size in `path + CHECKSUM_SUFFIX` (fsynced)."""
    record = {"crc32": file_crc32(path), "size": os.path.getsize(path)}
    with open(path + CHECKSUM_SUFFIX, "w") as f:
        json.dump(record, f)
        f.flush()
        os.fsync(f.fileno())


def verify_checksum(path: str) -> None:
    """Compare `path` with its sidecar; a missing sidecar means nothing to check."""
    try:
        with open(path + CHECKSUM_SUFFIX) as f:
            record = json.load(f)
        expected, size = int(record["crc32"]), int(record["size"])
    except FileNotFoundError:
        return
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CheckpointError(
            f"{path + CHECKSUM_SUFFIX} is unreadable ({type(error).__name__}: {error}); the "
            "checkpoint is damaged -- load an earlier iteration"
        ) from error
    actual_size = os.path.getsize(path)
    actual = file_crc32(path) if actual_size == size else None
    if actual != expected:
        found = f"{actual_size} bytes" if actual is None else f"CRC-32 {actual:08x}"
        raise CheckpointError(
            f"{path} is corrupted: {found}, but {size} bytes with CRC-32 {expected:08x} were "
            "written -- load an earlier iteration"
        )


class ChecksummingFileSystemWriter(FileSystemWriter):
    """FileSystemWriter that writes a CRC-32 sidecar for every data file once it is written
    (before write_data returns, so before the coordinator can write .metadata)."""

    def write_data(self, plan, planner):
        results = super().write_data(plan, planner).wait()
        for relative_path in sorted({result.storage_data.relative_path for result in results}):
            write_checksum(os.path.join(os.fspath(self.path), relative_path))
        future: Future = Future()
        future.set_result(results)
        return future


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader that never unpickles arbitrary objects, verifies data files against
    their checksums, and names broken files."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._verified: Set[str] = set()

    def reset(self, checkpoint_id=None) -> None:
        super().reset(checkpoint_id)
        self._verified = set()

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise CheckpointError("per-rank DCP metadata files are not supported")
        metadata = read_dcp_metadata(os.fspath(self.path))
        if getattr(metadata, "storage_meta", None) is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan, planner):
        # One file at a time, so that a decoding error names the file it came from.
        per_file: Dict[str, list] = collections.defaultdict(list)
        for item in plan.items:
            per_file[self.storage_data[item.storage_index].relative_path].append(item)
        for relative_path, items in sorted(per_file.items()):
            if relative_path not in self._verified:
                verify_checksum(os.path.join(os.fspath(self.path), relative_path))
                self._verified.add(relative_path)
            try:
                super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except CheckpointError:
                raise
            except Exception as error:
                path = os.path.join(os.fspath(self.path), relative_path)
                detail = (str(error).strip().splitlines() or [""])[0].split(". ")[0][:160]
                raise CheckpointError(
                    f"cannot decode checkpoint data in {path} ({type(error).__name__}: "
                    f"{detail}); the file is corrupted -- load an earlier iteration"
                ) from error
        future: Future = Future()  # DCP's readers return torch futures
        future.set_result(None)
        return future


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner whose non-tensor values are loaded with weights_only=True."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as error:
            raise CheckpointError(
                f"value {fqn!r} is not plain data (tensors, numbers, strings, lists, dicts) or "
                f"is corrupted: {type(error).__name__}: {error}"
            ) from error
        # Same placement as DefaultLoadPlanner.load_bytes, minus its unsafe torch.load.
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def maybe_test_write_delay() -> None:
    """Test hook, a no-op unless the env var is set: signal "writing started", then sleep."""
    delay = os.environ.get(TEST_WRITE_DELAY_ENV)
    if not delay:
        return
    marker = os.environ.get(TEST_WRITE_MARKER_ENV)
    if marker:
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        pathlib.Path(f"{marker}.rank{rank}").touch()
    time.sleep(float(delay))


def maybe_test_staging_delay() -> None:
    """Test hook, a no-op unless the env var is set: slow the staging copy down."""
    delay = os.environ.get(TEST_STAGING_DELAY_ENV)
    if delay:
        time.sleep(float(delay))


class HookedSavePlanner(DefaultSavePlanner):
    """DefaultSavePlanner with the kill-mid-write test hook (called once per written item)."""

    def resolve_data(self, write_item):
        maybe_test_write_delay()
        return super().resolve_data(write_item)


def make_storage_writer(checkpoint_dir: str, thread_count: int = 1) -> FileSystemWriter:
    # sync_files: fsync every data file, so "finished" means "on disk" before we publish.
    return ChecksummingFileSystemWriter(
        os.fspath(checkpoint_dir), sync_files=True, thread_count=thread_count, overwrite=True
    )


_PLAIN_SCALARS = (bool, int, float, str, bytes, type(None))


def check_plain_data(value: Any, key: str) -> None:
    """Raise if `value` holds anything that weights_only=True loading would refuse."""
    if isinstance(value, (torch.Tensor,) + _PLAIN_SCALARS) or isinstance(
        value, (torch.dtype, torch.device)
    ):
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_plain_data(item, f"{key}[{i}]")
        return
    if isinstance(value, dict):
        for k, item in value.items():
            if not isinstance(k, _PLAIN_SCALARS):
                raise CheckpointError(f"{key} has a non-plain dict key {k!r}")
            check_plain_data(item, f"{key}.{k}")
        return
    raise CheckpointError(
        f"{key} is a {type(value).__module__}.{type(value).__name__}; checkpoints hold only "
        "tensors and plain data (numbers, strings, lists, tuples, dicts) so that they load "
        "without unpickling code -- convert it (e.g. numpy arrays to tensors)"
    )
