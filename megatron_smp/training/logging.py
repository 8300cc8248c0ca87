"""Timers, Megatron's per-interval log line, validation line, TensorBoard / wandb scalars."""
from __future__ import annotations

import datetime
import math
import os
import time
from typing import Dict, Optional

import torch

from megatron_smp.config import TrainingConfig, TransformerConfig


def has_perplexity(key: str) -> bool:
    """Whether a validation loss is a language model's per-token cross entropy, whose exp is
    a perplexity ("lm loss", the MTP depths' "mtp_k loss"); Megatron's evaluation block
    prints a PPL beside those. A DPO loss, a reward or a log-prob has none."""
    return key == "lm loss" or (key.startswith("mtp_") and key.endswith(" loss"))


def synchronize(device: torch.device) -> None:
    """Make wall-clock timings honest on an accelerator (kernels run asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Timer:
    def __init__(self, device: torch.device):
        self.device = device
        self._start: Optional[float] = None
        self.elapsed_total = 0.0

    def start(self) -> None:
        synchronize(self.device)
        self._start = time.perf_counter()

    def stop(self) -> float:
        synchronize(self.device)
        elapsed = time.perf_counter() - self._start
        self.elapsed_total += elapsed
        self._start = None
        return elapsed

    def elapsed(self, reset: bool = True) -> float:
        value = self.elapsed_total
        if reset:
            self.elapsed_total = 0.0
        return value


def mla_attention_terms(config: TransformerConfig, seq_length: int) -> float:
    """Multiply-adds per token of one multi-latent attention layer, Megatron-LM's count: the
    q path (plain, or down + norm + up), the kv down-projection with its positional key, norm
    and up-projection, the output projection, and the causal core attention (scores over
    qk_head_dim + pos channels, values over v_head_dim, each half the square)."""
    h, n = config.hidden_size, config.num_attention_heads
    q_width = n * (config.qk_head_dim + config.qk_pos_emb_head_dim)
    if config.q_lora_rank is None:
        q_term = h * q_width
    else:
        q_term = config.q_lora_rank * (h + q_width + 1)
    kv_term = (config.kv_lora_rank * (h + n * (config.qk_head_dim + config.v_head_dim) + 1)
               + h * config.qk_pos_emb_head_dim)
    core = seq_length * q_width / 2 + seq_length * n * config.v_head_dim / 2
    return q_term + kv_term + n * config.v_head_dim * h + core


def mamba_layer_flops(config: TransformerConfig) -> float:
    """Forward FLOPs per token of a Mamba-2 mixer, Megatron-LM main's formula (d_in = 2 h, as
    there): in_proj 2 h (2 d_in + 2 g n + heads), scan 7 d_in n, out_proj 2 d_in h."""
    h, n = config.hidden_size, config.mamba_state_dim
    d_in = 2 * h
    return (2 * h * (2 * d_in + 2 * config.mamba_num_groups * n + config.mamba_heads())
            + 7 * d_in * n + 2 * d_in * h)


def gdn_layer_flops(config: TransformerConfig) -> float:
    """Forward FLOPs per token of a Gated DeltaNet mixer, Megatron-LM main's formula: in_proj
    to 2 qk + 2 v + 2 h_v, the conv over 2 qk + v channels, 4 h_v d_v^2 for the delta rule,
    out_proj."""
    h = config.hidden_size
    qk = config.linear_key_head_dim * config.linear_num_key_heads
    v = config.linear_value_head_dim * config.linear_num_value_heads
    heads = config.linear_num_value_heads
    return 2 * (h * (2 * qk + 2 * v + 2 * heads) + config.linear_conv_kernel_dim * (2 * qk + v)
                + heads * config.linear_value_head_dim ** 2 * 4 + h * v)


def hybrid_flops_per_iteration(config: TransformerConfig, seq_length: int,
                               global_batch_size: int, padded_vocab_size: int) -> float:
    """Megatron-LM main's `hybrid_flops` for --hybrid-layer-pattern: per token, each layer of
    its one part (attention 4 h q (1 + g/n) + 2 s q, MLP and MoE as GPT's, Mamba and GDN as
    above) plus the logits 2 h V, times 3 (forward and two backward GEMMs); each
    multi-token-prediction depth (`/` part) adds its layers and the logits once more."""
    h = config.hidden_size
    q = config.num_attention_heads * config.kv_channels
    gated = 3 if config.gated_linear_unit else 2
    attention = 2 * h * (q + 2 * config.num_query_groups * config.kv_channels) + 2 * q * h
    attention += 2 * seq_length * q
    moe = 0.0
    if config.num_moe_experts is not None:
        # Latent experts (--moe-latent-size L): the routed ones on L, plus the projections
        # h -> L -> h (4 h L), as Megatron counts them.
        routed = config.moe_latent_size or h
        moe = 2 * gated * (routed * config.moe_ffn_hidden_size * config.moe_router_topk
                           + h * (config.moe_shared_expert_intermediate_size or 0))
        if config.moe_latent_size:
            moe += 4 * h * config.moe_latent_size
    per_layer = {"*": attention, "-": 2 * gated * h * config.ffn_hidden_size, "E": moe,
                 "M": mamba_layer_flops(config), "G": gdn_layer_flops(config)}
    # The multi-token-prediction depths (the pattern's `/` parts) count their layers and
    # one more logits each, as Megatron counts them (eh_proj and norms not).
    depths = config.hybrid_mtp_depths()
    symbols = config.hybrid_layer_symbols() + (config.hybrid_mtp_symbols() or "") * depths
    per_token = sum(per_layer[symbol] for symbol in symbols)
    per_token += 2 * h * padded_vocab_size * (1 + depths)
    return 3.0 * per_token * seq_length * global_batch_size


def flops_per_iteration(config: TransformerConfig, seq_length: int, global_batch_size: int,
                        padded_vocab_size: int) -> float:
    """Model FLOPs of one training iteration, as Megatron-LM (core_v0.16.1) prints them.

    Every GEMM counts 3 times (forward, weight grad, data grad) at 2 FLOPs per multiply-add;
    recomputation is not counted. Per token and layer: QKV 2*h*(q + 2*kv) (GQA), attention
    scores and values 2*q*s (the causal mask halves the full square 4*q*s), output projection
    2*q*h, MLP 2*h*f*(3 if gated else 2), for an MoE layer topk routed experts of
    moe_ffn_hidden_size plus the shared expert (latent experts, --moe-latent-size L: the
    routed ones on L plus 4*h*L for the projections); plus the logits 2*h*V.
    Beyond Megatron (whose formula has no sliding windows): a layer attending through a
    window of W keys (--window-size, --window-attn-skip-freq) counts 2*q*(2*W - W^2/s) for
    scores and values instead of 2*q*s, the same half-square rule over the keys a query sees
    (W keys each once the window is full); W >= s is the causal term. A gated MLP counts 3
    GEMMs for --quick-geglu and --geglu too (Megatron counts 3 only for --swiglu). Norms
    (also --sandwich-norm's and --qk-layernorm's), --apply-embedding-scaling and
    --final-logit-softcapping are elementwise: not counted, as Megatron counts no norms.
    Multi-token prediction (Megatron's count): each of the D MTP layers counts as one more
    layer of the last layer's kind (attention, and MoE or dense MLP), plus its two input
    norms and final norm (3*h) and eh_proj (2*h*h), and the logits are computed D + 1 times.
    Hybrid models: `hybrid_flops_per_iteration`; a --linear-attention-freq layer's Gated
    DeltaNet counts `gdn_layer_flops` in place of its attention.
    Returns FLOPs for `global_batch_size` sequences of `seq_length` tokens.
    """
    if config.hybrid_layer_pattern is not None:
        return hybrid_flops_per_iteration(config, seq_length, global_batch_size,
                                          padded_vocab_size)
    h = config.hidden_size
    q = config.num_attention_heads * config.kv_channels
    kv = config.num_query_groups * config.kv_channels
    mlp_factor = 3 if config.gated_linear_unit else 2
    mtp = config.mtp_num_layers or 0
    pattern = config.moe_layer_pattern()
    pattern = pattern + [pattern[-1]] * mtp  # the MTP layers are of the last layer's kind
    num_layers = config.num_layers + mtp
    windows = config.window_layer_pattern()
    windowed_layers = sum(windows + [windows[-1]] * mtp)
    keys = seq_length  # twice the mean keys per query of causal attention (s / 2)
    if windowed_layers and config.window_size[0] + 1 < seq_length:
        window = config.window_size[0] + 1
        keys = 2 * window - window * window / seq_length
    core = q * (seq_length * (num_layers - windowed_layers) + keys * windowed_layers)
    attention = h * (q + 2 * kv) + q * h
    if config.multi_latent_attention:  # its core attention is in its terms (no windows)
        attention, core = mla_attention_terms(config, seq_length), 0.0
    num_moe_layers = sum(pattern)
    num_dense_layers = num_layers - num_moe_layers
    mlp = config.ffn_hidden_size * num_dense_layers
    if num_moe_layers:
        shared = config.moe_shared_expert_intermediate_size or 0
        routed = config.moe_ffn_hidden_size * config.moe_router_topk
        if config.moe_latent_size:  # the routed experts on L, then h -> L -> h
            routed = routed * config.moe_latent_size / h
        mlp += (routed + shared) * num_moe_layers
    linear = sum(config.linear_attention_pattern())  # Gated DeltaNet layers, no attention
    latent = 2 * h * (config.moe_latent_size or 0) * num_moe_layers
    per_token = (mlp_factor * h * mlp + latent + (num_layers - linear) * attention + core
                 + mtp * (3 * h + 2 * h * h) + h * padded_vocab_size * (1 + mtp))
    if linear:
        per_token += linear * (gdn_layer_flops(config) / 2 - q * seq_length)
    return 6.0 * per_token * seq_length * global_batch_size


def memory_scalars(device: torch.device) -> Dict[str, float]:
    """Megatron's `mem-*` TensorBoard scalars: the CUDA allocator's counters on a GPU, this
    process's resident set (current and peak, bytes) on the CPU."""
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)
        return {
            "mem-reserved-bytes": stats["reserved_bytes.all.current"],
            "mem-allocated-bytes": stats["allocated_bytes.all.current"],
            "mem-max-allocated-bytes": stats["allocated_bytes.all.peak"],
            "mem-allocated-count": stats["allocation.all.current"],
        }
    import resource

    scalars = {"mem-max-rss-bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    try:
        with open("/proc/self/statm") as handle:
            pages = int(handle.read().split()[1])
        scalars["mem-rss-bytes"] = pages * resource.getpagesize()
    except OSError:  # not Linux
        pass
    return scalars


class TrainingLogger:
    """Prints Megatron's log lines on the logging rank and writes its scalars there, to
    TensorBoard (--tensorboard-dir) and to wandb (`wandb`: the module `init_wandb` started).

    `config` is the run's TrainingConfig: its log_* / tensorboard_* fields choose the optional
    fields and scalars as Megatron's flags of the same names do.
    """

    def __init__(self, is_logging_rank: bool, config: TrainingConfig, device: torch.device,
                 wandb=None, world_size: int = 1):
        self.is_logging_rank = is_logging_rank
        self.config = config
        self.world_size = world_size
        self.train_iters = config.train_iters
        self.device = device
        self.writer = None
        self.wandb = wandb if is_logging_rank else None
        if is_logging_rank and config.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=config.tensorboard_dir,
                                        max_queue=config.tensorboard_queue_size)

    @property
    def writes_scalars(self) -> bool:
        return self.writer is not None or self.wandb is not None

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        """One scalar to every sink: wandb gets the TensorBoard scalars, at the same steps."""
        if isinstance(value, torch.Tensor):  # a device value: read only when written
            value = value.item()
        if self.writer is not None:
            self.writer.add_scalar(tag, value, step)
        if self.wandb is not None:
            self.wandb.log({tag: value}, step)

    def print(self, text: str) -> None:
        if self.is_logging_rank:
            print(text, flush=True)

    def iteration_scalars(
        self,
        iteration: int,
        learning_rate: float,
        global_batch_size: int,
        losses: Dict[str, torch.Tensor],
        loss_scale: torch.Tensor,
        grad_norm: Optional[float],
        num_zeros_in_grad: Optional[int],
        params_norm: Optional[float] = None,
        extra_scalars: Optional[Dict[str, float]] = None,
    ) -> None:
        """One iteration's own values, every --tensorboard-log-interval iterations
        (`extra_scalars`: scalars written as they are, e.g. per-layer MoE losses). Losses,
        loss scale and extra scalars may be device tensors: read on the host only when
        written."""
        if not self.writes_scalars or iteration % self.config.tensorboard_log_interval:
            return
        add = self.add_scalar
        add("learning-rate", learning_rate, iteration)
        add("batch-size", global_batch_size, iteration)
        for key, value in losses.items():
            add(key, value, iteration)
        if self.config.log_loss_scale_to_tensorboard:
            add("loss-scale", loss_scale, iteration)
        if self.config.log_world_size_to_tensorboard:
            add("world-size", self.world_size, iteration)
        if grad_norm is not None:
            add("grad-norm", grad_norm, iteration)
        if num_zeros_in_grad is not None:
            add("num-zeros", num_zeros_in_grad, iteration)
        if params_norm is not None:
            add("params-norm", params_norm, iteration)
        if self.config.log_memory_to_tensorboard:
            for key, value in memory_scalars(self.device).items():
                add(key, value, iteration)
        for key, value in (extra_scalars or {}).items():
            add(key, value, iteration)

    def training_line(
        self,
        iteration: int,
        consumed_samples: int,
        elapsed_ms: float,
        learning_rate: float,
        global_batch_size: int,
        losses: Dict[str, float],
        loss_scale: float,
        grad_norm: Optional[float],
        num_zeros_in_grad: Optional[int],
        skipped_iterations: int,
        nan_iterations: int,
        tokens_per_second: float,
        tflops: float,
        params_norm: Optional[float] = None,
    ) -> str:
        """Megatron's per-interval line (losses averaged over the interval)."""
        line = f" iteration {iteration:8d}/{self.train_iters:8d} |"
        line += f" consumed samples: {consumed_samples:12d} |"
        line += f" elapsed time per iteration (ms): {elapsed_ms:.1f} |"
        if self.config.log_throughput:
            line += f" throughput (tokens/s): {tokens_per_second:.1f} |"
            line += f" throughput per GPU (TFLOP/s/GPU): {tflops:.1f} |"
        line += f" learning rate: {learning_rate:.6E} |"
        line += f" global batch size: {global_batch_size:5d} |"
        for key, value in losses.items():
            line += f" {key}: {value:.6E} |"
        line += f" loss scale: {loss_scale:.1f} |"
        if grad_norm is not None:
            line += f" grad norm: {grad_norm:.3f} |"
        if num_zeros_in_grad is not None:
            line += f" num zeros: {float(num_zeros_in_grad):.1f} |"
        if params_norm is not None:
            line += f" params norm: {params_norm:.3f} |"
        line += f" number of skipped iterations: {skipped_iterations:3d} |"
        line += f" number of nan iterations: {nan_iterations:3d} |"
        self.print(line)
        if self.config.log_timers_to_tensorboard:
            self.add_scalar("iteration-time", elapsed_ms / 1000.0, iteration)
        if self.config.log_throughput:
            self.add_scalar("throughput", tflops, iteration)
        return line

    def validation_line(self, prefix: str, iteration: int, losses: Dict[str, float],
                        dataset: str = "", to_scalars: bool = True) -> str:
        """Megatron's evaluation block: "<key> value: X |" per loss or metric, followed by
        "<key> PPL: exp(X) |" for a language-model loss (`has_perplexity`). `dataset`: "" inside
        training, "validation" or "test" for the evaluations after it (which also go to the
        "<loss> validation" scalars, as Megatron writes them, unless `to_scalars` is False:
        --skip-train)."""
        where = f" on {dataset} set" if dataset else ""
        line = f" {prefix} loss at iteration {iteration}{where} |"
        for key, value in losses.items():
            line += f" {key} value: {value:.6E} |"
            ppl = math.exp(min(20.0, value)) if has_perplexity(key) else None
            if ppl is not None:
                line += f" {key} PPL: {ppl:.6E} |"
            if to_scalars:
                self.add_scalar(f"{key} validation", value, iteration)
                if ppl is not None and self.config.log_validation_ppl_to_tensorboard:
                    self.add_scalar(f"{key} validation ppl", ppl, iteration)
        length = len(line) + 1
        self.print("-" * length + "\n" + line + "\n" + "-" * length)
        return line

    def close(self) -> None:
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
            self.writer = None
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


class ProgressLog:
    """Megatron's --log-progress: rank 0 appends to <--save>/progress.txt a "Starting job"
    line per job and a line per saved checkpoint with the job's and the cumulative throughput
    (since the first job of this world size), floating-point operations and tokens so far.

    Floating-point operations so far are `flops_per_sample x consumed samples` (what
    Megatron sums iteration by iteration), so resumed jobs continue the count.
    """

    FILENAME = "progress.txt"

    def __init__(self, save_dir: str, world_size: int, rank: int, flops_per_sample: float,
                 seq_length: int, consumed_samples: int, start_time: float):
        self.path = os.path.join(save_dir, self.FILENAME)
        self.world_size = world_size
        self.rank = rank
        self.flops_per_sample = flops_per_sample
        self.seq_length = seq_length
        self.start_flops = flops_per_sample * consumed_samples
        self.start_time = start_time

    def _append(self, text: str) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()  # the line follows what every rank did
        if self.rank != 0:
            return
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
        with open(self.path, "a") as handle:
            handle.write(f"{stamp}\tJob ID: {os.environ.get('SLURM_JOB_ID', '')}\t"
                         f"# GPUs: {self.world_size}\t{text}\n")

    def job_started(self) -> None:
        self._append("Starting job")

    def _first_job_of_this_world_size(self):
        """(start datetime, flops at its start): Megatron's reading of the file."""
        start, start_flops, latest_flops = None, None, 0.0
        with open(self.path) as handle:
            for line in handle:
                fields = line.strip().split("\t")
                if fields[3] == "Saved checkpoint":
                    latest_flops = float(fields[7].split(": ")[1])
                if int(fields[2].split(": ")[1]) != self.world_size:
                    start, start_flops = None, None
                elif fields[3] == "Starting job" and start is None:
                    start, start_flops = fields[0], latest_flops
        return datetime.datetime.strptime(start, "%Y-%m-%d %H:%M:%S"), start_flops

    def checkpoint_saved(self, iteration: int, consumed_samples: int, async_save: bool) -> None:
        flops = self.flops_per_sample * consumed_samples
        job = (flops - self.start_flops) / (
            (time.time() - self.start_time) * 1e12 * self.world_size)
        cumulative = 0.0
        if self.rank == 0:
            start, start_flops = self._first_job_of_this_world_size()
            elapsed = (datetime.datetime.now() - start).total_seconds()
            cumulative = (flops - start_flops) / (max(elapsed, 1e-9) * 1e12 * self.world_size)
        what = "Saving async checkpoint" if async_save else "Saved checkpoint"
        self._append(
            f"{what}\tIteration: {iteration}\tJob throughput: {job:.1f} TFLOP/s/GPU\t"
            f"Cumulative throughput: {cumulative:.1f} TFLOP/s/GPU\t"
            f"Floating-point operations: {flops:.2e}\t"
            f"Tokens (in billions): {consumed_samples * self.seq_length / 1e9:.2f}"
        )


def set_logging_level(config: TrainingConfig) -> None:
    """Python logging's root level: --logging-level, else MEGATRON_LOGGING_LEVEL, else
    untouched (Megatron's order)."""
    import logging

    level = config.logging_level
    if level is None and os.environ.get("MEGATRON_LOGGING_LEVEL") is not None:
        level = int(os.environ["MEGATRON_LOGGING_LEVEL"])
    if level is not None:
        logging.getLogger().setLevel(level)

