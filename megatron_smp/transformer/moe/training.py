"""What the training loop does for MoE models: scale the auxiliary losses' gradient like
the main loss's, and report the losses once per iteration (Megatron's log fields).

Both walk the model chunks for their routers; nothing is global, so several models (or
jobs) in one process do not share state.
"""
from __future__ import annotations

from typing import Dict, Iterable, List

import torch
import torch.distributed as dist

from megatron_smp.config import TransformerConfig
from megatron_smp.tensor_parallel.mappings import group_size
from megatron_smp.transformer.moe.moe_utils import updated_expert_bias
from megatron_smp.transformer.moe.router import METRIC_NAMES, TopKRouter


def _routers(model_chunks: Iterable[torch.nn.Module]) -> List[TopKRouter]:
    return [m for chunk in model_chunks for m in chunk.modules() if isinstance(m, TopKRouter)]


def set_aux_loss_scale(model_chunks: Iterable[torch.nn.Module], scale: float) -> None:
    """Gradient of every auxiliary loss := `scale` (loss_scale x cp / num_microbatches, as
    the schedule scales each microbatch's language-model loss; Megatron's factor cp makes up
    for the average of grads over dp x cp, as the lm loss's x cp does)."""
    for router in _routers(model_chunks):
        router.aux_loss_scale.fill_(scale)


def tracked_metrics(config: TransformerConfig) -> List[str]:
    """The loss names this model reports (the same on every rank)."""
    names = []
    balancing = config.moe_router_load_balancing_type
    if config.num_moe_experts is not None and config.moe_aux_loss_coeff:
        if balancing in ("aux_loss", "seq_aux_loss"):
            names.append("load_balancing_loss")
        elif balancing == "global_aux_loss":
            names.append("global_load_balancing_loss")  # Megatron's log field
    if config.num_moe_experts is not None and config.moe_z_loss_coeff is not None:
        names.append("z_loss")
    return names


def moe_metrics(
    model_chunks: Iterable[torch.nn.Module], config: TransformerConfig, state,
    num_microbatches: int, per_layer: bool = False,
) -> Dict[str, torch.Tensor]:
    """{"load_balancing_loss", "z_loss"} of the last iteration (those the config enables),
    each without its coefficient, averaged over microbatches, MoE layers and data-parallel
    replicas (Megatron's tracker); with `per_layer` (--moe-per-layer-logging) also
    "moe/<name>_layer_<i>" per MoE layer i (0-based global layer index), that layer's value
    averaged over microbatches and replicas. Resets the routers' accumulators. A collective
    over the TP, PP and DP x CP groups: call it on every rank."""
    names = tracked_metrics(config)
    if not names:
        return {}
    # Row per global layer (the multi-token-prediction layers after the decoder's, as
    # Megatron counts them): each stage fills its own layers' rows.
    pattern = config.moe_layer_pattern()
    pattern = pattern + [pattern[-1]] * (config.mtp_num_layers or 0)
    values = torch.zeros(len(pattern), len(METRIC_NAMES), dtype=torch.float32,
                         device=state.device)
    for router in _routers(model_chunks):
        values[router.layer_number - 1] += torch.stack(
            [router.metrics[name] for name in METRIC_NAMES]).to(values.device)
        router.reset_metrics()
    # Each TP rank holds its sequence shard's partial sum; each stage its own layers.
    for group in (state.tp_group, state.pp_group):
        if dist.get_world_size(group) > 1:
            dist.all_reduce(values, group=group)
    # Context-parallel ranks hold partial sums too (their tokens' share), data-parallel
    # replicas whole values: sum over dp x cp, average over dp. The global loss's values are
    # shares of the global batch's loss on every dp x cp rank: summed only (Megatron's).
    if state.dp_cp_size > 1:
        dist.all_reduce(values, group=state.dp_cp_group)
        dp = state.dp_cp_size // state.cp_size
        divisor = torch.full((len(METRIC_NAMES),), float(dp), device=values.device)
        divisor[METRIC_NAMES.index("global_load_balancing_loss")] = 1.0
        values /= divisor
    values /= num_microbatches
    totals = values.sum(dim=0) / max(1, sum(pattern))
    # 0-dim device tensors: the training loop reads them on the host at the log line (and
    # TensorBoard / W&B when they write).
    out = {name: totals[METRIC_NAMES.index(name)] for name in names}
    if per_layer:
        for index, moe in enumerate(pattern):
            if moe:
                for name in names:
                    out[f"moe/{name}_layer_{index}"] = values[index, METRIC_NAMES.index(name)]
    return out


def reset_global_aux_loss(model_chunks: Iterable[torch.nn.Module]) -> None:
    """Zero every router's step counts of --moe-router-load-balancing-type global_aux_loss
    (after the step's last backward, as Megatron's finalize_model_grads)."""
    for router in _routers(model_chunks):
        router.reset_global_aux_loss_tracker()


def update_expert_bias(model_chunks: Iterable[torch.nn.Module], config: TransformerConfig,
                       state) -> None:
    """Aux-loss-free balancing: move every router's `expert_bias` by
    +-`moe_router_bias_update_rate` towards equal token counts, from the counts of the whole
    global batch, then zero the counts. Called once per step after the last backward (where
    Megatron's finalize_model_grads does it).

    The counts are summed over the tensor- and data/context-parallel groups (Megatron's
    TP x DP x CP group; expert-parallel ranks are data-parallel replicas of the router), so
    every replica computes the same bias. Those groups hold ranks of one pipeline stage,
    which hold the same layers: a stage without MoE layers issues nothing, and so do all
    its peers.
    """
    if config.num_moe_experts is None or not config.moe_router_enable_expert_bias:
        return
    routers = [r for r in _routers(model_chunks) if r.enable_expert_bias]
    if not routers:
        return
    counts = torch.stack([r.local_tokens_per_expert for r in routers])
    for group in (state.tp_group, state.dp_cp_group):
        if group_size(group) > 1:
            dist.all_reduce(counts, group=group)
    biases = updated_expert_bias(counts, torch.stack([r.expert_bias for r in routers]),
                                 config.moe_router_bias_update_rate)
    with torch.no_grad():
        for router, bias in zip(routers, biases):
            router.expert_bias.copy_(bias)
            router.local_tokens_per_expert.zero_()


__all__ = ["set_aux_loss_scale", "moe_metrics", "tracked_metrics", "update_expert_bias",
           "reset_global_aux_loss"]
