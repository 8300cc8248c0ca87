"""One training step (forward, backward, AdamW) of our GPTModel against Hugging Face's
GPT2LMHeadModel of the same shape and weights, in one process, interleaved.

    python tools/bench/bench_model_vs_hf.py [--layers 4 --hidden 256 --seq 128 --batch 8]

Both models start from the same weights (ours converted with the GPT-2 adapter), dropout is
off, both use torch.optim.AdamW. Steps alternate between the two models so machine noise
hits both alike; prints the median ms per step and ours / HF.
"""
from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8003)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import GPT2Config, GPT2LMHeadModel

    from megatron_smp.config import ParallelConfig
    from megatron_smp.models.gpt import GPTModel
    from megatron_smp.models.hf import gpt2
    from megatron_smp.parallel_state import build_parallel_state

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    state = build_parallel_state(ParallelConfig())
    torch.manual_seed(0)
    hf_config = GPT2Config(
        vocab_size=args.vocab, n_positions=args.seq, n_embd=args.hidden, n_layer=args.layers,
        n_head=args.heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=0, eos_token_id=0,
    )
    hf = GPT2LMHeadModel(hf_config).to(device).train()
    config = gpt2.config_from_hf(hf.config)
    ours = GPTModel(config, state, device=device).train()
    ours.load_state_dict(gpt2.from_hf({k: v.cpu() for k, v in hf.state_dict().items()}, config))

    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=generator)
    ids, labels = tokens[:, :-1].to(device), tokens[:, 1:].to(device)

    def ours_loss():
        return ours(ids, labels=labels).mean()

    def hf_step_loss():
        # The same next-token loss as ours: HF's labels= path would shift the labels itself.
        logits = hf(input_ids=ids).logits
        return torch.nn.functional.cross_entropy(logits.reshape(-1, args.vocab), labels.reshape(-1))

    with torch.no_grad():
        difference = (ours_loss() - hf_step_loss()).abs().item()
    print(f"params: {sum(p.numel() for p in hf.parameters()) / 1e6:.2f} M; "
          f"|loss(ours) - loss(HF)| at init = {difference:.2e}")

    runs = {
        "ours": (ours_loss, torch.optim.AdamW(ours.parameters(), lr=1e-4)),
        "hf": (hf_step_loss, torch.optim.AdamW(hf.parameters(), lr=1e-4)),
    }
    times = {name: [] for name in runs}

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    for step in range(args.warmup + args.repeats):
        for name, (loss_fn, optimizer) in runs.items():
            sync()
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn()
            loss.backward()
            optimizer.step()
            sync()
            if step >= args.warmup:
                times[name].append((time.perf_counter() - start) * 1e3)

    median = {name: statistics.median(values) for name, values in times.items()}
    print(f"device {device}, {torch.get_num_threads()} threads, layers {args.layers}, hidden "
          f"{args.hidden}, seq {args.seq}, batch {args.batch}, {args.repeats} repeats")
    for name in runs:
        print(f"  {name:5s} median {median[name]:8.1f} ms/step  "
              f"(min {min(times[name]):.1f}, max {max(times[name]):.1f})")
    print(f"  ours / HF = {median['ours'] / median['hf']:.3f}")


if __name__ == "__main__":
    main()
