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
