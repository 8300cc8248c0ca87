"""Index builders: ours beside megatron-core's compiled helpers, time and peak memory.

    .venv/bin/python tools/bench/bench_data_indices.py [--samples 24000000 244000000]
        [--datasets 10] [--mcore-helpers PATH/helpers_cpp.cpython-*.so]

For each sample count: build_blending_indices (random weights over --datasets datasets),
build_exhaustive_blending_indices (sizes summing to the count) and, up to
--max-sample-index-samples, the GPT sample index (documents of 1..2*seq tokens, seq 256),
each in a fresh process: wall and CPU time (the ratio to megatron-core is of CPU time, which
a shared machine disturbs less) and the growth of peak RSS (VmHWM, reset before the
build) beside the bytes of the output arrays. megatron-core's `helpers_cpp` is used when
importable (megatron-core installed here, or --mcore-helpers / $MCORE_HELPERS pointing at
its compiled module, e.g. from a scratch `pip install --no-deps megatron-core==0.16.1`);
its arrays are checked equal to ours. `--fallback` also times our numpy/Python path.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEQ_LENGTH = 256


def _rss_mib(field: str) -> float:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def _reset_peak() -> None:
    try:  # "5" resets VmHWM to the current RSS (Linux >= 4.0)
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
    except OSError:
        pass


def _load_mcore(path):
    if path:
        import importlib.machinery
        import importlib.util

        loader = importlib.machinery.ExtensionFileLoader("helpers_cpp", path)
        spec = importlib.util.spec_from_file_location("helpers_cpp", path, loader=loader)
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
        return module
    from megatron.core.datasets import helpers_cpp  # noqa: PLC0415

    return helpers_cpp


def _inputs(kind: str, samples: int, datasets: int):
    rng = np.random.RandomState(1234)
    if kind == "blending":
        weights = rng.rand(datasets)
        return (weights / weights.sum()).astype(np.float64)
    if kind == "exhaustive":
        shares = rng.rand(datasets)
        sizes = np.floor(shares / shares.sum() * samples).astype(np.int64)
        sizes[0] += samples - sizes.sum()
        return sizes
    # sample index: one epoch of documents holding samples * seq + 1 tokens
    mean = SEQ_LENGTH
    num_documents = (samples * SEQ_LENGTH) // mean + 1
    sizes = rng.randint(1, 2 * mean, size=num_documents).astype(np.int32)
    document_index = np.arange(num_documents, dtype=np.int32)
    rng.shuffle(document_index)
    return sizes, document_index


def _child(kind: str, impl: str, samples: int, datasets: int, mcore_path, out_path) -> None:
    """Build once in this process; print a JSON line with time, peak growth and a digest."""
    sys.path.insert(0, REPO)
    from megatron_smp.data import compiled, indices

    inputs = _inputs(kind, samples, datasets)
    if impl == "mcore":
        helpers = _load_mcore(mcore_path)
    elif impl == "ours":
        assert compiled.library() is not None, "the C helpers did not build"
    import gc

    gc.collect()
    rss_before = _rss_mib("VmRSS")
    _reset_peak()
    start, cpu_start = time.perf_counter(), time.process_time()
    if kind == "blending":
        if impl == "mcore":
            arrays = (np.zeros(samples, np.int16), np.zeros(samples, np.int64))
            helpers.build_blending_indices(arrays[0], arrays[1], inputs, datasets, samples, False)
        elif impl == "ours":
            arrays = indices.build_blending_indices(inputs, samples)
        else:
            arrays = indices._greedy_blend(inputs.tolist(), samples)
    elif kind == "exhaustive":
        total = int(inputs.sum())
        if impl == "mcore":
            arrays = (np.zeros(total, np.int16), np.zeros(total, np.int64))
            helpers.build_exhaustive_blending_indices(arrays[0], arrays[1], inputs, datasets)
        elif impl == "ours":
            arrays = indices.build_exhaustive_blending_indices(inputs.tolist())
        else:
            sizes = inputs.tolist()
            arrays = indices._greedy_blend(
                [s / float(total) for s in sizes], total, limits=sizes
            )
    else:
        sizes, document_index = inputs
        if impl == "mcore":
            tokens = int(sizes.sum(dtype=np.int64))
            arrays = (helpers.build_sample_idx_int64(
                sizes, document_index, SEQ_LENGTH, 1, tokens, True, 1
            ),)
        elif impl == "ours":
            arrays = (indices.build_sample_index(sizes, document_index, SEQ_LENGTH),)
        else:
            arrays = (indices._sample_index_numpy(sizes, document_index, SEQ_LENGTH, 1),)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    peak_growth = _rss_mib("VmHWM") - rss_before
    import hashlib

    digest = hashlib.sha1()
    for array in arrays:
        digest.update(np.ascontiguousarray(array, dtype=np.int64).tobytes())
    result = {
        "seconds": elapsed,
        "cpu_seconds": cpu,
        "peak_mib": peak_growth,
        "output_mib": sum(a.nbytes for a in arrays) / 2**20,
        "digest": digest.hexdigest(),
    }
    with open(out_path, "w") as handle:
        json.dump(result, handle)


def _run(kind, impl, samples, datasets, mcore_path):
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        command = [
            sys.executable, os.path.abspath(__file__), "--child", kind, impl, str(samples),
            str(datasets), mcore_path or "", out.name,
        ]
        subprocess.run(command, check=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        with open(out.name) as handle:
            return json.load(handle)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, nargs="+", default=[24_000_000, 244_000_000])
    parser.add_argument("--datasets", type=int, default=10)
    parser.add_argument("--kinds", nargs="+", default=["blending", "exhaustive", "sample_index"],
                        choices=["blending", "exhaustive", "sample_index"])
    parser.add_argument("--max-sample-index-samples", type=int, default=24_000_000)
    parser.add_argument("--mcore-helpers", default=os.environ.get("MCORE_HELPERS"))
    parser.add_argument("--fallback", action="store_true",
                        help="also time our numpy/Python path (slow at these sizes)")
    args = parser.parse_args(argv)
    impls = ["ours"]
    try:
        _load_mcore(args.mcore_helpers)
        impls.append("mcore")
    except (ImportError, OSError) as error:
        print(f"megatron-core's helpers_cpp is not importable ({error}); ours only")
    if args.fallback:
        impls.append("fallback")
    print(f"{'build':<14} {'samples':>12} {'impl':<9} {'wall s':>8} {'cpu s':>8} "
          f"{'peak MiB':>9} {'output MiB':>10} {'peak/out':>8} {'cpu/mcore':>9} same")
    for samples in args.samples:
        for kind in args.kinds:
            if kind == "sample_index" and samples > args.max_sample_index_samples:
                continue
            results = {impl: _run(kind, impl, samples, args.datasets, args.mcore_helpers)
                       for impl in impls}
            for impl, result in results.items():
                ratio = (f"{result['cpu_seconds'] / results['mcore']['cpu_seconds']:9.2f}"
                         if "mcore" in results else f"{'-':>9}")
                same = ("yes" if result["digest"] == results[impls[0]]["digest"] else "NO")
                print(f"{kind:<14} {samples:>12} {impl:<9} {result['seconds']:8.3f} "
                      f"{result['cpu_seconds']:8.3f} "
                      f"{result['peak_mib']:9.1f} {result['output_mib']:10.1f} "
                      f"{result['peak_mib'] / result['output_mib']:8.2f} {ratio} {same}",
                      flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        kind, impl, samples, datasets, mcore_path, out_path = sys.argv[2:8]
        _child(kind, impl, int(samples), int(datasets), mcore_path or None, out_path)
    else:
        main()
