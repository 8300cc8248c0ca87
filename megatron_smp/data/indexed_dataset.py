"""Megatron-LM's memory-mapped indexed dataset: a `.bin` of token ids and an `.idx` index.

Layout of `{prefix}.idx` (all little-endian), identical to Megatron-LM's so files move both ways:

    b"MMIDIDX\\x00\\x00"       9-byte magic
    version                  u64, always 1
    dtype code               u8   (see DTYPE_CODES)
    sequence count           u64  (S)
    document count           u64  (D = number of documents + 1)
    sequence lengths         int32[S]   tokens per sequence
    sequence pointers        int64[S]   byte offset of each sequence in the .bin
    document indices         int64[D]   sequence index where each document starts, then S

`{prefix}.bin` is the concatenation of all sequences in that dtype. With whole-document
preprocessing (no sentence splitting) a document is exactly one sequence.
"""
from __future__ import annotations

import os
import shutil
import struct
from typing import Iterable, List, Optional, Sequence, Union

import numpy as np

INDEX_HEADER = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1

# Megatron-LM's DType enum values; the codes are part of the on-disk format.
DTYPE_CODES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_CODE_OF_DTYPE = {np.dtype(dtype): code for code, dtype in DTYPE_CODES.items()}


def data_file_path(prefix: str) -> str:
    return prefix + ".bin"


def index_file_path(prefix: str) -> str:
    return prefix + ".idx"


def optimal_dtype(vocab_size: Optional[int]) -> type:
    """The dtype Megatron-LM's preprocessing picks: uint16 below 65500 ids, else int32."""
    if vocab_size is not None and vocab_size < 65500:
        return np.uint16
    return np.int32


def dataset_exists(prefix: str) -> bool:
    return os.path.isfile(index_file_path(prefix)) and os.path.isfile(data_file_path(prefix))


class IndexedDatasetBuilder:
    """Writes a `.bin` incrementally and the `.idx` at `finalize`.

    Only the per-sequence lengths (4 bytes each) and document boundaries are held in memory;
    token ids go straight to the `.bin`.
    """

    def __init__(self, bin_path: str, dtype=np.int32) -> None:
        self.dtype = np.dtype(dtype)
        if self.dtype not in _CODE_OF_DTYPE:
            raise ValueError(f"dtype {self.dtype} has no Megatron-LM dtype code")
        self._bin_path = bin_path
        self._data_file = open(bin_path, "wb")
        self._sequence_lengths: List[int] = []
        self._document_indices: List[int] = [0]

    def add_item(self, tokens: Union[np.ndarray, Sequence[int]]) -> None:
        """Append one sequence (it joins the current document until `end_document`)."""
        array = np.asarray(tokens)
        if array.dtype != self.dtype:
            array = array.astype(self.dtype)
        self._data_file.write(array.tobytes(order="C"))
        self._sequence_lengths.append(int(array.size))

    def end_document(self) -> None:
        self._document_indices.append(len(self._sequence_lengths))

    def add_document(
        self, tokens: Union[np.ndarray, Sequence[int]], lengths: Optional[Iterable[int]] = None
    ) -> None:
        """Append a document; `lengths` splits it into several sequences (e.g. sentences)."""
        array = np.asarray(tokens)
        if array.dtype != self.dtype:
            array = array.astype(self.dtype)
        self._data_file.write(array.tobytes(order="C"))
        if lengths is None:
            self._sequence_lengths.append(int(array.size))
        else:
            lengths = [int(length) for length in lengths]
            if sum(lengths) != array.size:
                raise ValueError(f"lengths sum to {sum(lengths)}, document has {array.size}")
            self._sequence_lengths.extend(lengths)
        self._document_indices.append(len(self._sequence_lengths))

    def add_index(self, prefix: str) -> None:
        """Append every document of an existing dataset (same dtype) to this one."""
        other = IndexedDataset(prefix)
        if other.dtype != self.dtype:
            raise ValueError(f"{prefix} has dtype {other.dtype}, this builder {self.dtype}")
        offset = len(self._sequence_lengths)
        self._sequence_lengths.extend(other.sequence_lengths.tolist())
        self._document_indices.extend((other.document_indices[1:] + offset).tolist())
        del other
        with open(data_file_path(prefix), "rb") as source:
            shutil.copyfileobj(source, self._data_file)

    def discard(self) -> None:
        """Abandon the build: close and delete the partial `.bin`."""
        self._data_file.close()
        if os.path.exists(self._bin_path):
            os.remove(self._bin_path)

    def finalize(self, idx_path: str) -> None:
        self._data_file.close()
        write_index(idx_path, self.dtype, self._sequence_lengths, self._document_indices)


def write_index(
    idx_path: str,
    dtype,
    sequence_lengths: Union[np.ndarray, Sequence[int]],
    document_indices: Union[np.ndarray, Sequence[int]],
) -> None:
    """Write a Megatron-LM `.idx` for sequences stored back to back in `dtype`."""
    lengths = np.asarray(sequence_lengths, dtype=np.int32)
    pointers = np.zeros(lengths.size, dtype=np.int64)
    if lengths.size > 1:
        np.cumsum(lengths[:-1].astype(np.int64) * np.dtype(dtype).itemsize, out=pointers[1:])
    documents = np.asarray(document_indices, dtype=np.int64)
    tmp_path = idx_path + ".tmp"
    with open(tmp_path, "wb") as index_file:
        index_file.write(INDEX_HEADER)
        index_file.write(struct.pack("<Q", INDEX_VERSION))
        index_file.write(struct.pack("<B", _CODE_OF_DTYPE[np.dtype(dtype)]))
        index_file.write(struct.pack("<Q", lengths.size))
        index_file.write(struct.pack("<Q", documents.size))
        index_file.write(lengths.astype("<i4").tobytes(order="C"))
        index_file.write(pointers.astype("<i8").tobytes(order="C"))
        index_file.write(documents.astype("<i8").tobytes(order="C"))
    os.replace(tmp_path, idx_path)


class IndexedDataset:
    """Read-only view of `{prefix}.bin/.idx`; neither file is read whole.

    The `.idx` is memory-mapped; the `.bin` too unless `mmap=False` (Megatron's
    --no-mmap-bin-files, for file systems where mmap is slow or counted against memory), then
    each `get` reads its slice with a seek and a read.
    `dataset[i]` is sequence i as a numpy array; `get(i, offset, length)` reads a slice of it.

    `counts` = (sequence count, document count) and `dtype` skip reading the index header
    (Megatron's --per-dataset-sequences-path, for blends of thousands of files on a slow file
    system); the file sizes must then agree with them exactly.
    """

    def __init__(
        self, prefix: str, mmap: bool = True, counts: Optional[Sequence[int]] = None,
        dtype=None,
    ) -> None:
        from megatron_smp.config import ConfigError

        self.prefix = prefix
        idx_path, bin_path = index_file_path(prefix), data_file_path(prefix)
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                raise ConfigError(
                    f"--data-path: {path} not found; give the prefix of a dataset made by "
                    "tools/preprocess_data.py (without .bin/.idx), e.g. out_text_document"
                )
        if counts is not None:
            self._from_counts(prefix, mmap, counts, dtype)
            return
        with open(idx_path, "rb") as index_file:
            header = index_file.read(len(INDEX_HEADER))
            if header != INDEX_HEADER:
                raise ConfigError(
                    f"{idx_path} is not a Megatron-LM mmap index (header {header!r}); "
                    "re-create it with tools/preprocess_data.py"
                )
            (version,) = struct.unpack("<Q", index_file.read(8))
            if version != INDEX_VERSION:
                raise ConfigError(f"{idx_path}: index version {version} is not supported (1 is)")
            (dtype_code,) = struct.unpack("<B", index_file.read(1))
            if dtype_code not in DTYPE_CODES:
                raise ConfigError(f"{idx_path}: unknown dtype code {dtype_code}")
            self.dtype = np.dtype(DTYPE_CODES[dtype_code])
            (sequence_count,) = struct.unpack("<Q", index_file.read(8))
            (document_count,) = struct.unpack("<Q", index_file.read(8))
            offset = index_file.tell()

        expected = offset + sequence_count * (4 + 8) + document_count * 8
        actual = os.path.getsize(idx_path)
        if actual < expected:
            raise ConfigError(
                f"{idx_path} is truncated: {actual} bytes, the header promises {expected}"
            )
        self._map(idx_path, bin_path, mmap, sequence_count, document_count, offset)

    def _from_counts(self, prefix, mmap, counts, dtype) -> None:
        from megatron_smp.config import ConfigError

        flag = "--per-dataset-sequences-path"
        idx_path, bin_path = index_file_path(prefix), data_file_path(prefix)
        sequence_count, document_count = (int(c) for c in counts)
        self.dtype = np.dtype(dtype)
        offset = len(INDEX_HEADER) + 8 + 1 + 8 + 8
        expected = offset + sequence_count * (4 + 8) + document_count * 8
        actual = os.path.getsize(idx_path)
        if actual != expected:
            raise ConfigError(
                f"{flag}: {prefix} has {sequence_count} sequences and {document_count} "
                f"document indices there, which make a {expected}-byte {idx_path}, but it has "
                f"{actual} bytes; rebuild the file with tools/build_sequences_per_dataset.py"
            )
        self._map(idx_path, bin_path, mmap, sequence_count, document_count, offset,
                  check_bin=False)
        if sequence_count:
            end = int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * (
                self.dtype.itemsize)
            if end != os.path.getsize(bin_path):
                raise ConfigError(
                    f"{flag}: {bin_path} does not hold {self.dtype} tokens (the dtype the "
                    f"tokenizer's vocabulary implies: uint16 up to 65536 ids, else int32); "
                    f"drop {flag} for this data"
                )

    def _map(self, idx_path, bin_path, mmap, sequence_count, document_count, offset,
             check_bin: bool = True) -> None:
        from megatron_smp.config import ConfigError

        self._index_map = np.memmap(idx_path, mode="r", order="C")
        self.sequence_lengths = np.frombuffer(
            self._index_map, dtype="<i4", count=sequence_count, offset=offset
        )
        offset += self.sequence_lengths.nbytes
        self.sequence_pointers = np.frombuffer(
            self._index_map, dtype="<i8", count=sequence_count, offset=offset
        )
        offset += self.sequence_pointers.nbytes
        self.document_indices = np.frombuffer(
            self._index_map, dtype="<i8", count=document_count, offset=offset
        )
        data_bytes = os.path.getsize(bin_path)
        if sequence_count and check_bin:
            last_length = int(self.sequence_lengths[-1])
            end = int(self.sequence_pointers[-1]) + last_length * self.dtype.itemsize
            if end > data_bytes:
                raise ConfigError(
                    f"{bin_path} is truncated: {data_bytes} bytes, the index needs {end}"
                )
        self._bin_path = bin_path
        self.mmap = mmap
        # np.memmap refuses empty files; an empty dataset has nothing to map.
        self._data_map = (
            np.memmap(bin_path, mode="r", order="C")
            if data_bytes and mmap
            else np.zeros(0, np.uint8)
        )

    def __len__(self) -> int:
        return self.sequence_lengths.size

    @property
    def sizes(self) -> np.ndarray:
        return self.sequence_lengths

    @property
    def num_documents(self) -> int:
        return max(self.document_indices.size - 1, 0)

    def get(self, index: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """Tokens `[offset, offset + length)` of sequence `index` (a view into the mmap, or a
        fresh array read from the file without mmap)."""
        size = int(self.sequence_lengths[index])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"slice [{offset}, {offset + length}) outside sequence of {size}")
        pointer = int(self.sequence_pointers[index]) + offset * self.dtype.itemsize
        if not self.mmap:
            tokens = np.empty(length, dtype=self.dtype)
            with open(self._bin_path, "rb", buffering=0) as data_file:
                data_file.seek(pointer)
                data_file.readinto(tokens)
            return tokens
        return np.frombuffer(self._data_map, dtype=self.dtype, count=length, offset=pointer)

    def __getitem__(self, index: int) -> np.ndarray:
        if isinstance(index, slice):
            return [self.get(i) for i in range(*index.indices(len(self)))]
        return self.get(int(index))


__all__ = [
    "INDEX_HEADER",
    "DTYPE_CODES",
    "IndexedDataset",
    "IndexedDatasetBuilder",
    "write_index",
    "optimal_dtype",
    "dataset_exists",
    "data_file_path",
    "index_file_path",
]
