"""Peak memory and throughput of tools/checkpoint/convert.py, every streaming path.

    python tools/bench/bench_convert.py                      # the 0.5B and 2B Llamas, tied GPT-2
    python tools/bench/bench_convert.py --models llama-0.5b --workdir /big/tmp

For each model, random bf16 weights are written by Hugging Face `save_pretrained` (into a
temporary directory, removed at the end unless --keep), then converted along the paths users
take, each conversion a fresh `python` process that reports its own peak RSS (VmHWM, Linux):

    hf -> megatron_smp -> hf                      (the HF loader and saver)
    megatron_smp -> megatron (Megatron-LM legacy, TP=2) -> hf / megatron_smp   (its saver
                                                   and loader)
    smp_v1 -> hf / megatron_smp                    (GPT-2 only: an SMP v1 file in v1's layout)

The figure is the peak above a baseline: the same conversion of a tiny model of the same kind
(2 layers x 64), which holds everything but the weights (the imports -- torch, transformers,
DCP -- the HF model class built on the meta device, the config files). Printed beside it: the
model's bytes, the largest layer's and the embedding's bytes, the ratio of the peak to them,
and MB/s (the model's bytes over the conversion's wall time, verification included).
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

# (model type, HF shape), bf16. The Llamas: ~0.5B and ~2B parameters, vocabulary 32000,
# untied output head. The GPT-2: tied head, its table (50257 x 1024) larger than 4 layers.
MODELS: Dict[str, Tuple[str, dict]] = {
    "llama-0.5b": ("llama", dict(hidden_size=1536, intermediate_size=4096,
                                 num_hidden_layers=16, num_attention_heads=12,
                                 num_key_value_heads=4, vocab_size=32000)),
    "llama-2b": ("llama", dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=40,
                               num_attention_heads=16, num_key_value_heads=4,
                               vocab_size=32000)),
    "gpt2-tied": ("gpt2", dict(n_embd=1024, n_layer=8, n_head=16, vocab_size=50257,
                               n_positions=1024)),
    "llama-tiny": ("llama", dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2,
                                 vocab_size=1000)),
    "gpt2-tiny": ("gpt2", dict(n_embd=64, n_layer=2, n_head=4, vocab_size=1000,
                               n_positions=64)),
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


def hf_config(model_type: str, shape: dict):
    from transformers import GPT2Config, LlamaConfig

    if model_type == "gpt2":
        return GPT2Config(tie_word_embeddings=True, **shape)
    return LlamaConfig(max_position_embeddings=4096,
                       **{"tie_word_embeddings": False, **shape})


def write_model(directory: str, model_type: str, shape: dict, seed: int = 0) -> None:
    """A model with random bf16 weights, written by save_pretrained."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = AutoModelForCausalLM.from_config(hf_config(model_type, shape))
    finally:
        torch.set_default_dtype(previous)
    model.save_pretrained(directory)


def write_smp_v1(hf_dir: str, v1_dir: str) -> None:
    """The GPT-2 of `hf_dir` as SMP v1's full checkpoint (smp.save({"model_state_dict": sd},
    partial=False) in v1's own layout, v1's translator), its config.json beside it."""
    import torch
    from transformers import AutoModelForCausalLM

    from megatron_smp.models.hf.smp_v1 import TRANSLATORS

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype="auto")
    os.makedirs(v1_dir, exist_ok=True)
    state_dict = TRANSLATORS["gpt2"][1](model.state_dict())
    torch.save({"model_state_dict": state_dict}, os.path.join(v1_dir, "checkpoint.pt"))
    model.config.save_pretrained(v1_dir)


def model_bytes(model_type: str, shape: dict) -> Tuple[int, int, int]:
    """(all weights as stored, the largest layer, the largest tensor outside the layers: the
    embedding) in bytes, from the HF model built on the meta device (a tied head counted
    once)."""
    from tools.checkpoint.common import meta_hf_model
    from tools.checkpoint.streaming import group_of

    config = hf_config(model_type, shape)
    state = meta_hf_model(config).state_dict()
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    per_group: Dict[object, int] = {}
    for name, tensor in state.items():
        key = group_of(name)
        per_group[key] = per_group.get(key, 0) + tensor.numel() * 2
    layers = [size for key, size in per_group.items() if key[0] == 1]
    others = [size for key, size in per_group.items() if key[0] != 1]
    return sum(per_group.values()), max(layers), max(others)


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


# Every path measured: (name, loader, saver, from, to, extra flags); from/to name the
# directories ("hf", "smp", "back", ...). The paths needing Megatron-LM / SMP v1 input follow
# the ones writing it.
PATHS = [
    ("hf->ours", "hf", "megatron_smp", "hf", "smp", []),
    ("ours->hf", "megatron_smp", "hf", "smp", "back", ["--max-shard-size", "500MB"]),
    ("ours->megatron", "megatron_smp", "megatron", "smp", "megatron",
     ["--target-tensor-parallel-size", "2"]),
    ("megatron->hf", "megatron", "hf", "megatron", "megatron-hf", []),
    ("megatron->ours", "megatron", "megatron_smp", "megatron", "megatron-smp", []),
    ("smp_v1->hf", "smp_v1", "hf", "v1", "v1-hf", []),
    ("smp_v1->ours", "smp_v1", "megatron_smp", "v1", "v1-smp", []),
]


def measure_here(argv: List[str]) -> Tuple[int, float]:
    """(peak RSS above the RSS before, seconds) of convert.py's main(argv) in this process:
    VmHWM reset to the current RSS (/proc/self/clear_refs) after freed memory was returned.
    Cheaper than a fresh process per conversion (the imports once), for a process that
    converted a tiny model along the same path first."""
    import gc

    from megatron_smp.distributed.param_and_grad_buffer import release_freed_host_memory
    from megatron_smp.testing import proc_status_kib
    from tools.checkpoint.convert import main as convert_main

    gc.collect()
    release_freed_host_memory()
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")  # VmHWM := VmRSS
    start = proc_status_kib("VmRSS")
    begin = time.perf_counter()
    status = convert_main(argv)
    seconds = time.perf_counter() - begin
    if status:
        raise RuntimeError(f"convert.py {' '.join(argv)} failed with status {status}")
    return (proc_status_kib("VmHWM") - start) * 1024, seconds


def convert_all(workdir: str, name: str, model_type: str, shape: dict, paths: List[str],
                measure_one=measure) -> Dict[str, Tuple[int, float]]:
    """Peak RSS and seconds (`measure_one`: a fresh process each, or `measure_here`) of each
    path of `paths` (names of PATHS), for a model written now; each output directory is
    removed as soon as no later path reads it."""
    def where(kind: str) -> str:
        return os.path.join(workdir, f"{name}-{kind}")

    chosen = [p for p in PATHS if p[0] in paths and (model_type == "gpt2" or
                                                     p[1] != "smp_v1")]
    write_model(where("hf"), model_type, shape)
    if any(p[1] == "smp_v1" for p in chosen):
        write_smp_v1(where("hf"), where("v1"))
    figures = {}
    for index, (path, loader, saver, source, target, extra) in enumerate(chosen):
        figures[path] = measure_one(["--model-type", model_type, "--loader", loader, "--saver",
                                     saver, "--load-dir", where(source), "--save-dir",
                                     where(target)] + extra)
        later = {p[3] for p in chosen[index + 1:]}
        for kind in (source, target):
            if kind not in later:
                shutil.rmtree(where(kind), ignore_errors=True)
    for kind in {"hf", "v1"} | {p[3] for p in chosen} | {p[4] for p in chosen}:
        shutil.rmtree(where(kind), ignore_errors=True)
    return figures


# Paths that between them run every reader and writer (and import what they import).
WARM_UP = ["hf->ours", "ours->megatron", "megatron->hf", "smp_v1->ours"]


def peaks_in_one_process(workdir: str, model_type: str, shape: dict,
                         paths: List[str]) -> Dict[str, Tuple[int, float]]:
    """`convert_all` of the model with `measure_here`, after WARM_UP on the tiny model of its
    kind (so that what the readers and writers import and cache is in the RSS before)."""
    from tools.checkpoint.convert import _return_freed_memory

    _return_freed_memory()  # the models written here free their memory too
    convert_all(workdir, "tiny", model_type, MODELS[f"{model_type}-tiny"][1], WARM_UP,
                measure_here)
    return convert_all(workdir, "model", model_type, shape, paths, measure_here)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="llama-0.5b,llama-2b,gpt2-tied",
                        help=f"of {sorted(MODELS)}")
    parser.add_argument("--paths", default=",".join(p[0] for p in PATHS),
                        help="of " + ", ".join(p[0] for p in PATHS))
    parser.add_argument("--workdir", default=None, help="where the models are written "
                        "(default: a temporary directory)")
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args()
    paths = args.paths.split(",")
    workdir = args.workdir or tempfile.mkdtemp(prefix="bench_convert_")
    os.makedirs(workdir, exist_ok=True)
    results = []
    baselines: Dict[str, Dict[str, Tuple[int, float]]] = {}
    try:
        for model in args.models.split(","):
            model_type, shape = MODELS[model]
            if model_type not in baselines:
                baselines[model_type] = convert_all(workdir, "tiny", model_type,
                                                    MODELS[f"{model_type}-tiny"][1], paths)
                for direction, (peak, _) in baselines[model_type].items():
                    print(f"baseline (tiny {model_type}) {direction}: peak RSS "
                          f"{peak / 2**20:.0f} MiB")
            total, layer, embedding = model_bytes(model_type, shape)
            figures = convert_all(workdir, model, model_type, shape, paths)
            for direction, (peak, seconds) in figures.items():
                above = peak - baselines[model_type][direction][0]
                row = dict(model=model, direction=direction, model_mb=total / 1e6,
                           layer_mb=layer / 1e6, embedding_mb=embedding / 1e6,
                           peak_mib=peak / 2**20, above_baseline_mb=above / 1e6,
                           peak_over_model=above / total,
                           peak_over_layer_plus_embedding=above / (layer + embedding),
                           seconds=seconds, mb_per_s=total / 1e6 / seconds,
                           load=os.getloadavg()[0])
                results.append(row)
                print(f"{model} {direction}: model {total / 1e6:.0f} MB (largest layer "
                      f"{layer / 1e6:.0f} MB, embedding {embedding / 1e6:.0f} MB); peak RSS "
                      f"{peak / 2**20:.0f} MiB, {above / 1e6:.0f} MB above the baseline = "
                      f"{above / total:.2f} x the model, "
                      f"{above / (layer + embedding):.2f} x (layer + embedding); "
                      f"{seconds:.1f} s, {total / 1e6 / seconds:.0f} MB/s (load "
                      f"{os.getloadavg()[0]:.1f})", flush=True)
    finally:
        if not args.keep and args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    print(f"load average: {os.getloadavg()}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)


if __name__ == "__main__":
    main()


__all__ = ["MODELS", "PATHS", "convert_all", "model_bytes", "measure", "measure_here",
           "peaks_in_one_process", "write_model"]
