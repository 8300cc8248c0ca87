"""Shared experts (Qwen-MoE / DeepSeek): a dense MLP every token goes through beside the
routed experts, optionally scaled per token by sigmoid(x . gate_weight) (Qwen-MoE's
`shared_expert_gate`).

forward(hidden_states [s(/tp), b, h]) -> [s(/tp), b, h]. The MLP is split over the tensor-
parallel group like the dense one (dense parameters, reduced over the full data-parallel
group); the gate [1, h] is replicated and, under sequence parallelism, sees only this rank's
shard, so its grad is summed over TP.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from megatron_smp.config import TransformerConfig
from megatron_smp.tensor_parallel import hidden_init_method
from megatron_smp.transformer.mlp import MLP


class SharedExpertMLP(MLP):
    def __init__(
        self,
        config: TransformerConfig,
        state,
        layer_number: int = 1,
        device: Optional[torch.device] = None,
    ) -> None:
        shared_config = config.replace(ffn_hidden_size=config.moe_shared_expert_intermediate_size)
        super().__init__(shared_config, state, layer_number=layer_number, device=device)
        self.gate_weight = None
        if config.moe_shared_expert_gate:
            master = torch.empty(1, config.hidden_size)
            hidden_init_method(config)(master)
            self.gate_weight = torch.nn.Parameter(
                torch.empty(1, config.hidden_size, dtype=config.params_dtype, device=device)
            )
            if self.gate_weight.device.type != "meta":
                with torch.no_grad():
                    self.gate_weight.copy_(master)
            self.gate_weight.sequence_parallel = config.sequence_parallel_at(state.tp_size)

    def replay_init(self, replay, materialize) -> int:
        """Delayed initialisation of a meta-device build (`distributed.delayed_init`): the
        MLP's projections (`replay`), then the gate drawn after them, as constructed."""
        count = sum(replay(module) for module in self.modules() if module is not self)
        if self.gate_weight is not None and self.gate_weight.is_meta:
            master = hidden_init_method(self.config)(
                torch.empty(self.gate_weight.shape))
            materialize(self)
            with torch.no_grad():
                self.gate_weight.copy_(master)
            count += master.numel()
        return count

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        output = super().forward(hidden_states)
        if self.gate_weight is not None:
            output = output * torch.sigmoid(F.linear(hidden_states, self.gate_weight))
        return output


__all__ = ["SharedExpertMLP"]
