"""--fault-tolerance (torchft): two replica groups of pretrain_gpt.py (one process each) and a
torchft lighthouse. Group 1's process is SIGKILLed in the middle of training; group 0 never
stops (one process from first to last iteration, every iteration logged once) and goes on
alone in a quorum of 1; group 1 is started again, fetches group 0's weights, optimizer and
progress (the digest it received equals the one group 0 sent), goes on from group 0's
iteration, and both finish with the same weights bit for bit.

Until group 1 has rejoined, each step sleeps 0.25 s (test-side: a wrapper of the
forward step, as long as a marker file exists) so that group 0 is still training when group 1
comes back; the marker is removed once group 1 has rejoined.
"""
import importlib.util
import os
import re
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ITERS = 80
FLAGS = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 4 "
    f"--train-iters {ITERS} --mock-data --tokenizer-type NullTokenizer --vocab-size 256 "
    "--hidden-dropout 0 --attention-dropout 0 --lr 1e-3 --log-interval 1 --eval-interval 1000 "
    "--eval-iters 0 --seed 7 --fault-tolerance --fault-tolerance-group-size 2 "
    "--fault-tolerance-process-group-timeout-ms 5000"
).split()
_ITER = re.compile(r" iteration +(\d+)/ *\d+ \| consumed samples: +(\d+) \|.*"
                   r"number of skipped iterations: +(\d+)")
_GRAD_NORM = re.compile(r" iteration +(\d+)/.*\| lm loss: ([-+\dEe.]+) \|.*grad norm: ([\d.]+) \|")
_QUORUM = re.compile(r"replica group (\d): iteration (\d+): (\d) of 2 replica groups")
_NOT_COMMITTED = re.compile(r"replica group 0: iteration (\d+) not committed")
_SENT = re.compile(r"replica group (\d): sent iteration (\d+)'s state .* weights sha1 (\w+)")
_RECOVERED = re.compile(r"replica group (\d): recovered iteration (\d+)'s .* weights sha1 (\w+)")
_FINISHED = re.compile(r"replica group (\d): finished at iteration (\d+), weights sha1 (\w+)")


def worker(marker: str, argv) -> None:
    """One replica group: pretrain_gpt.py's pretrain, each forward step 0.25 s longer while
    `marker` exists."""
    sys.path.insert(0, ROOT)
    from megatron_smp.training import pretrain
    from pretrain_gpt import forward_step, model_provider, train_valid_test_datasets_provider

    def slow_forward(data_iterator, model):
        if os.path.exists(marker):
            time.sleep(0.25)
        return forward_step(data_iterator, model)

    pretrain(train_valid_test_datasets_provider, model_provider, slow_forward, argv=argv)


def _wait_for(path, pattern, timeout, proc=None, after=None):
    """The first match of `pattern` in the log at `path` (after the first match of `after`)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(path) as f:
            text = f.read()
        start = re.search(after, text) if after else None
        match = (re.compile(pattern).search(text, start.end()) if start
                 else None if after else re.search(pattern, text))
        if match:
            return match
        if proc is not None and proc.poll() is not None:
            break
        time.sleep(0.1)
    with open(path) as f:
        raise AssertionError(f"no {pattern!r} in {path} within {timeout} s:\n{f.read()[-3000:]}")


def _lighthouse(tmp_path):
    binary = os.path.join(os.path.dirname(sys.executable), "torchft_lighthouse")
    log = tmp_path / "lighthouse.log"
    proc = subprocess.Popen([binary, "--min_replicas", "1", "--join_timeout_ms", "1000",
                             "--heartbeat_timeout_ms", "2000", "--bind", "127.0.0.1:0"],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)
    port = _wait_for(log, r"listening on: http://[^:]+:(\d+)", 30, proc).group(1)
    return proc, f"http://127.0.0.1:{port}"


@pytest.mark.skipif(importlib.util.find_spec("torchft") is None, reason="needs torchft (pip install 'megatron_smp[torchft]')")
def test_a_killed_replica_group_rejoins_without_stopping_the_other(tmp_path):
    marker = tmp_path / "slow"
    marker.write_text("")
    lighthouse, address = _lighthouse(tmp_path)
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    env.pop("MASTER_ADDR", None)
    env.pop("MASTER_PORT", None)
    procs = []

    def start(replica, name):
        argv = FLAGS + ["--fault-tolerance-replica-id", str(replica),
                        "--fault-tolerance-lighthouse", address]
        code = (f"from tests.functional.test_replica_groups import worker; "
                f"worker({str(marker)!r}, {argv!r})")
        log = tmp_path / name
        proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env,
                                stdout=open(log, "w"), stderr=subprocess.STDOUT)
        procs.append(proc)
        return proc, log

    try:
        group0, log0 = start(0, "group0.log")
        group1, log1 = start(1, "group1.log")
        # Both in the quorum, a few iterations in: kill group 1.
        killed_at = int(_wait_for(log1, r" iteration +(\d+)/", 120, group1,
                                  after=r"2 of 2 replica groups(?:.*\n){3}").group(1))
        group1.send_signal(signal.SIGKILL)
        group1.wait(timeout=30)
        group1b, log1b = start(1, "group1-restarted.log")
        _wait_for(log1b, r"recovered iteration", 120, group1b)
        marker.unlink()  # rejoined: the rest of the run at full speed
        assert group0.wait(timeout=120) == 0
        assert group1b.wait(timeout=120) == 0
    finally:
        for proc in procs + [lighthouse]:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    text0, text1, text1b = (log.read_text() for log in (log0, log1, log1b))

    # Group 0 never stopped: every iteration logged once, in order, by one process (from the
    # first, or from where it joined group 1 when group 1 started training first).
    iterations0 = [int(m.group(1)) for m in _ITER.finditer(text0)]
    joined = _RECOVERED.search(text0)
    first = int(joined.group(2)) + 1 if joined else 1
    assert iterations0 == list(range(first, ITERS + 1)), text0[-3000:]
    # The kill reached group 0 in the step it had in flight (not committed, no update); its
    # quorum then held itself alone until group 1 was back, or -- when the restarted group 1
    # was already waiting at group 0's next quorum (a loaded machine) -- both groups at once.
    failed = [int(i) for i in _NOT_COMMITTED.findall(text0)]
    assert [i for i in failed if killed_at <= i <= killed_at + 2], (killed_at, failed)
    quorums0 = [(int(i), int(n)) for g, i, n in _QUORUM.findall(text0)]
    counts = [n for _, n in quorums0]
    alone = [i for i, n in quorums0 if n == 1 and i > killed_at]
    assert counts[-1] == 2, quorums0
    # Group 1 restarted: it took group 0's state (the same weights, bit for bit) and went on
    # from group 0's iteration.
    sent = list(_SENT.finditer(text0))[-1] if _SENT.search(text0) else None
    recovered = _RECOVERED.search(text1b)
    assert sent and recovered, (text0[-2000:], text1b[-2000:])
    assert sent.group(1) == "0" and recovered.group(1) == "1"
    assert sent.group(2) == recovered.group(2) and sent.group(3) == recovered.group(3)
    step = int(recovered.group(2))
    rejoined = step + 1
    if alone:
        assert [i for i, n in quorums0 if n == 2 and i > alone[0]][0] == rejoined, quorums0
    iterations1b = [int(m.group(1)) for m in _ITER.finditer(text1b)]
    assert iterations1b == list(range(step + 1, ITERS + 1))
    consumed0 = {int(m.group(1)): int(m.group(2)) for m in _ITER.finditer(text0)}
    consumed1b = {int(m.group(1)): int(m.group(2)) for m in _ITER.finditer(text1b)}
    assert consumed1b == {i: consumed0[i] for i in consumed1b}
    # The killed process got no further than where it was killed (plus the step in flight).
    iterations1 = [int(m.group(1)) for m in _ITER.finditer(text1)]
    assert killed_at <= iterations1[-1] <= killed_at + 1, (killed_at, iterations1[-3:])
    # From the rejoin on, both groups update with the same gradient -- the mean over both
    # groups' batches -- while each computes its own loss on its own shard of the data.
    norms0 = {int(i): (loss, norm) for i, loss, norm in _GRAD_NORM.findall(text0)}
    norms1b = {int(i): (loss, norm) for i, loss, norm in _GRAD_NORM.findall(text1b)}
    assert all(norms1b[i][1] == norms0[i][1] for i in range(rejoined, ITERS + 1))
    assert sum(norms1b[i][0] != norms0[i][0] for i in range(rejoined, ITERS + 1)) > 0
    # Same weights at the end on both groups.
    finished = {m.group(1): (int(m.group(2)), m.group(3)) for m in _FINISHED.finditer(
        text0 + text1b)}
    assert finished["0"] == finished["1"] and finished["0"][0] == ITERS, finished
    print(f"\nkilled at iteration {killed_at}; group 0 alone from iteration "
          f"{alone[0] if alone else '-'}; group 1 "
          f"recovered iteration {step} (weights sha1 {sent.group(3)[:12]}) and rejoined at "
          f"{rejoined}; both finished with sha1 {finished['0'][1][:12]}")
