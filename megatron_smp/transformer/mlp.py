"""Feed-forward block: h -> ffn (ColumnParallelLinear) -> activation -> h (RowParallelLinear).

With `gated_linear_unit` (SwiGLU) the first linear is the fused [gate; up] weight
[2 * ffn, h], split with stride 2: rank r keeps gate rows r and up rows r, so its local
output is [gate_r, up_r] and the gating needs no communication.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from megatron_smp.config import ConfigError, TransformerConfig
from megatron_smp.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    hidden_init_method,
    output_init_method,
)
from megatron_smp.tensor_parallel.mappings import ProcessGroup


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def _squared_relu(x: torch.Tensor) -> torch.Tensor:
    return torch.pow(F.relu(x), 2)  # Megatron's squared_relu (Primer, So et al. 2021)


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)  # Megatron's quick_gelu (gpt-oss's GLU, alpha 1.702)


_ACTIVATIONS = {"gelu": F.gelu, "gelu_tanh": _gelu_tanh, "silu": F.silu,
                "squared_relu": _squared_relu, "quick_gelu": _quick_gelu}


def activation_function(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in _ACTIVATIONS:
        raise ConfigError(
            f"activation {name!r} is not supported; use one of {sorted(_ACTIVATIONS)}"
        )
    return _ACTIVATIONS[name]


def gated_linear_unit(intermediate: torch.Tensor, activation: Callable, config) -> torch.Tensor:
    """[..., 2f] = [gate, up] -> activation(gate) * (up + glu_linear_offset) [..., f], the
    gate clamped from above and up on both sides by `activation_func_clamp_value` if set
    (gpt-oss's clamped SwiGLU). Shared by the dense MLP and the experts."""
    gate, up = intermediate.chunk(2, dim=-1)
    limit = config.activation_func_clamp_value
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    if config.glu_linear_offset:
        up = up + config.glu_linear_offset
    return activation(gate) * up


class MLP(torch.nn.Module):
    """forward(hidden_states [s(/tp), b, h]) -> [s(/tp), b, h]."""

    def __init__(
        self,
        config: TransformerConfig,
        state,
        layer_number: int = 1,
        device: Optional[torch.device] = None,
        tp_group: Optional[ProcessGroup] = None,
    ) -> None:
        """`tp_group` overrides `state.tp_group` (e.g. for an expert's own TP group)."""
        super().__init__()
        tp_group = state.tp_group if tp_group is None else tp_group
        self.config = config
        self.gated = config.gated_linear_unit
        self.activation = activation_function(config.activation)
        init_method = hidden_init_method(config)
        output_init = output_init_method(config)
        fc1_size = config.ffn_hidden_size * (2 if self.gated else 1)
        self.linear_fc1 = ColumnParallelLinear(
            config.hidden_size,
            fc1_size,
            config=config,
            tp_group=tp_group,
            init_method=init_method,
            bias=config.add_bias_linear,
            gather_output=False,
            stride=2 if self.gated else 1,
            device=device,
        )
        self.linear_fc2 = RowParallelLinear(
            config.ffn_hidden_size,
            config.hidden_size,
            config=config,
            tp_group=tp_group,
            init_method=output_init,
            bias=config.add_bias_linear,
            input_is_parallel=True,
            device=device,
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        intermediate, _ = self.linear_fc1(hidden_states)
        if self.gated:
            intermediate = gated_linear_unit(intermediate, self.activation, self.config)
        else:
            intermediate = self.activation(intermediate)
        output, _ = self.linear_fc2(intermediate)
        return output


__all__ = ["MLP", "activation_function", "gated_linear_unit"]
