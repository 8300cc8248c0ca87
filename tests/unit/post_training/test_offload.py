"""offload / onload of params, grads and optimizer state: between two training steps on the
fake accelerator (every storage emptied, host copies on the CPU, training goes on); the
values round-trip through the same storages (views stay valid); on the CPU itself offload is
a clear error."""
import pytest
import torch

from megatron_smp.testing import run_distributed
from tests.fake_device.harness import pretrain_on_fake_device

ARGV = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--max-position-embeddings 16 --micro-batch-size 2 --global-batch-size 4 "
        "--train-iters 3 --mock-data --tokenizer-type NullTokenizer --vocab-size 128 "
        "--lr 1e-3 --log-interval 100 --eval-interval 100 --eval-iters 0 --seed 7 "
        "--bf16 --use-distributed-optimizer").split()


def test_offload_between_steps_on_the_fake_device(monkeypatch):
    import importlib

    from megatron_smp.post_training.engine import offload, onload

    pretrain_module = importlib.import_module("megatron_smp.training.pretrain")
    original = pretrain_module.train_step
    seen = []

    def train_step(run, *args, **kwargs):
        out = original(run, *args, **kwargs)
        handle = offload(run.model, run.optimizer)
        params = sum(p.numel() * p.element_size() for c in run.model for p in c.parameters())
        seen.append((handle.nbytes, params,
                     all(t.untyped_storage().nbytes() == 0 for t, _ in handle.pairs),
                     all(h.device.type == "cpu" for _, h in handle.pairs)))
        onload(handle)
        return out

    monkeypatch.setattr(pretrain_module, "train_step", train_step)
    # pretrain_on_fake_device wraps train_step itself: it takes the patched one.
    losses = pretrain_on_fake_device("pretrain_gpt", ARGV).losses
    assert len(seen) == 3 and losses[-1] < losses[0]
    for nbytes, params, emptied, on_host in seen:
        # Megatron's 18 bytes a parameter: bf16 params (2), fp32 main grads (4), fp32 main
        # params and Adam's two moments (4 + 4 + 4) = 9x the bf16 params' bytes.
        assert emptied and on_host and nbytes == 9 * params, (nbytes, params)


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
    from megatron_smp.post_training.engine import _offload, offload, onload
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
