"""Split a full (TP=1) framework state dict over tensor-parallel ranks, and merge it back.

Which tensors are split, along which dim and with which stride is what the parallel layers
record on their parameters (`tensor_model_parallel`, `partition_dim`, `partition_stride`);
`tensor_parallel_layout(model)` reads it from any model (at any TP size, the layout is the
same). `default_layout(config)` states the same layout for a `GPTModel` without building one
(a unit test checks the two agree), for tools that only have a checkpoint.

The vocabulary tables (word embedding, output layer) are padded to
`config.padded_vocab_size(tp)`, which depends on TP: shards are re-padded on the way in and
out, so a full state dict always has `padded_vocab_size(1)` rows.
"""
from __future__ import annotations

import re
from typing import Dict, List, Mapping, Optional, Tuple

import torch

from megatron_smp.config import ConfigError, TransformerConfig

Layout = Dict[str, Tuple[int, int]]  # name pattern -> (partition_dim, stride)

_LAYER_INDEX = re.compile(r"(^|\.)layers\.\d+\.")
_EXPERT_INDEX = re.compile(r"\.local_experts\.(\d+)\.")
VOCAB_PARALLEL_SUFFIXES = ("word_embeddings.weight", "output_layer.weight", "output_layer.bias")


def _pattern(name: str) -> str:
    return _EXPERT_INDEX.sub(".local_experts.*.", _LAYER_INDEX.sub(r"\1layers.*.", name))


def partition_of(layout: Layout, name: str) -> Optional[Tuple[int, int]]:
    """(partition_dim, stride) of parameter `name` in `layout`; None when it is replicated."""
    return layout.get(_pattern(name))


def tensor_parallel_layout(model: torch.nn.Module) -> Layout:
    """{name pattern: (partition_dim, stride)} of the parameters split over TP in `model`."""
    layout: Layout = {}
    for name, param in model.named_parameters():
        if getattr(param, "tensor_model_parallel", False):
            layout[_pattern(name)] = (int(param.partition_dim), int(param.partition_stride))
    return layout


def default_layout(config: TransformerConfig) -> Layout:
    """The layout `GPTModel(config, ...)` has, by parameter name."""
    fc1_stride = 2 if config.gated_linear_unit else 1
    layout: Layout = {
        "embedding.word_embeddings.weight": (0, 1),
        "output_layer.weight": (0, 1),
        "output_layer.bias": (0, 1),
        "decoder.layers.*.self_attention.linear_qkv.weight": (0, 1),
        "decoder.layers.*.self_attention.linear_qkv.bias": (0, 1),
        "decoder.layers.*.self_attention.linear_proj.weight": (1, 1),
        "decoder.layers.*.mlp.linear_fc1.weight": (0, fc1_stride),
        "decoder.layers.*.mlp.linear_fc1.bias": (0, fc1_stride),
        "decoder.layers.*.mlp.linear_fc2.weight": (1, 1),
        # Attention sinks (--softmax-type learnable): one per head, split with the heads.
        "decoder.layers.*.self_attention.core_attention.softmax_offset": (0, 1),
    }
    if config.multi_latent_attention:  # heads split; down-projections replicated
        for proj in ("linear_q_proj", "linear_q_up_proj", "linear_kv_up_proj"):
            layout[f"decoder.layers.*.self_attention.{proj}.weight"] = (0, 1)
    if config.num_moe_experts is not None:
        for mlp in ("mlp.experts.local_experts.*.", "mlp.shared_experts."):
            layout[f"decoder.layers.*.{mlp}linear_fc1.weight"] = (0, fc1_stride)
            layout[f"decoder.layers.*.{mlp}linear_fc1.bias"] = (0, fc1_stride)
            layout[f"decoder.layers.*.{mlp}linear_fc2.weight"] = (1, 1)
    if config.hybrid_layer_pattern is not None or config.linear_attention_freq is not None:
        _add_mixer_layout(layout, config)
    if config.mtp_num_layers:  # each MTP layer: eh_proj, then a decoder layer
        layout["mtp.layers.*.eh_proj.weight"] = (0, 1)
        # A hybrid pattern's depth is a stack of hybrid layers (transformer.hybrid).
        inner_layer = "layers.*." if config.hybrid_mtp_symbols() else ""
        for name, split in list(layout.items()):
            if name.startswith("decoder.layers.*."):
                inner = name[len("decoder.layers.*."):]
                layout[f"mtp.layers.*.mtp_model_layer.{inner_layer}{inner}"] = split
    return layout


# The recurrent mixers' split tensors (transformer/ssm): group-major rows, split contiguously.
_MIXER_SPLIT = ("in_proj.weight", "conv1d.weight", "conv1d.bias", "A_log", "dt_bias", "D",
                "norm_weight")


def _add_mixer_layout(layout: Layout, config: TransformerConfig) -> None:
    """Hybrid models: a layer's one part sits under `mixer.` (attention, MLP and MoE names as
    in GPT layers), Mamba / Gated DeltaNet tensors under `mixer.` or, for
    --linear-attention-freq, under `self_attention.`."""
    mixer_prefixes = ["decoder.layers.*.self_attention."]
    if config.hybrid_layer_pattern is not None:
        mixer_prefixes = ["decoder.layers.*.mixer."]
        for name, split in list(layout.items()):
            for part in ("decoder.layers.*.self_attention.", "decoder.layers.*.mlp."):
                if name.startswith(part):
                    layout["decoder.layers.*.mixer." + name[len(part):]] = split
    for prefix in mixer_prefixes:
        for name in _MIXER_SPLIT:
            layout[prefix + name] = (0, 1)
        layout[prefix + "out_proj.weight"] = (1, 1)


def expert_parallel_shard(
    state_dict: Mapping[str, torch.Tensor], num_experts: int, ep_size: int, ep_rank: int
) -> Dict[str, torch.Tensor]:
    """Rank `ep_rank`'s share of a state dict holding all `num_experts` experts under their
    global index: its experts, renamed to their local index (everything else kept)."""
    per_rank = num_experts // ep_size
    out = {}
    for name, tensor in state_dict.items():
        match = _EXPERT_INDEX.search(name)
        if match is None:
            out[name] = tensor
            continue
        local = int(match.group(1)) - ep_rank * per_rank
        if 0 <= local < per_rank:
            out[name[:match.start()] + f".local_experts.{local}." + name[match.end():]] = tensor
    return out


def expert_parallel_merge(
    state_dicts: List[Mapping[str, torch.Tensor]], num_experts: int
) -> Dict[str, torch.Tensor]:
    """Inverse of `expert_parallel_shard` over every expert-parallel rank's state dict (in EP
    rank order): all experts under their global index."""
    per_rank = num_experts // len(state_dicts)
    out = {}
    for ep_rank, state_dict in enumerate(state_dicts):
        for name, tensor in state_dict.items():
            match = _EXPERT_INDEX.search(name)
            if match is None:
                out.setdefault(name, tensor)
                continue
            index = int(match.group(1)) + ep_rank * per_rank
            out[name[:match.start()] + f".local_experts.{index}." + name[match.end():]] = tensor
    return out


def _is_vocab_parallel(name: str) -> bool:
    return name.endswith(VOCAB_PARALLEL_SUFFIXES)


def _repad_rows(tensor: torch.Tensor, vocab_size: int, padded: int) -> torch.Tensor:
    tensor = tensor[:vocab_size]
    if padded > vocab_size:
        pad = tensor.new_zeros((padded - vocab_size,) + tuple(tensor.shape[1:]))
        tensor = torch.cat([tensor, pad], dim=0)
    return tensor


def split_tensor(tensor: torch.Tensor, dim: int, stride: int, tp_size: int, tp_rank: int):
    """Rank `tp_rank`'s slice: `tp_size * stride` chunks along `dim`, chunks r, r + tp, ..."""
    if tensor.shape[dim] % (tp_size * stride) != 0:
        raise ConfigError(
            f"a tensor of shape {tuple(tensor.shape)} does not split into {tp_size} x {stride} "
            f"chunks along dim {dim}; choose a tensor-parallel size that divides it"
        )
    pieces = torch.chunk(tensor, tp_size * stride, dim=dim)
    return torch.cat(pieces[tp_rank::tp_size], dim=dim).clone()


def join_tensors(shards: List[torch.Tensor], dim: int, stride: int) -> torch.Tensor:
    """Inverse of `split_tensor` over all ranks' slices (in rank order)."""
    per_rank = [torch.chunk(shard, stride, dim=dim) for shard in shards]
    return torch.cat([per_rank[r][s] for s in range(stride) for r in range(len(shards))], dim=dim)


def shard_state_dict(
    full_state_dict: Mapping[str, torch.Tensor],
    config: TransformerConfig,
    tp_size: int,
    tp_rank: int,
    layout: Optional[Layout] = None,
) -> Dict[str, torch.Tensor]:
    """Rank `tp_rank`'s state dict of a TP=`tp_size` model from a full (TP=1) one."""
    layout = default_layout(config) if layout is None else layout
    padded = config.padded_vocab_size(tp_size)
    shards = {}
    for name, tensor in full_state_dict.items():
        spec = layout.get(_pattern(name))
        if spec is None:
            shards[name] = tensor.clone()
            continue
        if _is_vocab_parallel(name):
            tensor = _repad_rows(tensor, config.vocab_size, padded)
        shards[name] = split_tensor(tensor, spec[0], spec[1], tp_size, tp_rank)
    return shards


def merge_state_dicts(
    state_dicts: List[Mapping[str, torch.Tensor]],
    config: TransformerConfig,
    layout: Optional[Layout] = None,
) -> Dict[str, torch.Tensor]:
    """The full (TP=1) state dict from every TP rank's state dict, in rank order."""
    layout = default_layout(config) if layout is None else layout
    names = list(state_dicts[0])
    for rank, state_dict in enumerate(state_dicts[1:], start=1):
        if set(state_dict) != set(names):
            raise ConfigError(
                f"tensor-parallel rank {rank} has different parameter names than rank 0: "
                f"{sorted(set(state_dict) ^ set(names))[:5]}"
            )
    full = {}
    for name in names:
        spec = layout.get(_pattern(name))
        if spec is None:
            full[name] = state_dicts[0][name].clone()
            continue
        merged = join_tensors([sd[name] for sd in state_dicts], spec[0], spec[1])
        if _is_vocab_parallel(name):
            merged = _repad_rows(merged, config.vocab_size, config.padded_vocab_size(1))
        full[name] = merged
    return full


__all__ = [
    "Layout",
    "tensor_parallel_layout",
    "default_layout",
    "partition_of",
    "split_tensor",
    "join_tensors",
    "shard_state_dict",
    "merge_state_dicts",
    "expert_parallel_shard",
    "expert_parallel_merge",
]
