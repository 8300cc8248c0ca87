"""async_save of tensors in device memory: the checkpoint holds the device values at call
time (staged to host memory, pinned when the source is on CUDA, so the copies run
asynchronously), whether staging runs before async_save returns or on the writer thread."""
import pytest
import torch

from tests.gpu.common import DEVICES


def _tensors(device):
    generator = torch.Generator().manual_seed(7)
    return {
        "weight": torch.randn(64, 48, generator=generator).to(device),
        "bf16": torch.randn(33, generator=generator).to(device=device, dtype=torch.bfloat16),
        "step": torch.tensor(12, dtype=torch.int64).to(device),
    }


@pytest.mark.parametrize("device", DEVICES)
def test_staged_copies_equal_device_tensors(device):
    from megatron_smp.checkpointing.engine.saver import stage_to_cpu

    tensors = _tensors(device)
    staged = stage_to_cpu({"model": tensors})["model"]
    for name, tensor in tensors.items():
        assert staged[name].device.type == "cpu" and staged[name].dtype == tensor.dtype
        assert torch.equal(staged[name], tensor.cpu()), name
        assert staged[name].is_pinned() == (device == "cuda"), name
        tensor.add_(1)  # the staged copy is independent of the source
        assert not torch.equal(staged[name], tensor.cpu()), name


@pytest.mark.parametrize("stage_in_background", [False, True], ids=["staged", "background"])
@pytest.mark.parametrize("device", DEVICES)
def test_async_save_writes_device_values_at_call_time(device, stage_in_background, tmp_path):
    from megatron_smp.checkpointing import engine as dcp
    from megatron_smp.parallel_state import init_process_group

    init_process_group()  # one process: nccl on CUDA, gloo on the CPU
    tensors = _tensors(device)
    expected = {name: t.cpu().clone() for name, t in tensors.items()}
    dcp.async_save({"model": tensors}, checkpoint_id=str(tmp_path / "ckpt"),
                   stage_in_background=stage_in_background)
    if stage_in_background:
        dcp.wait_for_staging()
    for tensor in tensors.values():
        tensor.add_(1)  # after staging: must not reach the checkpoint
    dcp.maybe_finalize_async_calls(blocking=True)
    loaded = {name: torch.zeros_like(t) for name, t in expected.items()}
    dcp.load({"model": loaded}, checkpoint_id=str(tmp_path / "ckpt"))
    for name in expected:
        assert torch.equal(loaded[name], expected[name]), name
