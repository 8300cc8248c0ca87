"""RNG states carry the device type their accelerator and tensor-parallel streams belong to;
a checkpoint resumed on another device type restores only the host generators, with a warning
(issue 26: CPU generator states, 5056 bytes, reached torch.cuda.set_rng_state, which wants 16).
The GPU side is constructed: a CUDA generator state is 16 bytes (seed and offset)."""
import random

import pytest
import torch

from megatron_smp.checkpointing import rng
from megatron_smp.tensor_parallel.random import MODEL_PARALLEL_RNG, get_rng_tracker


@pytest.fixture
def tracker():
    tracker = get_rng_tracker()
    saved = (tracker.get_states(), set(tracker.seeds), tracker.device)
    tracker.reset()
    tracker.add(MODEL_PARALLEL_RNG, 1234)
    yield tracker
    tracker.states, tracker.seeds, tracker.device = saved


def _draw(tracker):
    with tracker.fork():
        return torch.rand(3)


def test_cpu_states_record_their_device_and_restore_on_it(tracker):
    states = rng.get_rng_state()
    assert states["device_type"] == "cpu"
    expected = (_draw(tracker), random.random(), torch.rand(2))
    rng.set_rng_state(states)
    assert torch.equal(_draw(tracker), expected[0])
    assert random.random() == expected[1]
    assert torch.equal(torch.rand(2), expected[2])


def test_gpu_states_resumed_on_cpu_restore_only_the_host_generators(tracker):
    states = rng.get_rng_state()
    states["device_type"] = "cuda"
    states["cuda"] = torch.zeros(16, dtype=torch.uint8)
    states["tensor_parallel"] = {MODEL_PARALLEL_RNG: torch.zeros(16, dtype=torch.uint8)}
    host_draw = torch.rand(2)
    stream_draw = _draw(tracker)  # this run's stream moves on; it must stay where it is now
    next_stream = _draw(_copy(tracker))
    with pytest.warns(UserWarning, match="saved on cuda, this run draws on cpu"):
        rng.set_rng_state(states)
    assert torch.equal(torch.rand(2), host_draw)  # the host generator is restored
    assert torch.equal(_draw(tracker), next_stream)  # the tracker is untouched, and forks
    assert not torch.equal(next_stream, stream_draw)


def test_cpu_states_resumed_on_gpu_leave_the_gpu_streams_alone(tracker, monkeypatch):
    states = rng.get_rng_state()  # saved on the CPU: 5056-byte generator states
    monkeypatch.setattr(rng, "_device_type", lambda: "cuda")
    set_states = []
    monkeypatch.setattr(tracker, "set_states", set_states.append)
    with pytest.warns(UserWarning, match="saved on cpu, this run draws on cuda"):
        rng.set_rng_state(states)
    assert set_states == []


def _copy(tracker):
    """A tracker with the same streams (drawing from it leaves `tracker` as it is)."""
    from megatron_smp.tensor_parallel.random import RNGStatesTracker

    copy = RNGStatesTracker()
    copy.set_states(tracker.get_states())
    copy.device = tracker.device
    return copy
