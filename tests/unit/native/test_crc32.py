"""crc32.c against zlib: every length and alignment around the fold boundaries, any starting
value, both of its paths; and the checkpoint engine's use of it (a checkpoint written with
either implementation verifies with the other, large items read on the worker thread)."""
import json
import os
import random
import zlib

import numpy as np
import pytest
import torch

from megatron_smp import native
from megatron_smp.native import checksum


def _library():
    if native._compiler() is None:
        pytest.skip("no C compiler here")
    library = native.load_library(checksum._SOURCE, checksum._FLAGS, checksum._declare, "")
    assert library is not None, "a C compiler is here: crc32.c must build"
    return library


def test_both_paths_equal_zlib_at_every_length_alignment_and_start_value():
    library = _library()
    data = np.frombuffer(os.urandom(1 << 16), dtype=np.uint8)
    rng = random.Random(5)
    lengths = list(range(0, 300)) + [511, 512, 513, 1023, 4096, 4099, 65000]
    for length in lengths:
        offset = rng.randrange(0, 64)
        chunk = data[offset:offset + length]
        pointer = chunk.ctypes.data
        for value in (0, 0xFFFFFFFF, rng.getrandbits(32)):
            expected = zlib.crc32(chunk.tobytes(), value)
            assert library.msmp_crc32(value, pointer, chunk.size) == expected, (length, value)
            assert library.msmp_crc32_table(value, pointer, chunk.size) == expected


def test_chained_calls_and_buffer_kinds_through_the_python_entry_point():
    _library()
    blob = os.urandom(3 << 20)
    expected = zlib.crc32(blob)
    assert checksum.library() is not None
    crc = 0
    for start in range(0, len(blob), 1 << 20):  # chained like a block-by-block reader
        crc = checksum.crc32(memoryview(blob)[start:start + (1 << 20)], crc)
    assert crc == expected
    assert checksum.crc32(bytearray(blob)) == expected
    assert checksum.crc32(np.frombuffer(blob, dtype=np.float32)) == expected
    tensor = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    assert checksum.crc32(tensor.numpy()[7:]) == zlib.crc32(blob[7:])
    assert checksum.crc32(b"abc", 9) == zlib.crc32(b"abc", 9)


def test_the_fallback_is_zlib(monkeypatch):
    monkeypatch.setenv(native.DISABLE_ENV, "1")
    assert checksum.library() is None
    blob = os.urandom(1 << 20)
    assert checksum.crc32(blob, 3) == zlib.crc32(blob, 3)


def _flip(path, position):
    with open(path, "r+b") as handle:
        handle.seek(position)
        byte = handle.read(1)
        handle.seek(position)
        handle.write(bytes([byte[0] ^ 0x10]))


@pytest.mark.parametrize("written_with", ["c", "zlib"])
def test_checkpoints_verify_across_implementations_and_large_items(tmp_path, monkeypatch,
                                                                    written_with):
    """An item larger than the read block goes through the worker-thread reader; a flipped
    byte in its last block is still found. Data files start their disk writes every
    WRITEBACK_BYTES, in order, covering the file."""
    _library()
    from megatron_smp.checkpointing import engine as dcp
    from megatron_smp.checkpointing.engine import storage

    big = torch.randn(5 << 20)  # 20 MiB: five read blocks
    state = {"big": big, "small": torch.arange(4.0),
             **{f"mid{i}": torch.randn(1 << 18) for i in range(8)}}  # 1 MiB each
    ranges = []
    if storage._sync_file_range is not None:
        real = storage._sync_file_range
        monkeypatch.setattr(storage, "WRITEBACK_BYTES", 1 << 20)
        monkeypatch.setattr(storage, "_sync_file_range", lambda fd, offset, length, flags: (
            ranges.append((offset, length, flags)), real(fd, offset, length, flags))[1])
    if written_with == "zlib":
        monkeypatch.setenv(native.DISABLE_ENV, "1")
    path = str(tmp_path / "ckpt")
    dcp.save(state, checkpoint_id=path)
    monkeypatch.delenv(native.DISABLE_ENV, raising=False)
    if storage._sync_file_range is not None:
        assert len(ranges) >= 8 and ranges[0][0] == 0
        assert all(a + n == b for (a, n, _), (b, _, _) in zip(ranges, ranges[1:]))
        assert all(flags == 2 and n >= 1 << 20 for _, n, flags in ranges)
        size = os.path.getsize(os.path.join(path, "__0_0.distcp"))
        assert ranges[-1][0] + ranges[-1][1] > size - (1 << 20)
    if written_with == "c":  # and read back with zlib
        monkeypatch.setenv(native.DISABLE_ENV, "1")
    template = {key: torch.zeros_like(value) for key, value in state.items()}
    dcp.load(template, checkpoint_id=path)
    assert all(torch.equal(template[key], value) for key, value in state.items())

    monkeypatch.delenv(native.DISABLE_ENV, raising=False)
    data = os.path.join(path, "__0_0.distcp")
    with open(data + ".crc32") as handle:
        items = json.load(handle)["items"]
    big_offset, big_length = max(((offset, length) for offset, length, _ in items),
                                 key=lambda item: item[1])
    _flip(data, big_offset + big_length - 5000)  # in the last block of big's data
    with pytest.raises(storage.CheckpointError, match="__0_0.distcp is corrupted: CRC-32"):
        dcp.load({key: torch.zeros_like(value) for key, value in state.items()},
                 checkpoint_id=path)
