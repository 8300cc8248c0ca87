import struct

import numpy as np
import pytest

from megatron_smp.config import ConfigError
from megatron_smp.data.indexed_dataset import (
    INDEX_HEADER,
    IndexedDataset,
    IndexedDatasetBuilder,
)

from .conftest import random_documents, write_documents


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.int64])
def test_builder_round_trip(tmp_path, dtype):
    documents = random_documents(200, seed=0, eod=999)
    prefix = write_documents(str(tmp_path / "ds"), documents, dtype)
    dataset = IndexedDataset(prefix)
    assert dataset.dtype == np.dtype(dtype)
    assert len(dataset) == 200 and dataset.num_documents == 200
    assert dataset.document_indices.tolist() == list(range(201))
    for i, document in enumerate(documents):
        assert dataset[i].tolist() == document
    assert dataset.get(3, offset=1, length=2).tolist() == documents[3][1:3]
    # The reader maps the files instead of reading them.
    assert isinstance(dataset._data_map, np.memmap)


def test_reads_a_file_in_megatron_lm_layout(tmp_path):
    """An .idx/.bin written byte by byte from Megatron-LM's documented format."""
    # Two documents: the first made of two sequences (sentences), the second of one.
    sequences = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    document_indices = [0, 2, 3]
    with open(tmp_path / "mlm.bin", "wb") as handle:
        for sequence in sequences:
            handle.write(np.asarray(sequence, dtype="<i4").tobytes())
    pointers, offset = [], 0
    for sequence in sequences:
        pointers.append(offset)
        offset += 4 * len(sequence)
    with open(tmp_path / "mlm.idx", "wb") as handle:
        handle.write(b"MMIDIDX\x00\x00")
        handle.write(struct.pack("<Q", 1))  # version
        handle.write(struct.pack("<B", 4))  # dtype code 4 = int32
        handle.write(struct.pack("<Q", len(sequences)))
        handle.write(struct.pack("<Q", len(document_indices)))
        handle.write(struct.pack(f"<{len(sequences)}i", *[len(s) for s in sequences]))
        handle.write(struct.pack(f"<{len(pointers)}q", *pointers))
        handle.write(struct.pack(f"<{len(document_indices)}q", *document_indices))
    dataset = IndexedDataset(str(tmp_path / "mlm"))
    assert dataset.dtype == np.int32
    assert [dataset[i].tolist() for i in range(3)] == sequences
    assert dataset.sequence_lengths.tolist() == [3, 2, 4]
    assert dataset.sequence_pointers.tolist() == [0, 12, 20]
    assert dataset.document_indices.tolist() == document_indices
    assert dataset.num_documents == 2


def test_builder_writes_megatron_lm_bytes(tmp_path):
    """Our .idx is byte-identical to what Megatron-LM's writer produces for the same data."""
    builder = IndexedDatasetBuilder(str(tmp_path / "ours.bin"), np.uint16)
    builder.add_document(np.array([1, 2, 3]), lengths=[2, 1])
    builder.add_item(np.array([4]))
    builder.end_document()
    builder.finalize(str(tmp_path / "ours.idx"))
    expected = (
        INDEX_HEADER
        + struct.pack("<Q", 1)
        + struct.pack("<B", 8)  # uint16
        + struct.pack("<Q", 3)
        + struct.pack("<Q", 3)
        + struct.pack("<3i", 2, 1, 1)
        + struct.pack("<3q", 0, 4, 6)
        + struct.pack("<3q", 0, 2, 3)
    )
    assert (tmp_path / "ours.idx").read_bytes() == expected
    assert (tmp_path / "ours.bin").read_bytes() == np.array([1, 2, 3, 4], "<u2").tobytes()


def test_add_index_merges_datasets(tmp_path):
    first = write_documents(str(tmp_path / "a"), [[1, 2], [3]])
    second = write_documents(str(tmp_path / "b"), [[4, 5, 6]])
    builder = IndexedDatasetBuilder(str(tmp_path / "merged.bin"), np.uint16)
    builder.add_index(first)
    builder.add_index(second)
    builder.finalize(str(tmp_path / "merged.idx"))
    merged = IndexedDataset(str(tmp_path / "merged"))
    assert [merged[i].tolist() for i in range(len(merged))] == [[1, 2], [3], [4, 5, 6]]
    assert merged.document_indices.tolist() == [0, 1, 2, 3]


def test_missing_corrupt_and_truncated_files_are_clear_errors(tmp_path):
    with pytest.raises(ConfigError, match="nope.idx not found"):
        IndexedDataset(str(tmp_path / "nope"))
    prefix = write_documents(str(tmp_path / "ds"), [[1, 2, 3], [4, 5]])
    idx = (tmp_path / "ds.idx").read_bytes()
    (tmp_path / "ds.idx").write_bytes(b"XXXXXXXXX" + idx[9:])
    with pytest.raises(ConfigError, match="not a Megatron-LM mmap index"):
        IndexedDataset(prefix)
    (tmp_path / "ds.idx").write_bytes(idx)
    (tmp_path / "ds.bin").write_bytes(b"\x00\x00")
    with pytest.raises(ConfigError, match="ds.bin is truncated"):
        IndexedDataset(prefix)
