"""LayerNorm and RMSNorm over the hidden dim, with apex's fused kernels when they import.

Both normalise the last dim of `[s, b, h]` activations. With sequence parallelism each rank
normalises its own sequence shard, so the (replicated) weights only see part of the batch:
they are marked `sequence_parallel = True`, and their gradients must be all-reduced over the
tensor-parallel group before the optimizer step.

`zero_centered_gamma` (Megatron's --apply-layernorm-1p) stores the scale as w with
y = norm(x) * (1 + w): w starts at 0, and where norms are decayed (--apply-wd-to-qk-layernorm)
the decay pulls the scale towards 1 rather than 0. Such a norm runs in fp32 and casts its
output back, as Gemma does: 1 + w in bf16 would round small w away (8 mantissa bits).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from megatron_smp.config import TransformerConfig

try:  # apex is CUDA-only and optional; the torch functions below are the tested fallback.
    from apex.normalization.fused_layer_norm import (  # type: ignore
        fused_layer_norm_affine,
        fused_rms_norm_affine,
    )

    _HAVE_APEX = True
except Exception:  # ImportError, or a broken build
    _HAVE_APEX = False


def _use_apex(x: torch.Tensor) -> bool:
    return _HAVE_APEX and x.is_cuda


def _at_least_fp32(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


class LayerNorm(torch.nn.Module):
    # reset_parameters() draws what the constructor drew: delayed (meta-device)
    # initialisation replays it (distributed.delayed_init).
    REPLAYS_CONSTRUCTOR_INIT = True

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-5,
        sequence_parallel: bool = False,
        dtype: torch.dtype = torch.float32,
        device: Optional[torch.device] = None,
        zero_centered_gamma: bool = False,
    ) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.zero_centered_gamma = zero_centered_gamma
        self.weight = torch.nn.Parameter(torch.empty(hidden_size, dtype=dtype, device=device))
        self.bias = torch.nn.Parameter(torch.empty(hidden_size, dtype=dtype, device=device))
        if self.weight.device.type != "meta":
            self.reset_parameters()
        for param in (self.weight, self.bias):
            param.sequence_parallel = sequence_parallel

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.fill_(0.0 if self.zero_centered_gamma else 1.0)
            self.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., h] -> [..., h]."""
        if self.zero_centered_gamma:
            dtype = _at_least_fp32(x)
            return F.layer_norm(x.to(dtype), (self.hidden_size,), self.weight.to(dtype) + 1,
                                self.bias.to(dtype), self.eps).to(x.dtype)
        if _use_apex(x):
            return fused_layer_norm_affine(x, self.weight, self.bias, (self.hidden_size,),
                                           self.eps)
        return F.layer_norm(x, (self.hidden_size,), self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, zero_centered_gamma={self.zero_centered_gamma}"


class RMSNorm(torch.nn.Module):
    # reset_parameters() draws what the constructor drew: delayed (meta-device)
    # initialisation replays it (distributed.delayed_init).
    REPLAYS_CONSTRUCTOR_INIT = True

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        sequence_parallel: bool = False,
        dtype: torch.dtype = torch.float32,
        device: Optional[torch.device] = None,
        zero_centered_gamma: bool = False,
    ) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.zero_centered_gamma = zero_centered_gamma
        self.weight = torch.nn.Parameter(torch.empty(hidden_size, dtype=dtype, device=device))
        if self.weight.device.type != "meta":
            self.reset_parameters()
        self.weight.sequence_parallel = sequence_parallel

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.fill_(0.0 if self.zero_centered_gamma else 1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., h] -> [..., h]."""
        if self.zero_centered_gamma:
            dtype = _at_least_fp32(x)
            return F.rms_norm(x.to(dtype), (self.hidden_size,), self.weight.to(dtype) + 1,
                              self.eps).to(x.dtype)
        if _use_apex(x):
            return fused_rms_norm_affine(x, self.weight, (self.hidden_size,), self.eps)
        return F.rms_norm(x, (self.hidden_size,), self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, zero_centered_gamma={self.zero_centered_gamma}"


def build_norm(
    config: TransformerConfig,
    hidden_size: Optional[int] = None,
    sequence_parallel: bool = False,
    device: Optional[torch.device] = None,
) -> torch.nn.Module:
    """The norm named by `config.normalization` over `hidden_size` (default config.hidden_size),
    zero-centred with --apply-layernorm-1p."""
    cls = {"LayerNorm": LayerNorm, "RMSNorm": RMSNorm}[config.normalization]
    return cls(
        hidden_size or config.hidden_size,
        eps=config.layernorm_epsilon,
        sequence_parallel=sequence_parallel,
        dtype=config.params_dtype,
        device=device,
        zero_centered_gamma=config.layernorm_zero_centered_gamma,
    )


__all__ = ["LayerNorm", "RMSNorm", "build_norm"]
