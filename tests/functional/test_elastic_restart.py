"""Fault-tolerant jobs: pretrain_gpt.py under torchrun resumes from the last complete checkpoint
with exactly the losses of an uninterrupted run, after a worker is SIGKILLed (torchrun
--max-restarts restarts the workers, c10d rendezvous) and after the whole job is SIGKILLed
while an asynchronous save is being written and started again (static rendezvous).

The faults come from a test-side wrapper (`_WRAPPER`, written into the test's tmp dir), which
runs pretrain_gpt.py as `__main__` with its `pretrain` wrapped: it records its pid and, from
environment variables only this test sets, SIGKILLs one rank in restart attempt 0 or slows the
checkpoint writer down from a given iteration on. The product has no such switch.
"""
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORLD = 4
ITERS = 6
# TP2 x DP2 with the distributed optimizer and dropout: resuming exactly needs the model and
# optimizer shards, the RNG states (dropout) and the data position of every rank.
FLAGS = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 8 "
    f"--train-iters {ITERS} --mock-data --tokenizer-type NullTokenizer --vocab-size 1000 "
    "--hidden-dropout 0.1 --attention-dropout 0.1 --lr 1e-3 --lr-warmup-iters 2 "
    "--log-interval 1 --eval-interval 100 --eval-iters 0 --seed 7 "
    "--tensor-model-parallel-size 2 --use-distributed-optimizer"
).split()
_LOSS = re.compile(r" iteration +(\d+)/ *\d+ \|.*?lm loss: ([-+\dEe.naif]+) \|")

_WRAPPER = '''
import os, runpy, signal, sys
sys.path.insert(0, {root!r})
import megatron_smp.training as training
from megatron_smp.checkpointing.engine.storage import TEST_WRITE_DELAY_ENV, TEST_WRITE_MARKER_ENV

rank = int(os.environ["RANK"])
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
open(os.path.join({pids!r}, f"attempt{{attempt}}.rank{{rank}}"), "w").write(str(os.getpid()))
kill = os.environ.get("TEST_KILL_RANK_AT")        # "rank,forward call" in attempt 0
slow = os.environ.get("TEST_SLOW_WRITES_FROM")    # "forward call,marker path"
pretrain = training.pretrain
calls = [0]

def pretrain_with_faults(datasets, model, forward_step, **kwargs):
    def forward(data_iterator, module):
        calls[0] += 1
        if kill and attempt == 0 and [rank, calls[0]] == [int(v) for v in kill.split(",")]:
            os.kill(os.getpid(), signal.SIGKILL)
        if slow and calls[0] == int(slow.split(",")[0]):
            # The checkpoint writer thread reads these at every write: saves from here on
            # touch the marker when they start writing, then stall.
            os.environ[TEST_WRITE_MARKER_ENV] = slow.split(",")[1]
            os.environ[TEST_WRITE_DELAY_ENV] = "600"
        return forward_step(data_iterator, module)
    return pretrain(datasets, model, forward, **kwargs)

training.pretrain = pretrain_with_faults
sys.argv = [{script!r}] + sys.argv[1:]
runpy.run_path({script!r}, run_name="__main__")
'''


def _wrapper(tmp_path):
    pids = tmp_path / "pids"
    pids.mkdir(exist_ok=True)
    path = tmp_path / "faulty_pretrain_gpt.py"
    path.write_text(_WRAPPER.format(root=ROOT, pids=str(pids),
                                    script=os.path.join(ROOT, "pretrain_gpt.py")))
    return str(path)


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launch(tmp_path, flags, rendezvous, env=None, max_restarts=0):
    """torchrun on WORLD processes of the wrapper; `rendezvous` "c10d" (torchrun --standalone:
    its store binds port 0, no race) or "static" (--master-port: a free port, picked again
    if another process took it before torchrun bound it)."""
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD),
              f"--max-restarts={max_restarts}", "--monitor-interval", "0.2"]
    if rendezvous == "c10d":
        launch += ["--standalone"]
    else:
        launch += ["--rdzv-backend", "static", "--master-addr", "127.0.0.1",
                   "--master-port", str(_free_port())]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, **(env or {}))
    log = open(tmp_path / f"torchrun{time.monotonic_ns()}.log", "w+")
    proc = subprocess.Popen(launch + [_wrapper(tmp_path)] + FLAGS + flags, stdout=log,
                            stderr=subprocess.STDOUT, env=env, cwd=str(tmp_path))
    return proc, log


def _kill_job(proc, tmp_path):
    """SIGKILL torchrun and every worker it started (they are not in its process group)."""
    if proc.poll() is None:
        proc.kill()
    for path in (tmp_path / "pids").iterdir():
        try:
            os.kill(int(path.read_text()), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
        path.unlink()  # the pid is not ours any more: never signal it again
    proc.wait()


def _finish(proc, log, tmp_path, timeout=240):
    try:
        proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:  # a hang: leave no worker behind
            _kill_job(proc, tmp_path)
    log.seek(0)
    output = log.read()
    log.close()
    return proc.returncode, output


def _losses(output):
    """{iteration: lm loss} of the log lines; a resumed attempt's lines replace earlier ones."""
    return {int(it): float(loss) for it, loss in _LOSS.findall(output)}


def _run(tmp_path, flags, rendezvous="c10d", env=None, max_restarts=0):
    for _ in range(3):
        code, output = _finish(*_launch(tmp_path, flags, rendezvous, env, max_restarts),
                               tmp_path)
        if not (code and rendezvous == "static" and "address already in use" in output.lower()):
            break
    assert code == 0, output[-6000:]
    return output


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    output = _run(tmp_path_factory.mktemp("uninterrupted"), [])
    losses = _losses(output)
    assert sorted(losses) == list(range(1, ITERS + 1)), output[-4000:]
    return losses


def test_worker_sigkill_restarts_and_resumes_exactly(tmp_path, uninterrupted):
    """Rank 3 SIGKILLs itself in iteration 5 (forward call 9: 2 microbatches per rank and
    step) of attempt 0; torchrun (c10d rendezvous) stops the others and restarts all four,
    which resume from iteration 4's checkpoint."""
    save = str(tmp_path / "ckpt")
    flags = ["--save", save, "--load", save, "--save-interval", "2"]
    output = _run(tmp_path, flags, max_restarts=1, env={"TEST_KILL_RANK_AT": "3,9"})
    attempts = sorted(os.listdir(tmp_path / "pids"))
    assert attempts == [f"attempt{a}.rank{r}" for a in (0, 1) for r in range(WORLD)], attempts
    assert "resuming at iteration 4" in output, output[-4000:]
    losses = _losses(output)
    assert losses == uninterrupted  # bitwise: the same layout and the same reductions
    with open(os.path.join(save, "latest_checkpointed_iteration.txt")) as tracker:
        assert int(tracker.read()) == ITERS


def _wait_for(paths, proc, timeout):
    deadline = time.monotonic() + timeout
    while not all(os.path.exists(path) for path in paths):
        assert proc.poll() is None, "the job ended before the fault"
        assert time.monotonic() < deadline, f"timed out waiting for {paths}"
        time.sleep(0.1)


def test_job_killed_during_async_save_resumes_from_last_complete(tmp_path, uninterrupted):
    """Saves every 2 iterations with --async-save; from iteration 4's forward the writer
    stalls, so iteration 4's save is in flight when the test SIGKILLs torchrun and every
    worker (a lost node). The tracker still names iteration 2, iteration 4 is only an
    `.incomplete` directory, and a new job (static rendezvous) resumes from 2 exactly -- also
    when its rank 3 is SIGKILLed in iteration 5 (--max-restarts 1), with the asynchronous save
    of iteration 4 in flight or already published: the restarted attempt resumes from 2 or 4,
    and either way with the uninterrupted run's losses."""
    save = str(tmp_path / "ckpt")
    marker = str(tmp_path / "writing")
    flags = ["--save", save, "--load", save, "--save-interval", "2", "--async-save"]
    proc, log = _launch(tmp_path, flags, "c10d", env={"TEST_SLOW_WRITES_FROM": f"7,{marker}"})
    try:
        _wait_for([f"{marker}.rank{r}" for r in range(WORLD)], proc, timeout=180)
    finally:
        _kill_job(proc, tmp_path)
    _, first = _finish(proc, log, tmp_path, timeout=30)
    assert sorted(os.listdir(save)) == ["iter_0000002", "iter_0000004.incomplete",
                                        "latest_checkpointed_iteration.txt"]
    with open(os.path.join(save, "latest_checkpointed_iteration.txt")) as tracker:
        assert int(tracker.read()) == 2
    output = _run(tmp_path, flags, rendezvous="static", max_restarts=1,
                  env={"TEST_KILL_RANK_AT": "3,5"})
    assert "attempt1.rank3" in os.listdir(tmp_path / "pids")  # the restart happened
    assert "resuming at iteration 2" in output, output[-4000:]
    resumed = _losses(output)
    assert sorted(resumed) == list(range(3, ITERS + 1))
    assert {**_losses(first), **resumed} == uninterrupted
    assert sorted(os.listdir(save)) == ["iter_0000002", "iter_0000004", "iter_0000006",
                                        "latest_checkpointed_iteration.txt"]
