"""Generation speed and KV-cache memory: our engine against Hugging Face's `generate` on the same
Llama-style model and weights (converted with `smp.transform`), in one process, interleaved.

    python tools/bench/bench_inference.py [--layers 4 --hidden 256 --prompt 128 --new 64]

* batch 1: one prompt of --prompt tokens, --new greedy tokens. Prefill tokens/s is the prompt
  over the time to the first token; decode tokens/s is the other new tokens over the rest.
* stream: --requests prompts of different lengths (--prompt / 4 .. --prompt) arriving at
  once, asking --new / 2 .. --new tokens (so they finish at different steps). Ours: every
  request to the continuous-batching engine; HF: one left-padded `generate` call over all
  of them (its best case: it must know the whole batch up front, and it runs every row to
  the longest), and HF one request at a time (what `generate` behind a server without a
  batching layer does). Reported: requested tokens per second of wall time.
* cache memory: our allocated pool for the stream (sized to the requests) against the bytes
  of HF's DynamicCache at the end of its batched call (padding included).
Greedy tokens are checked equal between the two for every prompt. Prints one table.
"""
from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch


def _timed(fn):
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


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
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    if args.threads:
        torch.set_num_threads(args.threads)

    import transformers as tf

    import megatron_smp as smp
    from megatron_smp.inference import InferenceEngine, SamplingParams

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

    def ours_generate(prompts, new, max_tokens=None):
        total = max_tokens or sum(len(p) + new for p in prompts)
        engine = InferenceEngine(module, max_tokens=total, max_requests=len(prompts))
        requests = engine.generate(prompts, [SamplingParams(max_new_tokens=new)] * len(prompts))
        return engine, requests

    # batch 1 ----------------------------------------------------------------------------------
    rows = {"hf": {"first": [], "all": []}, "ours": {"first": [], "all": []}}
    ones = torch.ones_like(prompt)
    for _ in range(args.repeats):
        rows["hf"]["first"].append(_timed(lambda: hf_generate(prompt, ones, 1))[0])
        rows["ours"]["first"].append(_timed(lambda: ours_generate(prompt.tolist(), 1))[0])
        t_hf, out_hf = _timed(lambda: hf_generate(prompt, ones, args.new))
        t_ours, (_, requests) = _timed(lambda: ours_generate(prompt.tolist(), args.new))
        rows["hf"]["all"].append(t_hf)
        rows["ours"]["all"].append(t_ours)
        assert requests[0].output == out_hf.sequences[0, args.prompt:].tolist(), "tokens differ"

    def batch1(name):
        first = statistics.median(rows[name]["first"])
        total = statistics.median(rows[name]["all"])
        return args.prompt / first, (args.new - 1) / max(total - first, 1e-9)

    # stream -----------------------------------------------------------------------------------
    longest = max(lengths)
    ids = torch.zeros(len(stream), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, tokens in enumerate(stream):
        ids[row, longest - len(tokens):] = torch.tensor(tokens)
        mask[row, longest - len(tokens):] = 1
    news = [args.new // 2 + (i * args.new // 2) // max(args.requests - 1, 1)
            for i in range(args.requests)]
    stream_times = {"hf": [], "ours": [], "hf_each": []}
    hf_cache_bytes = ours_cache_bytes = 0
    for _ in range(args.repeats):
        # HF's batch runs until its longest request is done; it cannot stop rows early.
        t_hf, out_hf = _timed(lambda: hf_generate(ids, mask, max(news)))
        stream_times["hf"].append(t_hf)
        cache = out_hf.past_key_values
        hf_cache_bytes = sum(t.numel() * t.element_size() for layer in cache.layers
                             for t in (layer.keys, layer.values))

        def run():
            total = sum(len(p) + n for p, n in zip(stream, news))
            engine = InferenceEngine(module, max_tokens=total, max_requests=len(stream))
            return engine, engine.generate(stream, [SamplingParams(max_new_tokens=n)
                                                    for n in news])

        def one_by_one():
            for tokens, new in zip(stream, news):
                row = torch.tensor([tokens])
                hf_generate(row, torch.ones_like(row), new)

        stream_times["hf_each"].append(_timed(one_by_one)[0])
        t_ours, (engine, requests) = _timed(run)
        stream_times["ours"].append(t_ours)
        ours_cache_bytes = engine.cache.allocated_bytes()
        for row, request in enumerate(requests):
            assert request.output == out_hf.sequences[row, longest:longest + news[row]].tolist()
    generated = sum(news)
    hf_generated = len(stream) * max(news)

    print(f"model: Llama {args.layers} x {args.hidden}, heads {args.heads}/{args.kv_heads}, "
          f"vocab {args.vocab}, fp32, {torch.get_num_threads()} threads; "
          f"median of {args.repeats}")
    print(f"{'':28}{'HF generate':>14}{'ours':>14}{'ours / HF':>12}")
    hf_prefill, hf_decode = batch1("hf")
    our_prefill, our_decode = batch1("ours")
    print(f"{'batch 1 prefill tok/s':28}{hf_prefill:14.0f}{our_prefill:14.0f}"
          f"{our_prefill / hf_prefill:12.2f}")
    print(f"{'batch 1 decode tok/s':28}{hf_decode:14.1f}{our_decode:14.1f}"
          f"{our_decode / hf_decode:12.2f}")
    hf_rate = generated / statistics.median(stream_times["hf"])
    our_rate = generated / statistics.median(stream_times["ours"])
    print(f"{f'{args.requests} requests, tok/s':28}{hf_rate:14.1f}{our_rate:14.1f}"
          f"{our_rate / hf_rate:12.2f}")
    print(f"{'  (HF generated, padding)':28}{hf_generated:14d}{generated:14d}")
    each_rate = generated / statistics.median(stream_times["hf_each"])
    print(f"{'  HF one request at a time':28}{each_rate:14.1f}{our_rate:14.1f}"
          f"{our_rate / each_rate:12.2f}")
    print(f"{'stream KV cache MiB':28}{hf_cache_bytes / 2**20:14.2f}"
          f"{ours_cache_bytes / 2**20:14.2f}{ours_cache_bytes / hf_cache_bytes:12.2f}")


if __name__ == "__main__":
    main()
