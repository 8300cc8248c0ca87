"""Multi-token prediction (DeepSeek-V3; Megatron's `--mtp-num-layers`,
`--mtp-loss-scaling-factor`), built on the last pipeline stage of a `GPTModel`.

Layer k (1..D) predicts the token k + 1 places ahead of each position. With h^0 the main
model's output (after its final norm) and the input ids shifted left k times,

    h^k = final_norm(layer(eh_proj([enorm(embed(ids shifted k)); hnorm(h^(k-1))])))

where `layer` is a decoder layer of the kind of the model's last one (MoE or dense, its
attention), `embed` the model's word embedding and the logits come from the model's output
layer (both shared with the main model). The loss of layer k is the cross entropy against the
labels shifted k times, averaged over the loss mask shifted k times (the last k positions of
each sequence have no target). Their mean, times `mtp_loss_scaling_factor`, enters backward
beside the language-model loss, attached to the last hidden states (scaled like each
microbatch's lm loss, as the MoE auxiliary losses are); each layer's loss is logged on its own
("mtp_1 loss", ...), averaged over microbatches and data-parallel replicas.

Parameter names follow megatron-core (main): `mtp.layers.<k-1>.{enorm, hnorm, eh_proj,
mtp_model_layer, final_layernorm}`; the inner layer's routers count as global layers
num_layers + k (Megatron's numbering for MTP routers).

Shifting under context parallelism: each rank holds chunks i and 2N-1-i of 2N, so a chunk's
last position takes the first token of the next chunk in sequence order, gathered from the
rank holding it. Each rank's loss is its masked sum over the whole sequences' count (summed
over the context-parallel group), so the ranks' shares add up to the single-process loss.
"""
from __future__ import annotations

from typing import Callable, Dict, Iterable, List, Optional

import torch
import torch.distributed as dist

from megatron_smp.config import TransformerConfig
from megatron_smp.tensor_parallel import ColumnParallelLinear, hidden_init_method
from megatron_smp.tensor_parallel.mappings import (
    _gather_first_dim,
    gather_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron_smp.tensor_parallel.random import checkpoint
from megatron_smp.transformer.attention import RotaryEmbeddings
from megatron_smp.transformer.moe.moe_utils import MoEAuxLossAutoScaler
from megatron_smp.transformer.norm import build_norm
from megatron_smp.transformer.spec import LayerSpec, build_module, spec_for_layer
from megatron_smp.transformer.utils import derive_seed, init_rng_scope


def roll_left(x: torch.Tensor, state) -> torch.Tensor:
    """x [b, s(/cp)] (ids, positions, labels, loss mask) shifted one position left along the
    whole sequence, 0 at its end. Under context parallelism x holds this rank's two chunks
    (i, 2N-1-i) and the positions that cross a chunk boundary come from the neighbours."""
    rolled = torch.roll(x, shifts=-1, dims=-1)
    if state.cp_size == 1:
        rolled[..., -1] = 0
        return rolled
    size, rank = state.cp_size, state.cp_rank
    half = x.shape[-1] // 2
    firsts = torch.stack([x[..., 0], x[..., half]]).contiguous()  # [2, b]
    gathered = _gather_first_dim(firsts.unsqueeze(0), state.cp_group)  # [N, 2, b]
    # Chunk i (< N) is rank i's first; chunk j >= N is rank 2N-1-j's second.
    after_first = gathered[rank + 1, 0] if rank + 1 < size else firsts[1]
    rolled[..., half - 1] = after_first
    rolled[..., -1] = gathered[rank - 1, 1] if rank > 0 else 0
    return rolled


class MultiTokenPredictionLayer(torch.nn.Module):
    """One prediction depth: forward(hidden_states [s(/tp), b, h], input_ids [b, s]
    (already shifted), position_ids, attention_mask, rotary_pos_emb, embedding)
    -> [s(/tp), b, h]."""

    def __init__(self, config: TransformerConfig, state, depth: int, layer_spec: LayerSpec,
                 device: Optional[torch.device] = None) -> None:
        super().__init__()
        self.tp_group = state.tp_group
        self.sequence_parallel = config.sequence_parallel_at(state.tp_size)
        self.recompute = config.recompute_granularity == "full"
        sp = self.sequence_parallel
        self.enorm = build_norm(config, sequence_parallel=sp, device=device)
        self.hnorm = build_norm(config, sequence_parallel=sp, device=device)
        self.eh_proj = ColumnParallelLinear(
            2 * config.hidden_size, config.hidden_size, config=config, tp_group=state.tp_group,
            init_method=hidden_init_method(config), bias=False,
            gather_output=False, device=device)
        layer_number = config.num_layers + depth
        self.mtp_model_layer = build_module(spec_for_layer(layer_spec, layer_number), config,
                                            state, layer_number=layer_number, device=device)
        self.final_layernorm = build_norm(config, sequence_parallel=sp, device=device)

    def forward(self, hidden_states, input_ids, position_ids, attention_mask, rotary_pos_emb,
                embedding: Callable) -> torch.Tensor:
        decoder_input = embedding(input_ids, position_ids)
        combined = torch.cat((self.enorm(decoder_input), self.hnorm(hidden_states)), dim=-1)
        combined, _ = self.eh_proj(combined)  # [s, b, h / tp]
        combined = gather_from_tensor_model_parallel_region(combined, self.tp_group)
        if self.sequence_parallel:
            combined = scatter_to_sequence_parallel_region(combined, self.tp_group)
        if self.recompute and self.training and torch.is_grad_enabled():
            output = checkpoint(self.mtp_model_layer, False, combined, attention_mask,
                                rotary_pos_emb)
        else:
            output = self.mtp_model_layer(combined, attention_mask, rotary_pos_emb)
        return self.final_layernorm(output)


class MultiTokenPredictionBlock(torch.nn.Module):
    """The D prediction layers of the last pipeline stage, and what they report.

    `loss_scale` (0-dim) is the gradient the training loop gives the attached MTP loss
    (loss_scale x cp / num_microbatches, as for the MoE auxiliary losses); `loss_sums` [D]
    accumulates each depth's logged loss over the microbatches of a training step."""

    def __init__(self, config: TransformerConfig, state, layer_spec: LayerSpec,
                 init_seed: Optional[int] = None,
                 device: Optional[torch.device] = None) -> None:
        super().__init__()
        self.config = config
        self.state = state
        layers = []
        for depth in range(1, config.mtp_num_layers + 1):
            # Seeds after the output layer's (num_layers + 1), so the main model's do not move.
            seed = None if init_seed is None else derive_seed(init_seed,
                                                              config.num_layers + 1 + depth)
            with init_rng_scope(seed):
                layers.append(MultiTokenPredictionLayer(config, state, depth, layer_spec,
                                                        device))
        self.layers = torch.nn.ModuleList(layers)
        buffer_device = None if device is None or torch.device(device).type == "meta" else device
        self.register_buffer("loss_scale", torch.ones((), device=buffer_device),
                             persistent=False)
        self.register_buffer("loss_sums", torch.zeros(config.mtp_num_layers,
                                                      device=buffer_device), persistent=False)

    def forward(self, hidden_states, input_ids, position_ids, attention_mask, rotary_pos_emb,
                embedding: Callable) -> List[torch.Tensor]:
        """[h^1, ..., h^D] from the main model's h^0."""
        outputs = []
        for layer in self.layers:
            input_ids = roll_left(input_ids, self.state)
            if position_ids is not None:  # only learned absolute positions read them
                position_ids = roll_left(position_ids, self.state)
            hidden_states = layer(hidden_states, input_ids, position_ids, attention_mask,
                                  rotary_pos_emb, embedding)
            outputs.append(hidden_states)
        return outputs

    def attach_loss(self, hidden_states: torch.Tensor, mtp_outputs: List[torch.Tensor],
                    labels: torch.Tensor, loss_mask: Optional[torch.Tensor],
                    per_token_loss: Callable) -> torch.Tensor:
        """`hidden_states` with the scaled mean MTP loss attached for backward.

        labels / loss_mask [b, s(/cp)]; per_token_loss(h [s, b, h], labels [b, s]) -> [b, s]
        fp32 through the model's output layer."""
        mask = torch.ones_like(labels, dtype=torch.float32) if loss_mask is None \
            else loss_mask.float()
        total = None
        for depth, output in enumerate(mtp_outputs):
            labels = roll_left(labels, self.state)
            mask = roll_left(mask, self.state)
            losses = per_token_loss(output, labels)
            local_sum = torch.sum(losses * mask)
            count = mask.sum()
            if self.state.cp_size > 1:
                count = count.clone()
                dist.all_reduce(count, group=self.state.cp_group)
            loss = local_sum / count.clamp(min=1.0)
            if self.training:
                with torch.no_grad():
                    self.loss_sums[depth] += loss.detach().to(self.loss_sums.dtype)
            total = loss if total is None else total + loss
        scaled = total * (self.config.mtp_loss_scaling_factor / len(mtp_outputs))
        return MoEAuxLossAutoScaler.apply(hidden_states, scaled, self.loss_scale)


def _blocks(model_chunks: Iterable[torch.nn.Module]) -> List[MultiTokenPredictionBlock]:
    return [m for chunk in model_chunks for m in chunk.modules()
            if isinstance(m, MultiTokenPredictionBlock)]


def set_mtp_loss_scale(model_chunks: Iterable[torch.nn.Module], scale) -> None:
    """At the start of a step's forward/backward: gradient of the attached MTP loss :=
    `scale` (the MoE aux losses' scale); the logged sums start from zero."""
    for block in _blocks(model_chunks):
        block.loss_scale.fill_(scale)
        block.loss_sums.zero_()


def mtp_loss_names(config: TransformerConfig) -> List[str]:
    return [f"mtp_{k} loss" for k in range(1, (config.mtp_num_layers or 0) + 1)]


def mtp_metrics(model_chunks: Iterable[torch.nn.Module], config: TransformerConfig, state,
                num_microbatches: int) -> Dict[str, torch.Tensor]:
    """{"mtp_k loss"} of the last training step: each depth's loss averaged over microbatches
    and data-parallel replicas (context-parallel ranks hold shares of one value). Resets the
    sums. A collective over the pipeline and data x context-parallel groups: call it on every
    rank."""
    names = mtp_loss_names(config)
    if not names:
        return {}
    values = torch.zeros(len(names), dtype=torch.float32, device=state.device)
    for block in _blocks(model_chunks):
        values += block.loss_sums.to(values.device)
        block.loss_sums.zero_()
    if state.pp_size > 1:  # the last stage holds them
        dist.all_reduce(values, group=state.pp_group)
    if state.dp_cp_size > 1:
        dist.all_reduce(values, group=state.dp_cp_group)
        values /= state.dp_cp_size // state.cp_size
    values /= num_microbatches
    return dict(zip(names, values.unbind()))


__all__ = [
    "MultiTokenPredictionBlock",
    "MultiTokenPredictionLayer",
    "mtp_loss_names",
    "mtp_metrics",
    "roll_left",
    "set_mtp_loss_scale",
]
