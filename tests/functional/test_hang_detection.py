"""A rank that stops without dying: pretrain_gpt.py at DP=2 under torchrun --max-restarts with
the progress watchdog (--enable-ft-package). One rank is frozen by a real SIGSTOP in the middle
of training, or blocks in its data loader; the watchdog names it with its Python stack within
the configured timeouts (well under 60 s), the job exits with HANG_EXIT_CODE, torchrun restarts
it, it resumes from the last checkpoint, and every logged iteration equals the uninterrupted
run's bit for bit.

The test-side wrapper (`_WRAPPER`) records each worker's pid and, from an environment variable
only this test sets, makes one rank's dataset block in attempt 0 (storage that stops
answering). The product has no such switch; the SIGSTOP comes from the test.
"""
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from megatron_smp.resilience import HANG_EXIT_CODE

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORLD = 2
ITERS = 24
FLAGS = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 4 "
    f"--train-iters {ITERS} --mock-data --tokenizer-type NullTokenizer --vocab-size 1000 "
    "--hidden-dropout 0.1 --attention-dropout 0.1 --lr 1e-3 --lr-warmup-iters 2 "
    "--log-interval 1 --eval-interval 100 --eval-iters 0 --seed 7 --use-distributed-optimizer "
    "--distributed-timeout-minutes 5"
).split()
WATCHDOG = ("--enable-ft-package --ft-num-warmup-iters 2 --ft-heartbeat-interval 0.5 "
            "--ft-rank-heartbeat-timeout 8 --ft-rank-out-of-section-timeout 120 "
            "--ft-rank-section-timeouts setup:240,step:12,checkpointing:120").split()
_LOSS = re.compile(r" iteration +(\d+)/ *\d+ \|.*?lm loss: ([-+\dEe.naif]+) \|")

_WRAPPER = '''
import os, runpy, sys, time
sys.path.insert(0, {root!r})
import megatron_smp.training as training

rank = int(os.environ["RANK"])
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
open(os.path.join({pids!r}, f"attempt{{attempt}}.rank{{rank}}"), "w").write(str(os.getpid()))
block = os.environ.get("TEST_BLOCK_DATA_AT")   # "rank,sample read" in attempt 0
pretrain = training.pretrain
reads = [0]

def pretrain_with_faults(datasets, model, forward_step, **kwargs):
    def provider(*args):
        splits = datasets(*args)
        train = splits[0]
        if not block or attempt != 0 or rank != int(block.split(",")[0]):
            return splits
        original = type(train).__getitem__

        class Blocking(type(train)):
            def __getitem__(self, index):
                reads[0] += 1
                if reads[0] == int(block.split(",")[1]):
                    time.sleep(3600)  # the storage stops answering
                return original(self, index)
        train.__class__ = Blocking
        return (train,) + tuple(splits[1:])
    return pretrain(provider, model, forward_step, **kwargs)

training.pretrain = pretrain_with_faults
sys.argv = [{script!r}] + sys.argv[1:]
runpy.run_path({script!r}, run_name="__main__")
'''


class Job:
    """torchrun --standalone on WORLD workers of the wrapper, its output in a file."""

    def __init__(self, tmp_path, flags, env=None, max_restarts=0):
        self.tmp_path = tmp_path
        self.pids = tmp_path / "pids"
        self.pids.mkdir(exist_ok=True)
        wrapper = tmp_path / "faulty_pretrain_gpt.py"
        wrapper.write_text(_WRAPPER.format(root=ROOT, pids=str(self.pids),
                                           script=os.path.join(ROOT, "pretrain_gpt.py")))
        launch = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                  "--nproc-per-node", str(WORLD), f"--max-restarts={max_restarts}",
                  "--monitor-interval", "0.2"]
        self.log_path = tmp_path / f"torchrun{time.monotonic_ns()}.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            launch + [str(wrapper)] + FLAGS + flags, stdout=self.log, stderr=subprocess.STDOUT,
            env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, **(env or {})),
            cwd=str(tmp_path))

    def output(self):
        return self.log_path.read_text()

    def wait_for(self, pattern, timeout, start=0):
        """(monotonic time, offset of the match end) once `pattern` is in the output after
        `start`; fails after `timeout` seconds or when the job ends first."""
        deadline = time.monotonic() + timeout
        regex = re.compile(pattern)
        while True:
            match = regex.search(self.output(), start)
            if match:
                return time.monotonic(), match.end()
            assert self.proc.poll() is None, f"job ended before {pattern!r}:\n" + \
                self.output()[-5000:]
            assert time.monotonic() < deadline, f"no {pattern!r} within {timeout} s:\n" + \
                self.output()[-5000:]
            time.sleep(0.05)

    def pid(self, attempt, rank):
        return int((self.pids / f"attempt{attempt}.rank{rank}").read_text())

    def finish(self, timeout=240):
        try:
            self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:  # a hang: leave no worker behind
                self.proc.kill()
                for path in self.pids.iterdir():
                    try:
                        os.kill(int(path.read_text()), signal.SIGKILL)
                    except (ProcessLookupError, ValueError):
                        pass
                self.proc.wait()
            self.log.close()
        return self.proc.returncode, self.output()


def _losses(output):
    """{iteration: lm loss}; a resumed attempt's lines replace the earlier ones."""
    return {int(it): float(loss) for it, loss in _LOSS.findall(output)}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    code, output = Job(tmp_path_factory.mktemp("uninterrupted"), WATCHDOG).finish()
    assert code == 0, output[-5000:]
    losses = _losses(output)
    assert sorted(losses) == list(range(1, ITERS + 1)), output[-4000:]
    assert "[watchdog]" not in output  # no false alarm on a healthy run
    return losses


def _check_recovered(job, save, code, output, uninterrupted):
    assert code == 0, output[-6000:]
    assert sorted(os.listdir(job.pids)) == [f"attempt{a}.rank{r}" for a in (0, 1)
                                           for r in range(WORLD)]
    assert f"(exitcode: {HANG_EXIT_CODE})" in output, output[-6000:]
    assert re.search(r"resuming at iteration \d+", output), output[-4000:]
    assert _losses(output) == uninterrupted  # bitwise
    with open(os.path.join(save, "latest_checkpointed_iteration.txt")) as tracker:
        assert int(tracker.read()) == ITERS


def test_sigstopped_rank_is_named_and_the_job_resumes(tmp_path, uninterrupted):
    """Rank 1 SIGSTOPped after iteration 9 is logged: rank 0's watchdog finds its heartbeat
    silent, names it with the stack of its last heartbeat, SIGKILLs it and exits 75; torchrun
    restarts both from iteration 8's checkpoint."""
    save = str(tmp_path / "ckpt")
    job = Job(tmp_path, WATCHDOG + ["--save", save, "--load", save, "--save-interval", "4"],
              max_restarts=1)
    try:
        job.wait_for(r" iteration +9/", timeout=180)
        os.kill(job.pid(0, 1), signal.SIGSTOP)
        stopped = time.monotonic()
        detected, offset = job.wait_for(r"\[watchdog\] hang detected", timeout=60)
        resumed, _ = job.wait_for(r" iteration +\d+/", timeout=120, start=offset)
    finally:
        code, output = job.finish()
    report = output[output.index("[watchdog] hang detected"):]
    assert re.search(r"stuck: rank\(s\) 1 -- sends no heartbeat", report), report[:3000]
    assert re.search(r"rank 1 \(host .*its last heartbeat's stack:\n +File", report), \
        report[:3000]
    assert re.search(r"rank 0 waits: .*at:\n +File", report), report[:3000]
    _check_recovered(job, save, code, output, uninterrupted)
    print(f"\nSIGSTOP: detected after {detected - stopped:.1f} s, first resumed iteration "
          f"{resumed - stopped:.1f} s after the fault")
    assert detected - stopped < 30


def test_rank_blocked_in_its_data_loader_is_named(tmp_path, uninterrupted):
    """Rank 1's dataset stops answering at its 30th sample read (iteration 15): its step
    passes the 12 s step timeout, the watchdog names rank 1 as waiting for its data, with the
    dataset's frame on its stack, while rank 0 waits in a collective; the job restarts and
    resumes from iteration 12."""
    save = str(tmp_path / "ckpt")
    job = Job(tmp_path, WATCHDOG + ["--save", save, "--load", save, "--save-interval", "4"],
              env={"TEST_BLOCK_DATA_AT": "1,30"}, max_restarts=1)
    try:
        blocked, _ = job.wait_for(r" iteration +14/", timeout=240)
        detected, offset = job.wait_for(r"\[watchdog\] hang detected", timeout=60)
        resumed, _ = job.wait_for(r" iteration +\d+/", timeout=120, start=offset)
    finally:
        code, output = job.finish()
    report = output[output.index("[watchdog] hang detected"):]
    assert re.search(r"stuck: rank\(s\) 1 -- waits for its data", report), report[:3000]
    assert re.search(r"phase 'data', stack:\n(    .*\n)*.*in __getitem__\n +time.sleep\(3600\)",
                     report), report[:3000]
    _check_recovered(job, save, code, output, uninterrupted)
    print(f"\ndata loader: detected {detected - blocked:.1f} s after iteration 14 was "
          f"logged, first resumed iteration {resumed - blocked:.1f} s after it")


@pytest.mark.parametrize("fault", ["hang", "crash"])
def test_injected_fault_is_recovered(tmp_path, uninterrupted, fault):
    """--fault-injector-*: rank 1 SIGSTOPs (hang) or SIGKILLs (crash) itself as soon as
    iteration 5 completes (no delay: an idle machine runs the remaining iterations in about
    0.1 s), in the first attempt only; the hang is named by the watchdog, the
    crash restarts through torchrun; both resume with the uninterrupted run's losses."""
    save = str(tmp_path / "ckpt")
    flags = WATCHDOG + ["--save", save, "--load", save, "--save-interval", "4",
                        "--fault-injector-ranks", "1", "--fault-injector-fault-types", fault,
                        "--fault-injector-delay-start-iteration", "5",
                        "--fault-injector-fault-delay", "0"]
    job = Job(tmp_path, flags, max_restarts=1)
    try:
        injected, offset = job.wait_for(rf"FAULT INJECTION: rank 1 injects {fault} now",
                                        timeout=180)
        if fault == "hang":
            detected, offset = job.wait_for(r"\[watchdog\] hang detected", timeout=60,
                                            start=offset)
        resumed, _ = job.wait_for(r"resuming at iteration \d+\n iteration +\d+/", timeout=120,
                                  start=offset)
    finally:
        code, output = job.finish()
    assert code == 0, output[-6000:]
    assert sorted(os.listdir(job.pids)) == [f"attempt{a}.rank{r}" for a in (0, 1)
                                           for r in range(WORLD)]
    assert output.count("FAULT INJECTION: rank 1 will inject") == 1  # not in the restart
    if fault == "hang":
        assert f"(exitcode: {HANG_EXIT_CODE})" in output
        assert re.search(r"stuck: rank\(s\) 1 -- sends no heartbeat", output), output[-5000:]
        print(f"\ninjected hang: detected after {detected - injected:.1f} s", end="")
    assert _losses(output) == uninterrupted
    print(f"\ninjected {fault}: first resumed iteration {resumed - injected:.1f} s after the "
          "fault")


def test_inprocess_restart_recovers_an_exception_and_a_stuck_rank(tmp_path, uninterrupted):
    """--inprocess-restart, two faults in one job, neither relaunching a process: rank 1's
    step raises (the injected "exception" fault, after iteration 5); both ranks abort their
    collectives, form new process groups in the same processes and resume from iteration 4's
    checkpoint. In that restarted run rank 1's dataset stops answering (its 30th sample read):
    the watchdog names it past the 6 s step timeout and every rank restarts in process again.
    torchrun never restarts anything, and the losses are the uninterrupted run's."""
    save = str(tmp_path / "ckpt")
    flags = WATCHDOG + ["--ft-rank-section-timeouts", "setup:240,step:6,checkpointing:120",
                        "--save", save, "--load", save, "--save-interval", "4",
                        "--inprocess-restart", "--inprocess-max-iterations", "2",
                        "--fault-injector-ranks", "1", "--fault-injector-fault-types",
                        "exception", "--fault-injector-delay-start-iteration", "5",
                        "--fault-injector-fault-delay", "0"]
    job = Job(tmp_path, flags, env={"TEST_BLOCK_DATA_AT": "1,30"}, max_restarts=0)
    try:
        injected, offset = job.wait_for(r"FAULT INJECTION: rank 1 raises", timeout=180)
        resumed, offset = job.wait_for(r"resuming at iteration \d+\n iteration +\d+/",
                                       timeout=120, start=offset)
        detected, offset = job.wait_for(r"\[watchdog\] hang detected", timeout=120,
                                        start=offset)
        resumed2, _ = job.wait_for(r"resuming at iteration \d+\n iteration +\d+/",
                                   timeout=120, start=offset)
    finally:
        code, output = job.finish()
    assert code == 0, output[-6000:]
    assert sorted(os.listdir(job.pids)) == [f"attempt0.rank{r}" for r in range(WORLD)]
    for rank in range(WORLD):
        for restart in (1, 2):
            assert re.search(rf"\[inprocess\] rank {rank}: .*restarting in process "
                             rf"\(restart {restart}\)", output), output[-5000:]
    report = output[output.index("[watchdog] hang detected"):]
    assert re.search(r"stuck: rank\(s\) 1 -- waits for its data", report), report[:3000]
    assert "every rank restarts in process" in report
    assert output.count("FAULT INJECTION: rank 1 will inject") == 1
    assert _losses(output) == uninterrupted
    with open(os.path.join(save, "latest_checkpointed_iteration.txt")) as tracker:
        assert int(tracker.read()) == ITERS
    print(f"\nin-process restart: exception -> first resumed iteration "
          f"{resumed - injected:.1f} s; stuck data loader detected "
          f"{detected - injected:.1f} s after the first fault, first resumed iteration "
          f"{resumed2 - detected:.1f} s after the detection")


class TwoNodes:
    """Two network namespaces joined by a veth pair (198.18.41.1 and .2, RFC 2544's range,
    which exists only inside this machine), each with its own host name and /etc/hosts: the
    nodes of a cluster, on the shared file system. `link(False)` cuts the link between them
    with every process alive (a network partition); `close()` removes all of it."""

    PREFIX, NET = "msmppart", "198.18.41"

    def __init__(self, tmp_path):
        self.names = [f"{self.PREFIX}-n{n}" for n in (1, 2)]
        self.hosts = tmp_path / "hosts"
        self.hosts.write_text("127.0.0.1 localhost\n" + "".join(
            f"{self.NET}.{n} {name}\n" for n, name in enumerate(self.names, 1)))
        self.close()  # what an interrupted earlier run may have left
        v1, v2 = f"{self.PREFIX}-v1", f"{self.PREFIX}-v2"
        commands = [["ip", "netns", "add", self.names[0]], ["ip", "netns", "add", self.names[1]],
                    ["ip", "link", "add", v1, "netns", self.names[0], "type", "veth", "peer",
                     "name", v2, "netns", self.names[1]]]
        for n, (name, dev) in enumerate(zip(self.names, (v1, v2)), 1):
            commands += [["ip", "-n", name, "addr", "add", f"{self.NET}.{n}/24", "dev", dev],
                         ["ip", "-n", name, "link", "set", dev, "up"],
                         ["ip", "-n", name, "link", "set", "lo", "up"]]
        for command in commands:
            proc = subprocess.run(command, capture_output=True, text=True, timeout=30)
            if proc.returncode:
                self.close()
                raise OSError(f"{' '.join(command)}: {proc.stderr.strip()}")

    def command(self, n, argv):
        """argv run on node n (its network, host name and /etc/hosts)."""
        name = self.names[n - 1]
        return ["nsenter", f"--net=/run/netns/{name}", "unshare", "--mount", "--uts", "sh",
                "-c", 'mount --bind "$0" /etc/hosts && hostname "$1" && shift 2 && exec "$@"',
                str(self.hosts), name, "--"] + argv

    def link(self, up):
        subprocess.run(["ip", "-n", self.names[1], "link", "set", f"{self.PREFIX}-v2",
                        "up" if up else "down"], check=True, timeout=30)

    def close(self):
        for name in self.names:
            pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True,
                                  text=True, timeout=30).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


@pytest.fixture
def two_nodes(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("a network partition needs two network namespaces: run as root")
    try:
        nodes = TwoNodes(tmp_path)
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"network namespaces are not permitted here: {exc}")
    try:
        yield nodes
    finally:
        nodes.close()


@pytest.mark.two_node
def test_network_partition_between_two_nodes_is_named_and_the_job_resumes(
        tmp_path, two_nodes, uninterrupted):
    """DP=2 over two namespace nodes (a torchrun per node, c10d rendezvous on node 1, one
    worker each). After iteration 9 the link between the nodes goes down, every process
    alive: the rank that still reaches the job's store finds the other's heartbeat silent and
    names it; the cut-off rank finds the store unreachable and says so; both exit 75. The link
    comes back, both torchruns restart their worker, and the job resumes from iteration 8's
    checkpoint with the uninterrupted run's losses."""
    save = str(tmp_path / "ckpt")
    pids = tmp_path / "pids"
    pids.mkdir()
    wrapper = tmp_path / "faulty_pretrain_gpt.py"
    wrapper.write_text(_WRAPPER.format(root=ROOT, pids=str(pids),
                                       script=os.path.join(ROOT, "pretrain_gpt.py")))
    flags = WATCHDOG + ["--save", save, "--load", save, "--save-interval", "4"]
    jobs, logs = [], []
    for n in (1, 2):
        launch = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                  "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                  "--rdzv-endpoint", f"{TwoNodes.NET}.1:29431", "--rdzv-id", "partition",
                  "--max-restarts", "1", "--monitor-interval", "0.2"]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT,
                   GLOO_SOCKET_IFNAME=f"{TwoNodes.PREFIX}-v{n}",
                   TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
        logs.append(tmp_path / f"node{n}.log")
        jobs.append(subprocess.Popen(two_nodes.command(n, launch + [str(wrapper)] + FLAGS
                                                        + flags),
                                     stdout=open(logs[-1], "w"), stderr=subprocess.STDOUT,
                                     env=env, cwd=str(tmp_path)))

    def output(node=None):
        return "".join(log.read_text() for n, log in enumerate(logs, 1) if node in (None, n))

    def wait_for(pattern, timeout, node=None):
        deadline = time.monotonic() + timeout
        while not re.search(pattern, output(node)):
            assert all(job.poll() is None for job in jobs), output()[-6000:]
            assert time.monotonic() < deadline, f"no {pattern!r} in {timeout} s:\n" + \
                output()[-6000:]
            time.sleep(0.05)
        return time.monotonic()

    try:
        wait_for(r" iteration +9/", timeout=240)
        two_nodes.link(False)
        cut = time.monotonic()
        named = wait_for(r"\[watchdog\] hang detected", timeout=60)
        unreachable = wait_for(r"the job's store has been unreachable", timeout=60)
        two_nodes.link(True)
        # The last rank logs the iterations: the first one after its restart.
        resumed = wait_for(r"(store has been unreachable|hang detected)[\s\S]* iteration +"
                           r"\d+/", timeout=180, node=2)
        codes = [job.wait(timeout=240) for job in jobs]
    finally:
        for job in jobs:
            if job.poll() is None:
                job.kill()
                job.wait(timeout=30)
    text = output()
    assert codes == [0, 0], text[-6000:]
    report = text[text.index("[watchdog] hang detected"):]
    stuck = re.search(r"stuck: rank\(s\) (\d) -- sends no heartbeat \(process frozen, or its "
                      r"node cut off\)", report)
    assert stuck, report[:3000]
    cut_off = re.search(r"\[watchdog\] rank (\d): the job's store has been unreachable", text)
    assert cut_off.group(1) == stuck.group(1)  # the same rank, named from both sides
    assert text.count(f"(exitcode: {HANG_EXIT_CODE})") >= 1, text[-6000:]
    assert re.search(r"resuming at iteration 8\b", text), text[-4000:]
    assert _losses(text) == uninterrupted
    with open(os.path.join(save, "latest_checkpointed_iteration.txt")) as tracker:
        assert int(tracker.read()) == ITERS
    print(f"\nnetwork partition: named after {named - cut:.1f} s, the cut-off rank stopped "
          f"after {unreachable - cut:.1f} s; first resumed iteration {resumed - cut:.1f} s "
          "after the cut (the link back up once both had stopped)")
