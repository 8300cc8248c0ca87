"""Settings the framework cannot honour stop every rank with one clear message, fast."""
import os
import subprocess
import sys
import time

import pytest

from megatron_smp.testing import run_distributed
from tests.functional.test_training_parity import COMMON, _train

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

NOT_YET = {
    "moe": (["--num-experts", "3", "--expert-model-parallel-size", "2"],
            "--num-experts (3) must be divisible by --expert-model-parallel-size (2)"),
    "cp": (["--context-parallel-size", "2", "--seq-length", "34", "--max-position-embeddings",
            "34"], "--seq-length (34) must be divisible by 2 x --context-parallel-size (4)"),
    "smp_offloading": (["--smp-config", '{"sm_activation_offloading": true}'],
                       "configure smp.fully_shard in a script of your own"),
    "fsdp_distopt": (["--use-torch-fsdp2", "--use-distributed-optimizer"],
                     "--use-torch-fsdp2 does not combine with --use-distributed-optimizer"),
}


@pytest.mark.parametrize("case", sorted(NOT_YET))
def test_not_yet_supported_setting_stops_every_rank(case):
    flags, message = NOT_YET[case]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "pretrain_llama.py", *COMMON, *flags],
        capture_output=True, text=True, timeout=120, env=env, cwd=ROOT,
    )
    assert proc.returncode != 0
    output = proc.stdout + proc.stderr
    assert output.count(message) == 1, output[-3000:]  # printed once (rank 0), every rank exits
    assert "megatron_smp/" not in output  # no stack trace of ours (torchrun prints its own)
    # Every rank stops at the configuration check, long before the collective timeout a
    # hanging rank would hit (the subprocess limit above is only the harness's backstop).
    assert time.monotonic() - start < 60


def test_kv_channels_model_trains_at_every_tensor_parallel_size():
    """--hidden-size 100 with 8 heads of --kv-channels 16: trains, and TP=2 gives the TP=1
    losses."""
    argv = [a for a in COMMON]
    argv[argv.index("--hidden-size") + 1] = "100"
    argv[argv.index("--num-attention-heads") + 1] = "8"
    argv += ["--kv-channels", "16"]
    single = run_distributed(_train, 1, args=(argv,))[0]
    assert single[-1] < single[0]
    for losses in run_distributed(_train, 2, args=(argv + ["--tensor-model-parallel-size", "2"],)):
        assert losses == pytest.approx(single, rel=1e-4)


def test_tools_end_a_configuration_error_with_one_line_and_status_2(tmp_path):
    """tools/generate.py at world 2 on a converted checkpoint with a contradicting shape flag,
    and convert.py on a directory without a model: `megatron_smp: error: ...` once (rank 0),
    exit status 2 on every rank, no traceback."""
    from tests.unit.inference.common import convert_to_ours, hf_model_dir, launch, wait_all

    hf_model_dir(tmp_path / "hf")
    convert_to_ours(tmp_path / "hf", tmp_path / "ckpt")
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "In the beginning"}\n')
    procs = launch("generate.py", ["--load", tmp_path / "ckpt", "--use-checkpoint-args",
                                   "--hidden-size", "32", "--tokenizer-type",
                                   "HuggingFaceTokenizer", "--tokenizer-model", tmp_path / "hf",
                                   "--tensor-model-parallel-size", "2", "--input",
                                   tmp_path / "prompts.jsonl", "--output", tmp_path / "out"],
                   2, tmp_path)
    assert wait_all(procs, 120) == [2, 2]
    logs = [(tmp_path / f"rank{rank}.log").read_text() for rank in range(2)]
    errors = [line for line in logs[0].splitlines() if line.startswith("megatron_smp: error:")]
    assert len(errors) == 1 and "--hidden-size gives hidden_size=32, the checkpoint 64" \
        in errors[0], logs[0][-2000:]
    assert "Traceback" not in logs[0] + logs[1] and "megatron_smp: error" not in logs[1]

    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "checkpoint", "convert.py"),
                           "--model-type", "llama", "--loader", "hf", "--saver", "megatron_smp",
                           "--load-dir", str(tmp_path / "nothing"), "--save-dir",
                           str(tmp_path / "out_ckpt")], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.count("megatron_smp: error:") == 1, proc.stderr[-2000:]
