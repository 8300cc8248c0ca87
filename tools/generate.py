"""Offline batched generation from a checkpoint: JSON lines of prompts in, JSON lines of
completions out, with a progress bar. Model, checkpoint and layout take Megatron's flags.

    torchrun --nproc-per-node 2 tools/generate.py --load ckpt --use-checkpoint-args \
        --tensor-model-parallel-size 2 --tokenizer-type HuggingFaceTokenizer \
        --tokenizer-model tok/ --input prompts.jsonl --output completions.jsonl \
        --max-new-tokens 64 [--temperature 0.7 --top-p 0.9 --seed 1]

Sampled lines are reproducible: line i draws with seed --seed + i (its own "seed" instead).

An input line is {"prompt": "text"}, {"prompt_ids": [ids]} or {"messages": [{"role": ...,
"content": ...}]} (the tokenizer's chat template, or --chat-template), optionally with its
own "max_new_tokens", "temperature", "top_k", "top_p", "seed", "stop" (strings). An output
line, in input order: {"index", "prompt" (as given), "completion" (text, cut at a stop
string), "tokens" (generated ids), "logprobs" (theirs), "finish_reason"}. Requests run through
the continuous-batching engine (`--inference-max-tokens`, `--inference-max-requests`;
speculative decoding with `--speculative-config` or `--num-speculative-tokens`, its drafted /
accepted counts printed at the end); with
data-parallel replicas each runs its share of the lines and rank 0 writes them all in order.
--load takes our checkpoints and Megatron-LM's (torch_dist or legacy), as training does.
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_smp.cli import run_entry  # noqa: E402
from megatron_smp.config import ConfigError  # noqa: E402
from megatron_smp.inference import SamplingParams  # noqa: E402
from megatron_smp.inference.text import TextCodec  # noqa: E402
from megatron_smp.parallel_state import destroy_parallel_state  # noqa: E402
from megatron_smp.training.inference_flags import build_inference_engine  # noqa: E402

LINE_FIELDS = {"prompt", "prompt_ids", "messages", "max_new_tokens", "temperature", "top_k",
               "top_p", "seed", "stop"}


def add_generate_args(parser):
    group = parser.add_argument_group("generate")
    group.add_argument("--input", required=True, help="JSON lines of prompts")
    group.add_argument("--output", required=True, help="JSON lines of completions (written)")
    group.add_argument("--max-new-tokens", type=int, default=64,
                       help="tokens generated per line at most (a line's own max_new_tokens wins)")
    group.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    group.add_argument("--top-k", type=int, default=0,
                       help="sample among the k most likely tokens (0: all)")
    group.add_argument("--top-p", type=float, default=1.0,
                       help="sample among the most likely tokens of this total probability")
    group.add_argument("--chat-template", default=None,
                       help="Jinja chat template (text or file) for 'messages' lines")
    group.add_argument("--ignore-eos", action="store_true",
                       help="do not stop at the tokenizer's end-of-document token")
    return parser


def read_requests(path, args, codec, vocab_size):
    """[(line, prompt ids, SamplingParams)]; a bad line is a ConfigError naming it."""
    requests = []
    with open(path) as handle:
        for number, text in enumerate(handle, start=1):
            if not text.strip():
                continue
            where = f"--input {path} line {number}"
            try:
                line = json.loads(text)
            except json.JSONDecodeError as error:
                raise ConfigError(f"{where}: not JSON ({error})") from error
            unknown = sorted(set(line) - LINE_FIELDS) if isinstance(line, dict) else None
            if unknown is None or unknown:
                raise ConfigError(f"{where}: expected an object with fields from "
                                  f"{sorted(LINE_FIELDS)}, got {unknown or type(line).__name__}")
            sources = [k for k in ("prompt", "prompt_ids", "messages") if k in line]
            if len(sources) != 1:
                raise ConfigError(f"{where}: give exactly one of prompt, prompt_ids, messages")
            if "prompt" in line:
                ids = codec.encode(line["prompt"])
            elif "prompt_ids" in line:
                ids = [int(t) for t in line["prompt_ids"]]
            else:
                ids = codec.chat(line["messages"])
            seed = line.get("seed", args.seed + len(requests))
            stops = [] if args.ignore_eos or codec.eos_id is None else [codec.eos_id]
            try:
                params = SamplingParams(
                    max_new_tokens=line.get("max_new_tokens", args.max_new_tokens),
                    temperature=line.get("temperature", args.temperature),
                    top_k=line.get("top_k", args.top_k), top_p=line.get("top_p", args.top_p),
                    seed=seed, stop=line.get("stop", []), stop_token_ids=stops,
                ).validate(vocab_size)
            except ConfigError as error:
                raise ConfigError(f"{where}: {error}") from error
            requests.append((line, ids, params))
    return requests


def main(argv=None):
    configs, state, engine, tokenizer = build_inference_engine(argv, add_generate_args)
    args = configs.args
    codec = TextCodec(tokenizer, args.chat_template)
    engine.stop_checker = codec.stop_checker
    requests, error = [], None
    if engine.is_leader:
        try:
            args.seed = configs.training.seed
            requests = read_requests(args.input, args, codec, engine.config.vocab_size)
            submitted = [engine.add_request(ids, params) for _, ids, params in requests]
        except ConfigError as caught:  # stop every rank, then raise
            error = caught
    bar = None
    if engine.is_leader and error is None:
        from tqdm import tqdm

        bar = tqdm(total=len(requests), desc="generating", unit="request")
    while True:
        stop = engine.is_leader and (error is not None or not engine.has_work)
        advanced = engine.step(stop=stop)
        if advanced is None:
            break
        if bar is not None:
            bar.update(sum(1 for request in advanced if request.finished))
    if bar is not None:
        bar.close()
    if error is not None:
        raise error
    if engine.is_leader:
        with open(args.output, "w") as handle:
            for index, ((line, _, _), request) in enumerate(zip(requests, submitted)):
                shown = {k: line[k] for k in ("prompt", "prompt_ids", "messages") if k in line}
                record = {"index": index, **shown,
                          "completion": codec.completion_text(request),
                          "tokens": request.output, "logprobs": request.logprobs,
                          "finish_reason": request.finish_reason}
                handle.write(json.dumps(record) + "\n")
        replicas = f" (requests per data-parallel replica: {engine.served})" \
            if hasattr(engine, "served") else ""
        print(f"wrote {len(requests)} completions to {args.output} in {engine.steps} "
              f"steps{replicas}", flush=True)
        if engine.speculative is not None:
            report = engine.speculation_report()
            print(f"speculative decoding ({engine.speculative.method}): "
                  f"{report['drafted_tokens']} tokens drafted, {report['accepted_tokens']} "
                  f"accepted (acceptance rate {report['acceptance_rate']:.3f})", flush=True)
    destroy_parallel_state()  # an orderly exit of the process groups, as pretraining's


if __name__ == "__main__":
    sys.exit(run_entry(main))
