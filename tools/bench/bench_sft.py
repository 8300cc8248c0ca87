"""Fine-tuning figures: packing efficiency, LoRA vs full fine-tuning memory, and the step-time
cost of document masking.

* packing: tokens used / tokens paid of `--sft`'s best-fit decreasing packing (and of a greedy
  next-fit packer, for comparison) on the bundled chats (tokenised with --tokenizer-model,
  a HF tokenizer directory with a chat template) and on a long-tailed (log-normal) length
  distribution.
* memory: peak RSS above an import-only baseline of `pretrain_llama.py --mock-data` (one
  process, fp32 Adam), full fine-tuning vs `--lora-rank` (adapters only in the optimizer).
* step: forward + backward time of a Llama model on packed rows: plain causal attention over
  the whole row (what a model without document masking computes), the packed "segments"
  path (no work across documents) and the dense document-mask fallback.

    python tools/bench/bench_sft.py --tokenizer-model tok_dir
    python tools/bench/bench_sft.py --skip memory --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
MIB = 1024 * 1024


def greedy_next_fit(lengths, capacity: int) -> List[List[int]]:
    """Pack in arrival order, starting a new pack when the next one does not fit."""
    packs, used = [[]], 0
    for i, length in enumerate(lengths):
        if used + int(length) > capacity:
            packs.append([])
            used = 0
        packs[-1].append(i)
        used += int(length)
    return packs


def long_tailed_lengths(count: int, longest: int = 4096, seed: int = 0) -> np.ndarray:
    """Log-normal document lengths (median ~245 tokens, sigma 1: a long tail, 0.1% past
    5000) clipped to [8, longest]."""
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(5.5, 1.0, count).astype(np.int64), 8, longest)


def packing(tokenizer_model, seq_lengths) -> Dict[str, Dict]:
    from megatron_smp.data.sft_dataset import pack_best_fit, packing_efficiency

    results = {}
    sets = {}
    if tokenizer_model:
        sys.path.insert(0, os.path.join(REPO, "tools"))
        import preprocess_sft_data

        with tempfile.TemporaryDirectory() as directory:
            prefix = os.path.join(directory, "chat")
            preprocess_sft_data.preprocess(preprocess_sft_data.get_args([
                "--input", os.path.join(REPO, "data", "chat", "tiny_chat.jsonl"),
                "--output-prefix", prefix, "--tokenizer-model", tokenizer_model]))
            from megatron_smp.data.indexed_dataset import IndexedDataset

            sets["bundled tiny_chat"] = np.asarray(
                IndexedDataset(prefix + "_text_document").sizes) - 1
    for count in (1000, 20000):
        sets[f"log-normal x{count}"] = long_tailed_lengths(count)
    for name, lengths in sets.items():
        for capacity in [c for c in seq_lengths if c >= lengths.max()]:
            best = pack_best_fit(lengths, capacity)
            greedy = greedy_next_fit(lengths, capacity)
            results[f"{name}, seq {capacity}"] = {
                "documents": int(len(lengths)), "mean length": float(lengths.mean()),
                "max length": int(lengths.max()),
                "best-fit packs": len(best),
                "best-fit efficiency": packing_efficiency(lengths, best, capacity),
                "greedy efficiency": packing_efficiency(lengths, greedy, capacity),
            }
    return results


_PEAK_WRAPPER = """
import atexit, resource, runpy, sys
def _report():
    with open({out!r}, "w") as f:
        f.write(str(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024))
atexit.register(_report)
import torch, megatron_smp.training, pretrain_llama  # the baseline stops here
if {run!r}:
    sys.argv = ["pretrain_llama.py"] + sys.argv[1:]
    runpy.run_path("pretrain_llama.py", run_name="__main__")
"""


def _peak_rss(args: List[str], run: bool) -> int:
    with tempfile.TemporaryDirectory() as directory:
        out = os.path.join(directory, "peak")
        environment = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
        subprocess.run([sys.executable, "-c", _PEAK_WRAPPER.format(out=out, run=run)] + args,
                       cwd=REPO, env=environment, check=True, stdout=subprocess.DEVNULL,
                       timeout=3600)
        with open(out) as handle:
            return int(handle.read())


def memory(layers: int, hidden: int, ffn: int, heads: int, seq: int, lora_rank: int) -> Dict:
    model = (f"--num-layers {layers} --hidden-size {hidden} --ffn-hidden-size {ffn} "
             f"--num-attention-heads {heads} --group-query-attention --num-query-groups "
             f"{max(heads // 4, 1)} --seq-length {seq} --max-position-embeddings {seq} "
             "--micro-batch-size 1 --global-batch-size 1 --train-iters 3 --lr 1e-4 "
             "--mock-data --tokenizer-type NullTokenizer --vocab-size 32000 "
             "--log-interval 1 --eval-iters 0 --no-check-for-nan-in-loss-and-grad").split()
    baseline = _peak_rss(model, run=False)
    full = _peak_rss(model, run=True)
    lora = _peak_rss(model + ["--lora-rank", str(lora_rank)], run=True)
    parameters = _llama_parameters(layers, hidden, ffn, heads, 32000)
    return {
        "model": f"Llama {layers}x{hidden}, ffn {ffn}, {parameters / 1e6:.1f}M params, "
                 f"seq {seq}, fp32 Adam, 1 process",
        "import baseline MiB": baseline / MIB,
        "full fine-tune peak above baseline MiB": (full - baseline) / MIB,
        f"LoRA r={lora_rank} peak above baseline MiB": (lora - baseline) / MIB,
        "LoRA / full": (lora - baseline) / max(full - baseline, 1),
    }


def _llama_parameters(layers, hidden, ffn, heads, vocab):
    groups = max(heads // 4, 1)
    qkv = hidden * (hidden + 2 * groups * hidden // heads)
    per_layer = qkv + hidden * hidden + 3 * hidden * ffn + 2 * hidden
    return layers * per_layer + 2 * vocab * hidden + hidden


def step_time(seq: int, layers: int, hidden: int, heads: int, repeats: int) -> Dict:
    import torch

    from megatron_smp.config import ParallelConfig, TransformerConfig
    from megatron_smp.data.sft_dataset import pack_best_fit
    from megatron_smp.models import GPTModel
    from megatron_smp.parallel_state import build_parallel_state, destroy_parallel_state

    torch.set_num_threads(1)
    lengths = long_tailed_lengths(4000, seq, seed=1)  # documents up to the whole row
    pack = max(pack_best_fit(lengths, seq), key=len)  # the pack holding most documents
    doc_lengths = [int(lengths[i]) for i in pack]
    if sum(doc_lengths) < seq:
        doc_lengths.append(seq - sum(doc_lengths))  # the end padding: a document of its own
    document_ids = torch.repeat_interleave(torch.arange(len(doc_lengths)),
                                           torch.tensor(doc_lengths))[None]
    positions = torch.cat([torch.arange(n) for n in doc_lengths])[None]
    state = build_parallel_state(ParallelConfig())
    results = {"documents in the row": len(doc_lengths), "seq": seq}
    backends = ("causal", "segments", "mask")
    try:
        models = {}
        for backend in backends:
            config = TransformerConfig(
                num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                num_query_groups=max(heads // 4, 1), ffn_hidden_size=4 * hidden,
                vocab_size=8000, max_position_embeddings=seq, hidden_dropout=0.0,
                attention_dropout=0.0, normalization="RMSNorm", gated_linear_unit=True,
                activation="silu", position_embedding_type="rope", add_bias_linear=False,
                packed_attention="segments" if backend == "causal" else backend)
            models[backend] = GPTModel(config, state)
        tokens = torch.randint(0, 8000, (1, seq))
        times = {backend: [] for backend in backends}
        # Round-robin, so that the machine's drift falls on every backend alike.
        for step in range(repeats + 1):
            for backend in backends:
                kwargs = {} if backend == "causal" else {"document_ids": document_ids,
                                                         "position_ids": positions}
                start = time.perf_counter()
                models[backend](tokens, labels=tokens, **kwargs).mean().backward()
                if step:  # the first round is a warm-up
                    times[backend].append(time.perf_counter() - start)
        for backend in backends:
            results[f"{backend} ms"] = 1000 * float(np.median(times[backend]))
    finally:
        destroy_parallel_state()
    results["segments / causal"] = results["segments ms"] / results["causal ms"]
    results["mask / causal"] = results["mask ms"] / results["causal ms"]
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer-model", default=None,
                        help="HF tokenizer directory with a chat template for the bundled set")
    parser.add_argument("--seq-lengths", type=int, nargs="+", default=[96, 256, 4096, 8192])
    parser.add_argument("--skip", nargs="*", default=[], choices=["packing", "memory", "step"])
    parser.add_argument("--memory-model", type=int, nargs=4, default=[8, 1024, 2816, 16],
                        metavar=("LAYERS", "HIDDEN", "FFN", "HEADS"))
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--step-seq-lengths", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    report = {}
    if "packing" not in args.skip:
        report["packing"] = packing(args.tokenizer_model, args.seq_lengths)
    if "memory" not in args.skip:
        report["memory"] = memory(*args.memory_model, seq=512, lora_rank=args.lora_rank)
    if "step" not in args.skip:
        report["step"] = [step_time(seq, 4, 512, 8, args.repeats)
                          for seq in args.step_seq_lengths]
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
