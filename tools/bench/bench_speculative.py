"""Speculative decoding's speed: decode tokens/s of our engine without speculation and with
each drafter (n-gram lookup, the model's MTP layers, a draft model), at batch 1 and under a
stream of requests, on trained checkpoints: a target (with --mtp-num-layers for the MTP
row) and a smaller draft sharing its tokenizer. Greedy; every method's tokens are checked
equal to plain decoding's.

    python tools/bench/bench_speculative.py --load target/ --use-checkpoint-args \
        --tokenizer-type SentencePieceTokenizer --tokenizer-model sp.model \
        --draft-load draft/ --prompts data/corpus/kjv.jsonl.gz \
        [--prompt-tokens 64 --new 64 --requests 8 --batch1-prompts 4 --num-drafts 3]

Prompts: the last lines of --prompts (JSON lines with "text", gzip or not) with at least
--prompt-tokens tokens, cut to that many. Batch 1: each of --batch1-prompts prompts alone;
stream: --requests prompts at once. Decode tokens/s: the tokens after each request's first
over the time after the prompt step (a run asking one token each, timed alone, subtracted).
Times are the process's CPU seconds (--threads, default 1) on a machine other jobs share.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402


def bench_args(parser):
    group = parser.add_argument_group("bench")
    group.add_argument("--draft-load", default=None, help="the draft model's checkpoint")
    group.add_argument("--prompts", required=True, help="JSON lines with 'text'")
    group.add_argument("--prompt-tokens", type=int, default=64)
    group.add_argument("--new", type=int, default=64)
    group.add_argument("--requests", type=int, default=8)
    group.add_argument("--batch1-prompts", type=int, default=4)
    group.add_argument("--num-drafts", type=int, default=3,
                       help="num_speculative_tokens of every method")
    group.add_argument("--threads", type=int, default=1)
    return parser


def _prompts(path, tokenizer, count, length):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as handle:
        lines = [json.loads(line)["text"] for line in handle if line.strip()]
    prompts = []
    for text in reversed(lines):
        ids = tokenizer.tokenize(text)
        if len(ids) >= length:
            prompts.append(ids[:length])
        if len(prompts) == count:
            return prompts
    raise SystemExit(f"--prompts {path}: fewer than {count} lines of {length} tokens")


def main(argv=None):
    from megatron_smp.inference import InferenceEngine, SamplingParams
    from megatron_smp.inference.speculative import SpeculativeConfig
    from megatron_smp.training.inference_flags import build_inference_engine

    argv = list(sys.argv[1:] if argv is None else argv)
    known, _ = bench_args(argparse.ArgumentParser(add_help=False)).parse_known_args(argv)
    torch.set_num_threads(known.threads)
    if known.draft_load:  # the engine's setup loads the draft checkpoint
        argv += ["--speculative-config", json.dumps(
            {"method": "draft_model", "model": known.draft_load,
             "num_speculative_tokens": known.num_drafts})]
    configs, state, engine, tokenizer = build_inference_engine(argv, bench_args)
    args = configs.args
    model = engine.model
    draft = engine.draft_runner.model if engine.draft_runner is not None else None
    count = max(args.requests, args.batch1_prompts)
    prompts = _prompts(args.prompts, tokenizer, count, args.prompt_tokens)
    total = (args.prompt_tokens + args.new) * count + 16 * count
    methods = [("plain", None)]
    methods.append(("ngram", SpeculativeConfig("ngram", args.num_drafts, 3, 1)))
    if model.config.mtp_num_layers:
        methods.append(("mtp", SpeculativeConfig("mtp", args.num_drafts)))
    if draft is not None:
        methods.append(("draft_model", SpeculativeConfig("draft_model", args.num_drafts)))

    def run(speculative, batch, new):
        engine = InferenceEngine(model, max_tokens=total, max_requests=count,
                                 speculative=speculative,
                                 draft_model=draft if speculative is not None
                                 and speculative.method == "draft_model" else None)
        params = [SamplingParams(max_new_tokens=new) for _ in batch]
        start = time.process_time()
        requests = engine.generate(batch, params)
        return time.process_time() - start, [r.output for r in requests], engine

    rows, plain_tokens = {}, {}
    for name, speculative in methods:
        run(speculative, prompts[:1], 4)  # warm-up
        batch1, first1, drafted, accepted = 0.0, 0.0, 0, 0
        for index, prompt in enumerate(prompts[:args.batch1_prompts]):
            first1 += run(speculative, [prompt], 1)[0]
            seconds, tokens, used = run(speculative, [prompt], args.new)
            batch1 += seconds
            if speculative is not None:
                drafted += used.num_drafted
                accepted += used.num_accepted
            key = ("batch1", index)
            plain_tokens.setdefault(key, tokens)
            assert tokens == plain_tokens[key], f"{name}: batch-1 tokens differ from plain"
        stream = prompts[:args.requests]
        first = run(speculative, stream, 1)[0]
        seconds, tokens, used = run(speculative, stream, args.new)
        plain_tokens.setdefault("stream", tokens)
        assert tokens == plain_tokens["stream"], f"{name}: stream tokens differ from plain"
        decode_tokens = args.batch1_prompts * (args.new - 1)
        rows[name] = (decode_tokens / max(batch1 - first1, 1e-9),
                      accepted / drafted if drafted else None,
                      len(stream) * (args.new - 1) / max(seconds - first, 1e-9),
                      used.num_accepted / used.num_drafted if speculative and used.num_drafted
                      else None, drafted, accepted, used.num_drafted, used.num_accepted)
    config = model.config
    print(f"target: {config.num_layers} x {config.hidden_size}, heads "
          f"{config.num_attention_heads}/{config.num_query_groups or config.num_attention_heads}, "
          f"vocab {config.vocab_size}, MTP layers {config.mtp_num_layers or 0}"
          + (f"; draft: {draft.config.num_layers} x {draft.config.hidden_size}" if draft else "")
          + f"; prompts {args.prompt_tokens} tokens, {args.new} new, greedy, "
          f"num_speculative_tokens {args.num_drafts}, {args.threads} thread(s), process time")
    print(f"{'method':14}{'batch-1 decode tok/s':>22}{'x plain':>9}{'accept':>9}"
          f"{f'{args.requests} requests decode tok/s':>28}{'x plain':>9}{'accept':>9}"
          f"{'drafted/accepted (b1; stream)':>32}")
    base = rows["plain"]
    for name, (b1, rate1, flow, rate, d1, a1, d, a) in rows.items():
        print(f"{name:14}{b1:22.1f}{b1 / base[0]:9.2f}"
              f"{'' if rate1 is None else f'{rate1:.3f}':>9}{flow:28.1f}{flow / base[2]:9.2f}"
              f"{'' if rate is None else f'{rate:.3f}':>9}"
              f"{'' if name == 'plain' else f'{d1}/{a1}; {d}/{a}':>32}")
    print("tokens: every method's equal to plain decoding's (batch 1 and stream)")


if __name__ == "__main__":
    main()
