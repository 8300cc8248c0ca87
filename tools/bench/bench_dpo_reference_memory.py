"""Peak host memory of DPO's three reference modes (one process, CPU), on the bundled
preference pairs with a 4 x 512 Llama: each mode in a fresh process, peak RSS (ru_maxrss)
and the model's parameter bytes.

    python tools/bench/bench_dpo_reference_memory.py [--work DIR] [--iters 4]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))

MODEL = ("--num-layers 4 --hidden-size 512 --num-attention-heads 8 --ffn-hidden-size 1536 "
         "--max-position-embeddings 128 --normalization RMSNorm --swiglu "
         "--position-embedding-type rope --untie-embeddings-and-output-weights "
         "--disable-bias-linear --group-query-attention --num-query-groups 4 "
         "--hidden-dropout 0 --attention-dropout 0").split()
MODES = {
    "full, precomputed": ["--dpo-reference", "precomputed"],
    "full, frozen copy": ["--dpo-reference", "frozen"],
    "LoRA, precomputed": ["--lora-rank", "16", "--dpo-reference", "precomputed"],
    "LoRA, frozen copy": ["--lora-rank", "16", "--dpo-reference", "frozen"],
    "LoRA, adapters-off": ["--lora-rank", "16", "--dpo-reference", "adapters-off"],
}

CHILD = r"""
import json, resource, sys
sys.path.insert(0, {root!r})
from megatron_smp.post_training.dpo_training import train_dpo
from pretrain_gpt import model_provider
params = {{}}
import megatron_smp.optimizer as optimizer_module
original = optimizer_module.get_megatron_optimizer
def capture(config, chunks, state, *args, **kwargs):
    params["bytes"] = sum(p.numel() * p.element_size() for c in chunks for p in c.parameters())
    return original(config, chunks, state, *args, **kwargs)
optimizer_module.get_megatron_optimizer = capture
result = train_dpo(model_provider, argv={argv!r})
losses = result.train_losses[max(result.train_losses)]
print("RESULT", json.dumps({{"peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                            "params": params["bytes"], "loss": losses["dpo loss"]}}))
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default=None)
    parser.add_argument("--iters", type=int, default=4)
    args = parser.parse_args()
    work = args.work or tempfile.mkdtemp(prefix="dpo_memory_")
    import preprocess_sft_data
    from make_tiny_llama import make_tiny_llama

    pairs = os.path.join(ROOT, "data", "chat", "tiny_preference.jsonl")
    tokenizer = os.path.join(work, "hf")
    if not os.path.isdir(tokenizer):
        make_tiny_llama(tokenizer, [pairs], num_layers=1, hidden_size=64)
    prefix = os.path.join(work, "pairs")
    preprocess_sft_data.preprocess(preprocess_sft_data.get_args(
        ["--input", pairs, "--output-prefix", prefix, "--tokenizer-model", tokenizer,
         "--preference", "--seq-length", "128"]))
    common = (f"--data-path {prefix}_text_document --split 100,0,0 --tokenizer-type "
              f"HuggingFaceTokenizer --tokenizer-model {tokenizer} --seq-length 128 "
              f"--micro-batch-size 2 --global-batch-size 4 --train-iters {args.iters} "
              "--lr 1e-4 --eval-iters 0 --log-interval 100 --seed 3").split() + MODEL
    print(f"{'reference mode':<20} {'peak RSS MiB':>12} {'params MiB':>10}")
    for name, flags in MODES.items():
        code = CHILD.format(root=ROOT, argv=common + flags)
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=ROOT)
        line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
        if not line:
            print(out.stdout[-2000:], out.stderr[-3000:])
            return 1
        result = json.loads(line[0][len("RESULT "):])
        print(f"{name:<20} {result['peak'] / 2**20:>12.0f} {result['params'] / 2**20:>10.1f}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
