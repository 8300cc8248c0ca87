"""Training throughput and MFU of pretrain_gpt.py / pretrain_llama.py, beside a plain-PyTorch peer.

Ours: the entry script itself, launched with torchrun on --mock-data with --log-throughput
and --log-interval 1; the "elapsed time per iteration (ms)" of Megatron's log line is read
for every iteration after the warm-up ones. Model FLOPs per iteration are Megatron-LM's
(core_v0.16.1 `num_floating_point_operations`, the number its training log prints):
`megatron_smp.training.logging.flops_per_iteration` of the same flags, recompute not counted.

    tokens/s          = global batch x seq / mean iteration time
    TFLOP/s/device    = flops per iteration / mean iteration time / world size
    MFU               = TFLOP/s/device / the device's dense bf16 peak (H100 SXM and H200:
                        989 TFLOP/s); on the CPU no MFU is printed.

The peer is torchtitan-style plain PyTorch in this process: Hugging Face `LlamaForCausalLM`
(`GPT2LMHeadModel` for the GPT-2 preset) with SDPA attention, the same shapes (vocabulary
padded as ours), torch AdamW (fused where the device has fused kernels, else foreach),
gradient clipping at 1.0, bf16 autocast over fp32 params when ours runs --bf16, the same
micro-batch and gradient accumulation up to the global batch, and the same warm-up and timed
steps. The closing line is the ratio ours / peer of tokens/s.

    python tools/bench/bench_throughput.py --preset tiny                 # CPU
    python tools/bench/bench_throughput.py --preset llama-1b --micro-batch-sizes 1,2,4
    python tools/bench/bench_throughput.py --preset gpt2-125m --json out.json
    python tools/bench/bench_throughput.py --preset tiny --extra-args "--use-distributed-optimizer"
    python tools/bench/bench_throughput.py --preset llama-1b --compile   # both sides compiled

Several --micro-batch-sizes run one after the other (global batch = micro-batch unless
--global-batch-size is given); a size that fails (out of memory) is reported as failed, so
the largest one that fits can be read off the table.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import re
import shlex
import subprocess
import sys
import time
from typing import Dict, List, Optional

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

# Dense bf16 tensor-core peaks (no sparsity), TFLOP/s per device, by device-name substring.
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0}


@dataclasses.dataclass
class Preset:
    script: str  # entry script at the repository root
    family: str  # "llama" | "gpt": the Hugging Face peer's class
    model_flags: str
    seq_length: int
    micro_batch_size: int
    bf16: bool


PRESETS = {
    # ~1.24B Llama (Llama-3.2-1B shapes, untied output), selective recompute, bf16.
    "llama-1b": Preset(
        "pretrain_llama.py", "llama",
        "--num-layers 16 --hidden-size 2048 --num-attention-heads 32 --group-query-attention "
        "--num-query-groups 8 --ffn-hidden-size 8192 --vocab-size 128255 "
        "--rotary-base 500000 --recompute-activations",
        4096, 1, True),
    # GPT-2 small: learned positions, LayerNorm, GeLU 4h MLP, tied embeddings.
    "gpt2-125m": Preset(
        "pretrain_gpt.py", "gpt",
        "--num-layers 12 --hidden-size 768 --num-attention-heads 12 --ffn-hidden-size 3072 "
        "--vocab-size 50256 --hidden-dropout 0 --attention-dropout 0",
        1024, 8, True),
    # A few-second CPU run of the Llama path.
    "tiny": Preset(
        "pretrain_llama.py", "llama",
        "--num-layers 2 --hidden-size 128 --num-attention-heads 4 --group-query-attention "
        "--num-query-groups 2 --ffn-hidden-size 512 --vocab-size 1023",
        128, 4, False),
}

_ITERATION_LINE = re.compile(
    r" iteration\s+(\d+)/\s*\d+ \|.*? elapsed time per iteration \(ms\): ([0-9.]+) \|"
)


def ours_argv(preset: Preset, micro_batch_size: int, global_batch_size: int, iters: int,
              bf16: bool, extra: List[str]) -> List[str]:
    """The entry script's flags for one run (mock data, NullTokenizer, log every iteration)."""
    flags = shlex.split(preset.model_flags) + [
        "--seq-length", str(preset.seq_length),
        "--max-position-embeddings", str(preset.seq_length),
        "--micro-batch-size", str(micro_batch_size),
        "--global-batch-size", str(global_batch_size),
        "--train-iters", str(iters),
        "--mock-data", "--tokenizer-type", "NullTokenizer",
        "--lr", "1e-4", "--min-lr", "1e-5", "--lr-warmup-iters", "1", "--clip-grad", "1.0",
        "--log-interval", "1", "--log-throughput",
        "--eval-interval", str(iters + 1), "--eval-iters", "0", "--seed", "1234",
    ]
    if bf16:
        flags.append("--bf16")
    return flags + extra


def model_flops(preset: Preset, argv: List[str], global_batch_size: int):
    """(TransformerConfig with the tokenizer's vocabulary, padded vocabulary, FLOPs per
    iteration) of the entry script run with `argv`."""
    import importlib

    from megatron_smp.data.tokenizers import build_tokenizer
    from megatron_smp.training.arguments import parse_args
    from megatron_smp.training.logging import flops_per_iteration

    entry = importlib.import_module(preset.script[:-3])
    configs = parse_args(argv, args_defaults=getattr(entry, "LLAMA_DEFAULTS", None))
    configs.model.vocab_size = build_tokenizer(configs.data).vocab_size
    padded = configs.model.padded_vocab_size(configs.parallel.tensor_model_parallel_size)
    flops = flops_per_iteration(configs.model, preset.seq_length, global_batch_size, padded)
    return configs.model, padded, flops


def run_ours(preset: Preset, argv: List[str], nproc: int, warmup: int,
             log_path: Optional[str]) -> Optional[List[float]]:
    """Seconds per timed iteration of the entry script under torchrun, or None if it failed."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(nproc), os.path.join(REPO, preset.script)] + argv
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    output = proc.stdout + proc.stderr
    if log_path:
        with open(log_path, "a") as f:
            f.write(" ".join(command) + "\n" + output + "\n")
    if proc.returncode != 0:
        print(f"  ours failed (exit {proc.returncode}):\n" + "\n".join(output.splitlines()[-15:]))
        return None
    times = {int(m.group(1)): float(m.group(2)) / 1000.0
             for m in _ITERATION_LINE.finditer(output)}
    timed = [seconds for iteration, seconds in sorted(times.items()) if iteration > warmup]
    if not timed:
        print("  ours printed no iteration lines after the warm-up")
        return None
    return timed


def run_peer(preset: Preset, model_config, padded_vocab: int, micro_batch_size: int,
             global_batch_size: int, warmup: int, iters: int, bf16: bool, device,
             recompute: bool, compile_layers: bool) -> Dict[str, float]:
    """Seconds per timed step of the Hugging Face model + torch AdamW (one device), and its
    peak device memory in GiB (CUDA only, else 0)."""
    import torch
    import torch.nn.functional as F

    from megatron_smp.optimizer import _fused_supported

    torch.manual_seed(1234)
    seq = preset.seq_length
    if preset.family == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=padded_vocab, hidden_size=model_config.hidden_size,
            intermediate_size=model_config.ffn_hidden_size,
            num_hidden_layers=model_config.num_layers,
            num_attention_heads=model_config.num_attention_heads,
            num_key_value_heads=model_config.num_query_groups,
            head_dim=model_config.kv_channels, max_position_embeddings=seq,
            rms_norm_eps=model_config.layernorm_epsilon, tie_word_embeddings=False,
            attention_bias=False, mlp_bias=False, bos_token_id=0, eos_token_id=1,
            pad_token_id=None,
        )
        model = LlamaForCausalLM._from_config(config, attn_implementation="sdpa")
    else:
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            vocab_size=padded_vocab, n_positions=seq, n_embd=model_config.hidden_size,
            n_layer=model_config.num_layers, n_head=model_config.num_attention_heads,
            n_inner=model_config.ffn_hidden_size, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, bos_token_id=0, eos_token_id=1,
        )
        model = GPT2LMHeadModel._from_config(config, attn_implementation="sdpa")
    model.to(device).train()
    if compile_layers:
        # torchtitan compiles per transformer block, as --torch-compile does for ours.
        layers = model.model.layers if preset.family == "llama" else model.transformer.h
        for layer in layers:
            layer.compile()
    if recompute:
        model.gradient_checkpointing_enable()
    params = [p for p in model.parameters() if p.requires_grad]
    implementation = {"fused": True} if _fused_supported(device) else {"foreach": True}
    optimizer = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, **implementation)
    accumulation = global_batch_size // micro_batch_size
    steps = warmup + iters
    tokens = torch.randint(0, model_config.vocab_size, (steps, accumulation, micro_batch_size,
                                                        seq + 1), device=device)

    def step(index: int) -> None:
        for micro in range(accumulation):
            batch = tokens[index, micro]
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                logits = model(input_ids=batch[:, :-1]).logits
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                   batch[:, 1:].reshape(-1))
            (loss / accumulation).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for index in range(warmup):
        step(index)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    synchronize()
    start = time.perf_counter()
    for index in range(warmup, steps):
        step(index)
    synchronize()
    seconds = (time.perf_counter() - start) / iters
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    del model, optimizer, tokens
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"seconds_per_step": seconds, "peak_memory_gib": peak}


def device_peak_tflops(device, override: Optional[float]) -> Optional[float]:
    """Dense bf16 peak of `device` in TFLOP/s, None where unknown (the CPU)."""
    if override:
        return override
    if device.type != "cuda":
        return None
    import torch

    name = torch.cuda.get_device_name(device)
    for key, value in PEAK_BF16_TFLOPS.items():
        if key in name:
            return value
    return None


def figures(seconds: float, tokens: int, flops: float, world_size: int,
            peak: Optional[float]) -> Dict[str, Optional[float]]:
    """tokens/s, TFLOP/s per device and MFU (None without a peak) of one iteration time."""
    tflops = flops / seconds / 1e12 / world_size
    return {"iteration_ms": seconds * 1000.0, "tokens_per_s": tokens / seconds,
            "tflops_per_device": tflops, "mfu": tflops / peak if peak else None}


def _row(name: str, values: Dict[str, Optional[float]]) -> str:
    mfu = f"{100 * values['mfu']:6.1f}%" if values.get("mfu") is not None else "     -"
    return (f"  {name:<6} {values['iteration_ms']:12.1f} {values['tokens_per_s']:14.1f} "
            f"{values['tflops_per_device']:16.4f} {mfu}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--micro-batch-sizes", default=None,
                        help="comma-separated; default: the preset's")
    parser.add_argument("--global-batch-size", type=int, default=None,
                        help="default: micro-batch x nproc (one microbatch per step)")
    parser.add_argument("--iters", type=int, default=10, help="timed iterations")
    parser.add_argument("--warmup-iters", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=1, help="torchrun processes for ours")
    parser.add_argument("--fp32", action="store_true", help="run a bf16 preset in fp32")
    parser.add_argument("--extra-args", default="", help="more entry-script flags for ours")
    parser.add_argument("--compile", action="store_true",
                        help="ours with --torch-compile, the peer's decoder layers compiled")
    parser.add_argument("--no-peer", action="store_true")
    parser.add_argument("--peer-recompute", action="store_true",
                        help="full activation checkpointing in the peer (HF has no selective)")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="the device's dense peak, for devices not in the table")
    parser.add_argument("--log", default=None, help="append ours' full output here")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    import torch

    from megatron_smp.parallel_state import default_device

    preset = PRESETS[args.preset]
    device = default_device()
    bf16 = preset.bf16 and not args.fp32
    peak = device_peak_tflops(device, args.peak_tflops)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    micro_batch_sizes = ([int(x) for x in args.micro_batch_sizes.split(",")]
                         if args.micro_batch_sizes else [preset.micro_batch_size])
    print(f"preset {args.preset} on {name} x{args.nproc}, seq {preset.seq_length}, "
          f"{'bf16' if bf16 else 'fp32'}{', compiled' if args.compile else ''}, "
          f"{args.warmup_iters} warm-up + {args.iters} timed "
          f"iterations, peak {peak if peak else '-'} TFLOP/s")
    results = []
    for micro_batch_size in micro_batch_sizes:
        global_batch_size = args.global_batch_size or micro_batch_size * args.nproc
        extra = shlex.split(args.extra_args) + (["--torch-compile"] if args.compile else [])
        argv = ours_argv(preset, micro_batch_size, global_batch_size,
                         args.warmup_iters + args.iters, bf16, extra)
        model_config, padded_vocab, flops = model_flops(preset, argv, global_batch_size)
        tokens = global_batch_size * preset.seq_length
        print(f"micro-batch {micro_batch_size}, global batch {global_batch_size}: "
              f"{flops / 1e12:.4f} TFLOP per iteration (Megatron's formula)")
        print(f"  {'':<6} {'ms/iter':>12} {'tokens/s':>14} {'TFLOP/s/device':>16} {'MFU':>7}")
        result = {"micro_batch_size": micro_batch_size, "global_batch_size": global_batch_size,
                  "flops_per_iteration": flops, "ours": None, "peer": None}
        timed = run_ours(preset, argv, args.nproc, args.warmup_iters, args.log)
        if timed is not None:
            result["ours"] = figures(sum(timed) / len(timed), tokens, flops, args.nproc, peak)
            print(_row("ours", result["ours"]))
        if not args.no_peer:
            try:
                peer = run_peer(preset, model_config, padded_vocab, micro_batch_size,
                                global_batch_size, args.warmup_iters, args.iters, bf16,
                                device, args.peer_recompute, args.compile)
            except torch.OutOfMemoryError as exc:
                print(f"  peer failed: {str(exc).splitlines()[0]}")
                # The failed step's tensors die with its frames: give their memory back
                # before the next (larger) run of ours needs it.
                del exc
                gc.collect()
                torch.cuda.empty_cache()
            else:
                # The peer runs on one device: its FLOPs are the whole iteration's.
                result["peer"] = figures(peer["seconds_per_step"], tokens, flops, 1, peak)
                result["peer"]["peak_memory_gib"] = peer["peak_memory_gib"]
                print(_row("peer", result["peer"]))
        if result["ours"] and result["peer"]:
            # Per device, so a multi-process run of ours compares with the one-device peer.
            ratio = (result["ours"]["tokens_per_s"] / args.nproc) / result["peer"]["tokens_per_s"]
            result["ratio_ours_over_peer"] = ratio
            print(f"  ours / peer tokens/s per device: {ratio:.3f}")
        results.append(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"preset": args.preset, "device": name, "nproc": args.nproc,
                       "bf16": bf16, "seq_length": preset.seq_length,
                       "peak_tflops": peak, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
