"""SMP-style save / async_save / maybe_finalize_async_calls / load on two gloo ranks."""
import os
import shutil
import threading

import pytest
import torch

from megatron_smp.testing import run_distributed

PAYLOAD = {
    "step": 7,
    "lr": 2.5e-4,
    "name": "gpt",
    "milestones": [1, 2.5, "x", None],
    "flags": (True, 3),
}


def _state_dict(rank, fill):
    from megatron_smp.checkpointing.engine import tp_sharded_tensor

    generator = torch.Generator().manual_seed(1234)
    full = torch.randn(6, 4, generator=generator)
    local = full.chunk(2)[rank].clone()
    bias = torch.randn(4, generator=generator, dtype=torch.float64)
    step = torch.tensor(11, dtype=torch.int64)
    extra = dict(PAYLOAD)
    if not fill:
        local.zero_(), bias.zero_(), step.zero_()
        extra = {k: None for k in PAYLOAD}
    state_dict = {
        "model": {"weight": tp_sharded_tensor(local, rank, 2, partition_dim=0), "bias": bias},
        "optimizer": {"step": step, "hyper": extra},
    }
    return state_dict, {"weight": local, "bias": bias, "step": step}


def _values(state_dict, tensors):
    return {
        **{k: v.tolist() for k, v in tensors.items()},
        "hyper": state_dict["optimizer"]["hyper"],
    }


def hold_writer(queue):
    """Occupy `queue`'s single writer thread until the returned event is set. Requests run in
    order, so a save scheduled meanwhile neither stages nor writes before then -- however
    slowly this process is scheduled, unlike a sleep in the writer."""
    from megatron_smp.checkpointing.engine import AsyncRequest

    released = threading.Event()
    # The time limit only spares a failed test a hang at interpreter exit.
    queue.schedule_async_request(
        AsyncRequest(async_fn=lambda: released.wait(60), description="held writer"))
    return released


def _error(fn):
    from megatron_smp.checkpointing.engine import CheckpointError

    try:
        fn()
    except CheckpointError as error:
        return str(error)
    return None


def _engine(rank, world_size, root):
    import torch.distributed as dist

    from megatron_smp.checkpointing import engine as dcp

    out = {}
    sync_path, async_path = os.path.join(root, "sync"), os.path.join(root, "async")
    saved, saved_tensors = _state_dict(rank, fill=True)
    out["expected"] = _values(saved, saved_tensors)

    # Synchronous round trip (rank 1 coordinates: it writes .metadata).
    dcp.save(saved, checkpoint_id=sync_path, coordinator_rank=1)
    template, tensors = _state_dict(rank, fill=False)
    dcp.load(template, checkpoint_id=sync_path)
    out["sync"] = _values(template, tensors)

    # Asynchronous: returns while the writer is held (call 0), so nothing of the save (call 1)
    # is written before the checks below; training then modifies the tensors, which must not
    # reach the checkpoint.
    released = hold_writer(dcp.DEFAULT_ASYNC_QUEUE)
    finalized_flags = []
    dcp.async_save(
        saved, checkpoint_id=async_path, finalize_fns=[lambda: finalized_flags.append(1)]
    )
    for t in saved_tensors.values():
        t.add_(1000)
    out["metadata_before_finalize"] = os.path.exists(os.path.join(async_path, ".metadata"))
    out["nonblocking"] = dcp.maybe_finalize_async_calls(blocking=False)
    out["finalized_before"] = list(finalized_flags)
    released.set()
    out["blocking"] = dcp.maybe_finalize_async_calls(blocking=True)
    out["finalized_after"] = list(finalized_flags)
    template, tensors = _state_dict(rank, fill=False)
    dcp.load(template, checkpoint_id=async_path)
    out["async"] = _values(template, tensors)

    # A write that fails in the background is raised on every rank at finalisation, and its
    # finalize functions do not run.
    blocked = os.path.join(root, "blocked")
    if rank == 0:
        open(blocked, "w").close()  # a file where the checkpoint directory should go
    dist.barrier()
    dcp.async_save(saved, checkpoint_id=os.path.join(blocked, "ckpt"),
                   finalize_fns=[lambda: finalized_flags.append(2)])
    out["failed_write"] = _error(lambda: dcp.maybe_finalize_async_calls(blocking=True))
    out["finalized_after_failure"] = list(finalized_flags)

    # A DTensor (uneven Shard(0) on a 1-D mesh) is staged and saved asynchronously, then
    # loaded back as a ShardedTensorView with the same chunk.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    full = torch.arange(15.0).reshape(5, 3)
    mesh = init_device_mesh("cpu", (world_size,))
    local = full.chunk(world_size)[rank].clone()
    dtensor = DTensor.from_local(local, mesh, [Shard(0)], shape=full.shape, stride=full.stride())
    dtensor_path = os.path.join(root, "dtensor")
    dcp.async_save({"w": dtensor}, checkpoint_id=dtensor_path)
    local.zero_()
    dcp.maybe_finalize_async_calls(blocking=True)
    target = torch.zeros_like(local)
    offset = 3 * rank  # torch.chunk of 5 rows: 3 + 2
    view = dcp.make_sharded_tensor(target, full.shape, (offset, 0))
    dcp.load({"w": view}, checkpoint_id=dtensor_path)
    out["dtensor"] = target.tolist() == full.chunk(world_size)[rank].tolist()

    # Key and shape mismatches are reported on every rank, naming the keys.
    template, _ = _state_dict(rank, fill=False)
    del template["model"]["bias"]
    template["model"]["extra"] = torch.zeros(2)
    out["keys_error"] = _error(lambda: dcp.load(template, checkpoint_id=sync_path))
    template, _ = _state_dict(rank, fill=False)
    template["model"]["bias"] = torch.zeros(5, dtype=torch.float64)
    out["shape_error"] = _error(lambda: dcp.load(template, checkpoint_id=sync_path))

    # Corrupted copies: truncated data file, garbage data file (without its checksum, so
    # torch's decoder meets it), one flipped byte (caught by the checksum), truncated metadata.
    corruptions = ("truncated", "garbage", "flipped", "metadata")
    if rank == 0:
        for name in corruptions:
            shutil.copytree(sync_path, os.path.join(root, name))
        data = os.path.join(root, "truncated", "__1_0.distcp")
        os.truncate(data, os.path.getsize(data) // 2)
        garbage = os.path.join(root, "garbage", "__0_0.distcp")
        os.remove(garbage + ".crc32")
        with open(garbage, "r+b") as f:
            f.write(b"\x00garbage" * 8)
        flipped = os.path.join(root, "flipped", "__1_0.distcp")
        with open(flipped, "r+b") as f:
            f.seek(os.path.getsize(flipped) // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x10]))
        meta = os.path.join(root, "metadata", ".metadata")
        os.truncate(meta, os.path.getsize(meta) // 2)
    dist.barrier()
    for name in corruptions:
        template, _ = _state_dict(rank, fill=False)
        out[name] = _error(lambda: dcp.load(template, checkpoint_id=os.path.join(root, name)))
    return out


def test_save_load_async_and_errors(tmp_path):
    results = run_distributed(_engine, 2, args=(str(tmp_path),))
    for rank, out in enumerate(results):
        expected = out["expected"]
        assert expected["hyper"] == PAYLOAD
        assert out["sync"] == expected, rank
        assert out["async"] == expected, rank
        # async_save returned before its write, which was held until after these checks.
        assert not out["metadata_before_finalize"]
        assert out["nonblocking"] == [] and out["finalized_before"] == []
        assert out["blocking"] == [0, 1] and out["finalized_after"] == [1]
        assert out["dtensor"]
        assert "failed on rank(s) [0, 1]" in out["failed_write"], out["failed_write"]
        assert out["finalized_after_failure"] == [1]

        assert "missing from the checkpoint: model.extra" in out["keys_error"]
        assert "loaded by no rank: model.bias" in out["keys_error"]
        assert "model.bias: checkpoint shape [4] vs model shape [5]" in out["shape_error"]
        assert "__1_0.distcp is truncated" in out["truncated"]
        assert "garbage/__0_0.distcp (" in out["garbage"] and "corrupted" in out["garbage"]
        assert "flipped/__1_0.distcp is corrupted: CRC-32" in out["flipped"], out["flipped"]
        assert ".metadata is truncated or corrupted" in out["metadata"]


def test_s3_arguments_are_rejected():
    from megatron_smp.checkpointing.engine import async_save, load, save

    for fn in (save, async_save, load):
        with pytest.raises(NotImplementedError, match="S3"):
            fn({}, checkpoint_id="s3://bucket/x", s3_region="us-west-2")


def test_non_plain_values_are_refused_at_save(tmp_path):
    import numpy as np

    from megatron_smp.checkpointing.engine import CheckpointError, save

    with pytest.raises(CheckpointError, match="numpy.ndarray"):
        save({"a": {"b": np.zeros(2)}}, checkpoint_id=str(tmp_path))


def test_metadata_unpickler_refuses_code(tmp_path):
    from megatron_smp.checkpointing.engine import CheckpointError, read_dcp_metadata

    # pickle protocol 4: GLOBAL "<dcp filesystem module>" "os.system", called with "echo".
    module = b"torch.distributed.checkpoint.filesystem"
    evil = (
        b"\x80\x04\x8c" + bytes([len(module)]) + module + b"\x94\x8c\tos.system\x94\x93\x94"
        b"\x8c\x0aecho PWNED\x94\x85\x94R\x94."
    )
    (tmp_path / ".metadata").write_bytes(evil)
    with pytest.raises(CheckpointError, match="os.system is not allowed"):
        read_dcp_metadata(str(tmp_path))


def test_metadata_is_unpickled_once_per_content(tmp_path, monkeypatch):
    """A load reads .metadata three times: the same bytes unpickle once; other bytes (a newer
    checkpoint, or the same file damaged in place) are read afresh."""
    from megatron_smp.checkpointing.engine import CheckpointError, read_dcp_metadata, save
    from megatron_smp.checkpointing.engine import storage

    for name, size in (("a", 4), ("b", 5)):
        save({"w": torch.arange(size, dtype=torch.float32)}, checkpoint_id=str(tmp_path / name))
    unpickled = []
    real = storage._MetadataUnpickler.load
    monkeypatch.setattr(storage._MetadataUnpickler, "load",
                        lambda self: unpickled.append(1) or real(self))
    first = read_dcp_metadata(str(tmp_path / "a"))
    assert read_dcp_metadata(str(tmp_path / "a")) is first and len(unpickled) == 1
    other = read_dcp_metadata(str(tmp_path / "b"))
    assert list(other.state_dict_metadata["w"].size) == [5] and len(unpickled) == 2
    path = tmp_path / "b" / ".metadata"
    data = bytearray(path.read_bytes())
    data[len(data) // 2:] = b"\xff" * (len(data) - len(data) // 2)  # same size, damaged
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="truncated or corrupted"):
        read_dcp_metadata(str(tmp_path / "b"))


def test_item_checksums_direct_reads_and_first_format_sidecars(tmp_path, monkeypatch):
    """Each item's CRC-32 is taken while it is written (the file is not read back); a large
    tensor loaded whole is read from the disk into its destination, a part of it (another
    layout) through torch.load; both are verified, and a flipped byte in either an item's
    data or its zip header is an error naming the file. A sidecar of the first format (one
    CRC-32 of the file) still verifies the whole file."""
    import json

    from megatron_smp.checkpointing import engine as dcp
    from megatron_smp.checkpointing.engine import storage

    big = torch.randn(1 << 19)  # 2 MiB: the direct read
    state = {"big": big, "big2": torch.randn(1 << 19),  # the same layout as "big"
             "bf16": torch.randn(1024, 600).to(torch.bfloat16),
             "small": torch.arange(6.0), "hyper": {"lr": 0.5}}
    path = str(tmp_path / "ckpt")
    monkeypatch.setattr(storage, "file_crc32", lambda p: pytest.fail("save read back " + p))
    dcp.save(state, checkpoint_id=path)
    monkeypatch.undo()
    data = os.path.join(path, "__0_0.distcp")
    with open(data + ".crc32") as handle:
        sidecar = json.load(handle)
    assert sidecar["format"] == 2 and sidecar["size"] == os.path.getsize(data)
    assert len(sidecar["items"]) == 5
    assert sum(length for _, length, _ in sidecar["items"]) == os.path.getsize(data)

    direct = []
    original = storage._read_into
    monkeypatch.setattr(storage, "_read_into",
                        lambda *args: direct.append(original(*args)) or direct[-1])

    meta_loads = []
    torch_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *args, **kwargs: meta_loads.append(
        kwargs.get("map_location")) or torch_load(*args, **kwargs))

    def load(where, template=None):
        template = template or {"big": torch.zeros_like(big), "big2": torch.zeros_like(big),
                                "bf16": torch.zeros(1024, 600, dtype=torch.bfloat16),
                                "small": torch.zeros(6), "hyper": {"lr": None}}
        dcp.load(template, checkpoint_id=where)
        return template

    loaded = load(path)
    assert direct == [True, True, True, False]  # big, big2, bf16 (> 1 MiB); small decoded
    # big2's zip layout is big's (same dtype, shape, length and header bytes): not decoded.
    assert meta_loads.count("meta") == 2
    assert torch.equal(loaded["big"], big) and torch.equal(loaded["bf16"], state["bf16"])
    assert torch.equal(loaded["big2"], state["big2"])
    assert torch.equal(loaded["small"], state["small"]) and loaded["hyper"] == {"lr": 0.5}
    # Half of "big" (as another layout would ask): decoded, then narrowed.
    half = dcp.make_sharded_tensor(torch.zeros(1 << 18), big.shape, (1 << 18,))
    dcp.load({"big": half}, checkpoint_id=path)
    assert torch.equal(half.local_tensors()[0], big[1 << 18:])

    offsets = sorted(offset for offset, _, _ in sidecar["items"])
    # The later of the two 2 MiB items is the one read through the remembered layout.
    cached_offset = max(offset for offset, length, _ in sidecar["items"] if length > 1 << 21)
    for name, position in (("data", os.path.getsize(data) // 5),  # inside big's data
                           ("header", offsets[1] + 2),  # an item's zip header
                           ("cached", cached_offset + (1 << 20))):
        copy = str(tmp_path / name)
        shutil.copytree(path, copy)
        with open(os.path.join(copy, "__0_0.distcp"), "r+b") as handle:
            handle.seek(position)
            byte = handle.read(1)
            handle.seek(position)
            handle.write(bytes([byte[0] ^ 0x01]))
        with pytest.raises(storage.CheckpointError,
                           match=f"{name}/__0_0.distcp is corrupted: CRC-32"):
            load(copy)

    # Checkpoints written before per-item checksums: the whole file is verified.
    old = str(tmp_path / "first_format")
    shutil.copytree(path, old)
    storage.write_checksum(os.path.join(old, "__0_0.distcp"))
    assert torch.equal(load(old)["big"], big)
    with open(os.path.join(old, "__0_0.distcp"), "r+b") as handle:
        handle.seek(100)
        byte = handle.read(1)
        handle.seek(100)
        handle.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(storage.CheckpointError, match="first_format/__0_0.distcp is "
                                                      "corrupted: CRC-32"):
        load(old)


@pytest.mark.parametrize("in_background", [False, True])
def test_prepared_staging_buffers_are_the_ones_saves_copy_into(tmp_path, in_background):
    """prepare_staging allocates the queue's staging buffers at once and writes their pages
    on the writer thread; the next async_save (staged at the call, which first waits for
    that, or in the background, after it on the same thread) copies into those buffers."""
    from megatron_smp.checkpointing import engine as dcp

    queue = dcp.AsyncCallsQueue()
    state = {"w": torch.randn(1000), "n": {"b": torch.ones(3, dtype=torch.bfloat16)},
             "lr": 0.1}
    dcp.prepare_staging(state, queue)
    prepared = dict(queue._staging_buffers)
    assert sorted(prepared) == [("n", "b"), ("w",)]
    path = str(tmp_path / "ckpt")
    saved = state["w"].clone()
    dcp.async_save(state, checkpoint_id=path, queue=queue, stage_in_background=in_background)
    if in_background:
        queue.wait_for_staging()
    state["w"].add_(1.0)  # after staging: the checkpoint keeps the values at the call
    queue.maybe_finalize_async_calls(blocking=True)
    assert all(queue._staging_buffers[key] is prepared[key] for key in prepared)
    template = {"w": torch.zeros(1000), "n": {"b": torch.zeros(3, dtype=torch.bfloat16)},
                "lr": None}
    dcp.load(template, checkpoint_id=path)
    assert torch.equal(template["w"], saved) and template["lr"] == 0.1
    assert torch.equal(template["n"]["b"], state["n"]["b"])
    queue.close()
