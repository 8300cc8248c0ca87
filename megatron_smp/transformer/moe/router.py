"""TopKRouter: which experts each token goes to, with what weight, and the balancing losses.

forward(hidden_states [s(/tp), b, h]) -> (probs [T, E] fp32, routing_map [T, E] bool),
T = s(/tp) * b this rank's tokens. Load balancing (`moe_router_load_balancing_type`):

* aux_loss      top-k, plus the Switch-Transformer loss (`moe_aux_loss_coeff`);
* seq_aux_loss  top-k, plus the same loss per sequence, averaged over the batch;
* global_aux_loss  top-k, plus the same loss with the token counts of the whole step: summed
                over tensor x data x context parallel ranks (Megatron's tp_dp_cp group) and
                averaged over the micro-batches so far (`global_tokens_per_expert` /
                `ga_steps`, zeroed once per step by `training.reset_global_aux_loss`); the
                probabilities stay this rank's (Megatron-LM main's `global_aux_loss`);
* sinkhorn      experts chosen on Sinkhorn-balanced scores (training), probs from softmax;
* none          plain top-k.

Scores (`moe_router_score_function`) are softmax or DeepSeek-V3's sigmoid; top-k may be
group-limited and scaled (see `topk_routing`). With `moe_router_enable_expert_bias` the
persistent buffer `expert_bias` [E] (fp32, saved with the model) steers the choice; the
tokens each expert got while training accumulate in `local_tokens_per_expert` and
`training.update_expert_bias` moves the bias once per step.

With `moe_z_loss_coeff` the logits also carry the z-loss; with a capacity factor tokens
beyond an expert's capacity are dropped (`moe_token_drop_policy`). The losses enter backward
through `MoEAuxLossAutoScaler` scaled by `aux_loss_scale` (set by the training loop to
loss_scale / num_microbatches) and are accumulated in `metrics` for the log line.
"""
from __future__ import annotations

import collections
import contextlib
from typing import Deque, Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from megatron_smp.config import TransformerConfig
from megatron_smp.tensor_parallel import hidden_init_method
from megatron_smp.tensor_parallel.mappings import group_size
from megatron_smp.tensor_parallel.random import (
    EXPERT_PARALLEL_RNG,
    get_rng_tracker,
    recompute_phase,
)
from megatron_smp.transformer.moe.moe_utils import (
    MoEAuxLossAutoScaler,
    apply_capacity,
    reduce_token_counts,
    scores_for_aux_loss,
    sequence_load_balancing_loss,
    sinkhorn,
    switch_load_balancing_loss,
    topk_routing,
    z_loss,
)

METRIC_NAMES = ("load_balancing_loss", "global_load_balancing_loss", "z_loss")


class TopKRouter(torch.nn.Module):
    """The gate [E, h] (and with `add_bias_linear` its bias [E]; replicated on every rank)
    and the routing rule of one MoE layer."""

    def __init__(
        self,
        config: TransformerConfig,
        state,
        layer_number: int = 1,
        device: Optional[torch.device] = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.layer_number = layer_number
        self.num_experts = config.num_moe_experts
        self.topk = config.moe_router_topk
        self.routing_type = config.moe_router_load_balancing_type
        # The ranks that split one sequence (sequence parallelism, context parallelism: Megatron's
        # tp_cp group): losses are partial sums over them and the token counts are summed over
        # them.
        self.sequence_group = state.tp_cp_group if state.cp_size > 1 else state.tp_group
        self.sequence_parallel = config.sequence_parallel_at(state.tp_size)
        # global_aux_loss: the counts are summed over tp, then dp x cp (together Megatron's
        # tp_dp_cp group: every rank of this pipeline stage).
        self.global_groups = (state.tp_group, getattr(state, "dp_cp_group", None))
        self.weight = torch.nn.Parameter(
            torch.empty(self.num_experts, config.hidden_size, dtype=config.params_dtype,
                        device=device)
        )
        self.bias = None
        if config.add_bias_linear:
            # Megatron's router has a bias with the linear layers' (gpt-oss: router.bias).
            self.bias = torch.nn.Parameter(
                torch.empty(self.num_experts, dtype=config.params_dtype, device=device))
        self.reset_parameters()
        # Each tensor-parallel rank routes its own sequence shard: the gate's grad is partial.
        self.weight.sequence_parallel = self.sequence_parallel
        if self.bias is not None:
            self.bias.sequence_parallel = self.sequence_parallel
        device = self.weight.device if self.weight.device.type != "meta" else None
        # Not buffers: neither is part of the model's state.
        self.aux_loss_scale = torch.ones((), dtype=torch.float32, device=device)
        self.metrics: Dict[str, torch.Tensor] = {
            name: torch.zeros((), dtype=torch.float32, device=device) for name in METRIC_NAMES
        }
        # Tokens this rank sent to each expert since the last `reset_metrics` (debugging).
        self.tokens_per_expert = torch.zeros(self.num_experts, dtype=torch.int64, device=device)
        self.enable_expert_bias = config.moe_router_enable_expert_bias
        if self.enable_expert_bias:
            # Megatron's names; the bias is state (checkpointed), the counts are not.
            self.register_buffer("expert_bias", torch.zeros(
                self.num_experts, dtype=torch.float32, device=device))
            self.register_buffer("local_tokens_per_expert", torch.zeros(
                self.num_experts, dtype=torch.float32, device=device),
                persistent=False)
        else:
            self.expert_bias = None
        if self.routing_type == "global_aux_loss":
            # Megatron's names: this step's global counts summed over its micro-batches so
            # far, and how many (not state: zeroed every step).
            self.register_buffer("global_tokens_per_expert", torch.zeros(
                self.num_experts, dtype=torch.float32, device=device), persistent=False)
            self.register_buffer("ga_steps", torch.zeros(
                (), dtype=torch.float32, device=device), persistent=False)
        else:
            self.global_tokens_per_expert = self.ga_steps = None
        # global_aux_loss under --recompute-modules moe: the counts each first run used, for
        # its recompute in backward (later microbatches have moved the running average).
        self._counts_for_recompute: Deque[torch.Tensor] = collections.deque()
        self.logits_dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(
            config.moe_router_dtype)

    # reset_parameters() draws what the constructor drew: delayed (meta-device)
    # initialisation replays it (distributed.delayed_init).
    REPLAYS_CONSTRUCTOR_INIT = True

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The gate (then the bias) drawn on the CPU, layout-independent; nothing is copied
        while the params are on the meta device (the draws still happen)."""
        init = hidden_init_method(self.config)
        master = init(torch.empty(self.weight.shape))
        bias_master = None if self.bias is None else init(torch.empty(self.bias.shape))
        if self.weight.device.type != "meta":
            self.weight.copy_(master)
            if self.bias is not None:
                self.bias.copy_(bias_master)

    def _apply(self, fn, recurse=True):
        # Keep the loss bookkeeping on the parameters' device when the module moves.
        result = super()._apply(fn, recurse)
        device = self.weight.device
        if device.type != "meta":
            self.aux_loss_scale = self.aux_loss_scale.to(device)
            self.metrics = {k: v.to(device) for k, v in self.metrics.items()}
            self.tokens_per_expert = self.tokens_per_expert.to(device)
        return result

    # Bookkeeping ------------------------------------------------------------------------------
    def reset_metrics(self) -> None:
        for value in self.metrics.values():
            value.zero_()
        self.tokens_per_expert.zero_()

    def reset_global_aux_loss_tracker(self) -> None:
        """Start a new step's global counts (Megatron's name; once per optimizer step)."""
        if self.global_tokens_per_expert is not None:
            self.global_tokens_per_expert.zero_()
            self.ga_steps.zero_()

    def _track(self, name: str, value: torch.Tensor) -> None:
        if self._recording():
            self.metrics[name] += value.detach().float().reshape(())

    @staticmethod
    def _recording() -> bool:
        """Whether this forward records statistics (losses for the log, token counts): every
        forward but the rerun of an activation recompute (--recompute-modules moe, full
        recompute), which repeats its first run only to rebuild the graph."""
        return recompute_phase() != "recompute"

    def _losses_enabled(self) -> bool:
        """Whether this forward computes the balancing losses: training forwards with grads
        (they enter backward), and the first, grad-less run of a recomputed layer (it records
        them; its recompute attaches them to the graph)."""
        return self.training and (torch.is_grad_enabled() or recompute_phase() == "forward")

    def _attach(self, activation: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        return MoEAuxLossAutoScaler.apply(activation, loss, self.aux_loss_scale)

    # Routing ----------------------------------------------------------------------------------
    def _jitter(self, tokens: torch.Tensor) -> torch.Tensor:
        eps = self.config.moe_input_jitter_eps
        if not eps or not self.training:
            return tokens
        # Random ops of the expert-parallel modules draw from the per-EP-rank stream (seeded
        # by the init seed, or SMP's MoEConfig.random_seed) when it exists.
        tracker = get_rng_tracker()
        scope = (tracker.fork(EXPERT_PARALLEL_RNG) if EXPERT_PARALLEL_RNG in tracker.states
                 else contextlib.nullcontext())
        with scope:
            noise = torch.empty_like(tokens).uniform_(1.0 - eps, 1.0 + eps)
        return tokens * noise

    def _z_loss(self, logits: torch.Tensor) -> torch.Tensor:
        coeff = self.config.moe_z_loss_coeff
        if coeff is None or not self._losses_enabled():
            return logits
        loss = z_loss(logits, coeff, group_size(self.sequence_group))
        self._track("z_loss", loss / coeff)
        return self._attach(logits, loss)

    def _sinkhorn(self, logits: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        def activation(x):
            if self.topk == 1:
                return torch.sigmoid(x.float())
            return torch.softmax(x.float(), dim=-1)

        if self.training:
            with torch.no_grad():
                _, indices = torch.topk(sinkhorn(logits.float()), k=self.topk, dim=1)
        else:
            _, indices = torch.topk(activation(logits), k=self.topk, dim=1)
        routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, indices, True)
        return activation(logits) * routing_map, routing_map

    def _load_balancing_loss(self, logits: torch.Tensor, shape) -> Optional[torch.Tensor]:
        config = self.config
        coeff = config.moe_aux_loss_coeff
        if not coeff or not self._losses_enabled():
            return None
        # The loss sees the routing before any capacity drop (as Megatron's), and neither
        # the expert bias nor the groups.
        scores = scores_for_aux_loss(logits, config.moe_router_score_function)
        _, top = torch.topk(scores, k=self.topk, dim=-1)
        loss_map = torch.zeros_like(scores, dtype=torch.bool).scatter(1, top, True)
        partitions = group_size(self.sequence_group)
        if self.routing_type == "seq_aux_loss":
            s_local, batch = shape[0], shape[1]
            return sequence_load_balancing_loss(
                scores.view(s_local, batch, -1), loss_map.view(s_local, batch, -1),
                s_local * partitions, self.topk, coeff, self.sequence_group,
            )
        if self.routing_type == "global_aux_loss":
            world = 1
            for group in self.global_groups:
                world *= group_size(group)
            if recompute_phase() == "recompute":
                average = self._counts_for_recompute.popleft()
            else:
                counts = loss_map.sum(dim=0).float()
                for group in self.global_groups:
                    counts = reduce_token_counts(counts, group)
                with torch.no_grad():
                    self.global_tokens_per_expert += counts
                    self.ga_steps += 1
                average = self.global_tokens_per_expert / self.ga_steps
                if recompute_phase() == "forward":
                    self._counts_for_recompute.append(average)
            # This rank's share: its probabilities over all the step's tokens (the ranks'
            # values add up to the loss of the global batch).
            return switch_load_balancing_loss(
                scores, average, logits.shape[0] * world, self.topk, coeff)
        counts = reduce_token_counts(loss_map.sum(dim=0).float(), self.sequence_group)
        return switch_load_balancing_loss(
            scores, counts, logits.shape[0] * partitions, self.topk, coeff
        )

    def routing(self, logits: torch.Tensor, shape) -> Tuple[torch.Tensor, torch.Tensor]:
        """logits [T, E] -> (probs [T, E] fp32, routing_map [T, E] bool)."""
        config = self.config
        if self.routing_type == "sinkhorn":
            return self._sinkhorn(logits)
        probs, routing_map = topk_routing(
            logits, self.topk, config.moe_router_pre_softmax, config.moe_router_score_function,
            self.expert_bias, config.moe_router_num_groups, config.moe_router_group_topk,
            config.moe_router_topk_scaling_factor,
        )
        if self.enable_expert_bias and self._losses_enabled() and self._recording():
            # Counted before capacity drops (Megatron's); only training steps move the bias.
            with torch.no_grad():
                self.local_tokens_per_expert += routing_map.sum(dim=0)
        if config.moe_expert_capacity_factor is not None:
            probs, routing_map = apply_capacity(
                probs, routing_map, self.topk, config.moe_expert_capacity_factor,
                config.moe_token_drop_policy, config.moe_pad_expert_input_to_capacity,
            )
        if self.routing_type in ("aux_loss", "seq_aux_loss", "global_aux_loss"):
            loss = self._load_balancing_loss(logits, shape)
            if loss is not None:
                name = ("global_load_balancing_loss" if self.routing_type == "global_aux_loss"
                        else "load_balancing_loss")
                self._track(name, loss / config.moe_aux_loss_coeff)
                probs = self._attach(probs, loss)
        return probs, routing_map

    def forward(self, hidden_states: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        tokens = hidden_states.reshape(-1, hidden_states.shape[-1])
        weight = self.weight
        if self.logits_dtype is not None:  # --moe-router-dtype: logits and routing in it
            tokens, weight = tokens.to(self.logits_dtype), weight.to(self.logits_dtype)
        bias = self.bias
        if self.logits_dtype is not None and bias is not None:
            bias = bias.to(self.logits_dtype)
        logits = F.linear(self._jitter(tokens), weight, bias)
        logits = self._z_loss(logits)
        probs, routing_map = self.routing(logits, hidden_states.shape)
        if self._recording():
            with torch.no_grad():
                self.tokens_per_expert += routing_map.sum(dim=0)
        return probs, routing_map


__all__ = ["TopKRouter", "METRIC_NAMES"]
