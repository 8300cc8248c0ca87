"""Measure this machine's constants for the step-time planner (tools/plan.py --gpu cpu
--efficiency FILE): one process per rank, one thread each (as the tests and torchrun run here).

    share     the share of a core this process gets now (CPU time / wall time of a busy
              loop): the compute figures below are CPU times (an idle core's); `at_share`
              turns them into wall times for a given share (planner_cpu.py measures it
              just before each run: the load of other sessions moves it)
    GEMM      fp32 matmul time over a table of shapes; fitted to the planner's roofline
              t = 2 M N K / (peak x M/(M+d0) x N/(N+d0) x K/(K+d0)) + launch
              (peak, d0 and launch: least squares on log time over a grid of d0 / launch)
    memory    an add over 3 x 32 MiB tensors: bytes moved / time
    attention SDPA forward (causal) at the calibration shape: its FLOPs / time / peak
    host      forward + backward of a tiny GPT layer (compute negligible): the per-layer
              host overhead; a world-1 pretrain_gpt.py step of a one-layer model: the
              per-step overhead (data, optimizer, logging)
    gloo      all_reduce between two processes over 4 KiB .. 8 MiB, the fastest of 15 (gloo
              works on the CPU: its copies and sums slow down with the share like compute):
              t = 2 (n-1)/n S / bw + 2 (n-1) latency fitted for bandwidth; the latency is
              that of a small all_reduce between two GEMMs (`gloo_blocking`, the median:
              the wait for the other rank, which a shared machine's scheduler stretches, is
              what every blocking collective of a step pays), on idle-core terms; gloo's
              reduce_scatter costs an all_reduce of its input (it is one, then a copy);
              the project's all-gather, reduce-scatter and ring exchange of a hidden state
              between GEMMs: each one's overhead beyond that fit, per call
              (`collective_overheads`)
Communication is not overlapped with compute on this machine (2 cores shared by every rank:
NOTES-CPU.md), so `comm_overlap` is 0 and every collective is exposed.

    python tools/bench/calibrate_planner.py --out cpu_planner.json
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, REPO)

GEMM_SHAPES = [(256, 256, 256), (512, 512, 512), (1024, 256, 256), (1024, 768, 256),
               (1024, 256, 768), (2048, 512, 128), (1024, 1024, 1024), (128, 1024, 256),
               (64, 256, 256), (4096, 256, 64), (1024, 4000, 256), (32, 64, 64)]


def _median_time(fn, repeats: int, warmup: int = 2, clock=time.thread_time) -> float:
    """Median time of `fn`: by default this thread's CPU time, which other processes sharing
    the cores do not inflate (`cpu_share` turns it into wall time)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = clock()
        fn()
        times.append(clock() - start)
    return statistics.median(times)


def cpu_share(seconds: float = 2.0) -> float:
    """The share of a core this process gets now: CPU time / wall time of a busy GEMM loop
    (1.0 on an idle machine; less while other sessions load the cores)."""
    import torch

    a = torch.randn(256, 256)
    wall, cpu = time.perf_counter(), time.thread_time()
    while time.perf_counter() - wall < seconds:
        torch.mm(a, a)
    return min(1.0, (time.thread_time() - cpu) / (time.perf_counter() - wall))


def gemm_table(repeats: int = 7) -> list:
    import torch

    rows = []
    for m, n, k in GEMM_SHAPES:
        a, b = torch.randn(m, k), torch.randn(k, n)
        rows.append((m, n, k, _median_time(lambda: torch.mm(a, b), repeats)))
    return rows


def fit_gemm(rows: list) -> dict:
    """(peak, d0, launch) minimising squared log error of the roofline over the table."""
    best = None
    for d0 in [0, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256]:
        for launch in [0, 2e-6, 5e-6, 1e-5, 2e-5, 4e-5]:
            # Given d0 and launch, the best log-peak is the mean log of the implied peaks.
            logs = []
            for m, n, k, t in rows:
                eta = (m / (m + d0)) * (n / (n + d0)) * (k / (k + d0))
                compute = max(t - launch, t * 0.05)
                logs.append(math.log(2 * m * n * k / (eta * compute)))
            peak = math.exp(sum(logs) / len(logs))
            error = 0.0
            for m, n, k, t in rows:
                eta = (m / (m + d0)) * (n / (n + d0)) * (k / (k + d0))
                error += (math.log(2 * m * n * k / (peak * eta) + launch) - math.log(t)) ** 2
            if best is None or error < best[0]:
                best = (error, peak, d0, launch)
    return {"peak_flops": best[1], "gemm_half_dim": float(best[2]), "kernel_launch": best[3],
            "rms_log_error": math.sqrt(best[0] / len(rows))}


def memory_bandwidth() -> float:
    import torch

    n = 8 * 1024 * 1024  # 32 MiB of fp32
    a, b, out = torch.randn(n), torch.randn(n), torch.empty(n)
    seconds = _median_time(lambda: torch.add(a, b, out=out), 7)
    return 3 * n * 4 / seconds


def attention_throughput(peak: float, seq: int = 256, heads: int = 8, dim: int = 32,
                         batch: int = 4) -> float:
    """SDPA causal forward's achieved fraction of the GEMM peak."""
    import torch
    import torch.nn.functional as F

    q, k, v = (torch.randn(batch, heads, seq, dim) for _ in range(3))
    seconds = _median_time(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), 7)
    flops = 2.0 * batch * heads * seq * (seq / 2) * 2 * dim
    return flops / seconds / peak


def layer_overhead() -> float:
    """Seconds per layer forward that are not compute: a tiny GPT layer's forward + backward
    (hidden 32, 8 tokens) over three (backward ~ two forwards)."""
    import torch

    from megatron_smp.config import ParallelConfig, TransformerConfig
    from megatron_smp.training.memory_planner import fake_layout

    config = TransformerConfig(num_layers=8, hidden_size=32, num_attention_heads=2,
                               vocab_size=64, max_position_embeddings=8, ffn_hidden_size=64,
                               hidden_dropout=0.0, attention_dropout=0.0)
    with fake_layout(ParallelConfig(), 1, 0) as state:
        from megatron_smp.models.gpt import GPTModel

        model = GPTModel(config, state, pre_process=True, post_process=True)
    tokens = torch.randint(0, 64, (1, 8))
    positions = torch.arange(8).unsqueeze(0)

    def step():
        out = model(tokens, positions, None)
        out.float().sum().backward()

    with torch.random.fork_rng(devices=[]):
        seconds = _median_time(step, 9)
    return seconds / config.num_layers / 3


def _gloo_body(rank, world_size, sizes, repeats):
    import torch
    import torch.distributed as dist

    out = []
    for size in sizes:
        buffer = torch.zeros(size // 4)
        for _ in range(2):
            dist.all_reduce(buffer)
        times = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(buffer)
            times.append(time.perf_counter() - start)
        out.append((size, min(times)))
    return out


def gloo_link(world_size: int = 2, repeats: int = 15) -> dict:
    """All-reduce times over sizes, fitted to 2 (n-1)/n S / bw + 2 (n-1) latency."""
    from megatron_smp.testing import run_distributed

    sizes = [4096, 65536, 524288, 2097152, 8388608]
    measured = run_distributed(_gloo_body, world_size, args=(sizes, repeats), timeout=300)[0]
    share = (world_size - 1) / world_size
    # Least squares t = a + b S with a = 2 (n-1) latency, b = 2 share / bw.
    xs, ys = [s for s, _ in measured], [t for _, t in measured]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = (sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys))
             / sum((x - mean_x) ** 2 for x in xs))
    intercept = max(mean_y - slope * mean_x, min(ys) * 0.5)
    return {"bandwidth": 2 * share / slope, "latency": intercept / (2 * (world_size - 1)),
            "all_reduce": measured}


def _blocking_body(rank, world_size, repeats, work):
    import torch
    import torch.distributed as dist

    a, small = torch.randn(work, work), torch.zeros(1024)
    for _ in range(3):
        torch.mm(a, a)
        dist.all_reduce(small)
    times = []
    for _ in range(repeats):
        torch.mm(a, a)
        start = time.perf_counter()
        dist.all_reduce(small)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _collectives_body(rank, world_size, rows, hidden, repeats, work):
    import torch
    import torch.distributed as dist

    from megatron_smp.context_parallel.attention import _wait
    from megatron_smp.tensor_parallel.mappings import (_gather_first_dim,
                                                       _reduce_scatter_first_dim)

    shard, whole = torch.randn(rows, hidden), torch.randn(rows * world_size, hidden)
    incoming = torch.empty_like(shard)
    peer = (rank + 1) % world_size, (rank - 1) % world_size

    def ring():
        _wait(dist.batch_isend_irecv([dist.P2POp(dist.isend, shard, peer[0]),
                                      dist.P2POp(dist.irecv, incoming, peer[1])]))

    ops = {"all_gather": lambda: _gather_first_dim(shard, None),
           "reduce_scatter": lambda: _reduce_scatter_first_dim(whole, None),
           "ring": ring}
    a = torch.randn(work, work)
    out = {}
    for name, fn in ops.items():
        for _ in range(3):
            fn()
        times = []
        for _ in range(repeats):
            torch.mm(a, a)
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        out[name] = statistics.median(times)
    return out


def collective_overheads(bandwidth: float, latency: float, share: float,
                         world_size: int = 2, rows: int = 512, hidden: int = 256,
                         repeats: int = 31) -> dict:
    """The project's own all-gather, reduce-scatter (tensor_parallel.mappings) and ring
    exchange (context parallelism's batch_isend_irecv) of a hidden state ([rows, hidden] fp32
    per rank) between GEMMs, median wall time in idle-core terms (x `share`), less what the
    bandwidth and latency fit gives them: each call's overhead beyond the fit (gloo's
    reduce-scatter and the exchange wait on the other rank far longer than an all_reduce)."""
    from megatron_smp.testing import run_distributed

    per_rank = run_distributed(_collectives_body, world_size,
                               args=(rows, hidden, repeats, 160), timeout=300)
    nbytes = rows * hidden * 4
    fit = {"all_gather": (world_size - 1) * nbytes / bandwidth + (world_size - 1) * latency,
           "reduce_scatter": 2 * (world_size - 1) / world_size * nbytes * world_size
           / bandwidth + 2 * (world_size - 1) * latency,
           "ring": nbytes / bandwidth + latency}
    out = {}
    for name, model in fit.items():
        measured = statistics.median(r[name] for r in per_rank) * share
        out[name] = {"measured_idle_s": measured, "overhead_s": max(0.0, measured - model)}
    return out


def gloo_blocking(world_size: int = 2, repeats: int = 41, work: int = 160) -> float:
    """What one small blocking collective costs between compute, as a step's collectives do
    (each rank a GEMM of about a millisecond, then a 4 KiB all_reduce): the median wall time
    of the all_reduce over the ranks' medians. Beside gloo's own latency it holds the wait
    for the other rank, which the scheduler of a shared machine delays."""
    from megatron_smp.testing import run_distributed

    medians = run_distributed(_blocking_body, world_size, args=(repeats, work), timeout=300)
    return statistics.median(medians)


def step_overhead() -> float:
    """Iteration time of pretrain_gpt.py at world 1 on a one-layer, hidden-32 model: what a
    step costs besides its layers (data, loss, optimizer, logging)."""
    import re

    flags = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2",
             "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "1",
             "--global-batch-size", "1", "--vocab-size", "64", "--train-iters", "12",
             "--mock-data", "--tokenizer-type", "NullTokenizer", "--lr", "1e-4",
             "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000",
             "--distributed-backend", "gloo", "--hidden-dropout", "0",
             "--attention-dropout", "0"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "1", os.path.join(REPO, "pretrain_gpt.py")]
                          + flags, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    times = [float(t) / 1e3 for i, t in re.findall(
        r" iteration\s+(\d+)/\s*\d+ \|.*? elapsed time per iteration \(ms\): ([0-9.]+) \|",
        proc.stdout + proc.stderr) if int(i) > 2]
    if not times:
        raise RuntimeError("pretrain_gpt.py printed no iterations:\n"
                           + (proc.stdout + proc.stderr)[-2000:])
    return statistics.median(times)


def calibrate(world_size: int = 2) -> dict:
    import torch

    torch.set_num_threads(1)
    share = cpu_share()
    table = gemm_table()
    gemm = fit_gemm(table)
    peak = gemm["peak_flops"]
    bandwidth = memory_bandwidth()
    link = gloo_link(world_size)
    # A collective's latency as the steps see it (idle-core terms: x the share now).
    blocking = gloo_blocking(world_size)
    latency = max(link["latency"], blocking * share / (2 * (world_size - 1)))
    overheads = collective_overheads(link["bandwidth"], latency, share, world_size)
    with open("/proc/meminfo") as f:
        total = int(f.readline().split()[1]) * 1024
    device = {"name": "CPU (1 thread per rank, measured)", "bf16_flops": peak,
              "fp8_flops": None, "hbm_bandwidth": bandwidth, "hbm_bytes": total,
              "gpus_per_node": 1024, "intra_node_bandwidth": link["bandwidth"],
              "inter_node_bandwidth": link["bandwidth"], "intra_node_latency": latency,
              "inter_node_latency": latency, "fp32_flops": peak,
              "reduce_scatter_as_all_reduce": True,
              "all_gather_overhead": overheads["all_gather"]["overhead_s"],
              "reduce_scatter_overhead": overheads["reduce_scatter"]["overhead_s"],
              "ring_exchange_overhead": overheads["ring"]["overhead_s"]}
    efficiency = {"gemm_max": 1.0, "gemm_half_dim": gemm["gemm_half_dim"],
                  "attention": attention_throughput(gemm["peak_flops"]), "memory": 1.0, "network": 1.0,
                  "kernel_launch": gemm["kernel_launch"], "comm_overlap": 0.0,
                  "layer_overhead": layer_overhead(), "step_overhead": step_overhead()}
    return {"device": device, "efficiency": efficiency,
            "measured": {"gemm": table, "gemm_fit": gemm, "all_reduce": link["all_reduce"],
                         "gloo_latency_fastest": link["latency"], "blocking_all_reduce": blocking,
                         "collectives": overheads,
                         "cpu_share": share, "load_average": os.getloadavg()}}


def at_share(calibration: dict, share: float) -> dict:
    """The calibration's figures (an idle core's) as wall times for processes that get
    `share` of a core: peak, memory and gloo bandwidth x share, latencies and host overheads
    / share."""
    out = json.loads(json.dumps(calibration))
    device, efficiency = out["device"], out["efficiency"]
    for name in ("bf16_flops", "fp32_flops", "hbm_bandwidth", "intra_node_bandwidth",
                 "inter_node_bandwidth"):
        device[name] *= share
    for name in ("intra_node_latency", "inter_node_latency", "all_gather_overhead",
                 "reduce_scatter_overhead", "ring_exchange_overhead"):
        if name in device:
            device[name] /= share
    for name in ("layer_overhead", "kernel_launch"):
        efficiency[name] /= share
    out["measured"]["share_used"] = share
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file for tools/plan.py --efficiency")
    args = parser.parse_args(argv)
    result = calibrate()
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    d, e = result["device"], result["efficiency"]
    print(f"GEMM peak {d['fp32_flops'] / 1e9:.1f} GFLOP/s (d0 {e['gemm_half_dim']:.0f}, launch "
          f"{e['kernel_launch'] * 1e6:.1f} us, rms log error "
          f"{result['measured']['gemm_fit']['rms_log_error']:.2f}); memory "
          f"{d['hbm_bandwidth'] / 1e9:.1f} GB/s; attention {e['attention']:.2f} of peak; gloo "
          f"{d['intra_node_bandwidth'] / 1e9:.2f} GB/s, {d['intra_node_latency'] * 1e6:.0f} us; "
          f"layer overhead {e['layer_overhead'] * 1e6:.0f} us; step overhead "
          f"{e['step_overhead'] * 1e3:.1f} ms; CPU share {result['measured']['cpu_share']:.2f}, "
          f"load {result['measured']['load_average']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
