"""The CUDA-only paths of the run-control flags, on a device (skipped without one):
--deterministic-mode (cuBLAS's workspace set for torch's deterministic check, bitwise
repeatable losses), --record-memory-history (an allocator snapshot with its history) and
--profile's CUDA profiler API capture (the losses of a run without it)."""
import os
import pickle
import re
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FLAGS = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 4 --train-iters 4 "
    "--mock-data --tokenizer-type NullTokenizer --vocab-size 1000 --lr 1e-3 "
    "--lr-warmup-iters 1 --log-interval 1 --eval-interval 100 --eval-iters 0 --seed 7"
).split()
_LOSS = re.compile(r" iteration\s+(\d+)/.*? lm loss: ([0-9.E+-]+) \|")


def _losses(extra, env_extra=None):
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env_extra or {}))
    env.pop("CUBLAS_WORKSPACE_CONFIG", None)  # --deterministic-mode must set it itself
    proc = subprocess.run([sys.executable, os.path.join(REPO, "pretrain_gpt.py")] + FLAGS
                          + extra, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [float(m.group(2)) for m in _LOSS.finditer(proc.stdout)]


def test_deterministic_mode_on_cuda_repeats_bitwise():
    # Megatron's rule: NCCL must use a fixed-order algorithm.
    first = _losses(["--deterministic-mode"], {"NCCL_ALGO": "Ring"})
    second = _losses(["--deterministic-mode"], {"NCCL_ALGO": "Ring"})
    assert len(first) == 4 and first == second


def test_memory_history_snapshot_and_nsys_capture_keep_the_losses(tmp_path):
    snapshot = str(tmp_path / "snapshot.pickle")
    plain = _losses([])
    recorded = _losses(["--record-memory-history", "--memory-snapshot-path", snapshot,
                        "--profile", "--profile-step-start", "1", "--profile-step-end", "3"])
    assert recorded == plain
    with open(snapshot, "rb") as handle:
        state = pickle.load(handle)
    assert state["segments"] and any(state["device_traces"])
