"""offload / onload of params, grads and optimizer state: the values round-trip through the
same storages (views stay valid); on the CPU itself offload is a clear error. (On the fake
accelerator: tests/fake_device/test_offload_fake_device.py.)"""
import pytest
import torch

from megatron_smp.testing import run_distributed

def test_offload_round_trips_values_and_views():
    """The same moves on CPU tensors (the capability check bypassed): every view -- params
    in their buffer, main grads, optimizer state -- reads its values again after onload."""
    emptied, same, count = run_distributed(_round_trip, 1)[0]
    assert emptied and same and count > 20


def _round_trip(rank, world_size):
    from megatron_smp.config import ConfigError, OptimizerConfig, ParallelConfig
    from megatron_smp.distributed import DistributedDataParallel
    from megatron_smp.models.gpt import GPTModel
    from megatron_smp.optimizer import get_megatron_optimizer
    from megatron_smp.parallel_state import build_parallel_state
    from megatron_smp.post_training.backend_api import _offload, offload, onload
    from tests.unit.distributed.test_fsdp import _model_config

    state = build_parallel_state(ParallelConfig())
    config = OptimizerConfig(lr=1e-3)
    model = DistributedDataParallel(GPTModel(_model_config("llama"), state), config, state)
    optimizer = get_megatron_optimizer(config, [model], state)
    tokens = torch.randint(0, 64, (2, 16))
    model(tokens, labels=tokens).mean().backward()
    model.finish_grad_sync()
    optimizer.step()
    model(tokens, labels=tokens).mean().backward()
    snapshot = {id(t): t.clone() for t in _views(model, optimizer)}
    with pytest.raises(ConfigError, match="offload: .* on the CPU"):
        offload(model, optimizer)
    handle = _offload(model, optimizer, check_device=False)
    emptied = all(t.untyped_storage().nbytes() == 0 for t in _views(model, optimizer))
    onload(handle)
    same = all(torch.equal(t, snapshot[id(t)]) for t in _views(model, optimizer))
    return emptied, same, len(snapshot)


def _views(model, optimizer):
    tensors = [p for p in model.parameters()] + [p.main_grad for p in model.parameters()]
    for per_param in optimizer.optimizer.state.values():
        tensors += [v for v in per_param.values() if torch.is_tensor(v) and v.dim() > 0]
    return tensors
