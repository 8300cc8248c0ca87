"""--decoupled-lr / --decoupled-min-lr move the word embedding and output layer weights on
their own schedule, with the plain and with the distributed optimizer (DP=2).

Each rank's loss is sum(param * c_rank) over the params, so the data-parallel mean grad of
every element is known, (c_0 + c_1) / 2, and one AdamW step from it is computed by hand:
p <- p (1 - lr wd) - lr g / (|g| + eps) (the first step's bias-corrected moments are g and
g^2). The embedding and output weights must take that step with --decoupled-lr, the other
params with --lr.
"""
import pytest
import torch

from megatron_smp.config import OptimizerConfig, ParallelConfig
from megatron_smp.testing import run_distributed
from megatron_smp.training.optimizer_param_scheduler import OptimizerParamScheduler
from tests.unit.training.test_scheduler import GPT_PARAMETER_SHAPES, module_with_parameters

LR, DECOUPLED_LR, WEIGHT_DECAY, EPS = 1e-2, 3e-1, 0.1, 1e-8
DECOUPLED = ("embedding.word_embeddings.weight", "output_layer.weight")
SHAPES = GPT_PARAMETER_SHAPES


def _model():
    torch.manual_seed(3)
    return module_with_parameters(SHAPES, init=torch.randn)


def _coefficients(rank):
    generator = torch.Generator().manual_seed(100 + rank)
    return {name: torch.randn(shape, generator=generator) for name, shape in SHAPES.items()}


def _one_step(rank, world_size, distributed):
    from megatron_smp.distributed import DistributedDataParallel, finalize_model_grads
    from megatron_smp.optimizer import get_megatron_optimizer
    from megatron_smp.parallel_state import build_parallel_state

    state = build_parallel_state(ParallelConfig())
    config = OptimizerConfig(lr=LR, min_lr=0.0, decoupled_lr=DECOUPLED_LR,
                             decoupled_min_lr=0.0, weight_decay=WEIGHT_DECAY, adam_eps=EPS,
                             clip_grad=0.0, lr_decay_style="constant",
                             use_distributed_optimizer=distributed)
    model = _model()
    ddp = DistributedDataParallel(model, config, state)
    optimizer = get_megatron_optimizer(config, [ddp], state)
    OptimizerParamScheduler(optimizer, config, train_iters=10)
    coefficients = _coefficients(rank)
    loss = sum((param * coefficients[name]).sum() for name, param in model.named_parameters())
    loss.backward()
    finalize_model_grads([ddp], state)
    optimizer.step()
    lrs = sorted({group["lr"] for group in optimizer.param_groups})
    return {name: param.detach().tolist() for name, param in model.named_parameters()}, lrs


@pytest.mark.parametrize("distributed", [False, True], ids=["plain", "distributed"])
def test_embedding_and_output_layer_take_the_decoupled_lr(distributed):
    results = run_distributed(_one_step, 2, args=(distributed,), timeout=180)
    initial = dict(_model().named_parameters())
    grads = {name: (_coefficients(0)[name] + _coefficients(1)[name]) / 2 for name in SHAPES}
    for params, lrs in results:
        assert lrs == [LR, DECOUPLED_LR]
        for name, value in params.items():
            value = torch.tensor(value)
            lr = DECOUPLED_LR if name in DECOUPLED else LR
            weight_decay = 0.0 if value.dim() == 1 else WEIGHT_DECAY
            grad = grads[name]
            expected = initial[name].detach() * (1 - lr * weight_decay) - lr * grad / (
                grad.abs() + EPS)
            torch.testing.assert_close(value, expected, rtol=1e-5, atol=1e-6, msg=name)
