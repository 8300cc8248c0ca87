"""An SMP v2-style training script: init -> transform -> FSDP2 with hybrid sharding -> delayed
initialisation -> train -> async_save / load. Run it as the reference's examples are run:

    torchrun --standalone --nproc-per-node 4 scripts/train_smp_fsdp.py \
        --smp-config '{"hybrid_shard_degree": 2, "tensor_parallel_degree": 1}' \
        --steps 20 --save-dir /tmp/ckpt           # then again with --resume to continue

The model is a small Hugging Face Llama built on the meta device (no memory), transformed on
meta, then materialised shard by shard by DelayedParamIniter while FSDP2 shards it. Data is a
fixed random batch per step (the point is the API; pretrain_llama.py trains on real data).
Checkpoints hold global names and shapes, so tools/checkpoint/convert.py reads them and a
run at another TP / sharding degree resumes them.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import megatron_smp as smp  # noqa: E402
from megatron_smp.checkpointing.sharded_state import (  # noqa: E402
    model_sharded_state_dict, optimizer_sharded_state_dict,
)
from megatron_smp.config import OptimizerConfig  # noqa: E402
from megatron_smp.checkpointing import engine as dcp  # noqa: E402
from megatron_smp.distributed import finalize_model_grads  # noqa: E402
from megatron_smp.distributed.delayed_init import DelayedParamIniter  # noqa: E402
from megatron_smp.optimizer import get_megatron_optimizer  # noqa: E402


def build_meta_llama(layers: int, hidden: int, vocab: int, seq: int):
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden,
        num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 64), max_position_embeddings=seq,
    )
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smp-config", default="{}", help="SMP v2 keys (JSON or a file)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2, help="per data-parallel rank")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--bf16", action="store_true", help="bf16 compute, fp32 params")
    parser.add_argument("--activation-offloading", action="store_true")
    parser.add_argument("--save-dir")
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args(argv)

    config = args.smp_config
    smp.init(json.loads(config) if config.lstrip().startswith("{") else config)
    state = smp.state.parallel_state

    model = smp.transform(build_meta_llama(args.layers, args.hidden, args.vocab, args.seq))
    initer = DelayedParamIniter(model)
    with initer.validate_params_and_buffers_inited():
        model = smp.fully_shard(
            model, param_init_fn=initer.get_param_init_fn(),
            mixed_precision=torch.bfloat16 if args.bf16 else None,
            activation_checkpointing=args.activation_offloading,
            activation_offloading=args.activation_offloading,
        )
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=args.lr), [model],
                                       state)

    def state_dict():
        vocab = model.config.vocab_size
        return {"model": model_sharded_state_dict([model], state, vocab),
                "optimizer": optimizer_sharded_state_dict(optimizer, [model], state, vocab)}

    start = 0
    if args.resume:
        loaded = state_dict()
        loaded["step"] = 0
        dcp.load(loaded, checkpoint_id=args.save_dir)
        start = int(loaded["step"])
    generator = torch.Generator().manual_seed(1234 + state.dp_rank)
    for step in range(start, args.steps):
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq), generator=generator)
        tokens = tokens.to(state.device)
        optimizer.zero_grad()
        loss = model(input_ids=tokens, labels=tokens)["loss"]  # HF's shifted mean loss
        loss.backward()
        finalize_model_grads([model], state)
        _, grad_norm, _ = optimizer.step()
        if state.rank == 0:
            print(f"step {step + 1}: loss {loss.item():.4f} grad norm {grad_norm:.3f}", flush=True)
    if args.save_dir:
        dcp.maybe_finalize_async_calls(blocking=True)
        dcp.async_save({**state_dict(), "step": args.steps}, checkpoint_id=args.save_dir)
        dcp.maybe_finalize_async_calls(blocking=True)
        if state.rank == 0:
            print(f"saved step {args.steps} to {args.save_dir}", flush=True)


if __name__ == "__main__":
    main()
