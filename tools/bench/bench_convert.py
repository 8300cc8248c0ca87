"""Peak memory and throughput of tools/checkpoint/convert.py, HF -> megatron_smp -> HF.

    python tools/bench/bench_convert.py                      # the 0.5B and the 2B Llama
    python tools/bench/bench_convert.py --sizes 0.5b --workdir /big/tmp

For each size, a Llama with random bf16 weights is written by Hugging Face `save_pretrained`
(into a temporary directory, removed at the end unless --keep), then converted to megatron_smp
and back to HF, each conversion a fresh `python` process that reports its own peak RSS
(VmHWM, Linux). The figure is the peak above a baseline: the same conversion of a tiny Llama
(2 layers x 64), which holds everything but the weights (the imports -- torch, transformers,
DCP -- the HF model class built on the meta device, the config files). Printed beside it:
the model's bytes, the largest layer's and the embedding's bytes, the ratio of the peak to
them, and MB/s (the model's bytes over the conversion's wall time, verification included).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Llama shapes (bf16): ~0.5B and ~2B parameters, vocabulary 32000, untied output head.
SIZES: Dict[str, dict] = {
    "0.5b": dict(hidden_size=1536, intermediate_size=4096, num_hidden_layers=16,
                 num_attention_heads=12, num_key_value_heads=4, vocab_size=32000),
    "2b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=40,
               num_attention_heads=16, num_key_value_heads=4, vocab_size=32000),
    "tiny": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=1000),
}

# Runs convert.py's main in this process and prints its peak RSS: the kernel's high-water
# mark of this process's memory (VmHWM), which starts afresh at exec -- unlike ru_maxrss, which
# Linux carries over from the forked copy of the parent (this benchmark, holding a model).
_MEASURE = """
import sys, time
sys.path.insert(0, {root!r})
from tools.checkpoint.convert import main
start = time.perf_counter()
status = main({argv!r})
seconds = time.perf_counter() - start
with open("/proc/self/status") as handle:
    peak = [int(line.split()[1]) * 1024 for line in handle if line.startswith("VmHWM:")][0]
print("MEASURED", status, peak, seconds)
"""


def write_llama(directory: str, seed: int = 0, **shape) -> None:
    """A Llama with random bf16 weights, written by save_pretrained."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(max_position_embeddings=4096, tie_word_embeddings=False, **shape)
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    model.save_pretrained(directory)


def model_bytes(shape: dict) -> Tuple[int, int, int]:
    """(all weights, the largest layer, the embedding table) in bytes, bf16."""
    h, f, heads, groups = (shape["hidden_size"], shape["intermediate_size"],
                           shape["num_attention_heads"], shape["num_key_value_heads"])
    d = h // heads
    layer = 2 * (h * heads * d * 2 + h * groups * d * 2 + 3 * h * f + 2 * h)
    embedding = 2 * shape["vocab_size"] * h
    return shape["num_hidden_layers"] * layer + 2 * embedding + 2 * h, layer, embedding


def measure(argv: List[str]) -> Tuple[int, float]:
    """(peak RSS in bytes, seconds) of convert.py's main(argv) in a fresh process."""
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS",
                                                                            "1"))
    result = subprocess.run([sys.executable, "-c", _MEASURE.format(root=ROOT, argv=argv)],
                            capture_output=True, text=True, env=env, timeout=3600)
    line = [x for x in result.stdout.splitlines() if x.startswith("MEASURED")]
    if result.returncode or not line or line[0].split()[1] != "0":
        raise RuntimeError(f"convert.py {' '.join(argv)} failed:\n{result.stdout[-2000:]}\n"
                           f"{result.stderr[-4000:]}")
    _, _, peak, seconds = line[0].split()
    return int(peak), float(seconds)


def round_trip(workdir: str, name: str, shape: dict) -> Dict[str, Tuple[int, float]]:
    """Peak RSS and seconds of HF -> megatron_smp and back, for a model written now."""
    hf, ours, back = (os.path.join(workdir, f"{name}-{kind}") for kind in ("hf", "smp", "back"))
    write_llama(hf, **shape)
    common = ["--model-type", "llama"]
    figures = {"hf->ours": measure(common + ["--loader", "hf", "--saver", "megatron_smp",
                                             "--load-dir", hf, "--save-dir", ours]),
               "ours->hf": measure(common + ["--loader", "megatron_smp", "--saver", "hf",
                                             "--load-dir", ours, "--save-dir", back,
                                             "--max-shard-size", "500MB"])}
    for path in (hf, ours, back):
        shutil.rmtree(path, ignore_errors=True)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="0.5b,2b", help=f"of {sorted(SIZES)}")
    parser.add_argument("--workdir", default=None, help="where the models are written "
                        "(default: a temporary directory)")
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args()
    workdir = args.workdir or tempfile.mkdtemp(prefix="bench_convert_")
    os.makedirs(workdir, exist_ok=True)
    results = []
    try:
        baseline = round_trip(workdir, "tiny", SIZES["tiny"])
        for direction, (peak, _) in baseline.items():
            print(f"baseline (tiny Llama) {direction}: peak RSS {peak / 2**20:.0f} MiB")
        for size in args.sizes.split(","):
            shape = SIZES[size]
            total, layer, embedding = model_bytes(shape)
            figures = round_trip(workdir, size, shape)
            for direction, (peak, seconds) in figures.items():
                above = peak - baseline[direction][0]
                row = dict(size=size, direction=direction, model_mb=total / 1e6,
                           layer_mb=layer / 1e6, embedding_mb=embedding / 1e6,
                           peak_mib=peak / 2**20, above_baseline_mb=above / 1e6,
                           peak_over_model=above / total,
                           peak_over_layer_plus_embedding=above / (layer + embedding),
                           seconds=seconds, mb_per_s=total / 1e6 / seconds)
                results.append(row)
                print(f"{size} {direction}: model {total / 1e6:.0f} MB (largest layer "
                      f"{layer / 1e6:.0f} MB, embedding {embedding / 1e6:.0f} MB); peak RSS "
                      f"{peak / 2**20:.0f} MiB, {above / 1e6:.0f} MB above the baseline = "
                      f"{above / total:.2f} x the model, "
                      f"{above / (layer + embedding):.2f} x (layer + embedding); "
                      f"{seconds:.1f} s, {total / 1e6 / seconds:.0f} MB/s", flush=True)
    finally:
        if not args.keep and args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    print(f"load average: {os.getloadavg()}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)


if __name__ == "__main__":
    main()
