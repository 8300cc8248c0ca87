"""Megatron-LM's own example launch scripts (core_v0.16.1) train here unchanged apart from
model size, data and hardware-only switches.

Each script's flags are kept below verbatim, as bash expands its arrays onto the torchrun
command line (placeholders such as $DATA_PATH stay as text until `_prepare` fills them).
`_prepare` then applies only:
  * the shrink: layers, hidden/ffn/heads/groups/kv channels, sequence, vocabulary, batch,
    experts, and the run's length (iterations or samples, warm-up/decay lengths, eval
    iterations, --log-interval 1 so every iteration's loss is printed);
  * the data swap: --mock-data with the NullTokenizer where a script reads a dataset;
  * hardware-only changes: the parallel degrees (8-GPU layouts onto 2 processes), the FP8
    switches (Transformer Engine on Hopper; bf16 here), and --use-pytorch-profiler beside
    --profile (which otherwise drives NVIDIA Nsight Systems through CUDA);
and each run goes through the entry script with torchrun on 2 processes, its per-iteration
lm loss compared with a 1-process run of the same flags (parallel degrees 1).
"""
import math
import os
import re
import subprocess
import sys
from typing import Dict, List, Sequence

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# examples/gpt3/train_gpt3_175b_distributed.sh @ core_v0.16.1: GPT_MODEL_ARGS, TRAINING_ARGS,
# MODEL_PARALLEL_ARGS, DATA_ARGS, EVAL_AND_LOGGING_ARGS.
GPT3_175B = [
    "--num-layers", "96", "--hidden-size", "12288", "--num-attention-heads", "96",
    "--seq-length", "2048", "--max-position-embeddings", "2048", "--attention-backend", "auto",
    "--micro-batch-size", "1", "--global-batch-size", "1536",
    "--rampup-batch-size", "16", "16", "5859375", "--train-iters", "500000",
    "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
    "--init-method-std", "0.006", "--clip-grad", "1.0", "--fp16", "--lr", "6.0e-5",
    "--lr-decay-style", "cosine", "--min-lr", "6.0e-6", "--lr-warmup-fraction", ".001",
    "--lr-decay-iters", "430000",
    "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "16",
    "--data-path", "$DATA_PATH", "--vocab-file", "$VOCAB_FILE", "--merge-file", "$MERGE_FILE",
    "--split", "949,50,1",
    "--log-interval", "100", "--save-interval", "10000", "--eval-interval", "1000",
    "--save", "$CHECKPOINT_PATH", "--load", "$CHECKPOINT_PATH", "--eval-iters", "10",
    "--tensorboard-dir", "$TENSORBOARD_LOGS_PATH",
]

# examples/llama/train_llama3_8b_h100_fp8.sh @ core_v0.16.1 (its default MOCK data): MODEL_ARGS,
# TRAINING_ARGS (+ DDP_ARGS), DTYPE_ARGS, MODEL_PARALLEL_ARGS, DATA_ARGS_LIST,
# EVAL_AND_LOGGING_ARGS.
# The unquoted "--split '99,1,0'" array element reaches the script as two words, quotes kept.
LLAMA3_8B_FP8 = [
    "--use-mcore-models", "--num-layers", "32", "--hidden-size", "4096",
    "--ffn-hidden-size", "14336", "--num-attention-heads", "32", "--group-query-attention",
    "--num-query-groups", "8", "--kv-channels", "128", "--seq-length", "8192",
    "--max-position-embeddings", "8192", "--position-embedding-type", "rope",
    "--rotary-base", "1000000", "--rotary-percent", "1.0", "--attention-dropout", "0.0",
    "--hidden-dropout", "0.0", "--swiglu", "--init-method-std", "0.0134",
    "--attention-backend", "fused", "--apply-layernorm-1p",
    "--untie-embeddings-and-output-weights", "--disable-bias-linear",
    "--micro-batch-size", "1", "--global-batch-size", "128", "--train-samples", "1953125000",
    "--lr-decay-samples", "1949218748", "--lr-warmup-samples", "3906252", "--lr", "0.00015",
    "--min-lr", "0.00001", "--decoupled-lr", "5.0e-4", "--decoupled-min-lr", "4.5e-5",
    "--lr-decay-style", "cosine", "--clip-grad", "1.0", "--weight-decay", "0.1",
    "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--bf16", "--grad-reduce-in-bf16",
    "--cross-entropy-loss-fusion", "--calculate-per-token-loss", "--manual-gc",
    "--empty-unused-memory-level", "1", "--exit-duration-in-mins", "235",
    "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
    "--fp8-format", "hybrid", "--fp8-amax-history-len", "1024", "--fp8-amax-compute-algo", "max",
    "--fp8-param-gather",
    "--tensor-model-parallel-size", "1", "--context-parallel-size", "1", "--sequence-parallel",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128256",
    "--data-cache-path", "$DATA_CACHE_PATH", "--tiktoken-pattern", "v2", "--split", "'99,1,0'",
    "--no-create-attention-mask-in-dataloader", "--no-mmap-bin-files", "--num-workers", "1",
    "--log-interval", "1", "--eval-iters", "32", "--eval-interval", "100",
    "--save-interval", "1000", "--log-throughput", "--profile", "--profile-step-start", "4",
    "--profile-step-end", "6", "--ckpt-format", "torch_dist", "--distributed-timeout-minutes",
    "60", "--save", "$CHECKPOINT_PATH", "--load", "$CHECKPOINT_PATH",
    "--tensorboard-dir", "$TENSORBOARD_LOGS_PATH",
]

# "Llama 3 8B FSDP": the same script with the flags that
# docs/discussions/megatron-fsdp-user-guide/megatron-fsdp-user-guide.md @ core_v0.16.1 requires
# ("Required Configurations"; Megatron asserts --ckpt-format fsdp_dtensor with Megatron-FSDP).
MEGATRON_FSDP = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy",
                 "optim_grads_params", "--no-gradient-accumulation-fusion",
                 "--use-distributed-optimizer", "--ckpt-format", "fsdp_dtensor"]

# examples/mixtral/train_mixtral_8x7b_distributed.sh @ core_v0.16.1: MODEL_ARGS, MOE_ARGS,
# DATA_ARGS, TRAINING_ARGS, MODEL_PARALLEL_ARGS, LOGGING_ARGS (no WANDB_API_KEY set).
MIXTRAL_8X7B = [
    "--use-mcore-models", "--disable-bias-linear", "--seq-length", "4096",
    "--max-position-embeddings", "32768", "--num-layers", "32", "--hidden-size", "4096",
    "--ffn-hidden-size", "14336", "--num-attention-heads", "32", "--init-method-std", "0.01",
    "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--normalization", "RMSNorm",
    "--position-embedding-type", "rope", "--swiglu", "--untie-embeddings-and-output-weights",
    "--group-query-attention", "--num-query-groups", "8", "--no-masked-softmax-fusion",
    "--no-position-embedding", "--rotary-base", "1000000",
    "--num-experts", "8", "--moe-router-topk", "2", "--moe-router-load-balancing-type",
    "aux_loss", "--moe-aux-loss-coeff", "1e-2", "--moe-grouped-gemm",
    "--moe-token-dispatcher-type", "alltoall", "--overlap-param-gather",
    "--overlap-grad-reduce",
    "--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", "$TOKENIZER_MODEL",
    "--data-path", "$DATA_PATH", "--split", "99990,8,2",
    "--micro-batch-size", "1", "--global-batch-size", "256", "--lr", "1e-4",
    "--train-iters", "500000", "--lr-decay-iters", "320000", "--lr-decay-style", "cosine",
    "--min-lr", "1.0e-5", "--weight-decay", "0.1", "--lr-warmup-iters", "500",
    "--clip-grad", "1.0", "--bf16",
    "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "4",
    "--expert-model-parallel-size", "8", "--use-distributed-optimizer", "--sequence-parallel",
    "--log-interval", "1", "--save-interval", "10000", "--eval-interval", "1000",
    "--eval-iters", "10", "--save", "$CHECKPOINT_PATH", "--load", "$CHECKPOINT_PATH",
    "--tensorboard-dir", "${CHECKPOINT_PATH}/tensorboard", "--no-load-optim", "--no-load-rng",
]

SMALL_MODEL = {"--num-layers": "2", "--hidden-size": "64", "--ffn-hidden-size": "128",
               "--num-attention-heads": "4", "--num-query-groups": "2", "--kv-channels": "16",
               "--seq-length": "64", "--max-position-embeddings": "64", "--vocab-size": "1000",
               "--micro-batch-size": "1", "--global-batch-size": "8", "--num-experts": "4",
               "--eval-iters": "1", "--log-interval": "1"}
# The run's length: 6 iterations of 8 samples, warm-up and decay shrunk alike.
SHORT_RUN = {"--train-iters": "6", "--lr-decay-iters": "6", "--lr-warmup-iters": "1",
             "--train-samples": "48", "--lr-decay-samples": "48", "--lr-warmup-samples": "8"}
MOCK_DATA = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000"]
# Flags that take values, for removal; any other removed flag is a switch.
_VALUES = {"--data-path": 1, "--vocab-file": 1, "--merge-file": 1, "--tokenizer-type": 1,
           "--tokenizer-model": 1, "--fp8-format": 1, "--fp8-amax-history-len": 1,
           "--fp8-amax-compute-algo": 1, "--tensor-model-parallel-size": 1,
           "--pipeline-model-parallel-size": 1, "--expert-model-parallel-size": 1,
           "--context-parallel-size": 1, "--rampup-batch-size": 3, "--ckpt-format": 1}


def _replace_values(argv: List[str], values: Dict[str, str]) -> List[str]:
    out = list(argv)
    for index, token in enumerate(argv):
        if token in values:
            out[index + 1] = values[token]
    return out


def _remove(argv: List[str], flags: Sequence[str]) -> List[str]:
    out, skip = [], 0
    for token in argv:
        if skip:
            skip -= 1
        elif token in flags:
            skip = _VALUES.get(token, 0)
        else:
            out.append(token)
    return out


def _prepare(script: List[str], tmp_path, parallel: Dict[str, str], remove=(), add=(),
             data_swap=False) -> List[str]:
    """The script's flags with only the shrink, the data swap, the hardware-only changes
    (`parallel` degrees, `remove`d switches) and the run's directories filled in."""
    argv = _replace_values(script, {**SMALL_MODEL, **SHORT_RUN})
    if data_swap:
        argv = _remove(argv, ["--data-path", "--vocab-file", "--merge-file", "--tokenizer-type",
                              "--tokenizer-model"]) + MOCK_DATA
    argv = _remove(argv, list(remove) + list(parallel)) + list(add)
    for flag, value in parallel.items():
        argv += [flag, value]
    paths = {"$CHECKPOINT_PATH": str(tmp_path / "ckpt"),
             "$DATA_CACHE_PATH": str(tmp_path / "cache"),
             "$TENSORBOARD_LOGS_PATH": str(tmp_path / "tb"),
             "${CHECKPOINT_PATH}/tensorboard": str(tmp_path / "ckpt" / "tensorboard")}
    return [paths.get(token, token) for token in argv]


_LOSS = re.compile(r" iteration +(\d+)/ *\d+ \|.*?lm loss: ([-+\dEe.naif]+) \|")


def _torchrun(script: str, argv: List[str], nproc: int, tmp_path) -> Dict[int, float]:
    """Per-iteration lm loss printed by `script` under torchrun on `nproc` processes."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         str(nproc), script, *argv],
        capture_output=True, text=True, timeout=420, env=env, cwd=str(tmp_path),
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    return {int(it): float(loss) for it, loss in _LOSS.findall(output)}


def _check_against_one_process(script, argv, single_argv, tmp_path, rel):
    (tmp_path / "two").mkdir()
    (tmp_path / "one").mkdir()
    entry = os.path.join(ROOT, script)
    two = _torchrun(entry, argv(tmp_path / "two"), 2, tmp_path / "two")
    one = _torchrun(entry, single_argv(tmp_path / "one"), 1, tmp_path / "one")
    assert sorted(two) == list(range(1, 7)) and sorted(one) == sorted(two), (two, one)
    assert all(math.isfinite(loss) for loss in two.values()), two
    for iteration in sorted(one):
        assert two[iteration] == pytest.approx(one[iteration], rel=rel), (iteration, two, one)
    return two


SINGLE = {"--tensor-model-parallel-size": "1", "--pipeline-model-parallel-size": "1",
          "--expert-model-parallel-size": "1", "--context-parallel-size": "1"}


def test_gpt3_175b_script_rampup_with_train_iters_is_megatrons_own_error(tmp_path):
    """Megatron-LM core_v0.16.1 itself rejects this script ("expected no batch-size rampup for
    iteration-based training"): --rampup-batch-size needs --train-samples. So do we, on every
    rank before any collective (checked in-process: no launch needed)."""
    from megatron_smp.config import ConfigError
    from megatron_smp.training.arguments import parse_args, validate_configs

    argv = _prepare(GPT3_175B, tmp_path, {"--tensor-model-parallel-size": "1",
                                          "--pipeline-model-parallel-size": "2"}, data_swap=True)
    with pytest.raises(ConfigError, match="--rampup-batch-size"):
        validate_configs(parse_args(argv), world_size=2)


def test_gpt3_175b_script_trains_on_two_processes(tmp_path):
    """Besides the shrink, mock data and TP8 x PP16 -> PP2: the ramp-up Megatron rejects with
    --train-iters is dropped (see the test above); fp16 with dynamic loss scaling."""
    def argv(path, parallel=None):
        return _prepare(GPT3_175B, path, parallel or {"--tensor-model-parallel-size": "1",
                                                      "--pipeline-model-parallel-size": "2"},
                        remove=["--rampup-batch-size"], data_swap=True)

    # fp16: PP2 and one process differ by up to 1.5e-4 (relative) per iteration.
    losses = _check_against_one_process("pretrain_gpt.py", argv, lambda p: argv(p, SINGLE),
                                        tmp_path, rel=1e-3)
    assert losses[6] < losses[1]


def _llama(path, parallel, extra=()):
    return _prepare(LLAMA3_8B_FP8, path, parallel, add=["--use-pytorch-profiler", *extra],
                    remove=["--fp8-format", "--fp8-amax-history-len", "--fp8-amax-compute-algo",
                            "--fp8-param-gather"])


def test_llama3_8b_fp8_script_trains_on_two_processes_in_bf16(tmp_path):
    """FP8 switches dropped (Transformer Engine on Hopper); TP1 x CP1 on 2 ranks is DP2."""
    parallel = {"--tensor-model-parallel-size": "1", "--context-parallel-size": "1"}
    losses = _check_against_one_process(
        "pretrain_gpt.py", lambda p: _llama(p, parallel), lambda p: _llama(p, SINGLE),
        tmp_path, rel=5e-4)
    assert losses[6] < losses[1]


def test_llama3_8b_fsdp_script_trains_on_two_processes(tmp_path):
    """The llama3 8B script with Megatron-FSDP's switches (full sharding on FSDP2 here)."""
    parallel = {"--tensor-model-parallel-size": "1", "--context-parallel-size": "1"}
    losses = _check_against_one_process(
        "pretrain_gpt.py", lambda p: _llama(p, parallel, MEGATRON_FSDP),
        lambda p: _llama(p, SINGLE), tmp_path, rel=5e-4)
    assert losses[6] < losses[1]


def test_mixtral_8x7b_script_trains_on_two_processes(tmp_path):
    """Mock data for its Llama2Tokenizer dataset; PP4 x EP8 -> EP2 on 2 ranks."""
    def argv(path, parallel):
        return _prepare(MIXTRAL_8X7B, path, parallel, data_swap=True)

    parallel = {"--tensor-model-parallel-size": "1", "--pipeline-model-parallel-size": "1",
                "--expert-model-parallel-size": "2"}
    losses = _check_against_one_process(
        "pretrain_gpt.py", lambda p: argv(p, parallel), lambda p: argv(p, SINGLE),
        tmp_path, rel=5e-4)
    assert losses[6] < losses[1]

