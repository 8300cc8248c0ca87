"""Mixture of experts: router, token dispatchers, experts, shared experts, the MoE layer, and
the training loop's hooks for the auxiliary losses (scale and logging)."""
from megatron_smp.transformer.moe.experts import MoEExperts, grouped_gemm_supported
from megatron_smp.transformer.moe.moe_layer import MoELayer, moe_layer_spec
from megatron_smp.transformer.moe.router import METRIC_NAMES, TopKRouter
from megatron_smp.transformer.moe.shared_experts import SharedExpertMLP
from megatron_smp.transformer.moe.token_dispatcher import (
    MoEAllGatherTokenDispatcher,
    MoEAlltoAllTokenDispatcher,
)
from megatron_smp.transformer.moe.training import (
    moe_metrics,
    reset_global_aux_loss,
    set_aux_loss_scale,
    update_expert_bias,
)

__all__ = [
    "MoELayer",
    "moe_layer_spec",
    "TopKRouter",
    "MoEExperts",
    "SharedExpertMLP",
    "MoEAllGatherTokenDispatcher",
    "MoEAlltoAllTokenDispatcher",
    "METRIC_NAMES",
    "grouped_gemm_supported",
    "set_aux_loss_scale",
    "moe_metrics",
    "update_expert_bias",
    "reset_global_aux_loss",
]
