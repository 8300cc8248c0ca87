"""Muon and Lion, with Megatron-LM's flags (`--optimizer muon|lion`, `--muon-*`, `--lion-*`).

Muon (Jordan et al.; "Muon is scalable", Kimi) keeps a momentum of each 2-D hidden weight's
grad and steps along its orthogonalisation, computed by a few Newton-Schulz (NS) iterations

    X <- X / ||X||_F;   repeat k times:  A = X X^T,  X <- a X + (b A + c A^2) X

on the short side of the matrix (the Gram A is min(m, n) square), scaled by a factor of the
full matrix's shape (`--muon-scale-mode`). Embeddings, the output layer, norms and biases
are stepped by the scalar optimizer (`--muon-scalar-optimizer adam|lion`). The coefficient
sets are the published ones (those `emerging_optimizers` names: simple is Keller Jordan's
triple, which torch.optim.Muon uses; quintic, polar_express, cans, aol, deepseekv4 vary per
step).

Under tensor parallelism a rank holds a shard of each matrix (`--muon-tp-mode`):
  * blockwise: each shard is orthogonalised (and scaled) on its own -- no communication, but
    the update depends on the TP size;
  * duplicated: the shards are all-gathered, every rank orthogonalises the whole matrix and
    keeps its shard -- TP-invariant;
  * distributed: the iteration runs on the shards, all-reducing the Gram matrix of the
    sharded side (and the Frobenius norm) -- TP-invariant, with no rank holding the matrix.
Fused QKV weights are orthogonalised per part (q, k, v of every query group together, GQA's
shapes), unless `--muon-no-split-qkv`; each MoE expert's weight is a matrix of its own. Under
FSDP2 (DTensor params sharded by rows) the rows are gathered like duplicated TP shards.

`--muon-fp32-matmul-prec medium` (Megatron's default) runs the iteration in bf16, as
emerging_optimizers does; `high` and `low` run it in fp32 (`high` lets a GPU use TF32, as
torch's precision of that name does).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron_smp.config import (
    MUON_COEFFICIENT_TYPES,
    MUON_MATMUL_PRECISIONS,
    MUON_SCALE_MODES,
    MUON_TP_MODES,
)
from megatron_smp.tensor_parallel.utils import is_muon_parameter

# The published NS coefficient sets; the sets of "polar_express", "cans" and "deepseekv4" are
# per step and their last triple repeats past the end, the others cycle.
NS_COEFFICIENTS: Dict[str, List[Tuple[float, float, float]]] = {
    "simple": [(3.4445, -4.7750, 2.0315)],
    "quintic": [
        (4.0848, -6.8946, 2.9270),
        (3.9505, -6.3029, 2.6377),
        (3.7418, -5.5913, 2.3037),
        (2.8769, -3.1427, 1.2046),
        (2.8366, -3.0525, 1.2012),
    ],
    "polar_express": [
        (8.2051, -22.9019, 16.4607),
        (4.0664, -2.8612, 0.5184),
        (3.9096, -2.8234, 0.5250),
        (3.2856, -2.4153, 0.4853),
        (2.2779, -1.6198, 0.3985),
        (1.8726, -1.2307, 0.3585),
        (1.8564, -1.2132, 0.3568),
        (1.8750, -1.2500, 0.3750),
    ],
    "cans": [
        (8.4703, -25.1081, 18.6293),
        (4.1828, -3.1087, 0.5806),
        (3.9619, -2.9541, 0.5630),
        (3.2866, -2.4647, 0.5074),
        (2.2737, -1.6447, 0.4162),
    ],
    "aol": [
        (4.0098, -7.0585, 2.4635),
        (3.4585, -5.5479, 2.5959),
        (2.7573, -3.2939, 1.4254),
        (2.7215, -3.0494, 1.3169),
    ],
    "deepseekv4": [(3.4445, -4.7750, 2.0315)] * 8 + [(2.0, -1.5, 0.5)] * 2,
}
assert tuple(NS_COEFFICIENTS) == MUON_COEFFICIENT_TYPES
_REPEAT_LAST = ("polar_express", "cans", "deepseekv4")
NS_EPS = 1e-7


def ns_coefficients(coefficient_type: str, steps: int) -> List[Tuple[float, float, float]]:
    """The (a, b, c) of each of `steps` iterations."""
    if coefficient_type not in NS_COEFFICIENTS:
        raise ValueError(
            f"--muon-coefficient-type must be one of {', '.join(NS_COEFFICIENTS)}, got "
            f"{coefficient_type!r}")
    sets = NS_COEFFICIENTS[coefficient_type]
    if coefficient_type in _REPEAT_LAST:
        return [sets[min(i, len(sets) - 1)] for i in range(steps)]
    return [sets[i % len(sets)] for i in range(steps)]


@contextlib.contextmanager
def _matmul_precision(precision: str):
    """torch's fp32 matmul precision for the iteration, as emerging_optimizers sets it: "high"
    (TF32 allowed on GPUs) and "medium"; "low", which torch does not know, keeps the current."""
    previous = torch.get_float32_matmul_precision()
    if precision != "low":
        torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


def newton_schulz(
    x: torch.Tensor,
    steps: int = 5,
    coefficient_type: str = "quintic",
    matmul_precision: str = "medium",
    group: Optional[dist.ProcessGroup] = None,
    sharded_dim: Optional[int] = None,
) -> torch.Tensor:
    """The approximate orthogonalisation U V^T of `x` [m, n] (fp32 in, fp32 out).

    With `group` and `sharded_dim`, `x` is this rank's shard of a matrix split along
    `sharded_dim` over `group`: the iteration runs with that side as the Gram's contracted
    side, all-reducing the Gram matrix and the norm, and returns this rank's shard of the
    result. Otherwise the short side is the Gram's.
    """
    if x.dim() != 2:
        raise ValueError(f"Newton-Schulz needs a matrix, got shape {tuple(x.shape)}")
    distributed = group is not None and sharded_dim is not None and dist.get_world_size(group) > 1
    # The Gram matrix contracts the columns: the sharded side, or else the long side.
    transpose = (sharded_dim == 0) if distributed else x.size(0) > x.size(1)
    matrix = x.float().mT if transpose else x.float()
    if distributed:
        squares = (matrix * matrix).sum()
        dist.all_reduce(squares, group=group)
        matrix = matrix / squares.sqrt().clamp_min(NS_EPS)
    else:
        matrix = torch.nn.functional.normalize(matrix, p=2, dim=(-2, -1), eps=NS_EPS)
    if matmul_precision == "medium":
        matrix = matrix.to(torch.bfloat16)
    with _matmul_precision(matmul_precision):
        for a, b, c in ns_coefficients(coefficient_type, steps):
            gram = matrix @ matrix.mT
            if distributed:
                dist.all_reduce(gram, group=group)
            update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
            matrix = torch.addmm(matrix, update, matrix, beta=a)
    matrix = matrix.float()
    return matrix.mT if transpose else matrix


def muon_scale_factor(rows: int, cols: int, mode: str) -> float:
    """The update's scale for a [rows, cols] matrix (`--muon-scale-mode`)."""
    if mode == "spectral":  # Kimi's: matches AdamW's update RMS with --muon-extra-scale-factor
        return max(rows, cols) ** 0.5
    if mode == "shape_scaling":  # Keller Jordan's (torch.optim.Muon's "original")
        return max(1.0, rows / cols) ** 0.5
    if mode == "unit_rms_norm":
        return (rows / cols) ** 0.5
    raise ValueError(f"--muon-scale-mode must be one of {', '.join(MUON_SCALE_MODES)}, got {mode!r}")


@dataclass
class MuonParamInfo:
    """What Muon needs to know of a main param beyond its values.

    partition_dim: the dim its TP shards split (None: not split over TP).
    tp_group: the group of those shards.
    qkv_split_shapes: rows of q, k, v per query group of a fused QKV weight (None: not QKV).
    """

    partition_dim: Optional[int] = None
    tp_group: Optional[dist.ProcessGroup] = None
    qkv_split_shapes: Optional[Sequence[int]] = None


def muon_param_info(param: torch.nn.Parameter, tp_group, split_qkv: bool) -> MuonParamInfo:
    """The MuonParamInfo of a model param from its TP marks (`tensor_model_parallel`,
    `partition_dim`) and `qkv_split_shapes` (set by attention on its fused QKV weight)."""
    split = getattr(param, "tensor_model_parallel", False) and getattr(param, "partition_dim", -1) >= 0
    tp_size = dist.get_world_size(tp_group) if tp_group is not None and dist.is_initialized() else 1
    return MuonParamInfo(
        partition_dim=param.partition_dim if split and tp_size > 1 else None,
        tp_group=tp_group if split and tp_size > 1 else None,
        qkv_split_shapes=getattr(param, "qkv_split_shapes", None) if split_qkv else None,
    )


class Muon(torch.optim.Optimizer):
    """Muon for the groups with `optimizer="muon"`, the scalar optimizer for the others.

    Each param group carries `optimizer` ("muon", "adam" or "lion"). Muon groups: `lr`,
    `weight_decay` (decoupled: p *= 1 - lr * wd), `momentum`, `nesterov`; Adam groups:
    `betas`, `eps` (torch's AdamW update); Lion groups: `betas` (decoupled decay).
    `bind(pairs)` tells it the model param behind each main param (TP layout, QKV split).

    Args:
        scale_mode, extra_scale_factor, coefficient_type, num_ns_steps, matmul_precision,
        tp_mode, split_qkv: the `--muon-*` flags.
    """

    def __init__(
        self,
        param_groups: Iterable[dict],
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        momentum: float = 0.9,
        nesterov: bool = False,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        scale_mode: str = "spectral",
        extra_scale_factor: float = 1.0,
        coefficient_type: str = "quintic",
        num_ns_steps: int = 5,
        matmul_precision: str = "medium",
        tp_mode: str = "duplicated",
        split_qkv: bool = True,
    ):
        if num_ns_steps < 1:
            raise ValueError(f"--muon-num-ns-steps must be at least 1, got {num_ns_steps}")
        ns_coefficients(coefficient_type, 1)
        muon_scale_factor(1, 1, scale_mode)
        if tp_mode not in MUON_TP_MODES:
            raise ValueError(f"--muon-tp-mode must be one of {', '.join(MUON_TP_MODES)}")
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        betas=betas, eps=eps, optimizer="muon")
        super().__init__(list(param_groups), defaults)
        self.scale_mode = scale_mode
        self.extra_scale_factor = extra_scale_factor
        self.coefficient_type = coefficient_type
        self.num_ns_steps = num_ns_steps
        self.matmul_precision = matmul_precision
        self.tp_mode = tp_mode
        self.split_qkv = split_qkv
        self.param_info: Dict[torch.Tensor, MuonParamInfo] = {}
        # Seconds spent orthogonalising in the last step (tools/bench reads it).
        self.last_ns_seconds = 0.0
        for group in self.param_groups:
            if group["optimizer"] not in ("muon", "adam", "lion"):
                raise ValueError(f"unknown optimizer {group['optimizer']!r} in a param group")

    def bind(self, model_and_main: Iterable[Tuple[torch.nn.Parameter, torch.Tensor]],
             tp_group=None, expert_tp_group=None) -> None:
        """Record each main param's MuonParamInfo from its model param (an expert's split
        over `expert_tp_group`, when given: --expert-tensor-parallel-size)."""
        from megatron_smp.tensor_parallel.utils import is_expert_param

        for model_param, main_param in model_and_main:
            group = (expert_tp_group if expert_tp_group is not None
                     and is_expert_param(model_param) else tp_group)
            self.param_info[main_param] = muon_param_info(model_param, group, self.split_qkv)

    # The orthogonalised update ----------------------------------------------------------------
    def _orthogonalize_matrix(self, matrix: torch.Tensor, info: MuonParamInfo) -> torch.Tensor:
        """NS of one matrix, or of this rank's TP shard of it, scaled by the whole's shape."""
        steps, kind, precision = self.num_ns_steps, self.coefficient_type, self.matmul_precision
        rows, cols = matrix.shape
        if info.partition_dim is None or self.tp_mode == "blockwise":
            update = newton_schulz(matrix, steps, kind, precision)
        elif self.tp_mode == "duplicated":
            group, dim = info.tp_group, info.partition_dim
            size = dist.get_world_size(group)
            # gloo's all_gather_into_tensor concatenates along dim 0: gather the split dim there.
            moved = matrix.movedim(dim, 0).contiguous()
            gathered = moved.new_empty((size * moved.shape[0],) + tuple(moved.shape[1:]))
            dist.all_gather_into_tensor(gathered, moved, group=group)
            whole = gathered.movedim(0, dim)
            update = newton_schulz(whole, steps, kind, precision).chunk(size, dim=dim)[
                dist.get_rank(group)]
            rows, cols = whole.shape
        else:
            size = dist.get_world_size(info.tp_group)
            update = newton_schulz(matrix, steps, kind, precision, info.tp_group,
                                   info.partition_dim)
            if info.partition_dim == 0:
                rows *= size
            else:
                cols *= size
        return update * (muon_scale_factor(rows, cols, self.scale_mode) * self.extra_scale_factor)

    def orthogonalize(self, momentum: torch.Tensor, info: MuonParamInfo) -> torch.Tensor:
        """The scaled, orthogonalised update of a (TP-local) momentum, QKV split per part."""
        shapes = info.qkv_split_shapes
        if not shapes:
            return self._orthogonalize_matrix(momentum, info)
        rows, cols = momentum.shape
        per_group = sum(shapes)
        if rows % per_group:
            raise RuntimeError(
                f"Muon's QKV split {list(shapes)} does not tile a weight of {rows} rows")
        groups = momentum.view(rows // per_group, per_group, cols)
        parts = [
            self._orthogonalize_matrix(part.reshape(-1, cols), info).view(rows // per_group, -1,
                                                                          cols)
            for part in torch.split(groups, list(shapes), dim=1)
        ]
        return torch.cat(parts, dim=1).view(rows, cols)

    def _fsdp_orthogonalize(self, momentum, info: MuonParamInfo) -> torch.Tensor:
        """An FSDP2 DTensor momentum: gather the rows, orthogonalise, keep this rank's rows."""
        from torch.distributed.tensor import DTensor, Replicate

        whole = momentum.redistribute(momentum.device_mesh,
                                      [Replicate()] * momentum.device_mesh.ndim).to_local()
        update = self.orthogonalize(whole, info)
        replicated = DTensor.from_local(update, momentum.device_mesh,
                                        [Replicate()] * momentum.device_mesh.ndim,
                                        run_check=False)
        return replicated.redistribute(momentum.device_mesh, momentum.placements)

    # Step --------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        import time

        if closure is not None:
            raise ValueError("Muon does not take a closure")
        self.last_ns_seconds = 0.0
        for group in self.param_groups:
            kind = group["optimizer"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                if kind == "muon":
                    start = time.perf_counter()
                    self._muon_step(param, param.grad, group)
                    self.last_ns_seconds += time.perf_counter() - start
                elif kind == "adam":
                    self._adam_step(param, param.grad, group)
                else:
                    self._lion_step(param, param.grad, group)
        return None

    def _muon_step(self, param, grad, group) -> None:
        from torch.distributed.tensor import DTensor

        if param.dim() != 2:
            raise RuntimeError(
                f"Muon needs whole matrices, got a main param of shape {tuple(param.shape)}: "
                "with --use-distributed-optimizer Muon uses the layer-wise layout")
        state = self.state[param]
        if group["weight_decay"]:  # decoupled, before the update (emerging_optimizers' order)
            param.add_(param, alpha=-group["lr"] * group["weight_decay"])
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(param)
        buffer = state["momentum_buffer"]
        momentum = group["momentum"]
        buffer.lerp_(grad, 1 - momentum)
        update = grad.lerp(buffer, momentum) if group["nesterov"] else buffer
        info = self.param_info.get(param, MuonParamInfo())
        if isinstance(update, DTensor):
            update = self._fsdp_orthogonalize(update, info)
        else:
            update = self.orthogonalize(update, info)
        param.add_(update.to(param.dtype), alpha=-group["lr"])

    def _adam_step(self, param, grad, group) -> None:
        # torch's AdamW (single-tensor path), so a scalar group steps as --optimizer adam does.
        state = self.state[param]
        if "exp_avg_sq" not in state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(param)
            state["exp_avg_sq"] = torch.zeros_like(param)
        beta1, beta2 = group["betas"]
        state["step"] += 1
        step = state["step"].item()
        if group["weight_decay"]:
            param.mul_(1 - group["lr"] * group["weight_decay"])
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bias_correction1 = 1 - beta1**step
        bias_correction2_sqrt = (1 - beta2**step) ** 0.5
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(group["eps"])
        param.addcdiv_(exp_avg, denom, value=-group["lr"] / bias_correction1)

    def _lion_step(self, param, grad, group) -> None:
        state = self.state[param]
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(param)
        beta1, beta2 = group["betas"]
        if group["weight_decay"]:
            param.add_(param, alpha=-group["lr"] * group["weight_decay"])
        exp_avg = state["exp_avg"]
        update = exp_avg.lerp(grad, 1 - beta1).sign_()
        exp_avg.lerp_(grad, 1 - beta2)
        param.add_(update, alpha=-group["lr"])

    def state_keys(self, group: dict) -> Tuple[str, ...]:
        """The per-param state tensors of a group (checkpoints)."""
        return {"muon": ("momentum_buffer",), "adam": ("exp_avg", "exp_avg_sq"),
                "lion": ("exp_avg",)}[group["optimizer"]]


class Lion(Muon):
    """`--optimizer lion`: every group steps by Lion (sign of the interpolated momentum)."""

    def __init__(self, param_groups: Iterable[dict], lr: float = 1e-4,
                 weight_decay: float = 0.0, betas: Tuple[float, float] = (0.95, 0.98)):
        groups = [{**group, "optimizer": "lion"} for group in param_groups]
        super().__init__(groups, lr=lr, weight_decay=weight_decay, betas=betas)


__all__ = [
    "NS_COEFFICIENTS",
    "MUON_SCALE_MODES",
    "MUON_TP_MODES",
    "MUON_MATMUL_PRECISIONS",
    "ns_coefficients",
    "newton_schulz",
    "muon_scale_factor",
    "MuonParamInfo",
    "muon_param_info",
    "is_muon_parameter",
    "Muon",
    "Lion",
]
