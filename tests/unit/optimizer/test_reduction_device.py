"""Grad-norm and zero-count accumulators, and the sequence-parallel grad all-reduce, live on
the process group's device (the state's), not on the grads' (issue 26): under FSDP2's
cpu_offload the grads are on the CPU, and a rank may hold no grads at all, while NCCL reduces
CUDA tensors only. The state's device here is "meta" (the CPU build has no second real device);
the collective is a recorder that stops the call once it has seen the tensor's device."""
import importlib
import math
import types

import pytest
import torch

from megatron_smp.optimizer import clip_grads

# The package re-exports a function of the module's name.
finalize_model_grads = importlib.import_module("megatron_smp.distributed.finalize_model_grads")

DEVICE = torch.device("meta")


class _Reduced(Exception):
    pass


@pytest.fixture
def recorder(monkeypatch):
    """Patch the collectives of both modules: a 2-rank group whose all_reduce raises
    `_Reduced(device of the tensor)`."""
    def all_reduce(tensor, *args, **kwargs):
        raise _Reduced(tensor.device)

    for module in (clip_grads, finalize_model_grads):
        monkeypatch.setattr(module.dist, "get_world_size", lambda group=None: 2)
        monkeypatch.setattr(module.dist, "all_reduce", all_reduce)


def _reduced_on(call) -> torch.device:
    with pytest.raises(_Reduced) as caught:
        call()
    return caught.value.args[0]


@pytest.mark.parametrize("grads", [[torch.ones(3), torch.zeros(2, 2)], []],
                         ids=["offloaded_grads", "no_grads"])
def test_norm_and_zero_count_reduce_on_the_state_device(recorder, grads):
    group = object()
    for norm_type in (2.0, math.inf):
        assert _reduced_on(lambda: clip_grads.get_grad_norm_fp32(
            grads, [group], DEVICE, norm_type)) == DEVICE
    assert _reduced_on(lambda: clip_grads.count_zeros_fp32(grads, [group], DEVICE)) == DEVICE


def test_sequence_parallel_grads_reduce_on_the_state_device(recorder):
    layer = torch.nn.Linear(2, 2)
    layer.weight.sequence_parallel = True
    layer.weight.grad = torch.ones(2, 2)  # offloaded: on the CPU
    group = object()
    state = types.SimpleNamespace(tp_size=2, tp_group=group, etp_group=group, etp_size=2,
                                  device=DEVICE)
    assert _reduced_on(lambda: finalize_model_grads.allreduce_sequence_parallel_grads(
        [layer], state)) == DEVICE


def test_norms_on_the_state_device_keep_their_values():
    """The values are unchanged (one rank, no collective): 2-norm, inf-norm and zeros."""
    grads = [torch.tensor([3.0, 0.0]), torch.tensor([[0.0, -4.0]])]
    cpu = torch.device("cpu")
    assert clip_grads.get_grad_norm_fp32(grads, [None], cpu) == pytest.approx(5.0)
    assert clip_grads.get_grad_norm_fp32(grads, [None], cpu, math.inf) == 4.0
    assert clip_grads.get_grad_norm_fp32([], [None], cpu) == 0.0
    assert clip_grads.count_zeros_fp32(grads, [None], cpu) == 2
