"""MoELayer: the MLP of a transformer layer replaced by routed experts (+ shared experts).

forward(hidden_states [s(/tp), b, h]) -> [s(/tp), b, h]:

    probs, routing_map = router(x)                     # [T, E] each, T = this rank's tokens
    expert_input, counts = dispatcher.dispatch(fc1_latent_proj(x), probs, routing_map)
    y = fc2_latent_proj(dispatcher.combine(experts(expert_input, counts)))
    y = y + shared_experts(x)                          # when configured

The latent projections (--moe-latent-size, Megatron's; identity without it) are replicated
over TP, like the router, so experts and dispatch work in the latent width.
Built through the layer spec (`MoELayer(config, state, layer_number, device)`), like the
dense `MLP`. This rank holds experts `ep_rank * E/ep ... (ep_rank + 1) * E/ep - 1`.
Construction draws the router, the latent projections, then the experts (each under a seed
of its global index), then the shared experts, so the weights do not depend on the parallel layout.
"""
from __future__ import annotations

from typing import Optional

import torch

from megatron_smp.config import ConfigError, TransformerConfig, recompute_modules
from megatron_smp.tensor_parallel import ReplicatedLinear, output_init_method
from megatron_smp.tensor_parallel.random import checkpoint
from megatron_smp.transformer.moe.experts import MoEExperts
from megatron_smp.transformer.moe.router import TopKRouter
from megatron_smp.transformer.moe.shared_experts import SharedExpertMLP
from megatron_smp.transformer.moe.token_dispatcher import build_token_dispatcher


class MoELayer(torch.nn.Module):
    def __init__(
        self,
        config: TransformerConfig,
        state,
        layer_number: int = 1,
        device: Optional[torch.device] = None,
    ) -> None:
        super().__init__()
        if config.num_moe_experts is None:
            raise ConfigError("MoELayer needs --num-experts (TransformerConfig.num_moe_experts)")
        ep_size, ep_rank = state.ep_size, state.ep_rank
        if config.num_moe_experts % ep_size:
            raise ConfigError(
                f"--num-experts ({config.num_moe_experts}) must be divisible by "
                f"--expert-model-parallel-size ({ep_size})"
            )
        self.num_local_experts = config.num_moe_experts // ep_size
        offset = ep_rank * self.num_local_experts
        self.local_expert_indices = list(range(offset, offset + self.num_local_experts))
        self.router = TopKRouter(config, state, layer_number=layer_number, device=device)
        self.fc1_latent_proj = self.fc2_latent_proj = None
        if config.moe_latent_size is not None:
            # Each TP rank projects its own sequence shard (MoE needs SP at TP > 1): the
            # grads are partial, summed over TP like the router's.
            sequence_parallel = config.sequence_parallel_at(state.tp_size)
            self.fc1_latent_proj = ReplicatedLinear(
                config.hidden_size, config.moe_latent_size, config, sequence_parallel, device,
                bias=config.add_bias_linear)
            self.fc2_latent_proj = ReplicatedLinear(
                config.moe_latent_size, config.hidden_size, config, sequence_parallel, device,
                init_method=output_init_method(config), bias=config.add_bias_linear)
        self.experts = MoEExperts(config, state, self.num_local_experts, offset,
                                  layer_number=layer_number, device=device)
        self.shared_experts = None
        if config.moe_shared_expert_intermediate_size is not None:
            self.shared_experts = SharedExpertMLP(config, state, layer_number=layer_number,
                                                  device=device)
        self.token_dispatcher = build_token_dispatcher(
            config.moe_token_dispatcher_type, config.num_moe_experts,
            self.local_expert_indices, state, config.moe_flex_dispatcher_backend,
        )
        # --recompute-granularity selective --recompute-modules moe / shared_experts
        # (Megatron's): the whole layer, or the shared experts, rerun in backward instead of
        # keeping their activations. The router records its losses and token counts in the
        # first run only (TopKRouter._recording).
        modules = recompute_modules(config)
        self.recompute = "moe" in modules
        self.recompute_shared_experts = "shared_experts" in modules

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.recompute and self.training and torch.is_grad_enabled():
            return checkpoint(self._forward, False, hidden_states)
        return self._forward(hidden_states)

    def _forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        probs, routing_map = self.router(hidden_states)
        # For debugging load balance: tokens this rank routed to each (global) expert in the
        # last forward, [num_experts] int64, after capacity drops.
        self.last_tokens_per_expert = routing_map.detach().sum(dim=0)
        tokens = hidden_states.reshape(-1, hidden_states.shape[-1])
        if self.fc1_latent_proj is not None:
            tokens = self.fc1_latent_proj(tokens)
        expert_input, tokens_per_expert = self.token_dispatcher.dispatch(
            tokens, probs, routing_map
        )
        expert_output = self.experts(expert_input, tokens_per_expert)
        output = self.token_dispatcher.combine(expert_output)
        if self.fc2_latent_proj is not None:
            output = self.fc2_latent_proj(output)
        output = output.view(hidden_states.shape)
        if self.shared_experts is not None:
            if (self.recompute_shared_experts and not self.recompute and self.training
                    and torch.is_grad_enabled()):
                return output + checkpoint(self.shared_experts, False, hidden_states)
            output = output + self.shared_experts(hidden_states)
        return output



def moe_layer_spec(config: TransformerConfig, dense_spec):
    """The decoder layer spec of a model whose MLPs follow `--moe-layer-freq`: `dense_spec`
    with its MLP replaced by `MoELayer` on MoE layers, as a function of the global 1-based
    layer number (a `LayerSpec`); `dense_spec` itself for a dense model."""
    import dataclasses

    from megatron_smp.transformer.spec import ModuleSpec

    if config.num_moe_experts is None:
        return dense_spec
    pattern = config.moe_layer_pattern()
    moe_spec = ModuleSpec(
        dense_spec.module, dict(dense_spec.params),
        dataclasses.replace(dense_spec.submodules, mlp=ModuleSpec(MoELayer)),
    )

    def spec_of(layer_number: int):
        return moe_spec if pattern[config.layer_pattern_number(layer_number) - 1] else dense_spec

    return spec_of


__all__ = ["MoELayer", "moe_layer_spec"]
