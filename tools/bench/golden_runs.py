"""Golden per-iteration losses and grad norms of whole training runs, for refactors that must
not change a single bit of the trajectory.

    python tools/bench/golden_runs.py record GOLDEN.json --checkpoints DIR   # before a change
    python tools/bench/golden_runs.py check GOLDEN.json --checkpoints DIR    # after it

Each run goes through the entry scripts' providers (pretrain_gpt / pretrain_llama) and
`pretrain(...)`, at the layouts of the functional tests: one process, TP2 (+SP), PP2 (and
interleaved), DP2 with the distributed optimizer and overlapped reductions, FSDP2, CP2, EP2,
LoRA over a base checkpoint, a resume, an --async-save run, --rerun-mode validate_results,
meta-device init and bf16. Values are kept exactly (float.hex). `record` also keeps the
checkpoints it wrote under --checkpoints; `check` then resumes from those checkpoints (written
by the code before the change) and compares with the recorded resumed losses.
"""
import argparse
import json
import os
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from megatron_smp.testing import run_distributed  # noqa: E402

COMMON = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 8 --train-iters 4 "
    "--mock-data --tokenizer-type NullTokenizer --vocab-size 1000 --hidden-dropout 0 "
    "--attention-dropout 0 --lr 1e-3 --lr-warmup-iters 1 --lr-decay-iters 6 --log-interval 1 --eval-interval 2 "
    "--eval-iters 1 --seed 7"
).split()
LLAMA = ("--normalization RMSNorm --swiglu --position-embedding-type rope "
         "--untie-embeddings-and-output-weights --disable-bias-linear "
         "--group-query-attention --num-query-groups 2").split()
MOE = "--num-experts 4 --moe-router-topk 2 --moe-aux-loss-coeff 0.01".split()


def _train(rank, world_size, argv, script="pretrain_gpt"):
    """(per-iteration losses, per-iteration grad norms, validation losses), exact."""
    import importlib

    from megatron_smp.training import logging as training_logging
    from megatron_smp.training import pretrain

    grad_norms = {}
    original = training_logging.TrainingLogger.iteration_scalars

    def record(self, iteration, lr, batch, losses, loss_scale, grad_norm, *args, **kwargs):
        grad_norms[iteration] = None if grad_norm is None else float(grad_norm).hex()
        return original(self, iteration, lr, batch, losses, loss_scale, grad_norm, *args,
                        **kwargs)

    training_logging.TrainingLogger.iteration_scalars = record
    entry = importlib.import_module(script)
    result = pretrain(entry.train_valid_test_datasets_provider, entry.model_provider,
                      entry.forward_step, argv=argv,
                      args_defaults=getattr(entry, "LLAMA_DEFAULTS", None))
    losses = {str(i): {k: float(v).hex() for k, v in sorted(values.items())}
              for i, values in sorted(result.train_losses.items())}
    valid = {str(i): {k: float(v).hex() for k, v in sorted(values.items())}
             for i, values in sorted(result.valid_losses.items())}
    final = {k: float(v).hex() for k, v in sorted(result.final_valid_losses.items())}
    return {"losses": losses, "grad_norms": {str(k): v for k, v in sorted(grad_norms.items())},
            "valid": valid, "final_valid": final, "iteration": result.iteration,
            "consumed": result.consumed_train_samples}


def _flags(text):
    return text.split()


def runs(ckpt):
    """(name, world size, argv, script) of every golden run; checkpoints under `ckpt`."""
    base, lora = os.path.join(ckpt, "base"), os.path.join(ckpt, "lora")
    resume_dist, resume_torch = os.path.join(ckpt, "resume_dist"), os.path.join(ckpt, "resume_torch")
    asyncd = os.path.join(ckpt, "async")
    return [
        ("single_gpt", 1, COMMON, "pretrain_gpt"),
        ("single_llama", 1, COMMON + LLAMA, "pretrain_gpt"),
        ("llama_entry", 1, COMMON + _flags("--tokenizer-type NullTokenizer"), "pretrain_llama"),
        ("tp2_sp_llama", 2, COMMON + LLAMA + _flags(
            "--tensor-model-parallel-size 2 --sequence-parallel"), "pretrain_gpt"),
        ("pp2_gpt", 2, COMMON + _flags("--pipeline-model-parallel-size 2"), "pretrain_gpt"),
        ("pp2_vp2_llama", 2, [a if a != "2" or i != 1 else "4" for i, a in enumerate(COMMON)]
         + LLAMA + _flags("--pipeline-model-parallel-size 2 "
                          "--num-layers-per-virtual-pipeline-stage 1"), "pretrain_gpt"),
        ("dp2_distopt", 2, COMMON + _flags(
            "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather"),
         "pretrain_gpt"),
        ("fsdp2", 2, COMMON + LLAMA + _flags("--use-torch-fsdp2"), "pretrain_gpt"),
        ("cp2_llama", 2, COMMON + LLAMA + _flags("--context-parallel-size 2"), "pretrain_gpt"),
        ("ep2_moe", 2, COMMON + LLAMA + MOE + _flags("--expert-model-parallel-size 2"),
         "pretrain_gpt"),
        ("meta_init", 1, COMMON + LLAMA + _flags("--init-model-with-meta-device"),
         "pretrain_gpt"),
        ("bf16_tp2", 2, COMMON + _flags("--bf16 --tensor-model-parallel-size 2"),
         "pretrain_gpt"),
        ("mtp", 1, COMMON + LLAMA + _flags("--mtp-num-layers 1"), "pretrain_gpt"),
        ("per_token_dp2", 2, COMMON + _flags("--calculate-per-token-loss"), "pretrain_gpt"),
        ("rerun_validate", 2, COMMON + _flags(
            "--rerun-mode validate_results"), "pretrain_gpt"),
        # A base checkpoint (DCP), then LoRA over it, saving small checkpoints.
        ("base_save", 2, COMMON + LLAMA + _flags(f"--save {base} --save-interval 4"),
         "pretrain_gpt"),
        ("lora_dp2", 2, COMMON + LLAMA + _flags(
            f"--lora-rank 4 --lora-alpha 8 --pretrained-checkpoint {base} --save {lora} "
            "--save-interval 2 --use-distributed-optimizer"), "pretrain_gpt"),
        ("lora_resume", 2, COMMON + LLAMA + _flags(
            f"--lora-rank 4 --lora-alpha 8 --load {lora} --train-iters 6"), "pretrain_gpt"),
        # Resume (torch_dist at another layout, torch at the same one).
        ("resume_dist_save", 2, COMMON + _flags(
            f"--tensor-model-parallel-size 2 --save {resume_dist} --save-interval 2"),
         "pretrain_gpt"),
        ("resume_dist_load", 2, COMMON + _flags(
            f"--pipeline-model-parallel-size 2 --load {resume_dist} --train-iters 6"),
         "pretrain_gpt"),
        ("resume_torch_save", 2, COMMON + _flags(
            f"--use-distributed-optimizer --ckpt-format torch --save {resume_torch} "
            "--save-interval 2"), "pretrain_gpt"),
        ("resume_torch_load", 2, COMMON + _flags(
            f"--use-distributed-optimizer --ckpt-format torch --load {resume_torch} "
            "--train-iters 6"), "pretrain_gpt"),
        ("async_save", 2, COMMON + _flags(
            f"--use-distributed-optimizer --save {asyncd} --save-interval 2 --async-save"),
         "pretrain_gpt"),
        ("async_load", 2, COMMON + _flags(f"--load {asyncd} --train-iters 6 --finetune"),
         "pretrain_gpt"),
    ]


# Runs that only load (resume from a checkpoint that `record` kept): in `check` mode they
# read the kept, pre-change checkpoints.
LOADS = {"lora_resume": "lora", "resume_dist_load": "resume_dist",
         "resume_torch_load": "resume_torch", "async_load": "async"}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("record", "check"))
    parser.add_argument("golden")
    parser.add_argument("--checkpoints", required=True,
                        help="where `record` keeps its checkpoints for `check` to load")
    parser.add_argument("--only", nargs="*", help="run only these names")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.mode == "record":
        shutil.rmtree(args.checkpoints, ignore_errors=True)
        os.makedirs(args.checkpoints)
        ckpt = args.checkpoints
        golden = {}
    else:
        with open(args.golden) as handle:
            golden = json.load(handle)
        ckpt = tempfile.mkdtemp(prefix="golden_")
    failures, results = [], {}
    for name, world_size, argv, script in runs(ckpt):
        if args.only and name not in args.only:
            continue
        start = time.time()
        values = run_distributed(_train, world_size, args=(argv, script), timeout=600)
        # Every rank returns; the logging (last) rank has the losses of every stage.
        results[name] = values[-1]
        line = f"{name:20s} world {world_size} {time.time() - start:6.1f} s"
        if args.mode == "check":
            same = golden.get(name) == values[-1]
            line += "  identical" if same else "  DIFFERENT"
            if not same:
                failures.append(name)
            if name in LOADS:
                # The checkpoint written before the change loads after it.
                kept = os.path.join(args.checkpoints, LOADS[name])
                old_argv = [kept if a == os.path.join(ckpt, LOADS[name]) else a for a in argv]
                old = run_distributed(_train, world_size, args=(old_argv, script),
                                      timeout=600)[-1]
                same = golden.get(name) == old
                line += ("; from the kept checkpoint: "
                         + ("identical" if same else "DIFFERENT"))
                if not same:
                    failures.append(name + " (kept checkpoint)")
        print(line, flush=True)
    if args.mode == "record":
        with open(args.golden, "w") as handle:
            json.dump(results, handle, indent=1, sort_keys=True)
        print(f"recorded {len(results)} runs to {args.golden}")
    else:
        shutil.rmtree(ckpt, ignore_errors=True)
        if failures:
            for name in failures:
                print(f"{name}: golden {json.dumps(golden.get(name))[:400]}\n"
                      f"      now    {json.dumps(results.get(name.split(' ')[0]))[:400]}")
            sys.exit(1)
        print(f"all {len(results)} runs bit-identical to {args.golden}")


if __name__ == "__main__":
    main()
