"""Pipeline schedules: measured bubble and step time, megatron_smp vs torch.distributed.pipelining.

Every schedule runs the same GPTModel stages (same layer split, same weights) on CPU gloo,
one thread per rank, in one set of processes:

  * megatron_smp `gpipe` (SMP's `simple`), `1f1b` (SMP's `interleaved`) and
    `interleaved_1f1b` (Megatron's virtual-pipeline schedule, v chunks);
  * torch.distributed.pipelining ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B.

Step time is one schedule call over the global batch (forward + backward of m microbatches,
no optimizer step), median over the timed steps, between barriers. The bubble is measured
from megatron_smp's timeline (1 - busy compute time / (ranks x step window)) and printed
next to the textbook (p - 1) / (v m + p - 1).

    python tools/bench/bench_pipeline.py                  # PP=2, m=8
    python tools/bench/bench_pipeline.py --pp 4 --microbatches 8 --trace /tmp/pp_trace
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron_smp.testing import run_distributed  # noqa: E402

# name -> (framework, schedule, virtual stages per rank)
RUNS = {
    "smp gpipe": ("smp", "gpipe", 1),
    "smp 1f1b": ("smp", "1f1b", 1),
    "smp interleaved_1f1b": ("smp", "interleaved_1f1b", 2),
    "torch ScheduleGPipe": ("torch", "ScheduleGPipe", 1),
    "torch Schedule1F1B": ("torch", "Schedule1F1B", 1),
    "torch ScheduleInterleaved1F1B": ("torch", "ScheduleInterleaved1F1B", 2),
}


def _model_config(opts):
    from megatron_smp.config import TransformerConfig

    return TransformerConfig(
        num_layers=opts["layers"], hidden_size=opts["hidden"], num_attention_heads=opts["heads"],
        vocab_size=opts["vocab"], max_position_embeddings=opts["seq"], hidden_dropout=0.0,
        attention_dropout=0.0,
    )


def _build_chunks(config, state, virtual, seed=1234):
    """This rank's GPTModel chunks; the same weights for every schedule and framework."""
    import torch

    from megatron_smp.models.gpt import GPTModel
    from megatron_smp.pipeline_parallel.stages import pipeline_layer_layout

    layout = pipeline_layer_layout(config.num_layers, state.pp_size, virtual_size=virtual)
    chunks = []
    for index, (offset, count) in enumerate(layout[state.pp_rank]):
        torch.manual_seed(seed)
        chunks.append(GPTModel(
            config, state, pre_process=state.is_pipeline_first_stage and index == 0,
            post_process=state.is_pipeline_last_stage and index == virtual - 1,
            layer_offset=offset, num_layers=count))
    return chunks


def _batches(opts):
    import torch

    generator = torch.Generator().manual_seed(0)
    shape = (opts["micro_batch"], opts["seq"])
    return [
        {"tokens": torch.randint(0, opts["vocab"], shape, generator=generator),
         "labels": torch.randint(0, opts["vocab"], shape, generator=generator)}
        for _ in range(opts["microbatches"])
    ]


def _smp_step_func(state, chunks, batches, schedule, timeline):
    from megatron_smp.pipeline_parallel.schedules import get_forward_backward_func

    func = get_forward_backward_func(state.pp_size, schedule)
    hidden = chunks[0].config.hidden_size
    micro_batch, seq = batches[0]["tokens"].shape

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        output = model(batch["tokens"], labels=batch["labels"])

        def loss_func(per_token_loss):
            loss = per_token_loss.float().mean()
            return loss, {"loss": loss.detach()}

        return output, loss_func

    def step():
        reports = func(
            forward_step_func=forward_step, data_iterator=iter(batches), model=chunks,
            num_microbatches=len(batches), state=state, tensor_shape=(seq, micro_batch, hidden),
            timeline=timeline)
        return [float(r["loss"]) for r in reports]

    return step


class _TorchStage:
    """GPTModel chunk as a torch.distributed.pipelining stage module (tensor in, tensor out)."""

    @staticmethod
    def wrap(model):
        import torch

        class Stage(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.model = model

            def forward(self, x):
                if self.model.pre_process:
                    return self.model(x)
                self.model.set_input_tensor(x)
                return self.model(None)

        return Stage()


def _torch_step_func(state, chunks, batches, schedule_class_name, virtual, opts):
    import torch
    import torch.nn.functional as F
    from torch.distributed import pipelining

    config = chunks[0].config
    micro_batch, seq = batches[0]["tokens"].shape
    vocab = config.padded_vocab_size(1)
    stages = []
    for index, chunk in enumerate(chunks):
        stage_index = index * state.pp_size + state.pp_rank
        # Examples instead of shape inference; torch copies their requires_grad into the
        # receive buffers and decides from it which grads travel back.
        hidden = torch.zeros(seq, micro_batch, config.hidden_size, requires_grad=True)
        tokens = torch.zeros(micro_batch, seq, dtype=torch.long)
        stages.append(pipelining.PipelineStage(
            _TorchStage.wrap(chunk), stage_index, state.pp_size * virtual, state.device,
            input_args=(tokens if chunk.pre_process else hidden,),
            output_args=(torch.zeros(micro_batch, seq, vocab) if chunk.post_process else hidden,),
            group=state.pp_group))

    def loss_fn(logits, target):
        logits = logits[..., : config.vocab_size].float()
        return F.cross_entropy(logits.reshape(-1, config.vocab_size), target.reshape(-1))

    schedule_class = getattr(pipelining, schedule_class_name)
    schedule = schedule_class(stages if virtual > 1 else stages[0], n_microbatches=len(batches),
                              loss_fn=loss_fn)
    tokens = torch.cat([b["tokens"] for b in batches])
    labels = torch.cat([b["labels"] for b in batches])

    def step():
        losses = []
        args = (tokens,) if state.is_pipeline_first_stage else ()
        target = labels if state.is_pipeline_last_stage else None
        schedule.step(*args, target=target, losses=losses)
        return [float(loss.detach()) for loss in losses]

    return step


def _body(rank, world_size, opts):
    import torch.distributed as dist

    from megatron_smp.config import ParallelConfig
    from megatron_smp.parallel_state import build_parallel_state
    from megatron_smp.pipeline_parallel.timeline import PipelineTimeline

    state = build_parallel_state(ParallelConfig(pipeline_model_parallel_size=world_size))
    config = _model_config(opts)
    batches = _batches(opts)
    runs = {}
    for name, (framework, schedule, virtual) in RUNS.items():
        if opts["only"] and opts["only"] not in name:
            continue
        chunks = _build_chunks(config, state, virtual)
        timeline = None
        if framework == "smp":
            path = os.path.join(opts["trace"], name.split(" (")[0].replace(" ", "_") + ".json") \
                if opts["trace"] else None
            timeline = PipelineTimeline(path, rank)
            step = _smp_step_func(state, chunks, batches, schedule, timeline)
        else:
            step = _torch_step_func(state, chunks, batches, schedule, virtual, opts)
        runs[name] = (chunks, step, timeline, virtual)

    # Round robin over the schedules, so the load of a shared machine hits them alike.
    times = {name: [] for name in runs}
    first_losses = {}
    for iteration in range(opts["warmup"] + opts["steps"]):
        for name, (chunks, step, _, _) in runs.items():
            for chunk in chunks:
                chunk.zero_grad(set_to_none=True)
            dist.barrier()
            start = time.perf_counter()
            losses = step()
            dist.barrier()
            if iteration >= opts["warmup"]:
                times[name].append(time.perf_counter() - start)
            first_losses.setdefault(name, losses)
    results = {}
    for name, (_, _, timeline, virtual) in runs.items():
        results[name] = {
            "step_ms": statistics.median(times[name]) * 1e3,
            "first_losses": first_losses[name],
            "virtual": virtual,
            "events": timeline.events if timeline is not None else None,
        }
    return results


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    # Eight layers and a small vocabulary keep the end stages (embedding, output layer and
    # loss) close to the others: the bubble formula assumes equal stages.
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--trace", default=None, help="directory for the per-rank Chrome traces")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--only", default=None, help="run only schedules whose name has this")
    args = parser.parse_args(argv)
    opts = {k: v for k, v in vars(args).items()}
    if args.layers % (2 * args.pp) or args.microbatches % args.pp:
        parser.error("--layers must be a multiple of 2 x --pp and --microbatches of --pp "
                     "(the virtual schedules run 2 chunks per rank)")

    from megatron_smp.pipeline_parallel.timeline import bubble_fraction

    per_rank = run_distributed(_body, args.pp, args=(opts,), timeout=900, collective_timeout=300)
    p, m = args.pp, args.microbatches
    print(f"PP={p}, m={m} microbatches of {args.micro_batch}x{args.seq} tokens, GPT "
          f"{args.layers} layers x {args.hidden} hidden, vocab {args.vocab}; CPU gloo, "
          "1 thread/rank; step = forward+backward of the global batch")
    print(f"{'schedule':32s} {'step ms':>8s} {'bubble':>7s} {'(p-1)/(vm+p-1)':>15s} "
          f"{'first loss':>11s}")
    summary = {}
    for name in per_rank[-1]:
        result = per_rank[-1][name]
        v = result["virtual"]
        theory = (p - 1) / (v * m + p - 1)
        measured = None
        if result["events"] is not None:
            steps = range(args.warmup, args.warmup + args.steps)
            measured = statistics.median(
                bubble_fraction([r[name]["events"] for r in per_rank], step) for step in steps)
        first_loss = statistics.mean(result["first_losses"]) if result["first_losses"] else None
        summary[name] = {"step_ms": result["step_ms"], "bubble": measured, "theory": theory,
                         "first_loss": first_loss}
        bubble_text = f"{measured:7.3f}" if measured is not None else f"{'-':>7s}"
        print(f"{name:32s} {result['step_ms']:8.1f} {bubble_text} {theory:15.3f} "
              f"{first_loss:11.5f}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(summary, handle, indent=2)
    return summary


if __name__ == "__main__":
    main()
