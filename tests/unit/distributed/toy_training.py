"""A small model and training loop shared by the distributed/ and optimizer/ tests.

The model mixes Linear layers (with and without bias), LayerNorms and odd sizes, so
buffers need padding and params straddle shard boundaries.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from megatron_smp.config import OptimizerConfig

IN_FEATURES, NUM_CLASSES = 12, 7


class ToyModel(torch.nn.Module):
    def __init__(self, hidden: int = 24, ffn: int = 40, dtype=torch.float32, seed: int = 1234):
        super().__init__()
        generator_state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        self.embed = torch.nn.Linear(IN_FEATURES, hidden)
        self.norm1 = torch.nn.LayerNorm(hidden)
        self.fc1 = torch.nn.Linear(hidden, ffn)
        self.fc2 = torch.nn.Linear(ffn, hidden, bias=False)
        self.norm2 = torch.nn.LayerNorm(hidden)
        self.head = torch.nn.Linear(hidden, NUM_CLASSES)
        torch.random.set_rng_state(generator_state)
        self.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        h = h + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm1(h))))
        return self.head(self.norm2(h))


def loss_of(model, x, y) -> torch.Tensor:
    logits = model(x.to(next(model.parameters()).dtype))
    return torch.nn.functional.cross_entropy(logits.float(), y)


def global_batch(iteration: int, size: int):
    generator = torch.Generator().manual_seed(100 + iteration)
    x = torch.randn(size, IN_FEATURES, generator=generator)
    y = torch.randint(0, NUM_CLASSES, (size,), generator=generator)
    return x, y


def param_count(model) -> int:
    return sum(p.numel() for p in model.parameters())


def flat_params(model) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])


def reference_training(iters, batch_size, lr=1e-2, weight_decay=0.1, clip_grad=1.0,
                       skip_iterations=()):
    """Single-process fp32 AdamW on the full global batch (plain torch, no megatron_smp)."""
    model = ToyModel()
    decay = [p for n, p in model.named_parameters() if p.dim() > 1 and not n.endswith(".bias")]
    no_decay = [p for n, p in model.named_parameters() if p.dim() == 1 or n.endswith(".bias")]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr, fused=True,
    )
    losses = []
    for iteration in range(iters):
        x, y = global_batch(iteration, batch_size)
        optimizer.zero_grad()
        loss = loss_of(model, x, y)
        loss.backward()
        losses.append(loss.item())
        if iteration in skip_iterations:
            continue
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad)
        optimizer.step()
    return losses, flat_params(model)


def ddp_training(config: OptimizerConfig, state, iters, batch_size, dtype=torch.float32,
                 micro_batches=2, before_step=None, start_iteration=0, checkpoint=None,
                 nccl_collectives=False):
    """Our DDP + get_megatron_optimizer on this rank's slice of each global batch.

    Returns (global losses per iteration, [(*step results, loss scale after)], final flat
    params, ddp, optimizer). `before_step(iteration, ddp)` may tamper with grads after
    finalize_model_grads; `checkpoint` = (model state dict, optimizer state dict) to resume;
    `nccl_collectives=True` forces the distributed optimizer's collectives on NCCL (the
    real reduce-scatter and all-gather), which gloo otherwise replaces with an all-reduce and
    one broadcast per shard.
    """
    from megatron_smp.distributed import DistributedDataParallel, finalize_model_grads
    from megatron_smp.optimizer import get_megatron_optimizer

    model = ToyModel(dtype=dtype)
    ddp = DistributedDataParallel(model, config, state)
    if nccl_collectives:
        for buffer in ddp.param_and_grad_buffers:
            buffer.reduce_scatter_by_all_reduce = False
            buffer.param_gather_by_broadcast = False
    optimizer = get_megatron_optimizer(config, [ddp], state)
    if checkpoint is not None:
        ddp.load_state_dict(checkpoint[0])
        optimizer.load_state_dict(checkpoint[1])
    per_rank = batch_size // state.dp_size
    per_micro = per_rank // micro_batches
    losses, results = [], []
    for iteration in range(start_iteration, start_iteration + iters):
        x, y = global_batch(iteration, batch_size)
        x = x[state.dp_rank * per_rank : (state.dp_rank + 1) * per_rank]
        y = y[state.dp_rank * per_rank : (state.dp_rank + 1) * per_rank]
        optimizer.zero_grad()
        total = torch.zeros(1)
        for micro in range(micro_batches):
            rows = slice(micro * per_micro, (micro + 1) * per_micro)
            last = micro == micro_batches - 1
            with contextlib.nullcontext() if last else ddp.no_sync():
                loss = loss_of(ddp, x[rows], y[rows]) / micro_batches
                optimizer.scale_loss(loss).backward()
            total += loss.detach()
        finalize_model_grads([ddp], state)
        if before_step is not None:
            before_step(iteration, ddp)
        results.append((*optimizer.step(), optimizer.get_loss_scale().item()))
        dist.all_reduce(total, group=state.dp_cp_group)
        losses.append(total.item() / state.dp_size)
    ddp.finish_param_sync()
    return losses, results, flat_params(model), ddp, optimizer


def max_relative_difference(a, b) -> float:
    a = torch.as_tensor(a, dtype=torch.float64)
    b = torch.as_tensor(b, dtype=torch.float64)
    return ((a - b).abs() / b.abs().clamp_min(1e-3)).max().item()


def memory_bytes(ddp, optimizer) -> dict:
    """Exact bytes of model params, grads, fp32 main params and optimizer state on this rank."""
    params = sum(b.param_data.numel() * b.param_data.element_size() for b in ddp.param_and_grad_buffers)
    grads = sum(b.grad_data.numel() * b.grad_data.element_size() for b in ddp.param_and_grad_buffers)
    main = sum(
        m.numel() * m.element_size() for p, m in optimizer.param_pairs if p.dtype != m.dtype
    )
    state = sum(
        t.numel() * t.element_size()
        for per_param in optimizer.optimizer.state.values()
        for key, t in per_param.items()
        if key != "step" and torch.is_tensor(t)
    )
    local = sum(m.numel() for _, m in optimizer.param_pairs)
    return {"params": params, "grads": grads, "main": main, "state": state, "local_numel": local,
            "padded_numel": sum(b.numel for b in ddp.param_and_grad_buffers)}




def relative_error(a, b) -> float:
    """||a - b|| / ||b|| over all elements (for parameter vectors)."""
    a = torch.as_tensor(a, dtype=torch.float64)
    b = torch.as_tensor(b, dtype=torch.float64)
    return ((a - b).norm() / b.norm()).item()
