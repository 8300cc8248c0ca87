"""FSDP2 (`--use-torch-fsdp2` / `smp.fully_shard`) against our DDP, the distributed optimizer
and torch FSDP2 applied directly to the Hugging Face model; and delayed initialisation.

Training modes (a Llama-like model, fp32 AdamW, DP = world size, one process per rank):

    ddp        our DDP (contiguous buffers), FP32Optimizer
    distopt    our DDP + the distributed optimizer
    fsdp       megatron_smp FSDP2 (`fully_shard_model` on our GPTModel) + FSDPOptimizer
    hf_fsdp2   torch `fully_shard` on `LlamaForCausalLM` (per decoder layer, then the root)
               with torch AdamW: the "plain PyTorch FSDP2" baseline

The defaults (32 layers x hidden 512, 105M params, short sequences) make params, grads and
optimizer state most of the memory, which is what the FSDP/DDP peak ratio is meant to compare;
a larger sequence or batch adds activations, which sharding does not divide.

Per rank it reports the bytes of params + grads + optimizer state this rank holds (counted
from the tensors after a step: local shards for FSDP), the peak RSS above the RSS before the
model was built, and the mean step time of the steps after the first two.

`--delayed-init` builds a GPTModel of about `--delayed-params` parameters on the meta device
at DP = world size and materialises it through `DelayedParamIniter` + FSDP2, reporting each
rank's peak RSS above its pre-build RSS against the size of its shards.

    python tools/bench/bench_fsdp.py --world-size 2
    python tools/bench/bench_fsdp.py --world-size 4 --delayed-init --delayed-params 400e6
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from megatron_smp.testing import proc_status_kib  # noqa: E402

MIB = 1024 * 1024


def _rss_bytes() -> int:
    return proc_status_kib("VmRSS") * 1024


def _peak_rss_bytes() -> int:
    return proc_status_kib("VmHWM") * 1024


def _hf_llama(layers, hidden, vocab, seq):
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden,
        num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64,
        max_position_embeddings=seq, tie_word_embeddings=False,
    )
    return transformers.LlamaForCausalLM(config)


def _state_bytes(params, optimizer_state) -> int:
    from torch.distributed.tensor import DTensor

    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    total = 0
    seen = set()
    for p in params:
        for t in (p, getattr(p, "main_grad", None), p.grad):
            if t is not None and id(t) not in seen:
                seen.add(id(t))
                total += local(t).numel() * local(t).element_size()
    for state in optimizer_state:
        for value in state.values():
            if hasattr(value, "numel") and value.dim() > 0:
                total += local(value).numel() * local(value).element_size()
    return total


def train_worker(rank, world_size, mode, layers, hidden, vocab, seq, batch, steps):
    import torch
    import torch.distributed as dist

    from megatron_smp.config import OptimizerConfig
    from megatron_smp.testing import run_distributed  # noqa: F401 (same import cost everywhere)

    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (batch, seq), generator=generator)
    baseline = _rss_bytes()
    if mode == "hf_fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        model = _hf_llama(layers, hidden, vocab, seq)
        mesh = init_device_mesh("cpu", (world_size,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
        params = list(model.parameters())

        def step():
            optimizer.zero_grad()
            out = model(input_ids=tokens, labels=tokens)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()

        state_of = lambda: optimizer.state.values()  # noqa: E731
    else:
        from megatron_smp.distributed import DistributedDataParallel, finalize_model_grads
        from megatron_smp.distributed.fsdp import fully_shard_model
        from megatron_smp.models.gpt import GPTModel
        from megatron_smp.optimizer import get_megatron_optimizer
        from megatron_smp.config import ParallelConfig, TransformerConfig
        from megatron_smp.parallel_state import build_parallel_state

        state = build_parallel_state(ParallelConfig())
        config = TransformerConfig(
            num_layers=layers, hidden_size=hidden, num_attention_heads=hidden // 64,
            ffn_hidden_size=4 * hidden, vocab_size=vocab, max_position_embeddings=seq,
            normalization="RMSNorm", gated_linear_unit=True, activation="silu",
            position_embedding_type="rope", untie_embeddings_and_output_weights=True,
            add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        )
        optimizer_config = OptimizerConfig(lr=1e-4, use_distributed_optimizer=mode == "distopt")
        if mode == "fsdp":
            # As pretrain --use-torch-fsdp2 does: built on meta, each unit materialised and
            # sharded in turn, so the full model never exists on a rank.
            from megatron_smp.distributed.delayed_init import DelayedParamIniter

            model = GPTModel(config, state, device="meta")
            initer = DelayedParamIniter(model)
            with initer.validate_params_and_buffers_inited():
                fully_shard_model(model, state, param_init_fn=initer.get_param_init_fn())
        else:
            model = DistributedDataParallel(GPTModel(config, state), optimizer_config, state)
        optimizer = get_megatron_optimizer(optimizer_config, [model], state)
        params = list(model.parameters())

        def step():
            optimizer.zero_grad()
            loss = model(tokens, labels=tokens).mean()
            loss.backward()
            finalize_model_grads([model], state)
            optimizer.step()

        state_of = lambda: optimizer.optimizer.state.values()  # noqa: E731
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    state_bytes = _state_bytes(params, state_of())
    return {"state_mib": state_bytes / MIB, "peak_rss_above_mib": (_peak_rss_bytes() - baseline) / MIB,
            "step_s": sum(times[2:]) / max(1, len(times) - 2)}


def delayed_init_worker(rank, world_size, layers, hidden, vocab):
    import torch

    from megatron_smp.config import ParallelConfig, TransformerConfig
    from megatron_smp.distributed.delayed_init import DelayedParamIniter
    from megatron_smp.distributed.fsdp import fully_shard_model, local_tensor
    from megatron_smp.models.gpt import GPTModel
    from megatron_smp.parallel_state import build_parallel_state

    state = build_parallel_state(ParallelConfig())
    config = TransformerConfig(
        num_layers=layers, hidden_size=hidden, num_attention_heads=hidden // 64,
        vocab_size=vocab, max_position_embeddings=128, hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    baseline = _rss_bytes()
    start = time.perf_counter()
    torch.manual_seed(0)
    model = GPTModel(config, state, device="meta")
    initer = DelayedParamIniter(model)
    with initer.validate_params_and_buffers_inited():
        fully_shard_model(model, state, param_init_fn=initer.get_param_init_fn())
    seconds = time.perf_counter() - start
    shard = sum(local_tensor(p).numel() * local_tensor(p).element_size()
                for p in model.parameters())
    total = sum(p.numel() for p in model.parameters())
    layer_bytes = sum(p.numel() * 4 for p in model.decoder.layers[0].parameters())
    return {"params": total, "full_model_mib": total * 4 / MIB, "shard_mib": shard / MIB,
            "one_layer_mib": layer_bytes / MIB,
            "peak_rss_above_mib": (_peak_rss_bytes() - baseline) / MIB, "seconds": seconds}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=2000)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--modes", default="ddp,distopt,fsdp,hf_fsdp2")
    parser.add_argument("--delayed-init", action="store_true")
    parser.add_argument("--delayed-params", type=float, default=400e6)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    from megatron_smp.testing import run_distributed

    report = {}
    if args.delayed_init:
        hidden = 1024
        layers = max(1, round((args.delayed_params - 2 * 8000 * hidden) / (12 * hidden * hidden)))
        results = run_distributed(delayed_init_worker, args.world_size,
                                  args=(layers, hidden, 8000), timeout=1800,
                                  collective_timeout=900)
        report["delayed_init"] = results
        for rank, r in enumerate(results):
            print(f"delayed init rank {rank}: {r['params'] / 1e6:.0f}M params "
                  f"({r['full_model_mib']:.0f} MiB fp32), shard {r['shard_mib']:.0f} MiB, one layer "
                  f"{r['one_layer_mib']:.0f} MiB, peak RSS above pre-build "
                  f"{r['peak_rss_above_mib']:.0f} MiB, {r['seconds']:.1f} s")
    else:
        for mode in args.modes.split(","):
            results = run_distributed(
                train_worker, args.world_size,
                args=(mode, args.layers, args.hidden, args.vocab, args.seq, args.batch,
                      args.steps), timeout=1800, collective_timeout=900)
            report[mode] = results
            worst = max(results, key=lambda r: r["state_mib"])
            print(f"{mode:9s} params+grads+optimizer {worst['state_mib']:8.1f} MiB/rank | peak "
                  f"RSS above baseline {max(r['peak_rss_above_mib'] for r in results):8.1f} MiB "
                  f"| step {sum(r['step_s'] for r in results) / len(results) * 1000:7.1f} ms")
        if "ddp" in report and "fsdp" in report:
            ddp = max(r["state_mib"] for r in report["ddp"])
            fsdp = max(r["state_mib"] for r in report["fsdp"])
            print(f"fsdp / ddp state: {fsdp / ddp:.3f} (1/DP = {1 / args.world_size:.3f})")
            peak = {mode: max(r["peak_rss_above_mib"] for r in report[mode])
                    for mode in ("ddp", "fsdp")}
            print(f"fsdp / ddp peak RSS: {peak['fsdp'] / peak['ddp']:.3f} (goal <= 1.1/DP = "
                  f"{1.1 / args.world_size:.3f})")
        for other in ("distopt", "hf_fsdp2"):
            if other in report and "fsdp" in report:
                ratio = (sum(r["step_s"] for r in report["fsdp"])
                         / sum(r["step_s"] for r in report[other]))
                print(f"step time fsdp / {other}: {ratio:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
