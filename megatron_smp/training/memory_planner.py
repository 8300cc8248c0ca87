"""Memory planner: bytes per rank of parameters, gradients, optimizer state and activations
for a flag set at a target layout, computed without allocating (`--report-memory`,
`tools/estimate_memory.py`).

Parameters, gradients and optimizer state are counted, not modelled: the entry script's own
`model_provider` builds each pipeline stage on the meta device inside a fake process group
of the target world size (torch's `fake` backend: ranks and sizes, no communication), so
Qwen3-235B-A22B at 256 ranks is counted in seconds without allocating a parameter. Every
rank of a pipeline stage holds the same shapes (TP, CP, DP and EP split evenly), so one
build per stage gives every rank's count.

Activations are a formula per micro-batch (`layer_activation_bytes`), written for this
implementation's saved tensors (checked against the tensors autograd saves in a real CPU
forward, `tests/unit/training/test_memory_planner.py`): per layer and token, in units of the
activation dtype,

    replicated over TP (split by SP):  norm inputs (LayerNorm 1 h, RMSNorm 2 h each; with
                                       --sandwich-norm four norms), the two pre-norm outputs
                                       (2 h), hidden-dropout masks (2 h)
    split over TP:                     fused QKV (a + 2g) d, context a d,
                                       RoPE's rotated q/k (a + g) d, or the contiguous q copy
                                       of grouped-query attention a d; log-sum-exp (fp32, a);
                                       --qk-layernorm: the normalised q/k (a + g) d, their
                                       statistics (fp32, a + g), and with RoPE and
                                       1 < g < a the contiguous q copy the norm reads (a d)
    sliding-window layer:              the dense window mask, s_q s_k in the activation dtype
                                       (not with selective recompute of core_attn)
                                       dense MLP 2 f (4 f gated)
                                       MoE: top-k x (3 h + 2 f (4 f gated) / tp) per
                                       token of the whole sequence (gathered over TP)
    CPU attention with dropout:        12 bytes per score a s_q s_k (fp32: probabilities,
                                       dropout mask, dropped probabilities), 13.5 in
                                       bf16/fp16 (SDPA's math fallback)

then selective recompute removes what it recomputes (`core_attn`: the log-sum-exp and the
scores; `mlp`: the dense MLP; `layernorm`: 3 h), full recompute keeps one layer input per
checkpointed group (and, in backward, the group being recomputed: a transient that never
meets the logits); the first/last stage add the embedding and the output layer's input and
logits (with --final-logit-softcapping also the tanh's output, one more logits-sized
tensor). A pipeline rank holds `in_flight` micro-batches
(1F1B: pp - rank; interleaved: the warm-up forwards + 1, in chunks; GPipe: all), and its
peak adds the transient logits and cross-entropy buffers of one micro-batch and one
parameter's gradient: the largest one autograd materialises (with gradient-accumulation fusion
a linear layer's weight grad goes straight into the main grad: none), or with FSDP2 one
gathered unit with its unsharded grads, which only exist in that unit's backward, after the
loss buffers are gone. Not modelled: communication buffers, the allocator's fragmentation,
the CUDA context, all_gather CP's gathered keys/values, and the fp32 copies of q/k/v the
context-parallel attention of a bf16 model makes.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

GIB = 1024 ** 3
MIB = 1024 ** 2

# Bytes per attention score element CPU attention keeps for backward when attention dropout
# is on, measured with saved-tensor hooks: fp32 (transformer.attention's own path): the
# probabilities, the dropout's scale mask and the dropped probabilities; bf16 / fp16 (SDPA's
# math fallback): 13.5; other widths: three score-sized tensors.
CPU_DROPOUT_ATTENTION_BYTES_PER_SCORE = {4: 12.0, 2: 13.5}


@contextlib.contextmanager
def fake_layout(parallel_config, world_size: int, rank: int):
    """A `ParallelState` for `rank` of `world_size` over torch's fake process group: every
    size and rank is real, no collective communicates. For counting only (meta builds)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from megatron_smp.parallel_state import create_parallel_state

    if dist.is_initialized():
        raise RuntimeError("fake_layout needs torch.distributed uninitialised (the memory "
                           "report runs before the process group is created)")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield create_parallel_state(parallel_config)
    finally:
        dist.destroy_process_group()


@dataclass
class StageCount:
    """What one pipeline rank's model chunks hold, counted on meta."""

    pp_rank: int
    param_bytes: int = 0
    dense_numel: int = 0  # trainable, grads reduced over dp x cp
    expert_numel: int = 0  # trainable, grads reduced over expert-data-parallel (dp x cp / ep)
    fsdp_shard_numel: int = 0  # trainable numel one FSDP2 shard holds (rows padded)
    largest_param_numel: int = 0
    # The largest whose grad autograd materialises: not a linear weight under
    # --gradient-accumulation-fusion (those add into the main grad in place)
    largest_unfused_numel: int = 0
    largest_unit_numel: int = 0  # the largest transformer layer (FSDP2's gather unit)
    chunks: List[dict] = field(default_factory=list)  # per chunk: layers, pre/post


def _layer_kinds(model_config, offset: int, count: int) -> List[bool]:
    """Whether each layer of a chunk is an MoE layer."""
    symbols = model_config.hybrid_layer_symbols()
    if symbols is not None:
        return [symbols[i] == "E" for i in range(offset, offset + count)]
    if not model_config.num_moe_experts:
        return [False] * count
    pattern = model_config.moe_layer_pattern()
    return [bool(pattern[i]) for i in range(offset, offset + count)]


def _mixer_kinds(model_config, offset: int, count: int) -> List[Optional[str]]:
    """Each layer's --hybrid-layer-pattern symbol, "G" for a --linear-attention-freq GPT
    layer's Gated DeltaNet, None for a GPT layer with attention."""
    symbols = model_config.hybrid_layer_symbols()
    if symbols is not None:
        return [symbols[i] for i in range(offset, offset + count)]
    linear = model_config.linear_attention_pattern()
    return ["G" if linear[i] else None for i in range(offset, offset + count)]


def mixer_activation_bytes(model_config, kind: str, seq_length: int, tokens: int,
                           tp: int) -> float:
    """Bytes a Mamba-2 ("M") or Gated DeltaNet ("G") mixer keeps for backward per micro-batch
    on one rank: its saved tensors per token in fp32 units (the scans compute in fp32), fitted
    to the tensors autograd saves (saved-tensor hooks, 64 configurations, within 1% / 4%):
        Mamba: 13 d_inner + 8.5 g n + 2.5 h_m + 2 L h_m + 2 d_inner n / L
        GDN:   12 h_v d_v + 5 h_k d_k + 15 h_v + 5 L h_v + h_v d_k d_v / L + 10 h_v d_k
    (L the chunk, no longer than the sequence); all of it split over TP with the heads."""
    m = model_config
    if kind == "M":
        heads, n = m.mamba_heads(), m.mamba_state_dim
        inner, chunk = heads * m.mamba_head_dim, min(m.mamba_chunk_size, seq_length)
        units = (13 * inner + 8.5 * m.mamba_num_groups * n + 2.5 * heads + 2 * chunk * heads
                 + 2 * inner * n / chunk)
    else:
        values, keys = m.linear_num_value_heads, m.linear_num_key_heads
        dk, dv = m.linear_key_head_dim, m.linear_value_head_dim
        chunk = min(m.linear_chunk_size, seq_length)
        units = (12 * values * dv + 5 * keys * dk + 15 * values + 5 * chunk * values
                 + values * dk * dv / chunk + 10 * values * dk)
    return tokens * 4 * units / tp


def _layer_windows(model_config, offset: int, count: int) -> List[bool]:
    """Whether each layer of a chunk attends through a sliding window."""
    pattern = model_config.window_layer_pattern()
    return [bool(pattern[i]) for i in range(offset, offset + count)]


def check_model_provider(model_provider: Callable) -> None:
    """The planner builds on meta through the provider's `device=`; a clear error if it
    takes none (pure: every rank can check before any collective)."""
    from megatron_smp.config import ConfigError
    from megatron_smp.distributed.fsdp import provider_accepts_device

    if not provider_accepts_device(model_provider):
        raise ConfigError("--report-memory counts the model built on the meta device: the "
                          "entry script's model_provider must take device= (or **kwargs) and "
                          "pass it to the model, as pretrain_gpt.py's does")


def count_stages(configs, world_size: int, model_provider: Callable) -> List[StageCount]:
    """Build every pipeline stage on meta at the target layout and count its parameters."""
    from megatron_smp.pipeline_parallel.stages import layout_from_configs

    check_model_provider(model_provider)

    parallel = configs.parallel
    tp, cp = parallel.tensor_model_parallel_size, parallel.context_parallel_size
    pp = parallel.pipeline_model_parallel_size
    dp = parallel.data_parallel_size_for(world_size)
    layout = (layout_from_configs(configs, pp) if pp > 1
              else [[(0, configs.model.num_layers)]])
    shard = parallel.fsdp_shard_size(world_size) if parallel.use_torch_fsdp2 else 1
    stages = []
    # Building draws from the default generator (init seeds): the run's own draws must not
    # move when --report-memory counts first.
    with torch.random.fork_rng(devices=[]):
        for pp_rank in range(pp):
            stages.append(_count_stage(configs, world_size, model_provider, layout, pp_rank,
                                       tp * cp * dp, shard))
    return stages


def count_stages_composed(configs, world_size: int, model_provider: Callable,
                          cache: Optional[dict] = None) -> List[StageCount]:
    """`count_stages`'s counts, composed from one-layer builds: a layer's parameters depend on
    its kind (MoE or dense, its --hybrid-layer-pattern symbol) and the layout, not on where it
    sits, so each stage is the sum of the pieces it holds: the first layer of each chunk built
    with the chunk's embedding / output layer, every other layer by its kind. `cache` keeps
    the pieces across calls for one model shape (a search over layouts builds each piece once
    per TP / EP / shard). Equal to `count_stages` (tests/unit/training/test_memory_planner.py)."""
    from megatron_smp.pipeline_parallel.stages import layout_from_configs

    check_model_provider(model_provider)
    parallel, model = configs.parallel, configs.model
    tp, cp = parallel.tensor_model_parallel_size, parallel.context_parallel_size
    pp = parallel.pipeline_model_parallel_size
    dp = parallel.data_parallel_size_for(world_size)
    layout = layout_from_configs(configs, pp) if pp > 1 else [[(0, model.num_layers)]]
    if any(num_layers < 1 for chunks in layout for _, num_layers in chunks):
        return count_stages(configs, world_size, model_provider)
    shard = parallel.fsdp_shard_size(world_size) if parallel.use_torch_fsdp2 else 1
    cache = {} if cache is None else cache
    moe = _layer_kinds(model, 0, model.num_layers)
    kinds = _mixer_kinds(model, 0, model.num_layers)
    base = (tp, parallel.expert_model_parallel_size,
            parallel.expert_tensor_parallel_size, shard, parallel.use_torch_fsdp2, pp > 1)

    def piece(pp_rank: int, offset: int, pre: bool, post: bool) -> StageCount:
        key = base + (moe[offset], kinds[offset], pre, post)
        if key not in cache:
            with torch.random.fork_rng(devices=[]):
                cache[key] = _count_chunks(configs, world_size, model_provider,
                                           pp_rank * tp * cp * dp,
                                           [(offset, 1, pre, post, True)], shard)
        return cache[key]

    stages = []
    for pp_rank, chunks in enumerate(layout):
        count = StageCount(pp_rank)
        for index, (offset, num_layers) in enumerate(chunks):
            pre = pp_rank == 0 and index == 0
            post = pp_rank == pp - 1 and index == len(chunks) - 1
            parts = [piece(pp_rank, offset, pre, post)]
            parts += [piece(pp_rank, i, False, False)
                      for i in range(offset + 1, offset + num_layers)]
            for part in parts:
                for name in ("param_bytes", "dense_numel", "expert_numel",
                             "fsdp_shard_numel"):
                    setattr(count, name, getattr(count, name) + getattr(part, name))
                for name in ("largest_param_numel", "largest_unfused_numel",
                             "largest_unit_numel"):
                    setattr(count, name, max(getattr(count, name), getattr(part, name)))
            count.chunks.append(_chunk_info(model, offset, num_layers, pre, post))
        stages.append(count)
    return stages


def _count_stage(configs, world_size, model_provider, layout, pp_rank, ranks_per_stage,
                 shard) -> StageCount:
    """One pipeline rank's chunks built on meta (at tp = cp = dp = 0 of the stage), counted."""
    pp = len(layout)
    chunks = layout[pp_rank]
    specs = [(offset, num_layers, pp_rank == 0 and index == 0,
              pp_rank == pp - 1 and index == len(chunks) - 1, pp > 1)
             for index, (offset, num_layers) in enumerate(chunks)]
    count = _count_chunks(configs, world_size, model_provider, pp_rank * ranks_per_stage,
                          specs, shard)
    count.pp_rank = pp_rank
    return count


def _chunk_info(model_config, offset: int, num_layers: int, pre: bool, post: bool) -> dict:
    return {"pre": pre, "post": post, "moe": _layer_kinds(model_config, offset, num_layers),
            "kinds": _mixer_kinds(model_config, offset, num_layers),
            "windows": _layer_windows(model_config, offset, num_layers)}


def _count_chunks(configs, world_size, model_provider, rank, specs, shard) -> StageCount:
    """Chunks (offset, layers, pre_process, post_process, staged) built on meta as `rank`
    holds them and counted together (a parameter two chunks share counts once)."""
    from megatron_smp.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron_smp.tensor_parallel.utils import is_expert_param

    parallel = configs.parallel
    count = StageCount(0)
    with fake_layout(parallel, world_size, rank) as state:
        chunks = []
        for offset, num_layers, pre, post, staged in specs:
            stage = {"layer_offset": offset, "num_layers": num_layers} if staged else {}
            chunks.append(model_provider(configs, state, pre_process=pre, post_process=post,
                                         device=torch.device("meta"), **stage))
            count.chunks.append(_chunk_info(configs.model, offset, num_layers, pre, post))
    fused = set()
    if configs.model.gradient_accumulation_fusion and not parallel.use_torch_fsdp2:
        fused = {id(m.weight) for chunk in chunks for m in chunk.modules()
                 if isinstance(m, (ColumnParallelLinear, RowParallelLinear))
                 and m.weight is not None}
    seen = set()
    for chunk in chunks:
        for param in chunk.parameters():
            if id(param) in seen:
                continue
            seen.add(id(param))
            numel = param.numel()
            count.param_bytes += numel * param.element_size()
            count.largest_param_numel = max(count.largest_param_numel, numel)
            if id(param) not in fused:
                count.largest_unfused_numel = max(count.largest_unfused_numel, numel)
            if not param.requires_grad:
                continue
            if is_expert_param(param):
                count.expert_numel += numel
            else:
                count.dense_numel += numel
            if param.dim() > 0:
                # FSDP2 shards expert params over the ranks of a shard group holding the
                # same experts (parallel_state.expert_fsdp_layout).
                over = (max(1, shard // parallel.expert_model_parallel_size)
                        if is_expert_param(param) else shard)
                rows = math.ceil(param.shape[0] / over)
                count.fsdp_shard_numel += rows * (numel // max(param.shape[0], 1))
            else:
                count.fsdp_shard_numel += numel
        layers = [m for m in chunk.modules() if type(m).__name__.endswith("TransformerLayer")]
        for layer in layers:
            # Under FSDP2 a MoE layer's experts are a unit of their own.
            experts = sum(p.numel() for p in layer.parameters() if is_expert_param(p))
            dense = sum(p.numel() for p in layer.parameters()) - experts
            count.largest_unit_numel = max(count.largest_unit_numel, dense, experts)
    return count


def _act_bytes(model_config) -> int:
    return torch.tensor([], dtype=model_config.params_dtype).element_size()


def layer_activation_bytes(model_config, seq_length: int, micro_batch_size: int, tp: int,
                           cp: int, moe: bool, device_type: str = "cuda",
                           recompute_modules: Optional[List[str]] = None,
                           moe_capacity_tokens: Optional[float] = None,
                           windowed: bool = False,
                           kind: Optional[str] = None) -> Dict[str, float]:
    """Bytes one transformer layer keeps for backward per micro-batch on one rank, by part
    (see the module docstring for the terms). `recompute_modules` are the selective-recompute
    modules in effect (None: no selective recompute); `windowed`: the layer attends through
    its sliding window. `kind`: the layer's --hybrid-layer-pattern symbol (one norm and that
    one part), or "G" for a GPT layer whose attention is a Gated DeltaNet
    (`mixer_activation_bytes`)."""
    m = model_config
    p = _act_bytes(m)
    tokens = seq_length // cp * micro_batch_size
    sp = tp if m.sequence_parallel_at(tp) else 1
    h, a, g, d = m.hidden_size, m.num_attention_heads, m.num_query_groups, m.kv_channels
    modules = set(recompute_modules or ())
    norms_in = (2 if m.normalization == "RMSNorm" else 1) * 2
    if m.sandwich_norm:  # the post norms' inputs; their outputs only meet the residual add
        norms_in *= 2
    replicated = norms_in + 2 + (2 if m.hidden_dropout > 0 else 0)
    if "layernorm" in modules:
        replicated -= 3
    parts = {"replicated": tokens * h * replicated * p / sp}
    attention = (a + 2 * g) * d + a * d
    if m.position_embedding_type == "rope":
        attention += (a + g) * d
    elif 1 < g < a:
        attention += a * d
    if m.qk_layernorm:
        attention += (a + g) * d + (a + g) * 4 / p
        if m.position_embedding_type == "rope" and 1 < g < a:
            attention += a * d
    parts["attention"] = tokens * attention * p / tp
    if windowed and "core_attn" not in modules:  # built inside the core attention
        parts["window_mask"] = seq_length // cp * seq_length * p
    if "core_attn" not in modules:
        parts["core_attention"] = tokens * a * 4 / tp  # log-sum-exp, fp32
        if device_type == "cpu" and m.attention_dropout > 0:
            per_score = CPU_DROPOUT_ATTENTION_BYTES_PER_SCORE.get(p, 3.0 * p)
            parts["core_attention"] += per_score * a * tokens * (seq_length // cp) / tp
    gated = 2 if m.gated_linear_unit else 1
    if moe and "moe" in modules:
        pass  # recomputed in backward from its input (the norm's output, counted above)
    elif moe:
        # The dispatchers gather the sequence-parallel shards over TP first: every TP rank
        # routes all the tokens, its experts holding f / tp of each (expert TP = TP).
        routed = tokens * m.moe_router_topk
        if moe_capacity_tokens is not None:
            routed = moe_capacity_tokens
        parts["moe"] = routed * (3 * h + 2 * gated * m.moe_ffn_hidden_size / tp) * p
        if "moe_act" in modules:  # the activation's output, freed until backward
            parts["moe"] -= routed * m.moe_ffn_hidden_size / tp * p
        if m.moe_shared_expert_intermediate_size and "shared_experts" not in modules:
            parts["moe"] += tokens * 2 * gated * m.moe_shared_expert_intermediate_size * p / tp
    elif "mlp" not in modules:
        parts["mlp"] = tokens * 2 * gated * m.ffn_hidden_size * p / tp
    if kind is None:
        return parts
    if kind in ("M", "G"):
        parts.pop("attention"), parts.pop("core_attention", None)
        parts["mixer"] = mixer_activation_bytes(m, kind, seq_length, tokens, tp)
    if m.hybrid_layer_pattern is not None:  # one norm, one part
        kept = {"M": ("mixer",), "G": ("mixer",),
                "*": ("attention", "core_attention", "window_mask"),
                "-": ("mlp",), "E": ("moe",)}[kind]
        parts = {name: value for name, value in parts.items() if name in kept}
        norm = (2 if m.normalization == "RMSNorm" else 1) + 1 + (1 if m.hidden_dropout > 0 else 0)
        parts["replicated"] = tokens * h * norm * p / sp
    return parts


def moe_capacity_tokens(model_config, tokens_per_rank: float) -> Optional[float]:
    """Tokens the local experts of one rank process per layer and micro-batch: with
    --moe-expert-capacity-factor c at most c x tokens x top-k (exactly that when padded to
    capacity); dropless: tokens x top-k under balanced routing (an estimate: a skewed router
    sends up to ep times as many to one rank)."""
    m = model_config
    routed = tokens_per_rank * m.moe_router_topk
    if m.moe_expert_capacity_factor is None:
        return None
    factor = m.moe_expert_capacity_factor
    return routed * (factor if m.moe_pad_expert_input_to_capacity else min(factor, 1.0))


def in_flight_microbatches(schedule: str, pp: int, pp_rank: int, num_microbatches: int,
                           num_chunks: int) -> int:
    """Micro-batch forwards (chunk forwards with virtual stages) whose activations one
    pipeline rank holds at its peak under our schedules."""
    from megatron_smp.pipeline_parallel.schedules import interleaved_num_warmup

    if pp == 1:
        return 1
    if schedule == "gpipe":
        return num_microbatches * num_chunks
    if schedule == "interleaved_1f1b":
        total = num_microbatches * num_chunks
        return min(total, interleaved_num_warmup(num_microbatches, pp, pp_rank, num_chunks) + 1)
    return min(pp - pp_rank, num_microbatches)


@dataclass
class RankMemory:
    """One pipeline rank's bytes (every tp/cp/dp/ep position of the stage is the same)."""

    pp_rank: int
    params: int
    grads: int
    optimizer: int
    activations_per_microbatch: float
    in_flight: float
    activations: float
    transient: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.transient


@dataclass
class MemoryReport:
    world_size: int
    layout: str
    ranks: List[RankMemory]
    notes: List[str]

    @property
    def largest(self) -> RankMemory:
        return max(self.ranks, key=lambda r: r.total)

    def table(self) -> str:
        """The per-rank table (GiB, or MiB below 1 GiB), naming the largest rank."""
        largest = self.largest
        unit, scale = ("GiB", GIB) if largest.total >= GIB else ("MiB", MIB)
        lines = [f"memory estimate per rank ({self.layout}, world size {self.world_size}), "
                 f"{unit}:",
                 f"{'pp rank':>7} {'params':>9} {'grads':>9} {'optim':>9} {'act/mb':>9} "
                 f"{'in-flight':>9} {'acts':>9} {'transient':>9} {'total':>9}"]
        for r in self.ranks:
            lines.append(f"{r.pp_rank:>7} {r.params / scale:>9.3f} {r.grads / scale:>9.3f} "
                         f"{r.optimizer / scale:>9.3f} "
                         f"{r.activations_per_microbatch / scale:>9.3f} {r.in_flight:>9g} "
                         f"{r.activations / scale:>9.3f} {r.transient / scale:>9.3f} "
                         f"{r.total / scale:>9.3f}")
        lines.append(f"largest: pipeline rank {largest.pp_rank} (every tp/cp/dp/ep rank of that "
                     f"stage), {largest.total / scale:.3f} {unit}")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def _optimizer_bytes_per_param(configs) -> int:
    optimizer = configs.optimizer
    half = configs.model.params_dtype != torch.float32
    # Muon keeps one momentum per matrix (its few scalar params' Adam moments are neglected),
    # Lion one moment per param.
    state = {"adam": 8, "muon": 4, "lion": 4}.get(optimizer.optimizer,
                                                 4 if optimizer.sgd_momentum else 0)
    return state + (4 if half else 0)  # + fp32 main params of bf16/fp16 models


def _state_bytes(stage, configs, p: int, grad_bytes: int, opt_bytes: float,
                 dp: int) -> Tuple[float, float, float]:
    """(params, grads, optimizer state) bytes of one pipeline stage's rank."""
    parallel = configs.parallel
    cp, ep = parallel.context_parallel_size, parallel.expert_model_parallel_size
    trainable = stage.dense_numel + stage.expert_numel
    if parallel.use_torch_fsdp2:
        params = stage.fsdp_shard_numel * 4  # fp32 shards are the main params
        grads = stage.fsdp_shard_numel * 4
        optimizer = stage.fsdp_shard_numel * (opt_bytes - (4 if p != 4 else 0))
    else:
        params = stage.param_bytes
        grads = trainable * grad_bytes
        optimizer = trainable * opt_bytes
        if configs.optimizer.use_distributed_optimizer:
            expert_dp = max(dp * cp // ep, 1)  # expert grids fold cp in (Megatron's)
            optimizer = (stage.dense_numel * opt_bytes / (dp * cp)
                         + stage.expert_numel * opt_bytes / expert_dp)
    return params, grads, optimizer


def _chunk_activation_bytes(chunk, layer_bytes: List[float], model, layer_input: float,
                            loss_softmax: float, softcap: float) -> Tuple[float, float]:
    """(activations held per microbatch, recompute transient) of one model chunk, given its
    layers' activation bytes (`softcap`: the logit soft-cap's output, 0 without)."""
    acts, recompute_peak = 0.0, 0.0
    if model.recompute_granularity == "full":
        # Held: the checkpointed inputs. The group being recomputed exists only in
        # backward, after the logits and the loss buffers are gone: a transient.
        n = model.recompute_num_layers or 1
        if model.recompute_method == "block":
            acts += layer_input * len(layer_bytes[:n]) + sum(layer_bytes[n:])
            recompute_peak = max(layer_bytes[:n], default=0)
        else:
            groups = [layer_bytes[i:i + n] for i in range(0, len(layer_bytes), n)]
            acts += layer_input * len(groups)
            recompute_peak = max((sum(g) for g in groups), default=0)
    else:
        acts += sum(layer_bytes)
    if chunk["pre"] and model.hidden_dropout > 0:
        acts += layer_input  # the embedding dropout's mask
    if chunk["post"]:
        # final norm input and output layer input; cross entropy's fp32 softmax
        acts += 2 * layer_input + loss_softmax
        if softcap:
            acts += softcap
    return acts, recompute_peak


def estimate_memory(configs, world_size: int, model_provider: Callable,
                    device_type: str = "cuda",
                    stages: Optional[List[StageCount]] = None) -> MemoryReport:
    """The per-rank memory of `configs` at `world_size`; `configs.model.vocab_size` must be
    set (the tokenizer's). `device_type` picks the attention kernels modelled ("cpu": SDPA's
    math path with attention dropout). `stages`: `count_stages` of the same layout, when the
    caller has counted it already (the step-time planner's search)."""
    from megatron_smp.pipeline_parallel.schedules import schedule_name

    parallel, model, training = configs.parallel, configs.model, configs.training
    tp, cp = parallel.tensor_model_parallel_size, parallel.context_parallel_size
    pp, ep = parallel.pipeline_model_parallel_size, parallel.expert_model_parallel_size
    dp = parallel.data_parallel_size_for(world_size)
    if stages is None:
        stages = count_stages(configs, world_size, model_provider)
    notes = []
    p = _act_bytes(model)
    grad_bytes = 4 if configs.optimizer.accumulate_allreduce_grads_in_fp32 else p
    opt_bytes = _optimizer_bytes_per_param(configs)
    num_mb = training.num_microbatches(dp)
    num_chunks = len(stages[0].chunks)
    schedule = schedule_name(training.pipeline_schedule, num_chunks) if pp > 1 else "none"
    modules = None
    if model.recompute_granularity == "selective":
        from megatron_smp.config import recompute_modules as active_modules

        modules = list(active_modules(model))
    tokens = training.seq_length // cp * training.micro_batch_size
    sp = tp if model.sequence_parallel_at(tp) else 1
    capacity = moe_capacity_tokens(model, tokens) if model.num_moe_experts else None
    if model.num_moe_experts and capacity is None:
        notes.append("MoE dropless: routed tokens assume balanced routing (tokens x top-k per "
                     f"rank); a skewed router can send up to {ep}x that to one rank")
    vocab = model.padded_vocab_size(tp)
    ranks = []
    for stage in stages:
        params, grads, optimizer = _state_bytes(stage, configs, p, grad_bytes, opt_bytes, dp)
        per_chunk = []
        recompute_peak = 0.0
        for chunk in stage.chunks:
            layer_bytes = [sum(layer_activation_bytes(
                model, training.seq_length, training.micro_batch_size, tp, cp, moe,
                device_type, modules, capacity, windowed, kind).values())
                for moe, windowed, kind in zip(chunk["moe"], chunk["windows"], chunk["kinds"])]
            softcap = (tokens * vocab / tp * p  # the soft-cap's tanh output
                       if model.final_logit_softcapping is not None else 0.0)
            acts, peak = _chunk_activation_bytes(chunk, layer_bytes, model,
                                                 tokens * model.hidden_size * p / sp,
                                                 tokens * vocab / tp * 4, softcap)
            recompute_peak = max(recompute_peak, peak)
            per_chunk.append(acts)
        in_flight = in_flight_microbatches(schedule, pp, stage.pp_rank, num_mb, num_chunks)
        # Chunks of a rank take turns: the in-flight chunk forwards spread evenly over them.
        mean_chunk = sum(per_chunk) / len(per_chunk)
        activations = mean_chunk * in_flight if num_chunks > 1 else per_chunk[0] * in_flight
        per_microbatch = sum(per_chunk)
        logits = 0.0
        if any(c["post"] for c in stage.chunks):
            logits = tokens * vocab / tp * (p + 4)  # logits, fp32 copy for the loss
        if parallel.use_torch_fsdp2:
            # One gathered unit, and its unsharded grads during its own backward, which
            # starts after the root's (output layer, loss) has freed the logits' buffers.
            unit = stage.largest_unit_numel
            transient = unit * p + max(unit * 4, logits, recompute_peak)
        else:
            transient = stage.largest_unfused_numel * grad_bytes + max(logits, recompute_peak)
        ranks.append(RankMemory(stage.pp_rank, params, grads, int(optimizer), per_microbatch,
                                in_flight, activations, transient))
    layout = f"TP{tp} PP{pp} CP{cp} DP{dp} EP{ep}"
    if num_chunks > 1:
        layout += f" VPP{num_chunks}"
    if parallel.use_torch_fsdp2:
        layout += " FSDP2"
    elif configs.optimizer.use_distributed_optimizer:
        layout += " distributed-optimizer"
    return MemoryReport(world_size, layout, ranks, notes)


def report_from_argv(argv: List[str], world_size: int, model_provider: Callable,
                     args_defaults: Optional[dict] = None,
                     device_type: Optional[str] = None) -> MemoryReport:
    """Parse entry-script flags (with the entry script's defaults), build the tokenizer for
    the vocabulary size, validate at `world_size` and estimate."""
    from megatron_smp.checkpointing.loop import model_vocab_size
    from megatron_smp.data import build_tokenizer
    from megatron_smp.training.arguments import parse_args, validate_configs

    configs = parse_args(argv, None, args_defaults)
    configs.model.vocab_size = model_vocab_size(configs.model.vocab_size,
                                                build_tokenizer(configs.data).vocab_size)
    validate_configs(configs, world_size)
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    return estimate_memory(configs, world_size, model_provider, device_type)


__all__ = [
    "fake_layout", "check_model_provider", "count_stages", "count_stages_composed",
    "layer_activation_bytes",
    "in_flight_microbatches", "moe_capacity_tokens", "estimate_memory", "report_from_argv",
    "MemoryReport", "RankMemory",
]
