"""Step-time planner: predicted step time, tokens/s and MFU of a layout on a cluster, and the
layouts ranked by it (`tools/plan.py`). The memory side is the memory planner's
(`training/memory_planner.py`): both read the same `Configs` (the model is its
`TransformerConfig`, the parameters per pipeline stage its meta-device count).

The cost model, per micro-batch and layer on one rank of the slowest pipeline stage:

    compute     every GEMM (QKV / MLA projections, attention output, MLP or each local
                expert, shared experts, router, output layer) timed by a roofline,
                    t = max(2 M N K / (peak x eta(M, N, K)), bytes / (HBM x eta_mem)) + launch
                with eta = gemm_max x M/(M+d0) x N/(N+d0) x K/(K+d0) (small dimensions run
                below peak); backward = the dgrad and wgrad GEMMs. Attention's core (causal:
                half the scores; windows: the window) at `attention` x peak, backward 2.5 x
                forward (FlashAttention's five GEMMs against two). Norms, residuals,
                activations: `elementwise_passes` passes over the hidden state at HBM speed.
                Under FP8 the linear layers' GEMMs run at the FP8 peak, attention in BF16.
                Unfused (eager PyTorch, `fused_elementwise=False`): `eager_passes` more.
                Hybrid layers (--hybrid-layer-pattern, --linear-attention-freq): each part
                its own (attention, MLP, MoE; Mamba-2 and Gated DeltaNet: their in / out
                projections as GEMMs, the chunked scan's FLOPs, `mixer_scan_flops`, at the
                attention efficiency, backward 2.5 x), norms and TP collectives per part.
    recompute   full: every layer's forward once more; selective: the modules named
                (core_attn, mlp, moe, moe_act, shared_experts, layernorm).
    TP          sequence parallelism: all-gather + reduce-scatter of the hidden state twice
                per layer forward, twice backward, and the column-parallel layers' gather
                again for the weight grad (behind the input grad's GEMM); without it
                all-reduces; the embedding's, the output layer's and the cross entropy's
                collectives on the first / last stage. Exposed whole, or
                `tp_overlap_exposed` of it with Megatron's --tp-comm-overlap.
    CP          p2p ring: (cp - 1) K/V blocks forward; backward the K/V again and their grads
                cp hops home (2 cp - 1 exchanges), hidden behind the block's attention; all_gather / a2a: exposed collectives.
    EP          all-to-all dispatch and combine of top-k x hidden per token (the allgather
                dispatcher: all-gather / reduce-scatter of the tokens over EP), forward and
                backward, x the routing imbalance (the busiest rank sets the pace); the
                expert GEMMs of the busiest rank likewise.
    PP          1F1B: step = m t_max + (sum of the other stages' t) / v (the fill and drain;
                v = virtual stages per rank), + the activations' send/recv per boundary.
    DP          reduce-scatter of the grads (all-reduce without the distributed optimizer)
                over dp x cp (experts over the expert-data-parallel group) and the params'
                all-gather; --overlap-grad-reduce hides it behind the last micro-batch's
                backward, --overlap-param-gather behind the first forward (one bucket stays
                exposed). FSDP2: per micro-batch, gathers and reduce-scatters behind compute.
    optimizer   Adam's step at HBM speed (fp32 params, grads, two moments, the bf16 copy).

A collective over n ranks moves (n-1)/n of its buffer (twice for an all-reduce) at the bus
bandwidth of its group: NVLink while the group's ranks share a node, else the network's
per-GPU bandwidth (ranks ordered tp, cp, ep, dp, pp: Megatron's default). Each costs
(n - 1) latencies.

MFU follows Megatron-LM's `num_floating_point_operations` (training.logging's
`flops_per_iteration`): 3 x 2 x the GEMMs' multiply-adds, attention's core causal (Megatron-LM
since March 2025: s / 2 keys per query; `attention="full"`: every score, its formula until then,
which its README's 2024 H100 table used); recompute is not counted (Narayanan et al. 2021 count
it: `recompute=True` adds one forward of the layers, their 96 B s l h^2 formula). MFU is
against the BF16 dense peak, FP8 runs included.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Optional, Tuple

from megatron_smp.config import ConfigError

TB = 1e12
GB = 1e9


@dataclass(frozen=True)
class GPUSpec:
    """Vendor figures of one accelerator (dense FLOP/s, no sparsity; bytes/s one way)."""

    name: str
    bf16_flops: float
    fp8_flops: Optional[float]
    hbm_bandwidth: float
    hbm_bytes: float
    gpus_per_node: int
    intra_node_bandwidth: float  # NVLink, per GPU, one direction
    inter_node_bandwidth: float  # NIC per GPU, one direction
    intra_node_latency: float = 3e-6
    inter_node_latency: float = 8e-6
    fp32_flops: Optional[float] = None  # non-tensor-core FP32 (TF32 is not assumed)
    # gloo's reduce_scatter all-reduces its input and keeps the rank's shard (measured here:
    # as long as an all_reduce of the same input); NCCL's moves (n - 1) / n of it.
    reduce_scatter_as_all_reduce: bool = False
    # Seconds each call costs beyond bandwidth and latency (measured for gloo on a CPU:
    # tools/bench/calibrate_planner.py's collective_overheads; 0 for the GPU presets).
    all_gather_overhead: float = 0.0
    reduce_scatter_overhead: float = 0.0
    ring_exchange_overhead: float = 0.0


# Vendor specifications (dense tensor-core figures; the sparsity figures are twice these):
# A100 80GB SXM: 312 TFLOP/s BF16, 2,039 GB/s HBM2e, NVLink 3 600 GB/s (both directions),
#   https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/
#   nvidia-a100-datasheet-nvidia-us-2188504-web.pdf ; DGX A100: one 200 Gb/s HDR NIC per GPU.
# H100 SXM: 989 TFLOP/s BF16, 1,979 FP8, 3.35 TB/s HBM3, 80 GB, NVLink 4 900 GB/s,
#   https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet ;
#   DGX H100: one 400 Gb/s NDR NIC per GPU.
# H200 SXM: the H100's compute, 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s,
#   https://www.nvidia.com/en-us/data-center/h200/
# B200 (HGX B200): 2.25 PFLOP/s BF16, 4.5 FP8 dense, 180 GB HBM3e at 7.7 TB/s, NVLink 5
#   1.8 TB/s, https://www.nvidia.com/en-us/data-center/hgx/ ; one 400 Gb/s NIC per GPU.
# GB200 (NVL72, per GPU): 2.5 PFLOP/s BF16, 5 FP8 dense, 186 GB HBM3e at 8 TB/s, NVLink 5
#   1.8 TB/s across all 72 GPUs of the rack, https://www.nvidia.com/en-us/data-center/gb200-nvl72/
#   ; ConnectX-8 800 Gb/s per GPU between racks.
# H100 96GB HBM2e at 500 W (Meta's Grand Teton hosts, torchtitan's published runs): HBM2e at
#   2.4 TB/s, 400 Gb/s RDMA per GPU, the 500 W power limit (the SXM part's is 700 W), peak
#   "between SXM and NVL" (torchtitan benchmarks/llama3_h100_202412_torchtitan.md, which does
#   not know it): taken as the mean of the SXM's 989 and the NVL's 835 TFLOP/s BF16 dense
#   (1,671 with sparsity, https://www.nvidia.com/en-us/data-center/h100/), FP8 likewise.
GPUS: Dict[str, GPUSpec] = {
    "a100-80gb": GPUSpec("A100 80GB SXM", 312 * TB, None, 2039 * GB, 80 * GB, 8,
                         300 * GB, 25 * GB, fp32_flops=19.5 * TB),
    "h100-sxm": GPUSpec("H100 SXM", 989 * TB, 1979 * TB, 3350 * GB, 80 * GB, 8,
                        450 * GB, 50 * GB, fp32_flops=67 * TB),
    "h100-96gb-500w": GPUSpec("H100 96GB HBM2e 500 W", 912 * TB, 1825 * TB, 2400 * GB,
                              96 * GB, 8, 450 * GB, 50 * GB, fp32_flops=60 * TB),
    "h200": GPUSpec("H200 SXM", 989 * TB, 1979 * TB, 4800 * GB, 141 * GB, 8,
                    450 * GB, 50 * GB, fp32_flops=67 * TB),
    "b200": GPUSpec("B200", 2250 * TB, 4500 * TB, 7700 * GB, 180 * GB, 8,
                    900 * GB, 50 * GB, fp32_flops=75 * TB),
    "gb200": GPUSpec("GB200", 2500 * TB, 5000 * TB, 8000 * GB, 186 * GB, 72,
                     900 * GB, 100 * GB, fp32_flops=80 * TB),
}


@dataclass(frozen=True)
class Efficiency:
    """What fraction of the vendor peaks a run reaches. `GPU_EFFICIENCY`: one set for every
    GPU, fitted once (minimising the largest |log(predicted / published)|) to the Megatron-LM
    rows of tests/fixtures/published_runs/published_runs.json; a CPU's is measured
    (tools/bench/calibrate_planner.py)."""

    gemm_max: float = 0.863
    gemm_half_dim: float = 185.0  # d0: a GEMM dimension of d0 runs at half of gemm_max
    attention: float = 0.162  # of the BF16 peak, on the causal half of the scores
    memory: float = 0.654
    network: float = 1.0  # share of the NIC bandwidth large collectives reach across nodes
    nvlink: float = 0.883  # and of NVLink inside a node
    kernel_launch: float = 3.3e-6
    elementwise_passes: float = 17.9  # hidden-sized reads+writes per layer forward
    tp_overlap_exposed: float = 0.02  # with --tp-comm-overlap
    dp_bucket_exposed: float = 0.02  # of an overlapped reduction, the last bucket's share
    step_overhead: float = 0.0019  # seconds per step: data, logging, synchronisation
    layer_overhead: float = 3.0e-5  # seconds per layer forward (host work, small kernels)
    comm_overlap: float = 1.0  # share of an overlappable window that hides communication
    optimizer_bytes_per_param: float = 38.0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


GPU_EFFICIENCY = Efficiency()


@dataclass
class Cluster:
    """The machines a run gets: `num_gpus` of `gpu`, `gpus_per_node` sharing NVLink."""

    gpu: GPUSpec
    num_gpus: int
    gpus_per_node: Optional[int] = None
    intra_node_bandwidth: Optional[float] = None
    inter_node_bandwidth: Optional[float] = None
    intra_node_latency: Optional[float] = None
    inter_node_latency: Optional[float] = None
    efficiency: Efficiency = GPU_EFFICIENCY

    def __post_init__(self) -> None:
        g = self.gpu
        self.gpus_per_node = self.gpus_per_node or g.gpus_per_node
        self.intra_node_bandwidth = self.intra_node_bandwidth or g.intra_node_bandwidth
        self.inter_node_bandwidth = self.inter_node_bandwidth or g.inter_node_bandwidth
        if self.intra_node_latency is None:
            self.intra_node_latency = g.intra_node_latency
        if self.inter_node_latency is None:
            self.inter_node_latency = g.inter_node_latency

    def link(self, stride: int, size: int) -> Tuple[float, float]:
        """(bandwidth, latency) of a group of `size` ranks `stride` apart."""
        if size <= 1:
            return math.inf, 0.0
        if stride * size <= self.gpus_per_node:
            return self.intra_node_bandwidth, self.intra_node_latency
        # A ring over nodes crosses each node once per channel; with `local` members per node
        # NCCL runs one channel per member's NIC, the hops inside the node on NVLink.
        local = max(1, min(size, self.gpus_per_node // stride))
        return (min(self.intra_node_bandwidth, self.inter_node_bandwidth * local),
                self.inter_node_latency)


@dataclass
class PlanOptions:
    """What the flags of the entry scripts do not say: precision of the GEMMs (None: the
    model's params dtype; "fp8": Transformer Engine FP8 linear layers), Megatron's
    --tp-comm-overlap, the MoE routing imbalance (busiest rank's tokens / the mean), the FLOP
    convention of the reported MFU, and the memory a GPU may fill (fraction of HBM)."""

    precision: Optional[str] = None
    tp_comm_overlap: bool = False
    moe_imbalance: float = 1.0
    attention_flops: str = "causal"  # "causal" | "full"
    count_recompute_flops: bool = False
    # Selective recompute that torchtitan's per-op policy does (half the matmuls): the share
    # of the linear layers' forward GEMM time recomputed. None: from the model's flags.
    recompute_gemm_fraction: Optional[float] = None
    # ... and that policy recomputes every non-matmul op too (norms, RoPE, the activation).
    recompute_elementwise: bool = False
    # False: the layer's norms, RoPE, GQA's key/value expansion and the gated activation run as
    # separate PyTorch ops, as torchtitan's Llama without torch.compile (`eager_passes`).
    fused_elementwise: bool = True
    memory_fraction: float = 0.95


# ------------------------------------------------------------------ the model's arithmetic


@dataclass
class Gemm:
    name: str
    m: float
    n: float
    k: float
    count: int = 1  # same-shape GEMMs (local experts)
    linear: bool = True  # a linear layer (FP8-able), not attention's core

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k * self.count


def _precision(configs, options: PlanOptions) -> str:
    if options.precision:
        return options.precision
    model = configs.model
    return "bf16" if model.bf16 else "fp16" if model.fp16 else "fp32"


def _dtype_bytes(precision: str) -> int:
    return {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 2}[precision]


def attention_gemms(model, tokens: float, tp: int) -> List[Gemm]:
    """One layer's attention projections on one TP rank, `tokens` rows (gathered over SP)."""
    h, a = model.hidden_size, model.num_attention_heads
    if model.multi_latent_attention:
        rope, qk, v = model.qk_pos_emb_head_dim, model.qk_head_dim, model.v_head_dim
        out = []
        if model.q_lora_rank:
            out += [Gemm("q_down", tokens, model.q_lora_rank, h),
                    Gemm("q_up", tokens, a * (qk + rope) / tp, model.q_lora_rank)]
        else:
            out.append(Gemm("q", tokens, a * (qk + rope) / tp, h))
        out += [Gemm("kv_down", tokens, model.kv_lora_rank + rope, h),
                Gemm("kv_up", tokens, a * (qk + v) / tp, model.kv_lora_rank),
                Gemm("attn_out", tokens, h, a * v / tp)]
        return out
    g, d = model.num_query_groups, model.kv_channels
    qkv = (a + 2 * g) * d + (a * d if model.attention_output_gate else 0)
    return [Gemm("qkv", tokens, qkv / tp, h), Gemm("attn_out", tokens, h, a * d / tp)]


def mlp_gemms(model, tokens: float, tp: int, moe: bool, ep: int,
              imbalance: float) -> List[Gemm]:
    """One layer's MLP (dense, or the busiest rank's local experts + shared experts)."""
    h = model.hidden_size
    gated = 2 if model.gated_linear_unit else 1
    if not moe:
        f = model.ffn_hidden_size
        return [Gemm("fc1", tokens, gated * f / tp, h), Gemm("fc2", tokens, h, f / tp)]
    experts, topk = model.num_moe_experts, model.moe_router_topk
    f = model.moe_ffn_hidden_size or model.ffn_hidden_size
    local = experts // ep
    # Each rank's experts receive, balanced, its own tokens x top-k (EP exchanges them).
    per_expert = tokens * topk * imbalance / local
    out = [Gemm("router", tokens, experts, h),
           Gemm("expert_fc1", per_expert, gated * f / tp, h, count=local),
           Gemm("expert_fc2", per_expert, h, f / tp, count=local)]
    shared = model.moe_shared_expert_intermediate_size
    if shared:
        out += [Gemm("shared_fc1", tokens, gated * shared / tp, h),
                Gemm("shared_fc2", tokens, h, shared / tp)]
    return out


def mixer_gemms(model, kind: str, tokens: float, tp: int) -> List[Gemm]:
    """One Mamba-2 ("M") or Gated DeltaNet ("G") mixer's projections on one TP rank (the
    heads split over TP, as transformer/ssm's layers split them)."""
    h = model.hidden_size
    if kind == "M":
        inner = model.mamba_heads() * model.mamba_head_dim
        groups_state = 2 * model.mamba_num_groups * model.mamba_state_dim
        return [Gemm("in_proj", tokens, (2 * inner + groups_state + model.mamba_heads()) / tp,
                     h),
                Gemm("out_proj", tokens, h, inner / tp)]
    qk = model.linear_key_head_dim * model.linear_num_key_heads
    v = model.linear_value_head_dim * model.linear_num_value_heads
    return [Gemm("in_proj", tokens, (2 * qk + 2 * v + 2 * model.linear_num_value_heads) / tp,
                 h),
            Gemm("out_proj", tokens, h, v / tp)]


def mixer_scan_flops(model, kind: str, tokens: float, seq_length: int, tp: int) -> float:
    """Forward FLOPs of a mixer's chunked scan on one rank (chunks of L tokens). Mamba-2's
    SSD per token: the chunk states B^T x and their read-out C h (2 x 2 d_inner n), inside
    the chunk C B^T (causal, L / 2 x 2 g n) and its product with x (L / 2 x 2 d_inner).
    Gated DeltaNet per token and value head: the state's update and read-out (2 x 2 d_k d_v),
    inside the chunk the causal products over d_k and d_v and the WY transform's
    (L / 2 x 2 (2 d_k + d_v))."""
    if kind == "M":
        inner = model.mamba_heads() * model.mamba_head_dim
        chunk = min(model.mamba_chunk_size, seq_length)
        gn = model.mamba_num_groups * model.mamba_state_dim
        per_token = 4 * inner * model.mamba_state_dim + chunk * (gn + inner)
    else:
        dk, dv = model.linear_key_head_dim, model.linear_value_head_dim
        chunk = min(model.linear_chunk_size, seq_length)
        per_token = model.linear_num_value_heads * (4 * dk * dv + chunk * (2 * dk + dv))
    return per_token * tokens / tp


def mixer_width(model, kind: str) -> float:
    """Channels a mixer's elementwise work runs over (its conv, activation and gate)."""
    if kind == "M":
        return (model.mamba_heads() * model.mamba_head_dim
                + 2 * model.mamba_num_groups * model.mamba_state_dim)
    return (2 * model.linear_key_head_dim * model.linear_num_key_heads
            + model.linear_value_head_dim * model.linear_num_value_heads)


def eager_passes(model, tp: int = 1, sp: int = 1) -> float:
    """Hidden-sized reads + writes one layer's forward adds when its elementwise ops are
    separate PyTorch kernels instead of fused ones (the fused count is `elementwise_passes`),
    counted on torchtitan's Llama (models/llama/model.py, models/norms.py at 2024-12):
    RMSNorm in fp32 (x.float(), pow, mean, x * rsqrt, type_as, * weight: 18 passes against a
    fused norm's 2, twice per layer); RoPE through fp32 complex numbers on q and k (10 passes of
    their width against 2); GQA's repeat_kv copying k and v to every head; the attention
    output's transpose copy; SiLU and the product as two kernels (5 passes of the FFN width
    against 3)."""
    h = model.hidden_size
    a, g, d = model.num_attention_heads, model.num_query_groups, model.kv_channels
    q, kv = a * d / tp, g * d / max(1, min(tp, g))
    passes = 2 * 16.0 / sp
    if model.uses_rotary_embedding():
        passes += 8.0 * (q + kv) / h
    if g < a:
        passes += 2.0 * (q + kv) / h
    passes += 2.0 * q / h
    if model.gated_linear_unit:
        passes += 2.0 * model.ffn_hidden_size / tp / h
    return passes


def output_gemm(model, tokens: float, tp: int) -> Gemm:
    return Gemm("output", tokens, model.padded_vocab_size(tp) / tp, model.hidden_size)


def attention_core_flops(model, seq_length: int, micro_batch_size: int, tp: int, cp: int,
                         windowed: bool) -> float:
    """Forward FLOPs of QK^T and PV on one rank: causal (half the scores), or the window."""
    a = model.num_attention_heads / tp
    if model.multi_latent_attention:
        dims = model.qk_head_dim + model.qk_pos_emb_head_dim + model.v_head_dim
    else:
        dims = 2 * model.kv_channels
    queries = micro_batch_size * seq_length / cp
    keys = seq_length / 2
    if windowed and model.window_size is not None:
        keys = min(keys, model.window_size[0] + 1)
    return 2.0 * queries * keys * a * dims


def model_flops(model, seq_length: int, global_batch_size: int, attention: str = "causal",
                recompute: bool = False) -> float:
    """Model FLOPs of one iteration: `training.logging.flops_per_iteration` (Megatron-LM's
    formula, attention causal); `attention="full"` counts every score (Megatron-LM's formula
    before March 2025: s per query instead of s / 2), `recompute=True` one more forward of
    the layers (Narayanan et al. 2021's 96 B s l h^2 (1 + s / 6h + V / 16 l h))."""
    from megatron_smp.training.logging import flops_per_iteration

    if attention not in ("causal", "full"):
        raise ConfigError(f"attention FLOP convention {attention!r}: use causal or full")
    vocab = model.padded_vocab_size(1)
    flops = flops_per_iteration(model, seq_length, global_batch_size, vocab)
    tokens = seq_length * global_batch_size
    if attention == "full" and model.hybrid_layer_pattern is None:
        if model.multi_latent_attention:
            per_layer = model.num_attention_heads * (
                model.qk_head_dim + model.qk_pos_emb_head_dim + model.v_head_dim) / 2
        else:
            per_layer = model.num_attention_heads * model.kv_channels
        layers = model.num_layers + (model.mtp_num_layers or 0)
        flops += 6.0 * per_layer * seq_length * layers * tokens
    if recompute:
        logits = 6.0 * model.hidden_size * vocab * (1 + (model.mtp_num_layers or 0)) * tokens
        flops += (flops - logits) / 3
    return flops


# ------------------------------------------------------------------------- the layout


@dataclass
class Layout:
    """One parallel layout of a run (what the flags say), on `num_gpus`."""

    tp: int
    pp: int
    cp: int
    ep: int
    dp: int
    vpp: int
    micro_batch_size: int
    global_batch_size: int
    seq_length: int
    sequence_parallel: bool
    recompute: Optional[str]  # None | "full" | "selective"
    recompute_modules: Tuple[str, ...]
    sharding: str  # "ddp" | "distributed-optimizer" | "fsdp2"
    overlap_grad_reduce: bool
    overlap_param_gather: bool
    # Uneven pipeline split (Megatron's --decoder-first/last-pipeline-num-layers); None: even.
    first_stage_layers: Optional[int] = None
    last_stage_layers: Optional[int] = None

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.dp)

    def name(self) -> str:
        pp = f"PP{self.pp}"
        if self.first_stage_layers is not None or self.last_stage_layers is not None:
            pp += f"({self.first_stage_layers or '-'}..{self.last_stage_layers or '-'})"
        parts = [f"TP{self.tp}", pp]
        if self.vpp > 1:
            parts.append(f"VPP{self.vpp}")
        parts += [f"CP{self.cp}", f"EP{self.ep}", f"DP{self.dp}", f"mb{self.micro_batch_size}"]
        if self.recompute == "full":
            parts.append("recompute-full")
        elif self.recompute == "selective":
            parts.append("recompute-" + "+".join(self.recompute_modules))
        parts.append({"ddp": "ddp", "distributed-optimizer": "distopt",
                      "fsdp2": "fsdp2"}[self.sharding])
        return " ".join(parts)

    def flags(self) -> List[str]:
        """The entry-script flags that select this layout."""
        out = ["--tensor-model-parallel-size", str(self.tp),
               "--pipeline-model-parallel-size", str(self.pp),
               "--context-parallel-size", str(self.cp),
               "--expert-model-parallel-size", str(self.ep),
               "--micro-batch-size", str(self.micro_batch_size),
               "--global-batch-size", str(self.global_batch_size)]
        if self.vpp > 1:
            out += ["--virtual-pipeline-model-parallel-size", str(self.vpp)]
        if self.first_stage_layers is not None:
            out += ["--decoder-first-pipeline-num-layers", str(self.first_stage_layers)]
        if self.last_stage_layers is not None:
            out += ["--decoder-last-pipeline-num-layers", str(self.last_stage_layers)]
        if self.sequence_parallel and self.tp > 1:
            out.append("--sequence-parallel")
        if self.recompute == "full":
            out += ["--recompute-granularity", "full", "--recompute-method", "uniform",
                    "--recompute-num-layers", "1"]
        elif self.recompute == "selective":
            out += ["--recompute-granularity", "selective", "--recompute-modules",
                    *self.recompute_modules]
        if self.sharding == "fsdp2":
            out.append("--use-torch-fsdp2")
        elif self.sharding == "distributed-optimizer":
            out.append("--use-distributed-optimizer")
            if self.overlap_param_gather:
                out.append("--overlap-param-gather")
        if self.overlap_grad_reduce and self.sharding != "fsdp2":
            out.append("--overlap-grad-reduce")
        return out

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["recompute_modules"] = list(self.recompute_modules)
        out["name"] = self.name()
        out["flags"] = self.flags()
        return out


def layout_of(configs, num_gpus: int) -> Layout:
    """The layout the flags in `configs` describe on `num_gpus`."""
    from megatron_smp.config import recompute_modules

    p, model, training = configs.parallel, configs.model, configs.training
    tp, cp, pp = (p.tensor_model_parallel_size, p.context_parallel_size,
                  p.pipeline_model_parallel_size)
    dp = p.data_parallel_size_for(num_gpus)
    vpp = p.virtual_pipeline_model_parallel_size or 1
    if p.num_layers_per_virtual_pipeline_stage:
        vpp = model.num_layers // (pp * p.num_layers_per_virtual_pipeline_stage)
    sharding = ("fsdp2" if p.use_torch_fsdp2 else "distributed-optimizer"
                if configs.optimizer.use_distributed_optimizer else "ddp")
    modules = (tuple(recompute_modules(model))
               if model.recompute_granularity == "selective" else ())
    return Layout(tp=tp, pp=pp, cp=cp, ep=p.expert_model_parallel_size, dp=dp, vpp=vpp,
                  micro_batch_size=training.micro_batch_size,
                  global_batch_size=(training.global_batch_size
                                     or training.micro_batch_size * dp),
                  seq_length=training.seq_length,
                  sequence_parallel=model.sequence_parallel_at(tp),
                  recompute=model.recompute_granularity, recompute_modules=modules,
                  sharding=sharding,
                  overlap_grad_reduce=configs.optimizer.overlap_grad_reduce,
                  overlap_param_gather=configs.optimizer.overlap_param_gather,
                  first_stage_layers=p.decoder_first_pipeline_num_layers,
                  last_stage_layers=p.decoder_last_pipeline_num_layers)


def configs_for(configs, layout: Layout):
    """A copy of `configs` set to `layout` (the model's shape untouched)."""
    out = copy.copy(configs)
    out.parallel = dataclasses.replace(
        configs.parallel, tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp, context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep, data_parallel_size=None,
        virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp > 1 else None,
        num_layers_per_virtual_pipeline_stage=None,
        decoder_first_pipeline_num_layers=layout.first_stage_layers,
        decoder_last_pipeline_num_layers=layout.last_stage_layers,
        use_torch_fsdp2=layout.sharding == "fsdp2")
    recompute = layout.recompute
    out.model = configs.model.replace(
        sequence_parallel=layout.sequence_parallel and layout.tp > 1,
        recompute_granularity=recompute,
        recompute_method=("uniform" if recompute == "full" else None),
        recompute_num_layers=(1 if recompute == "full" else None),
        recompute_modules=list(layout.recompute_modules) if recompute == "selective" else None)
    out.optimizer = dataclasses.replace(
        configs.optimizer, use_distributed_optimizer=layout.sharding == "distributed-optimizer",
        overlap_grad_reduce=layout.overlap_grad_reduce and layout.sharding != "fsdp2",
        overlap_param_gather=(layout.overlap_param_gather
                              and layout.sharding == "distributed-optimizer"))
    out.training = dataclasses.replace(configs.training,
                                       micro_batch_size=layout.micro_batch_size,
                                       global_batch_size=layout.global_batch_size)
    return out


# ------------------------------------------------------------------------ timing


class _Timer:
    """Roofline times on one cluster at one precision."""

    def __init__(self, cluster: Cluster, precision: str):
        self.cluster, self.eff = cluster, cluster.efficiency
        gpu = cluster.gpu
        self.bytes = _dtype_bytes(precision)
        half = gpu.bf16_flops
        if precision == "fp32":
            half = gpu.fp32_flops or gpu.bf16_flops
        self.attention_peak = half
        if precision == "fp8":
            if not gpu.fp8_flops:
                raise ConfigError(f"--fp8-format: the {gpu.name} has no FP8 tensor cores; "
                                  "use --bf16, or a Hopper / Blackwell --gpu")
            self.linear_peak = gpu.fp8_flops
        else:
            self.linear_peak = half

    def _eta(self, m: float, n: float, k: float) -> float:
        d0 = self.eff.gemm_half_dim
        return self.eff.gemm_max * (m / (m + d0)) * (n / (n + d0)) * (k / (k + d0))

    def gemm(self, m: float, n: float, k: float, peak: float) -> float:
        if m <= 0 or n <= 0 or k <= 0:
            return 0.0
        flops = 2.0 * m * n * k
        moved = (m * k + k * n + m * n) * self.bytes
        return (max(flops / (peak * self._eta(m, n, k)),
                    moved / (self.cluster.gpu.hbm_bandwidth * self.eff.memory))
                + self.eff.kernel_launch)

    def gemm_fwd_bwd(self, g: Gemm) -> Tuple[float, float]:
        peak = self.linear_peak if g.linear else self.attention_peak
        fwd = self.gemm(g.m, g.n, g.k, peak)
        bwd = self.gemm(g.m, g.k, g.n, peak) + self.gemm(g.k, g.n, g.m, peak)
        return fwd * g.count, bwd * g.count

    def memory(self, nbytes: float) -> float:
        return nbytes / (self.cluster.gpu.hbm_bandwidth * self.eff.memory)

    def collective(self, kind: str, nbytes: float, size: int, stride: int,
                   plain: bool = False) -> float:
        """One collective of `nbytes` (the full buffer: gathered output / reduced input) over
        `size` ranks `stride` apart (`plain`: without the device's per-call overhead)."""
        if size <= 1 or nbytes <= 0:
            return 0.0
        bandwidth, latency = self.cluster.link(stride, size)
        inside = stride * size <= self.cluster.gpus_per_node
        bandwidth *= self.eff.nvlink if inside else self.eff.network
        share = (size - 1) / size
        gpu = self.cluster.gpu
        extra = {"all_gather": gpu.all_gather_overhead,
                 "reduce_scatter": gpu.reduce_scatter_overhead,
                 "ring": gpu.ring_exchange_overhead}.get(kind, 0.0)
        if extra and not plain:
            return self.collective(kind, nbytes, size, stride, plain=True) + extra
        if kind == "ring":  # context parallelism's exchange with its ring neighbours
            kind = "p2p"
        if kind == "reduce_scatter" and gpu.reduce_scatter_as_all_reduce:
            kind = "all_reduce"
        if kind == "all_reduce":
            return 2 * share * nbytes / bandwidth + 2 * (size - 1) * latency
        if kind == "all_to_all":
            return share * nbytes / bandwidth + (size - 1) * latency
        if kind == "p2p":
            return nbytes / bandwidth + latency
        return share * nbytes / bandwidth + (size - 1) * latency  # all_gather, reduce_scatter


@dataclass
class StageTime:
    """One micro-batch (all chunks of one pipeline rank), seconds."""

    forward: float = 0.0
    backward: float = 0.0
    recompute: float = 0.0
    tp: float = 0.0
    cp: float = 0.0
    ep: float = 0.0
    p2p: float = 0.0

    @property
    def total(self) -> float:
        return (self.forward + self.backward + self.recompute + self.tp + self.cp + self.ep
                + self.p2p)


@dataclass
class StepPrediction:
    layout: Layout
    num_gpus: int
    step_time: float
    breakdown: Dict[str, float]
    tokens_per_second_per_gpu: float
    model_tflops_per_gpu: float
    mfu: float
    precision: str
    memory_gib: Optional[float] = None
    memory_limit_gib: Optional[float] = None
    fits: Optional[bool] = None
    notes: List[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"layout": self.layout.to_dict(), "num_gpus": self.num_gpus,
                "step_time_s": self.step_time, "breakdown_s": self.breakdown,
                "tokens_per_s_per_gpu": self.tokens_per_second_per_gpu,
                "model_tflops_per_gpu": self.model_tflops_per_gpu, "mfu": self.mfu,
                "precision": self.precision, "memory_gib": self.memory_gib,
                "memory_limit_gib": self.memory_limit_gib, "fits": self.fits,
                "notes": self.notes}


BREAKDOWN = ("compute", "recompute", "tp", "cp", "ep", "pp_bubble", "pp_p2p", "dp",
             "optimizer", "overhead")


def _stage_layers(configs, layout: Layout) -> List[List[Tuple[int, int]]]:
    from megatron_smp.pipeline_parallel.stages import layout_from_configs

    if layout.pp == 1:
        return [[(0, configs.model.num_layers)]]
    return layout_from_configs(configs_for(configs, layout), layout.pp)


def _layer_parts(model, kind: Optional[str]) -> Tuple[bool, Optional[str], bool]:
    """(attention, mixer "M" / "G" or None, MLP) of a layer: a GPT layer has attention (or a
    --linear-attention-freq Gated DeltaNet) and an MLP; a --hybrid-layer-pattern layer its
    one part ("*" attention, "-" MLP, "E" MoE, "M" Mamba-2, "G" Gated DeltaNet)."""
    if model.hybrid_layer_pattern is None:
        return kind is None, kind, True
    return kind == "*", kind if kind in ("M", "G") else None, kind in ("-", "E")


def _layer_time(configs, layout: Layout, timer: _Timer, cluster: Cluster, moe: bool,
                windowed: bool, options: PlanOptions, kind: Optional[str] = None) -> StageTime:
    """One transformer layer, one micro-batch, on one rank (`kind`: `_layer_parts`)."""
    m, eff = configs.model, cluster.efficiency
    attention, mixer, has_mlp = _layer_parts(m, kind)
    parts = int(attention) + int(mixer is not None) + int(has_mlp)
    tp, cp, ep = layout.tp, layout.cp, layout.ep
    tokens = layout.micro_batch_size * layout.seq_length / cp  # gathered over SP
    sp = tp if layout.sequence_parallel else 1
    modules = set(layout.recompute_modules) if layout.recompute == "selective" else set()
    t = StageTime()

    def add(gemms: List[Gemm], recomputed: bool) -> float:
        fwd_total = 0.0
        for g in gemms:
            fwd, bwd = timer.gemm_fwd_bwd(g)
            t.forward += fwd
            t.backward += bwd
            fwd_total += fwd
            if recomputed:
                t.recompute += fwd
        return fwd_total

    full = layout.recompute == "full"
    attn_fwd = add(attention_gemms(m, tokens, tp), full) if attention else 0.0
    if mixer is not None:
        attn_fwd += add(mixer_gemms(m, mixer, tokens, tp), full)
        scan = mixer_scan_flops(m, mixer, tokens, layout.seq_length, tp) / (
            timer.attention_peak * eff.attention)
        t.forward += scan
        t.backward += 2.5 * scan
        if full:
            t.recompute += scan
    imbalance = options.moe_imbalance if moe else 1.0
    mlp = mlp_gemms(m, tokens, tp, moe, ep, imbalance) if has_mlp else []
    if moe:
        experts = [g for g in mlp if g.name.startswith("expert")]
        shared = [g for g in mlp if g.name.startswith("shared") or g.name == "router"]
        add(experts, full or "moe" in modules)
        add(shared, full or "moe" in modules or "shared_experts" in modules)
    else:
        mlp_fwd = add(mlp, full or "mlp" in modules)
        attn_fwd += mlp_fwd
    if options.recompute_gemm_fraction:
        t.recompute += options.recompute_gemm_fraction * attn_fwd
    core = attention_core_flops(m, layout.seq_length, layout.micro_batch_size, tp, cp,
                                windowed) if attention else 0.0
    core_fwd = core / (timer.attention_peak * eff.attention)
    t.forward += core_fwd
    t.backward += 2.5 * core_fwd
    if full or "core_attn" in modules:
        t.recompute += core_fwd
    # Norms, residuals, dropout, RoPE, the activation: memory-bound passes.
    hidden = tokens * m.hidden_size * timer.bytes
    ffn = (m.moe_ffn_hidden_size or m.ffn_hidden_size) if moe else m.ffn_hidden_size
    routed = m.moe_router_topk * imbalance if moe else 1
    passes = eff.elementwise_passes / sp * parts / 2  # the fitted count is two parts'
    if not options.fused_elementwise:
        passes += eager_passes(m, tp, sp)
    if not has_mlp:
        ffn = 0
    width = mixer_width(m, mixer) if mixer is not None else 0
    elementwise = timer.memory(passes * hidden
                               + 3 * tokens * routed * (ffn or 0) / tp * timer.bytes
                               + 6 * tokens * width / tp * timer.bytes)
    t.forward += elementwise + eff.layer_overhead
    t.backward += 2 * (elementwise + eff.layer_overhead)
    if full or options.recompute_elementwise:
        t.recompute += elementwise + eff.layer_overhead

    # Tensor parallelism: two gathers and two scatters (or two all-reduces) each way; with
    # sequence parallelism the column-parallel layers (QKV, fc1) gather their input again in
    # backward for the weight grad, behind the input grad's GEMM.
    if tp > 1:
        if layout.sequence_parallel:
            gather = timer.collective("all_gather", hidden, tp, 1)
            one = gather + timer.collective("reduce_scatter", hidden, tp, 1)
            columns = ((attention_gemms(m, tokens, tp)[:1] if attention else [])
                       + (mixer_gemms(m, mixer, tokens, tp)[:1] if mixer else [])
                       + (mlp_gemms(m, tokens, tp, False, 1, 1.0)[:1] if has_mlp else []))
            regather = sum(max(0.0, gather - eff.comm_overlap
                               * timer.gemm(g.m, g.k, g.n, timer.linear_peak))
                           for g in columns)
        else:
            one, regather = timer.collective("all_reduce", hidden, tp, 1), 0.0
        comm = parts * one * (2 + (1 if full else 0)) + regather
        t.tp += comm * (eff.tp_overlap_exposed if options.tp_comm_overlap else 1.0)

    # Context parallelism.
    if cp > 1 and attention:
        if m.multi_latent_attention:
            kv_width = m.num_attention_heads * (m.qk_head_dim + m.qk_pos_emb_head_dim
                                                 + m.v_head_dim) / tp
        else:
            kv_width = 2 * m.num_query_groups * m.kv_channels / max(
                1, min(tp, m.num_query_groups))
        kv = tokens * kv_width * timer.bytes
        if m.cp_comm_type == "p2p":
            # Forward: K/V visit the cp - 1 other ranks; backward: K/V again, and their
            # grads travel cp hops back to their owner (context_parallel.attention).
            step = timer.collective("ring", kv, cp, tp)
            fwd, bwd = (cp - 1) * step, (2 * cp - 1) * step
            hide = eff.comm_overlap * core_fwd
            t.cp += max(0.0, fwd - hide) + max(0.0, bwd - 2.5 * hide)
        else:  # all_gather (a2a: four exchanges of the same size)
            fwd = timer.collective("all_gather", kv * cp, cp, tp)
            t.cp += fwd + timer.collective("reduce_scatter", kv * cp, cp, tp)
        if full or "core_attn" in modules:
            t.cp += max(0.0, (cp - 1) * timer.collective("ring", kv, cp, tp)
                        - eff.comm_overlap * core_fwd)

    # Expert parallelism: dispatch and combine, each way.
    if moe and ep > 1:
        routed_bytes = tokens * m.moe_router_topk * m.hidden_size * timer.bytes * imbalance
        if m.moe_token_dispatcher_type == "alltoall":
            one = 2 * timer.collective("all_to_all", routed_bytes, ep, tp * cp)
        else:
            gathered = tokens * m.hidden_size * timer.bytes * ep
            one = (timer.collective("all_gather", gathered, ep, tp * cp)
                   + timer.collective("reduce_scatter", gathered, ep, tp * cp))
        t.ep += one * (2 + (1 if full or "moe" in modules else 0))
    return t


def _stage_time(configs, layout: Layout, timer: _Timer, cluster: Cluster,
                chunks: List[Tuple[int, int]], first: bool, last: bool,
                options: PlanOptions, cache: dict) -> StageTime:
    m = configs.model
    from megatron_smp.training.memory_planner import _layer_kinds, _mixer_kinds

    moe_pattern = _layer_kinds(m, 0, m.num_layers)
    kinds = _mixer_kinds(m, 0, m.num_layers)
    windows = m.window_layer_pattern()
    total = StageTime()
    for offset, count in chunks:
        for index in range(offset, offset + count):
            key = (bool(moe_pattern[index]), bool(windows[index]), kinds[index])
            if key not in cache:
                cache[key] = _layer_time(configs, layout, timer, cluster, key[0], key[1],
                                         options, key[2])
            layer = cache[key]
            for name in ("forward", "backward", "recompute", "tp", "cp", "ep"):
                setattr(total, name, getattr(total, name) + getattr(layer, name))
    tokens = layout.micro_batch_size * layout.seq_length / layout.cp
    if last:
        fwd, bwd = timer.gemm_fwd_bwd(output_gemm(m, tokens, layout.tp))
        # Cross entropy over the fp32 logits: a few passes.
        loss = timer.memory(4 * tokens * m.padded_vocab_size(layout.tp) / layout.tp * 4)
        total.forward += fwd + loss
        total.backward += bwd + loss
        if m.mtp_num_layers:
            mtp = cache.get((bool(moe_pattern[-1]), False, None))
            if mtp is not None:
                total.forward += m.mtp_num_layers * (mtp.forward + fwd)
                total.backward += m.mtp_num_layers * (mtp.backward + bwd)
    if first:
        hidden = tokens * m.hidden_size * timer.bytes
        total.forward += timer.memory(2 * hidden)
        total.backward += timer.memory(2 * hidden)
    if layout.tp > 1 and (first or last):
        # The vocabulary-parallel embedding's reduction (a reduce-scatter into the sequence
        # shards, or an all-reduce) and its backward gather; the output layer's gather, its
        # grad's reduce-scatter and the weight grad's gather; the cross entropy's three
        # all-reduces of one fp32 figure per token (max, target logit, sum of exponents).
        hidden = tokens * m.hidden_size * timer.bytes
        tp = layout.tp
        if layout.sequence_parallel:
            pair = (timer.collective("all_gather", hidden, tp, 1)
                    + timer.collective("reduce_scatter", hidden, tp, 1))
            embedding, output = pair, pair + timer.collective("all_gather", hidden, tp, 1)
        else:
            embedding, output = timer.collective("all_reduce", hidden, tp, 1), 0.0
        comm = (embedding if first else 0.0) + (
            output + 3 * timer.collective("all_reduce", tokens * 4, tp, 1) if last else 0.0)
        total.tp += comm * (cluster.efficiency.tp_overlap_exposed if options.tp_comm_overlap else 1.0)
    if layout.pp > 1:
        sp = layout.tp if layout.sequence_parallel else 1
        activation = tokens * m.hidden_size * timer.bytes / sp
        stride = layout.tp * layout.cp * layout.dp
        # Each chunk receives its input and sends its grad (and the reverse).
        total.p2p = 2 * len(chunks) * timer.collective("p2p", activation, layout.pp, stride)
    return total


def _param_counts(configs, layout: Layout, num_gpus: Optional[int], model_provider,
                  cache) -> list:
    """The memory planner's per-stage parameter count (composed from one-layer meta builds,
    `count_stages_composed`, whose pieces `cache` keeps), cached per layout shape.
    `num_gpus` None: the smallest world of the same TP / PP / EP (CP 1, DP = EP), whose
    per-rank dense and expert counts are the same (what the timing reads; FSDP2's shard
    sizes need the real world)."""
    from megatron_smp.training.memory_planner import count_stages_composed

    if num_gpus is None:
        # Parameters do not depend on CP either: counted at CP 1.
        layout = dataclasses.replace(layout, dp=layout.ep, cp=1, micro_batch_size=1,
                                     global_batch_size=layout.ep * layout.pp,
                                     sharding="ddp" if layout.sharding == "fsdp2"
                                     else layout.sharding)
        world = layout.tp * layout.pp * layout.cp * layout.dp
    else:
        world = num_gpus
    key = (layout.tp, layout.pp, layout.vpp, layout.cp, layout.ep, layout.sharding, world,
           layout.first_stage_layers, layout.last_stage_layers)
    if cache is not None and key in cache:
        return cache[key]
    pieces = cache.setdefault("pieces", {}) if cache is not None else None
    stages = count_stages_composed(configs_for(configs, layout), world, model_provider, pieces)
    if cache is not None:
        cache[key] = stages
    return stages


def predict(configs, cluster: Cluster, model_provider: Callable,
            options: Optional[PlanOptions] = None, memory: bool = True,
            cache: Optional[dict] = None) -> StepPrediction:
    """The predicted step of `configs` (its layout) on `cluster`, with the memory planner's
    peak per GPU when `memory`. `configs.model.vocab_size` must be set."""
    options = options or PlanOptions()
    model = configs.model
    layout = layout_of(configs, cluster.num_gpus)
    precision = _precision(configs, options)
    timer = _Timer(cluster, precision)
    eff = cluster.efficiency
    stages_layers = _stage_layers(configs, layout)
    layer_cache: dict = {}
    times = [_stage_time(configs, layout, timer, cluster, chunks, rank == 0,
                         rank == layout.pp - 1, options, layer_cache)
             for rank, chunks in enumerate(stages_layers)]
    mb = layout.num_microbatches
    slowest = max(times, key=lambda s: s.total)
    others = sum(s.total for s in times) - slowest.total
    bubble = others / layout.vpp
    breakdown = {name: 0.0 for name in BREAKDOWN}
    breakdown["compute"] = mb * (slowest.forward + slowest.backward)
    breakdown["recompute"] = mb * slowest.recompute
    breakdown["tp"], breakdown["cp"] = mb * slowest.tp, mb * slowest.cp
    breakdown["ep"], breakdown["pp_p2p"] = mb * slowest.ep, mb * slowest.p2p
    breakdown["pp_bubble"] = bubble

    # Data parallelism and the optimizer, from the memory planner's parameter count.
    stages = _param_counts(configs, layout, None, model_provider, cache)
    grad_bytes = 4 if (configs.optimizer.accumulate_allreduce_grads_in_fp32
                       and precision != "fp32") else timer.bytes
    dp_cp = layout.dp * layout.cp
    expert_dp = max(1, dp_cp // layout.ep)
    worst_dp, worst_opt = 0.0, 0.0
    for stage, st in zip(stages, times):
        def sync(numel: float, size: int, stride: int) -> Tuple[float, float]:
            if layout.sharding == "ddp":
                return timer.collective("all_reduce", numel * grad_bytes, size, stride), 0.0
            return (timer.collective("reduce_scatter", numel * grad_bytes, size, stride),
                    timer.collective("all_gather", numel * timer.bytes, size, stride))
        stride = layout.tp
        grad_dense, gather_dense = sync(stage.dense_numel, dp_cp, stride)
        grad_exp, gather_exp = sync(stage.expert_numel, expert_dp, stride * layout.ep)
        reduce, gather = grad_dense + grad_exp, gather_dense + gather_exp
        if layout.sharding == "fsdp2":
            # Every micro-batch gathers the params (again in backward) and reduce-scatters
            # the grads, behind that micro-batch's compute.
            per_mb = gather * 2 + reduce
            compute = (st.forward + st.backward + st.recompute) * eff.comm_overlap
            exposed = mb * max(per_mb * eff.dp_bucket_exposed, per_mb - compute)
        else:
            window_bwd = (st.backward + st.recompute) * eff.comm_overlap
            window_fwd = st.forward * eff.comm_overlap
            exposed_reduce = (max(reduce * eff.dp_bucket_exposed, reduce - window_bwd)
                              if layout.overlap_grad_reduce else reduce)
            exposed_gather = (max(gather * eff.dp_bucket_exposed, gather - window_fwd)
                              if layout.overlap_param_gather else gather)
            exposed = exposed_reduce + exposed_gather
        local = stage.dense_numel + stage.expert_numel
        if layout.sharding != "ddp":
            local = stage.dense_numel / dp_cp + stage.expert_numel / expert_dp
        optimizer = timer.memory(local * eff.optimizer_bytes_per_param)
        worst_dp, worst_opt = max(worst_dp, exposed), max(worst_opt, optimizer)
    breakdown["dp"] = worst_dp
    breakdown["optimizer"] = worst_opt
    breakdown["overhead"] = eff.step_overhead
    step = sum(breakdown.values())

    tokens = layout.global_batch_size * layout.seq_length
    flops = model_flops(model, layout.seq_length, layout.global_batch_size,
                        options.attention_flops, options.count_recompute_flops)
    per_gpu = flops / step / cluster.num_gpus
    prediction = StepPrediction(
        layout=layout, num_gpus=cluster.num_gpus, step_time=step, breakdown=breakdown,
        tokens_per_second_per_gpu=tokens / step / cluster.num_gpus,
        model_tflops_per_gpu=per_gpu / TB, mfu=per_gpu / cluster.gpu.bf16_flops,
        precision=precision)
    if model.num_moe_experts and options.moe_imbalance == 1.0:
        prediction.notes.append("MoE routing assumed balanced (--moe-imbalance 1.0)")
    if memory:
        attach_memory(prediction, configs, cluster, model_provider, options, cache)
    return prediction


def attach_memory(prediction: StepPrediction, configs, cluster: Cluster, model_provider,
                  options: PlanOptions, cache: Optional[dict] = None) -> None:
    """The memory planner's largest rank for the prediction's layout, and whether it fits."""
    from megatron_smp.training import memory_planner

    layout = prediction.layout
    planned = configs_for(configs, layout)
    # Per-rank counts do not depend on DP but for FSDP2's shards: the small world's serve.
    stages = _param_counts(configs, layout,
                           cluster.num_gpus if layout.sharding == "fsdp2" else None,
                           model_provider, cache)
    report = memory_planner.estimate_memory(planned, cluster.num_gpus, model_provider,
                                            "cuda", stages=stages)
    prediction.memory_gib = report.largest.total / memory_planner.GIB
    prediction.memory_limit_gib = cluster.gpu.hbm_bytes * options.memory_fraction / \
        memory_planner.GIB
    prediction.fits = prediction.memory_gib <= prediction.memory_limit_gib


# ------------------------------------------------------------------------- search


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _pipeline_splits(num_layers: int, ranks: int) -> List[Tuple[int, Optional[int],
                                                                   Optional[int]]]:
    """(pp, first, last) for every pipeline size dividing `ranks`: even where pp divides the
    layers, else Megatron's uneven split with the middle stages at ceil(L / pp) layers and
    the remainder on the first and last stages (first >= last >= 1)."""
    out = []
    for pp in _divisors(ranks):
        if pp > num_layers:
            break
        if num_layers % pp == 0:
            out.append((pp, None, None))
            continue
        if pp < 3:
            continue
        middle = -(-num_layers // pp)
        rest = num_layers - (pp - 2) * middle
        first, last = -(-rest // 2), rest // 2
        if 1 <= last <= first <= middle:
            out.append((pp, first, last))
    return out


def candidate_layouts(configs, cluster: Cluster,
                      recompute: Tuple[Optional[str], ...] = (None, "selective", "full"),
                      shardings: Tuple[str, ...] = ("distributed-optimizer", "fsdp2"),
                      micro_batch_sizes: Tuple[int, ...] = (1, 2, 4, 8)
                      ) -> Iterator[Layout]:
    """Every layout of `num_gpus` the configuration validates (TP within a node), with the
    global batch and sequence length of `configs`."""
    from megatron_smp.training.arguments import validate_configs

    model, training = configs.model, configs.training
    n = cluster.num_gpus
    base = layout_of(configs, n)
    gbs = base.global_batch_size
    experts = model.num_moe_experts or 1
    pow2 = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    for tp in [t for t in pow2 if t <= cluster.gpus_per_node and n % t == 0]:
        if model.num_attention_heads % tp or (model.num_query_groups % tp
                                              and tp % model.num_query_groups):
            continue
        for pp, first, last in _pipeline_splits(model.num_layers, n // tp):
            for cp in [c for c in pow2 if n % (tp * pp * c) == 0
                       and training.seq_length % (2 * c) == 0 and c <= 16]:
                dp = n // (tp * pp * cp)
                for ep in [e for e in _divisors(experts) if (dp * cp) % e == 0]:
                    vpps = [1] + [v for v in (2, 3, 4, 6, 8) if pp > 1 and first is None
                                  and model.num_layers % (pp * v) == 0]
                    for vpp in vpps:
                        for mb in micro_batch_sizes:
                            if gbs % (mb * dp):
                                continue
                            if vpp > 1 and (gbs // (mb * dp)) % pp:
                                continue
                            for rc in recompute:
                                for sharding in shardings:
                                    layout = Layout(
                                        tp=tp, pp=pp, cp=cp, ep=ep, dp=dp, vpp=vpp,
                                        micro_batch_size=mb, global_batch_size=gbs,
                                        seq_length=training.seq_length,
                                        sequence_parallel=tp > 1, recompute=rc,
                                        recompute_modules=(("core_attn",)
                                                           if rc == "selective" else ()),
                                        sharding=sharding, overlap_grad_reduce=True,
                                        overlap_param_gather=sharding != "fsdp2",
                                        first_stage_layers=first, last_stage_layers=last)
                                    try:
                                        validate_configs(configs_for(configs, layout), n)
                                    except ConfigError:
                                        continue
                                    yield layout


def search(configs, cluster: Cluster, model_provider: Callable,
           options: Optional[PlanOptions] = None, top: int = 5,
           **space) -> Tuple[List[StepPrediction], int]:
    """Layouts ranked by predicted tokens/s per GPU, each checked with the memory planner in
    that order; returns (the first `top` that fit, or every fitting one for top=0; the number
    of candidates)."""
    options = options or PlanOptions()
    cache: dict = {}
    predictions = []
    for layout in candidate_layouts(configs, cluster, **space):
        predictions.append(predict(configs_for(configs, layout), cluster, model_provider,
                                   options, memory=False, cache=cache))
    predictions.sort(key=lambda p: -p.tokens_per_second_per_gpu)
    fitting = []
    for prediction in predictions:
        attach_memory(prediction, configs_for(configs, prediction.layout), cluster,
                      model_provider, options, cache)
        if prediction.fits:
            fitting.append(prediction)
            if top and len(fitting) >= top:
                break
    return fitting, len(predictions)


# ---------------------------------------------------------------------- reporting


def format_prediction(p: StepPrediction) -> str:
    lines = [f"layout: {p.layout.name()} on {p.num_gpus} GPUs ({p.precision}), "
             f"{p.layout.num_microbatches} micro-batches",
             f"step time {p.step_time * 1e3:.1f} ms: "
             + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in p.breakdown.items() if v),
             f"tokens/s/GPU {p.tokens_per_second_per_gpu:,.0f}   model TFLOP/s/GPU "
             f"{p.model_tflops_per_gpu:.1f}   MFU {p.mfu * 100:.1f}%"]
    if p.memory_gib is not None:
        lines.append(f"memory (memory planner, largest rank) {p.memory_gib:.1f} GiB of "
                     f"{p.memory_limit_gib:.1f} GiB usable: "
                     + ("fits" if p.fits else "does NOT fit"))
    lines += [f"note: {n}" for n in p.notes]
    return "\n".join(lines)


def format_table(predictions: List[StepPrediction]) -> str:
    head = (f"{'#':>2} {'layout':<58} {'tok/s/GPU':>10} {'MFU':>6} {'GiB':>6} {'step ms':>8} "
            + " ".join(f"{k[:8]:>8}" for k in BREAKDOWN))
    lines = [head]
    if not predictions:
        return "no layout fits"
    for i, p in enumerate(predictions, 1):
        lines.append(f"{i:>2} {p.layout.name():<58} {p.tokens_per_second_per_gpu:>10,.0f} "
                     f"{p.mfu * 100:>5.1f}% {p.memory_gib or 0:>6.1f} "
                     f"{p.step_time * 1e3:>8.1f} "
                     + " ".join(f"{p.breakdown[k] * 1e3:>8.1f}" for k in BREAKDOWN))
    return "\n".join(lines)


def _read_calibration(path: str) -> dict:
    if not os.path.exists(path):
        raise ConfigError(f"--efficiency {path}: no such file")
    with open(path) as f:
        return json.load(f)


def cpu_spec(path: str) -> GPUSpec:
    """The measured "device" of a calibration file (tools/bench/calibrate_planner.py): one
    process per core, its GEMM peak, memory bandwidth and gloo's bandwidth and latency."""
    data = _read_calibration(path)
    if "device" not in data:
        raise ConfigError(f"--efficiency {path}: no \"device\" section (write it with "
                          "tools/bench/calibrate_planner.py)")
    return GPUSpec(**data["device"])


def load_efficiency(path: str) -> Efficiency:
    """An `Efficiency` from a JSON file (the CPU calibration's output)."""
    data = _read_calibration(path)
    known = {f.name for f in dataclasses.fields(Efficiency)}
    unknown = set(data.get("efficiency", data)) - known
    if unknown:
        raise ConfigError(f"--efficiency {path}: unknown keys {sorted(unknown)}")
    return Efficiency(**data.get("efficiency", data))


__all__ = [
    "GPUSpec", "GPUS", "Efficiency", "GPU_EFFICIENCY", "Cluster", "PlanOptions", "Layout",
    "StepPrediction", "layout_of", "configs_for", "predict", "search", "candidate_layouts",
    "model_flops", "format_prediction", "format_table", "load_efficiency",
    "cpu_spec", "eager_passes", "mixer_gemms", "mixer_scan_flops",
]
