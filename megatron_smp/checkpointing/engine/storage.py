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
can be published) holding the CRC-32 of each item's bytes (a tensor chunk or a value), taken
while the item is written; the reader verifies each item it reads on the bytes it reads, so a
flipped byte in tensor payload -- which decodes without complaint -- is an error naming the
file, and verifying costs neither a second pass over the disk nor reads of the items this
rank does not load. Sidecars of the first format (one CRC-32 of the whole file) are verified
whole before the file's first read. Files without a sidecar (checkpoints from elsewhere) are
read unverified.
"""
from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import ctypes
import dataclasses
import gc
import io
import json
import os
import pathlib
import pickle
import time
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.planner import LoadItemType
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import Metadata
from torch.futures import Future

from megatron_smp.config import ConfigError
from megatron_smp.native.checksum import crc32

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


# The bytes of the last .metadata read and what they unpickled to: a load reads the file up to
# three times (the saved keys, the checks, DCP's planning) and unpickling a large model's takes
# ~60 ms; the same bytes give the same (never modified) Metadata.
_metadata_cache: Optional[Tuple[bytes, Metadata]] = None


def read_dcp_metadata(checkpoint_dir: str) -> Metadata:
    """Unpickle `checkpoint_dir/.metadata` allowing only DCP's metadata classes."""
    global _metadata_cache
    path = os.path.join(os.fspath(checkpoint_dir), METADATA_FILE)
    if not os.path.isfile(path):
        raise CheckpointError(
            f"{path} does not exist: {checkpoint_dir} is not a complete distributed checkpoint"
        )
    try:
        with open(path, "rb") as f:
            data = f.read()
        if _metadata_cache is not None and _metadata_cache[0] == data:
            return _metadata_cache[1]
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as error:
        raise CheckpointError(
            f"{path} is truncated or corrupted and cannot be read ({type(error).__name__}: "
            f"{error}); load an earlier iteration"
        ) from error
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path} holds a {type(metadata).__name__}, not DCP Metadata")
    _metadata_cache = (data, metadata)
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
# Sidecar formats: 1 = {"crc32", "size"} of the whole file; 2 = {"format": 2, "size",
# "items": [[offset, length, crc32], ...]}, one entry per item (what a reader reads at once).
ITEM_CHECKSUMS_FORMAT = 2


def file_crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(_CHECKSUM_BLOCK):
            crc = crc32(block, crc)
    return crc


def _write_sidecar(path: str, record: dict) -> None:
    with open(path + CHECKSUM_SUFFIX, "w") as f:
        json.dump(record, f)
        f.flush()
        os.fsync(f.fileno())


def write_checksum(path: str) -> None:
    """Record `path`'s CRC-32 and size in `path + CHECKSUM_SUFFIX` (fsynced; format 1)."""
    _write_sidecar(path, {"crc32": file_crc32(path), "size": os.path.getsize(path)})


def _damaged_sidecar(path: str, error: Exception) -> CheckpointError:
    return CheckpointError(
        f"{path + CHECKSUM_SUFFIX} is unreadable ({type(error).__name__}: {error}); the "
        "checkpoint is damaged -- load an earlier iteration"
    )


def read_sidecar(path: str) -> Optional[dict]:
    """`path`'s checksum record, or None when it has none (a checkpoint from elsewhere)."""
    try:
        with open(path + CHECKSUM_SUFFIX) as f:
            record = json.load(f)
        if record.get("format") == ITEM_CHECKSUMS_FORMAT:
            record["items"] = {int(offset): (int(length), int(crc))
                               for offset, length, crc in record["items"]}
        else:
            record = {"crc32": int(record["crc32"]), "size": int(record["size"])}
        return record
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise _damaged_sidecar(path, error) from error


def verify_checksum(path: str, record: Optional[dict] = None) -> None:
    """Compare the whole of `path` with a format-1 sidecar (a missing sidecar, or a
    format-2 one, whose items are verified as they are read, means nothing to do here)."""
    record = read_sidecar(path) if record is None else record
    if record is None or "items" in record:
        return
    expected, size = record["crc32"], record["size"]
    actual_size = os.path.getsize(path)
    actual = file_crc32(path) if actual_size == size else None
    if actual != expected:
        found = f"{actual_size} bytes" if actual is None else f"CRC-32 {actual:08x}"
        raise CheckpointError(
            f"{path} is corrupted: {found}, but {size} bytes with CRC-32 {expected:08x} were "
            "written -- load an earlier iteration"
        )


@contextlib.contextmanager
def gc_paused():
    """No garbage collection inside: the plans and metadata a save or load exchanges are
    many small objects, and a full collection while unpickling them stalled a 4.7 GB save
    by 0.15 s (measured). The loop waits on a synchronous save or a load anyway."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def _start_writeback_function():
    """libc's sync_file_range where there is one (Linux), else None."""
    if not hasattr(os, "sched_getaffinity"):  # not Linux
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        function = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


_sync_file_range = _start_writeback_function()
_SYNC_FILE_RANGE_WRITE = 2
# Every this many bytes a data file asks the kernel to start writing what it has so far.
WRITEBACK_BYTES = 32 * 2**20


class _ChecksummingStream(io.RawIOBase):
    """A binary file being written, with the CRC-32 of the bytes written between successive
    `tell()` calls. DCP's writer asks for the position before and after each item, so each
    segment is one item's bytes.

    Every `WRITEBACK_BYTES` it starts the disk write of what came before
    (sync_file_range(SYNC_FILE_RANGE_WRITE), which does not wait), so the disk works while the
    rest is serialized and the final fsync waits for the last blocks only, instead of
    the whole file sitting dirty in the page cache until then."""

    def __init__(self, raw) -> None:
        super().__init__()
        self.raw = raw
        self.position = raw.tell()
        self._segment_start = self.position
        self._crc = 0
        self._written_back = self.position
        self.segments: List[Tuple[int, int, int]] = []  # (offset, length, crc32)

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        written, self._crc = _write_and_checksum(self.raw, memoryview(data).cast("B"),
                                                 self._crc)
        self.position += written
        if _sync_file_range is not None and \
                self.position - self._written_back >= WRITEBACK_BYTES:
            self.raw.flush()
            _sync_file_range(self.raw.fileno(), self._written_back,
                             self.position - self._written_back, _SYNC_FILE_RANGE_WRITE)
            self._written_back = self.position
        return written

    def tell(self) -> int:
        if self.position > self._segment_start:
            self.segments.append((self._segment_start, self.position - self._segment_start,
                                  self._crc))
        self._segment_start, self._crc = self.position, 0
        return self.position

    def flush(self) -> None:
        self.raw.flush()

    def fileno(self) -> int:
        return self.raw.fileno()

    def close(self) -> None:
        self.tell()  # the last segment
        super().close()


class _ChecksummingFileSystem(FileSystem):
    """DCP's local file system whose written files report their items' CRC-32s."""

    def __init__(self) -> None:
        super().__init__()
        self.segments: Dict[str, List[Tuple[int, int, int]]] = {}

    @contextlib.contextmanager
    def create_stream(self, path, mode: str) -> Iterator[io.IOBase]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with super().create_stream(path, mode) as raw:
            stream = _ChecksummingStream(raw)
            try:
                yield stream
            finally:
                stream.close()
                self.segments[os.fspath(path)] = stream.segments


class ChecksummingFileSystemWriter(FileSystemWriter):
    """FileSystemWriter that writes a CRC-32 sidecar for every data file once it is written
    (before write_data returns, so before the coordinator can write .metadata), from the
    CRC-32s taken as the items were written (the file is not read back)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fs = _ChecksummingFileSystem()

    def write_data(self, plan, planner):
        # torch.save's zip records carry CRC-32s of their own, which nothing reads back: the
        # sidecar covers every byte, so the writer does not compute them twice.
        previous = torch.serialization.get_crc32_options()
        torch.serialization.set_crc32_options(False)
        try:
            results = super().write_data(plan, planner).wait()
        finally:
            torch.serialization.set_crc32_options(previous)
        for relative_path in sorted({result.storage_data.relative_path for result in results}):
            path = os.path.join(os.fspath(self.path), relative_path)
            segments = self.fs.segments.pop(os.fspath(self.fs.concat_path(self.path,
                                                                          relative_path)))
            items = {offset: (length, crc) for offset, length, crc in segments}
            for result in results:
                info = result.storage_data
                if info.relative_path == relative_path and items.get(info.offset, (None,))[0] \
                        != info.length:
                    raise CheckpointError(
                        f"{path}: item {result.index.fqn} at byte {info.offset} was not "
                        "written as one piece; cannot checksum it")
            _write_sidecar(path, {"format": ITEM_CHECKSUMS_FORMAT,
                                  "size": os.path.getsize(path),
                                  "items": [list(segment) for segment in segments]})
        future: Future = Future()
        future.set_result(results)
        return future


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader that never unpickles arbitrary objects, verifies data against the
    checksums taken when it was written, and names broken files."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._sidecars: Dict[str, Optional[dict]] = {}
        self._metadata: Optional[Metadata] = None

    def reset(self, checkpoint_id=None) -> None:
        super().reset(checkpoint_id)
        self._sidecars = {}
        self._metadata = None

    def use_metadata(self, metadata: Metadata) -> None:
        """Answer `read_metadata` with `metadata` (already read and checked) instead of
        reading the file again."""
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise CheckpointError("per-rank DCP metadata files are not supported")
        metadata = self._metadata or read_dcp_metadata(os.fspath(self.path))
        if getattr(metadata, "storage_meta", None) is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan, planner):
        # One file at a time, so that a decoding error names the file it came from.
        per_file: Dict[str, list] = collections.defaultdict(list)
        for item in plan.items:
            per_file[self.storage_data[item.storage_index].relative_path].append(item)
        for relative_path, items in sorted(per_file.items()):
            path = os.path.join(os.fspath(self.path), relative_path)
            if relative_path not in self._sidecars:
                self._sidecars[relative_path] = read_sidecar(path)
                verify_checksum(path, self._sidecars[relative_path])  # format 1: whole file
            record = self._sidecars[relative_path]
            # In file order: the reads go forward through the file.
            items.sort(key=lambda item: self.storage_data[item.storage_index].offset)
            try:
                if record is not None and "items" in record:
                    self._read_verified(path, items, record["items"], planner)
                else:
                    rest = self._read_direct(path, items, planner)
                    if rest:
                        super().read_data(dataclasses.replace(plan, items=rest),
                                          planner).wait()
            except CheckpointError:
                raise
            except Exception as error:
                detail = (str(error).strip().splitlines() or [""])[0].split(". ")[0][:160]
                raise CheckpointError(
                    f"cannot decode checkpoint data in {path} ({type(error).__name__}: "
                    f"{detail}); the file is corrupted -- load an earlier iteration"
                ) from error
        future: Future = Future()  # DCP's readers return torch futures
        future.set_result(None)
        return future

    def _read_direct(self, path: str, items, planner) -> list:
        """The tensor items of a file without checksums (written before them, or by
        Megatron-LM) that load whole into a contiguous piece of a tensor of their dtype, read
        from the disk straight into it (`_read_into`), not decoded into memory of their own
        and copied; returns the other items."""
        rest = []
        layouts: Dict[Any, Tuple[int, bytes]] = {}
        with open(path, "rb") as file:
            for request in items:
                info = self.storage_data[request.storage_index]
                if request.type == LoadItemType.BYTE_IO or info.transform_descriptors:
                    rest.append(request)
                    continue
                target = planner.resolve_tensor(request).detach()
                # The item's place in the target: a tensor-parallel shard of rows is one
                # contiguous piece of it.
                place = narrow_tensor_by_index(target, request.dest_offsets, request.lengths)
                if place.is_contiguous() and _read_into(file, info, None, path, request, place,
                                                        layouts):
                    planner.commit_tensor(request, target)
                else:
                    rest.append(request)
        return rest

    def _read_verified(self, path: str, items, checksums: Dict[int, Tuple[int, int]],
                       planner) -> None:
        """DCP's read loop over one file's items, each verified against the CRC-32 taken when
        it was written. A tensor item this rank loads whole into a contiguous tensor of its
        dtype is read from the disk straight into that tensor; any other item is read into
        memory, verified, then decoded as DCP does."""
        infos = [self.storage_data[request.storage_index] for request in items]
        layouts: Dict[Any, Tuple[int, bytes]] = {}  # see `_read_into`
        with open(path, "rb") as file:
            # Ask the kernel for each item one ahead of its read: the disk works on the next
            # item while this one is verified and copied, and the small reads of an item's
            # zip directory (at its end) before its data find the bytes cached.
            _will_need(file, infos[:1])
            for index, request in enumerate(items):
                info = infos[index]
                _will_need(file, infos[index + 1:index + 2])
                expected = checksums.get(info.offset)
                if expected is None or expected[0] != info.length:
                    raise CheckpointError(
                        f"{path}: no checksum for the {info.length} bytes at {info.offset} in "
                        f"{path + CHECKSUM_SUFFIX}; the checkpoint is damaged -- load an "
                        "earlier iteration")
                if info.transform_descriptors:
                    raise CheckpointError(f"{path}: items written through DCP stream "
                                          "extensions are not supported")
                if request.type == LoadItemType.BYTE_IO:
                    data = _read_checked(file, info, expected[1], path)
                    planner.load_bytes(request, io.BytesIO(data))
                    continue
                target = planner.resolve_tensor(request).detach()
                if not _read_into(file, info, expected[1], path, request, target, layouts):
                    data = _read_checked(file, info, expected[1], path)
                    tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
                    tensor = narrow_tensor_by_index(tensor, request.storage_offsets,
                                                    request.lengths)
                    if target.size() != tensor.size():
                        raise CheckpointError(
                            f"{path}: item {request.storage_index.fqn} holds "
                            f"{list(tensor.size())}, the load needs {list(target.size())}")
                    target.copy_(tensor)
                planner.commit_tensor(request, target)


def _will_need(file, infos) -> None:
    """Start reading these items' bytes into the page cache (asynchronously; a hint)."""
    advise = getattr(os, "posix_fadvise", None)
    if advise is None:
        return
    for info in infos:
        advise(file.fileno(), info.offset, info.length, os.POSIX_FADV_WILLNEED)


def _corrupted(path: str, info, actual: int, expected: int) -> CheckpointError:
    return CheckpointError(
        f"{path} is corrupted: CRC-32 {actual:08x} of the {info.length} bytes at {info.offset}, "
        f"but {expected:08x} was written -- load an earlier iteration")


def _read_checked(file, info, expected_crc: int, path: str) -> bytes:
    """The item's bytes, verified."""
    file.seek(info.offset)
    data = file.read(info.length)
    if len(data) != info.length:
        raise CheckpointError(f"{path} is truncated: {len(data)} of the {info.length} bytes at "
                              f"{info.offset} -- load an earlier iteration")
    actual = crc32(data)
    if actual != expected_crc:
        raise _corrupted(path, info, actual, expected_crc)
    return data


class _FileRange(io.RawIOBase):
    """A read-only, seekable view of bytes [start, start + length) of an open file."""

    def __init__(self, file, start: int, length: int) -> None:
        super().__init__()
        self.file, self.start, self.length, self.position = file, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.length}[whence]
        self.position = min(max(base + offset, 0), self.length)
        return self.position

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")
        count = min(len(view), self.length - self.position)
        if count <= 0:
            return 0
        self.file.seek(self.start + self.position)
        count = self.file.readinto(view[:count])
        self.position += count
        return count


# Smaller tensor items are decoded from memory: the direct read saves little on them.
_DIRECT_READ_MIN_BYTES = 1 << 20
# Large reads and writes go in blocks of this size, each checksummed while the I/O thread moves
# the next (reads) or this one (writes).
_IO_BLOCK = 4 << 20


_worker: Optional[concurrent.futures.ThreadPoolExecutor] = None


def _io_worker() -> concurrent.futures.ThreadPoolExecutor:
    """The thread that reads or writes one block while the caller checksums another."""
    global _worker
    if _worker is None:
        _worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ckpt-io")
    return _worker


def _forget_worker() -> None:
    global _worker
    _worker = None  # a forked child has none of the parent's threads


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_worker)


def _read_and_checksum(file, destination: memoryview, size: int, crc: int) -> Tuple[int, int]:
    """Read up to `size` bytes from `file` into `destination`, block by block; (CRC-32 of
    them continuing `crc`, bytes read). A worker thread reads the next block while this one
    is checksummed, still in the CPU's cache (both calls release the GIL)."""
    if size <= _IO_BLOCK:
        count = file.readinto(destination[:size]) or 0
        return crc32(destination[:count], crc), count
    read = 0
    pending = _io_worker().submit(file.readinto, destination[:_IO_BLOCK])
    while pending is not None:
        count = pending.result() or 0
        start = read
        read += count
        pending = None
        if count and read < size:
            pending = _io_worker().submit(file.readinto, destination[read:min(read + _IO_BLOCK,
                                                                            size)])
        try:
            crc = crc32(destination[start:read], crc)
        except BaseException:
            if pending is not None:
                pending.result()  # the file's position stays with this thread's reads
            raise
    return crc, read


def _write_and_checksum(file, data: memoryview, crc: int) -> Tuple[int, int]:
    """Write `data`; (bytes written, CRC-32 of them continuing `crc`). One block or less is
    written here; more goes block by block, a worker thread writing each while this one
    checksums it (both release the GIL)."""
    if data.nbytes <= _IO_BLOCK:
        written = file.write(data)
        return written, crc32(data[:written] if written < data.nbytes else data, crc)
    written = 0
    while written < data.nbytes:
        block = data[written:written + _IO_BLOCK]
        pending = _io_worker().submit(file.write, block)
        try:
            block_crc = crc32(block, crc)
        finally:
            count = pending.result() or 0
        if count < block.nbytes:  # a short write: the CRC of what was written
            return written + count, crc32(block[:count], crc)
        written, crc = written + count, block_crc
    return written, crc


def _read_into(file, info, expected_crc: Optional[int], path: str, request, target,
               layouts: Dict[Any, Tuple[int, bytes]]) -> bool:
    """Read a tensor item (torch.save's zip of one tensor) from the disk straight into
    `target`, verifying the CRC-32 of all its bytes in file order (unless `expected_crc` is
    None: no checksum was taken); False (nothing read into `target`) when the item is not one
    whole contiguous chunk of `target`'s dtype and shape.

    torch.load on the meta device gives the tensor's layout and its data's offset in the
    item without reading the data. `layouts` remembers, per dtype, shape and item length,
    that offset and the bytes before it (zip headers and pickle): an item whose first bytes
    are the same has the same layout, so its data is read without decoding it again."""
    if (info.length < _DIRECT_READ_MIN_BYTES or not target.is_contiguous()
            or any(request.storage_offsets) or list(request.lengths) != list(target.shape)):
        return False
    key = (target.dtype, tuple(target.shape), info.length)
    head = None
    if key in layouts:
        start, known_head = layouts[key]
        file.seek(info.offset)
        head = file.read(start)
        if head != known_head:
            head = None
    if head is None:
        try:
            meta = torch.load(_FileRange(file, info.offset, info.length), map_location="meta",
                              weights_only=True)
        except Exception:
            return False  # the decode path reports what is wrong with the item
        record_offset = getattr(meta.untyped_storage(), "_checkpoint_offset", None) \
            if isinstance(meta, torch.Tensor) else None
        if (record_offset is None or meta.dtype != target.dtype or meta.shape != target.shape
                or not meta.is_contiguous()):
            return False
        start = record_offset + meta.storage_offset() * meta.element_size()
        if start + target.numel() * target.element_size() > info.length:
            return False
        file.seek(info.offset)
        head = file.read(start)
        layouts[key] = (start, head)
    size = target.numel() * target.element_size()
    destination = memoryview(target.reshape(-1).view(torch.uint8).numpy())
    crc, read = _read_and_checksum(file, destination, size, crc32(head))
    tail = file.read(info.length - start - size)
    if len(head) != start or read != size or len(tail) != info.length - start - size:
        raise CheckpointError(f"{path} is truncated at the item of {info.length} bytes at "
                              f"{info.offset} -- load an earlier iteration")
    actual = crc32(tail, crc)
    if expected_crc is not None and actual != expected_crc:
        raise _corrupted(path, info, actual, expected_crc)
    return True


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


def _exact_storage(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`'s memory, as a tensor whose storage is exactly its bytes. DCP's writer clones
    a tensor that views a larger storage (torch.save would write all of it): the params in
    their grad-sync buffers, the distributed optimizer's shards -- a copy of nearly the whole
    state in a synchronous save. A contiguous CPU view needs no copy for that."""
    if (tensor.device.type != "cpu" or not tensor.is_contiguous() or tensor.numel() == 0
            or tensor.untyped_storage().nbytes() == tensor.nbytes):
        return tensor
    flat = tensor.detach().reshape(-1).view(torch.uint8)
    return torch.frombuffer(flat.numpy(), dtype=torch.uint8).view(tensor.dtype).view(
        tensor.shape)


class HookedSavePlanner(DefaultSavePlanner):
    """DefaultSavePlanner that hands the writer views without copying them (see
    `_exact_storage`), with the kill-mid-write test hook (called once per written item)."""

    def resolve_data(self, write_item):
        maybe_test_write_delay()
        data = super().resolve_data(write_item)
        return _exact_storage(data) if isinstance(data, torch.Tensor) else data


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
