"""Optimizers: fp32, fp16/bf16 with fp32 main params, and the distributed (sharded) one."""
from __future__ import annotations

import itertools
import warnings
from typing import Callable, Dict, List, Optional

import torch

from torch.distributed.tensor import DTensor

from megatron_smp.config import ConfigError, OptimizerConfig
from megatron_smp.optimizer.clip_grads import (
    clip_grad_by_total_norm_fp32,
    count_zeros_fp32,
    get_grad_norm_fp32,
)
from megatron_smp.optimizer.distrib_optimizer import DistributedOptimizer, Range
from megatron_smp.optimizer.fsdp_optimizer import FSDPOptimizer
from megatron_smp.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler
from megatron_smp.optimizer.muon import Lion, Muon, is_muon_parameter
from megatron_smp.optimizer.optimizer import (
    HALF_DTYPES,
    Float16OptimizerWithFloat16Params,
    FP32Optimizer,
    MegatronOptimizer,
)


def _default_no_weight_decay(name: str, param: torch.nn.Parameter) -> bool:
    # Biases and norm weights/biases (all 1-D) are not decayed, as in Megatron.
    return name.endswith(".bias") or param.dim() == 1


def _no_weight_decay_but_qk_layernorm(name: str, param: torch.nn.Parameter) -> bool:
    # --apply-wd-to-qk-layernorm (Megatron's, for Qwen3-Next): the per-head q/k norms are decayed.
    qk_norm = "q_layernorm." in name or "k_layernorm." in name
    return _default_no_weight_decay(name, param) and not qk_norm


def is_embedding_or_output_parameter(name: str) -> bool:
    """The input word embedding and the output layer weight: the params Megatron's
    --decoupled-lr applies to (its `is_embedding_or_output_parameter`; not the position
    embedding)."""
    return name.endswith("word_embeddings.weight") or name.endswith("output_layer.weight")


def is_mup_scaled(name: str, param: torch.nn.Parameter, config: OptimizerConfig,
                  mup_width_mult: float) -> bool:
    """Whether muP (--use-mup) gives `param` its own learning rate (and Adam eps), as
    Megatron-LM main's get_mup_config_overrides does. Vector-like params are the 1-D ones,
    the embeddings and the output layer; the others are hidden. Adam and other optimizers:
    hidden params get LR / m (Adam also eps / m), except the matrices Muon itself steps;
    SGD: vector-like params get LR x m, except those on --decoupled-lr."""
    if mup_width_mult == 1.0:
        return False
    vector_like = (param.dim() <= 1 or "embedding" in name.lower()
                   or name.endswith("output_layer.weight"))
    if config.optimizer == "sgd":
        return vector_like and not (config.decoupled_lr is not None
                                    and is_embedding_or_output_parameter(name))
    if vector_like:
        return False
    return not (config.optimizer == "muon" and is_muon_parameter(name, param))


def get_param_groups(
    model_chunks: List[torch.nn.Module],
    config: OptimizerConfig,
    no_weight_decay_cond: Optional[Callable[[str, torch.nn.Parameter], bool]] = None,
    mup_width_mult: float = 1.0,
) -> List[Dict]:
    """Trainable params split into a decayed and a non-decayed group, and with
    --decoupled-lr the embedding / output layer weights into groups of their own; with a
    muP width multiplier m != 1 (--use-mup) the params `is_mup_scaled` picks too, on a
    schedule between --lr and --min-lr times 1/m (SGD: times m), Adam's with eps / m.

    Each group carries `wd_mult` / `lr_mult` so the scheduler can set
    `group["weight_decay"] = weight_decay * wd_mult` and `group["lr"] = lr * lr_mult`; the
    decoupled groups also carry `max_lr` / `min_lr`, the bounds of their own schedule
    (Megatron's param-group overrides; the others follow --lr / --min-lr, or the
    checkpoint's with --use-checkpoint-opt_param-scheduler).
    Groups on the default schedule come first and carry `default_config=True` (the learning
    rate the log line reports).
    """
    condition = no_weight_decay_cond or (
        _no_weight_decay_but_qk_layernorm if config.apply_wd_to_qk_layernorm
        else _default_no_weight_decay)
    decoupled = config.decoupled_lr is not None
    muon = config.optimizer == "muon"
    by_key: Dict[tuple, List[torch.nn.Parameter]] = {}
    for chunk in model_chunks:
        for name, param in chunk.named_parameters():
            if param.requires_grad:
                key = (decoupled and is_embedding_or_output_parameter(name),
                       0.0 if condition(name, param) else 1.0,
                       muon and is_muon_parameter(name, param),
                       is_mup_scaled(name, param, config, mup_width_mult))
                by_key.setdefault(key, []).append(param)
    groups = []
    for own_schedule, wd_mult, use_muon, mup in itertools.product(
            (False, True), (1.0, 0.0), (True, False), (False, True)):
        params = by_key.get((own_schedule, wd_mult, use_muon, mup))
        if not params:
            continue
        group = {
            "params": params,
            "wd_mult": wd_mult,
            "lr_mult": 1.0,
            "default_config": not (own_schedule or mup),
            "weight_decay": config.weight_decay * wd_mult,
            "lr": config.lr,
        }
        group.update(_optimizer_group_settings(config, use_muon))
        if own_schedule:
            group["max_lr"] = group["lr"] = config.decoupled_lr
            group["min_lr"] = (config.min_lr if config.decoupled_min_lr is None
                               else config.decoupled_min_lr)
        if mup:
            mult = mup_width_mult if config.optimizer == "sgd" else 1.0 / mup_width_mult
            group["max_lr"] = group["lr"] = config.lr * mult
            group["min_lr"] = config.min_lr * mult
            if config.optimizer == "adam":
                group["eps"] = config.adam_eps * mult
        groups.append(group)
    return groups


def _optimizer_group_settings(config: OptimizerConfig, use_muon: bool) -> Dict:
    """The per-group keys of Muon / Lion (optimizer.muon.Muon steps each group by its own)."""
    if config.optimizer == "muon" and use_muon:
        return {"optimizer": "muon", "momentum": config.muon_momentum,
                "nesterov": config.muon_nesterov}
    scalar = config.optimizer if config.optimizer == "lion" else (
        config.muon_scalar_optimizer if config.optimizer == "muon" else None)
    if scalar == "lion":
        return {"optimizer": "lion", "betas": (config.lion_beta1, config.lion_beta2)}
    if scalar == "adam":
        return {"optimizer": "adam", "betas": (config.adam_beta1, config.adam_beta2),
                "eps": config.adam_eps}
    return {}


def _fused_supported(device: torch.device) -> bool:
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

        return device.type in _get_fused_kernels_supported_devices()
    except ImportError:
        return device.type == "cuda"


def build_torch_optimizer(config: OptimizerConfig, device: torch.device) -> Callable:
    """A factory `groups -> torch optimizer` for `config.optimizer`.

    Uses apex FusedAdam on CUDA when it imports and builds (an apex without its CUDA
    extensions raises RuntimeError at construction: a warning, then torch's), else torch's fused kernels where the device
    has them (CUDA, and CPU in recent torch, ~3x faster than the loop), else foreach.
    """
    fused = _fused_supported(device)

    def factory(groups: List[Dict]) -> torch.optim.Optimizer:
        if config.optimizer == "muon":
            return Muon(
                groups, lr=config.lr, weight_decay=config.weight_decay,
                momentum=config.muon_momentum, nesterov=config.muon_nesterov,
                scale_mode=config.muon_scale_mode,
                extra_scale_factor=config.muon_extra_scale_factor,
                coefficient_type=config.muon_coefficient_type,
                num_ns_steps=config.muon_num_ns_steps,
                matmul_precision=config.muon_fp32_matmul_prec, tp_mode=config.muon_tp_mode,
                split_qkv=config.muon_split_qkv)
        if config.optimizer == "lion":
            return Lion(groups, lr=config.lr, weight_decay=config.weight_decay,
                        betas=(config.lion_beta1, config.lion_beta2))
        if config.optimizer == "adam":
            kwargs = dict(
                lr=config.lr,
                betas=(config.adam_beta1, config.adam_beta2),
                eps=config.adam_eps,
                weight_decay=config.weight_decay,
            )
            if device.type == "cuda":
                try:
                    from apex.optimizers import FusedAdam

                    return FusedAdam(groups, adam_w_mode=True, **kwargs)
                except ImportError:
                    pass
                except RuntimeError as error:
                    # An apex built without its CUDA extensions imports, then raises here.
                    warnings.warn(f"apex's FusedAdam is unusable ({error}); using torch's "
                                  f"{'fused' if fused else 'foreach'} AdamW instead")
            implementation = {"fused": True} if fused else {"foreach": True}
            return torch.optim.AdamW(groups, **kwargs, **implementation)
        kwargs = dict(lr=config.lr, momentum=config.sgd_momentum, weight_decay=config.weight_decay)
        if fused:
            try:
                return torch.optim.SGD(groups, fused=True, **kwargs)
            except (RuntimeError, ValueError):
                pass
        return torch.optim.SGD(groups, foreach=True, **kwargs)

    return factory


def get_grad_scaler(config: OptimizerConfig, device: torch.device, fp16: bool):
    """fp16 params need loss scaling: constant with --loss-scale, else dynamic. None
    otherwise (bf16 and fp32 do not)."""
    if not fp16:
        return None
    if config.loss_scale:
        return ConstantGradScaler(config.loss_scale, device)
    return DynamicGradScaler(
        initial_scale=config.initial_loss_scale,
        min_scale=config.min_loss_scale,
        growth_interval=config.loss_scale_window,
        hysteresis=config.hysteresis,
        device=device,
    )


def get_megatron_optimizer(
    config: OptimizerConfig,
    model_chunks: List[torch.nn.Module],
    state,
    no_weight_decay_cond: Optional[Callable[[str, torch.nn.Parameter], bool]] = None,
    mup_width_mult: float = 1.0,
) -> MegatronOptimizer:
    """Build the optimizer for `model_chunks` (DDP-wrapped chunks, or plain modules without
    --use-distributed-optimizer, or FSDP2-sharded chunks: `FSDPOptimizer`).

    --use-distributed-optimizer: `DistributedOptimizer`; fp16/bf16 params:
    `Float16OptimizerWithFloat16Params`; otherwise `FP32Optimizer`. The precision is the
    params' own (the model's config is its one home): fp16 params get loss scaling.
    `mup_width_mult`: the model's muP width multiplier (TransformerConfig.mup_width_mult).
    `config` is a validated one (`validate_configs`, or `config.validate()` for a config
    built by hand).
    """
    groups = get_param_groups(model_chunks, config, no_weight_decay_cond, mup_width_mult)
    factory = build_torch_optimizer(config, state.device)
    dtypes = {p.dtype for g in groups for p in g["params"]}
    if any(isinstance(p, DTensor) for g in groups for p in g["params"]):
        # FSDP2-sharded chunks: the sharded fp32 params are the main params; layers that
        # compute in fp16 (the chunk's param_dtype) get the loss scaler, over the shards.
        if config.use_distributed_optimizer:
            raise ConfigError(
                "an FSDP2-sharded model already shards its optimizer state and keeps fp32 "
                "main params: drop --use-distributed-optimizer")
        fp16 = any(getattr(chunk, "param_dtype", None) == torch.float16 for chunk in model_chunks)
        return FSDPOptimizer(factory, config, state, model_chunks, groups,
                             grad_scaler=get_grad_scaler(config, state.device, fp16))
    grad_scaler = get_grad_scaler(config, state.device, torch.float16 in dtypes)
    if config.use_distributed_optimizer:
        return DistributedOptimizer(factory, config, state, model_chunks, groups, grad_scaler)
    if dtypes & set(HALF_DTYPES):
        return Float16OptimizerWithFloat16Params(
            factory, config, state, model_chunks, groups, grad_scaler
        )
    return FP32Optimizer(factory, config, state, model_chunks, groups)


__all__ = [
    "get_megatron_optimizer",
    "get_param_groups",
    "is_embedding_or_output_parameter",
    "is_muon_parameter",
    "Muon",
    "Lion",
    "build_torch_optimizer",
    "get_grad_scaler",
    "MegatronOptimizer",
    "FP32Optimizer",
    "Float16OptimizerWithFloat16Params",
    "DistributedOptimizer",
    "FSDPOptimizer",
    "Range",
    "ConstantGradScaler",
    "DynamicGradScaler",
    "get_grad_norm_fp32",
    "clip_grad_by_total_norm_fp32",
    "count_zeros_fp32",
]
