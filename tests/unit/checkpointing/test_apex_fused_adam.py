"""apex's FusedAdam (our optimizer on CUDA where apex imports), without apex or CUDA: a
stand-in `apex.optimizers.FusedAdam` with apex's bookkeeping (moments per param, the step
count per param *group*) is put in sys.modules.

Checkpoints taken with it resume exactly (the per-group step count included) and load into
torch's AdamW; an apex built without CUDA extensions (RuntimeError at construction) falls back
to torch's AdamW with a warning."""
import sys
import types

import pytest
import torch

from megatron_smp.config import OptimizerConfig
from megatron_smp.testing import run_distributed

ITERS, SAVED_AT, BATCH = 4, 2, 8


class StandInFusedAdam(torch.optim.Optimizer):
    """apex.optimizers.FusedAdam's contract in plain torch: AdamW math (adam_w_mode), state
    {exp_avg, exp_avg_sq} per param, `group["step"]` an int created at the first step."""

    broken = False  # an apex without CUDA extensions: RuntimeError at construction

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 adam_w_mode=True):
        if self.broken:
            raise RuntimeError("apex.optimizers.FusedAdam requires cuda extensions")
        assert adam_w_mode
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            step = group["step"]
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state["exp_avg"] = torch.zeros_like(param)
                    state["exp_avg_sq"] = torch.zeros_like(param)
                param.mul_(1 - group["lr"] * group["weight_decay"])
                state["exp_avg"].lerp_(param.grad, 1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(param.grad, param.grad, value=1 - beta2)
                denom = (state["exp_avg_sq"] / (1 - beta2 ** step)).sqrt_().add_(group["eps"])
                param.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / (1 - beta1 ** step))


def _install_stand_in(modules, broken=False):
    """Put the stand-in apex into `modules` (sys.modules, or a monkeypatch's setitem)."""
    apex = types.ModuleType("apex")
    optimizers = types.ModuleType("apex.optimizers")
    optimizers.FusedAdam = type("FusedAdam", (StandInFusedAdam,), {"broken": broken})
    apex.optimizers = optimizers
    modules("apex", apex)
    modules("apex.optimizers", optimizers)
    return optimizers.FusedAdam


def _build(state, apex: bool, distributed: bool):
    """ToyModel under our DDP with the optimizer our factory builds for a CUDA device (apex's
    stand-in) or for the CPU (torch's AdamW)."""
    import megatron_smp.optimizer as optimizer_module
    from megatron_smp.distributed import DistributedDataParallel
    from tests.unit.distributed.toy_training import ToyModel

    config = OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=1.0,
                             use_distributed_optimizer=distributed)
    model = ToyModel()
    ddp = DistributedDataParallel(model, config, state)
    original = optimizer_module.build_torch_optimizer
    if apex:  # the factory picks apex only for a CUDA device; the params stay on the CPU
        optimizer_module.build_torch_optimizer = lambda c, device: original(c, torch.device("cuda"))
    try:
        optimizer = optimizer_module.get_megatron_optimizer(config, [ddp], state)
    finally:
        optimizer_module.build_torch_optimizer = original
    return model, ddp, optimizer


def _train(ddp, optimizer, state, iterations):
    from megatron_smp.distributed import finalize_model_grads
    from tests.unit.distributed.toy_training import global_batch, loss_of

    for iteration in iterations:
        x, y = global_batch(iteration, BATCH)
        optimizer.zero_grad()
        loss_of(ddp, x, y).backward()
        finalize_model_grads([ddp], state)
        optimizer.step()
    ddp.finish_param_sync()


def _state_dict(ddp, optimizer, state):
    from megatron_smp.checkpointing.sharded_state import (
        model_sharded_state_dict,
        optimizer_sharded_state_dict,
    )

    return {"model": model_sharded_state_dict([ddp], state, vocab_size=0),
            "optimizer": optimizer_sharded_state_dict(optimizer, [ddp], state, vocab_size=0)}


def _resume_body(rank, world_size, save_dir):
    from megatron_smp.checkpointing import load_checkpoint, save_checkpoint
    from megatron_smp.checkpointing.sharded_state import finish_optimizer_load
    from megatron_smp.parallel_state import build_parallel_state
    from tests.unit.distributed.toy_training import ToyModel, flat_params

    fused_adam = _install_stand_in(sys.modules.__setitem__)
    state = build_parallel_state()
    out = {}
    for distributed in (False, True):
        model, ddp, optimizer = _build(state, apex=True, distributed=distributed)
        assert isinstance(optimizer.optimizer, fused_adam)
        _train(ddp, optimizer, state, range(ITERS))
        uninterrupted = flat_params(model)

        model, ddp, optimizer = _build(state, apex=True, distributed=distributed)
        _train(ddp, optimizer, state, range(SAVED_AT))
        where = f"{save_dir}/{distributed}"
        save_checkpoint(SAVED_AT, _state_dict(ddp, optimizer, state), where, state)
        model, ddp, optimizer = _build(state, apex=True, distributed=distributed)
        loaded = _state_dict(ddp, optimizer, state)
        load_checkpoint(loaded, where, state)
        finish_optimizer_load(optimizer, loaded["optimizer"])
        steps = {group["step"] for group in optimizer.optimizer.param_groups}
        _train(ddp, optimizer, state, range(SAVED_AT, ITERS))
        resumed = flat_params(model)

        # The same checkpoint into torch's AdamW: the per-group count becomes the per-param one.
        _, ddp, optimizer = _build(state, apex=False, distributed=distributed)
        assert isinstance(optimizer.optimizer, torch.optim.AdamW)
        loaded = _state_dict(ddp, optimizer, state)
        load_checkpoint(loaded, where, state)
        torch_steps = {float(s["step"]) for s in optimizer.optimizer.state.values()}
        out[distributed] = dict(
            moved=(uninterrupted - flat_params(ToyModel())).abs().max().item(),
            resume_error=(resumed - uninterrupted).abs().max().item(),
            steps=steps, torch_steps=torch_steps,
        )
    return out


def test_apex_fused_adam_checkpoints_resume_exactly(tmp_path):
    (out,) = run_distributed(_resume_body, 1, args=(str(tmp_path),), timeout=120)
    for distributed, result in out.items():
        assert result["moved"] > 1e-2, distributed  # four steps of lr 1e-2 move the params
        # A lost step count would change Adam's bias correction: ~1e-3 here.
        assert result["resume_error"] == 0.0, (distributed, result)
        assert result["steps"] == {SAVED_AT}, (distributed, result)
        assert result["torch_steps"] == {float(SAVED_AT)}, (distributed, result)


def test_apex_without_cuda_extensions_falls_back_to_torch(monkeypatch):
    from megatron_smp.optimizer import build_torch_optimizer

    params = [torch.nn.Parameter(torch.ones(3))]
    config = OptimizerConfig(lr=1e-2)
    install = lambda name, module: monkeypatch.setitem(sys.modules, name, module)  # noqa: E731
    fused_adam = _install_stand_in(install)
    assert isinstance(build_torch_optimizer(config, torch.device("cuda"))([{"params": params}]),
                      fused_adam)
    _install_stand_in(install, broken=True)
    with pytest.warns(UserWarning, match="FusedAdam is unusable .*requires cuda extensions"):
        optimizer = build_torch_optimizer(config, torch.device("cuda"))([{"params": params}])
    assert type(optimizer) is torch.optim.AdamW
