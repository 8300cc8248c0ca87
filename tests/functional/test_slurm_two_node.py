"""The batch jobs of scripts/slurm/ on two nodes under a real SLURM, as users submit them.

`scripts/slurm/local_two_node_cluster.sh` makes the two nodes: network namespaces with their
own addresses (198.18.40.1 and .2), host names and slurmd, joined by a veth pair, slurmctld
on node 1; the file system (clone, corpus, checkpoints) is shared as on a cluster. Where
network namespaces are not permitted (not root, a kernel or container that refuses them)
every test here skips with the reason. The jobs are submitted on node 1 with `--nodes=2`:
  * a torchrun per node with the c10d rendezvous on node 1's address (TP=2 within a node,
    DP=2 across the nodes), and one task per rank with srun (TP=2 within, PP=2 across), each
    with the single-process losses;
  * in one job, node 2's workers SIGKILLed mid-run (torchrun --max-restarts re-forms the
    job), then node 2 lost whole (SLURM requeues the job, a replacement node joins): each
    time the run resumes from the last checkpoint with the uninterrupted run's losses;
  * a node slow to start: the rendezvous times out after RDZV_TIMEOUT with a clear error.
The cluster is torn down at the end, also when a test fails, leaving nothing behind.
"""
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.functional.test_slurm import TINY, _environment, _losses, _submit, _wait

pytestmark = pytest.mark.two_node

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLUSTER = os.path.join(REPO, "scripts/slurm/local_two_node_cluster.sh")
PREFIX = os.environ.get("SLURM_TWO_NODE_PREFIX", "msmp")
NET = os.environ.get("SLURM_TWO_NODE_NET", "198.18.40")
STATE = os.environ.get("SLURM_TWO_NODE_STATE", "/var/tmp/megatron_smp_slurm_two_node")
ON_NODE_1 = ["bash", CLUSTER, "on", "1"]  # the SLURM commands run on the head node
ITERS = 20
# No dropout: its masks depend on the layout (each data-parallel rank draws its own), so only
# without it can a 4-rank layout follow the single process (to 1e-4; bf16 as the launcher).
ARGS = TINY + ["--train-iters", str(ITERS), "--lr-decay-iters", str(ITERS),
               "--hidden-dropout", "0", "--attention-dropout", "0"]
TP2 = ["--tensor-model-parallel-size", "2"]
SAVE = ["--save-interval", "4"]
# One torchrun per node starting 2 processes, or 2 srun tasks per node (one per rank).
TORCHRUN_JOB = ["--nodes", "2", "--gpus-per-node", "0", "--ntasks-per-node", "1",
                "--cpus-per-task", "2"]
SRUN_JOB = ["--nodes", "2", "--gpus-per-node", "0", "--ntasks-per-node", "2",
            "--cpus-per-task", "1"]
TIMES = {}  # seconds, printed at the end of the module (pytest -s shows them)
RESULTS = {}  # the same for the losses compared


def _node(n):
    return f"{PREFIX}-n{n}"


def _cluster(*args, timeout=120):
    return subprocess.run(["bash", CLUSTER, *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def cluster():
    """The two-node SLURM, torn down after the module's last test whatever happened."""
    start = time.monotonic()
    proc = _cluster(timeout=600)
    if proc.returncode == 2 or (proc.returncode and "apt-get" in proc.stderr):
        reason = f"no two-node SLURM here: {proc.stderr.strip()[-500:]}"
        print(reason)
        pytest.skip(reason)
    assert proc.returncode == 0, proc.stderr
    TIMES["cluster start"] = time.monotonic() - start
    try:
        yield
    finally:
        _cluster("stop")
        print("two-node SLURM times (s):",
              ", ".join(f"{name} {seconds:.1f}" for name, seconds in TIMES.items()))
        for name, result in RESULTS.items():
            print(f"two-node SLURM {name}: {result}")


def _job(script, name, tmp_path, corpus, directives, args, env=()):
    submit_dir = tmp_path / name
    submit_dir.mkdir()
    environ = _environment(corpus["gpt"], tmp_path / f"{name}_checkpoints")
    environ.update(env)
    return _submit(script, submit_dir, environ, directives, args, client=ON_NODE_1), submit_dir


def _wait_job(job, submit_dir, until=None, timeout=600):
    """`_wait` on node 1; 600 s: a loaded 2-core machine runs these jobs 10x slower."""
    return _wait(job, submit_dir, timeout=timeout, until=until, client=ON_NODE_1)


def _at_iteration(n):
    return lambda output: any(int(i) >= n for i in re.findall(r"^ iteration +(\d+)/", output,
                                                               re.M))


@pytest.fixture(scope="module")
def single_process(corpus, tmp_path_factory):
    """The launcher's run on one process (torchrun --standalone, no SLURM): its losses."""
    tmp = tmp_path_factory.mktemp("single_process")
    env = dict(_environment(corpus["gpt"], tmp / "checkpoints"), NPROC_PER_NODE="1")
    proc = subprocess.run(["bash", os.path.join(REPO, "scripts/pretrain_gpt_125m.sh")] + ARGS,
                          cwd=tmp, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = _losses(proc.stdout)
    assert sorted(losses) == list(range(1, ITERS + 1)), proc.stdout[-3000:]
    return losses


_UNINTERRUPTED = {}


def _compare(name, losses, single_process):
    worst = max(abs(losses[i] - single_process[i]) / abs(single_process[i]) for i in losses)
    RESULTS[name] = (f"iterations 1/10/{ITERS} {losses[1]}/{losses[10]}/{losses[ITERS]} vs single "
                     f"process {single_process[1]}/{single_process[10]}/{single_process[ITERS]}, "
                     f"largest relative difference {worst:.1e}")


def _uninterrupted(corpus, tmp_path_factory):
    """The TP=2 x DP=2 torchrun job across both nodes, run once: (job, output)."""
    if not _UNINTERRUPTED:
        tmp = tmp_path_factory.mktemp("uninterrupted")
        start = time.monotonic()
        job, submit_dir = _job("pretrain_gpt.sbatch", "job", tmp, corpus, TORCHRUN_JOB,
                               ARGS + TP2, env={"LOGLEVEL": "INFO"})
        output = _wait_job(job, submit_dir)
        TIMES["2-node job, submit to end"] = time.monotonic() - start
        assert sorted(_losses(output)) == list(range(1, ITERS + 1)), output[-4000:]
        _UNINTERRUPTED.update(job=job, output=output)
    return _UNINTERRUPTED["job"], _UNINTERRUPTED["output"]


def _rendezvous_port(job, output):
    """The job's rendezvous line names node 1's namespace address; its port."""
    found = re.search(rf"^job {job} attempt 0 on {PREFIX}-n\[1-2\], clone .*, "
                      rf"rendezvous {re.escape(NET)}\.1:(\d+)$", output, re.M)
    assert found, output[:3000]
    return found.group(1)


def _assert_nodes_route_to_node_1(output, port, lines_per_node=1):
    """Each node's launcher found its own address and interface on the route to node 1."""
    for n in (1, 2):
        line = (f"node {_node(n)}: rendezvous {NET}.1:{port} ({NET}.1), this node {NET}.{n}, "
                f"GLOO_SOCKET_IFNAME={PREFIX}-v{n} NCCL_SOCKET_IFNAME={PREFIX}-v{n}")
        assert output.count(line) == lines_per_node, (line, output[:3000])


def _launch_env_on(node, **env):
    """Source scripts/launch_env.sh on a node: (NODE_ADDR, GLOO_SOCKET_IFNAME,
    NCCL_SOCKET_IFNAME), the LAUNCH command, the lines it printed."""
    script = ('source scripts/launch_env.sh && echo "$NODE_ADDR $GLOO_SOCKET_IFNAME '
              '$NCCL_SOCKET_IFNAME" && echo "${LAUNCH[*]}"')
    environ = {k: v for k, v in os.environ.items()
               if k not in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "NODE_ADDR")}
    proc = subprocess.run(["bash", CLUSTER, "on", str(node), "bash", "-c", script], cwd=REPO,
                          env=dict(environ, **env), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    derived, launch = proc.stdout.splitlines()
    return tuple(derived.split()), launch.split(), proc.stderr


def test_launcher_derives_node_address_and_interface_unless_set(cluster):
    """On node 2, with MASTER_ADDR node 1's host name: this node's address and interface on
    the route to it, torchrun's --local-addr, the rendezvous timeout and restarts; a
    GLOO_SOCKET_IFNAME the user set is kept."""
    rendezvous = dict(NNODES="2", MASTER_ADDR=_node(1), MASTER_PORT="29400")
    derived, launch, printed = _launch_env_on(2, RDZV_TIMEOUT="7", MAX_RESTARTS="2",
                                              **rendezvous)
    assert derived == (f"{NET}.2", f"{PREFIX}-v2", f"{PREFIX}-v2")
    assert f"node {_node(2)}: rendezvous {_node(1)}:29400 ({NET}.1), this node {NET}.2" in printed
    text = " ".join(launch)
    for expected in (f"--rdzv-endpoint {_node(1)}:29400", f"--local-addr {NET}.2",
                     "--rdzv-conf join_timeout=7", "--max-restarts 2", "--nnodes 2"):
        assert expected in text, (expected, text)
    derived, _, _ = _launch_env_on(2, GLOO_SOCKET_IFNAME="eth7", **rendezvous)
    assert derived == (f"{NET}.2", "eth7", f"{PREFIX}-v2")
    # One node: nothing derived, torchrun alone as before.
    derived, launch, _ = _launch_env_on(1, NNODES="1", MASTER_ADDR=_node(1))
    assert derived == () and "--local-addr" not in launch


def test_tp2_in_node_dp2_across_nodes_torchrun_matches_single_process(
        cluster, corpus, single_process, tmp_path_factory):
    """pretrain_gpt.sbatch as submitted with --nodes=2: one torchrun per node, c10d rendezvous
    on node 1's address, both agents joining from their own addresses, the workers' store on
    node 1; the losses are the single process's."""
    job, output = _uninterrupted(corpus, tmp_path_factory)
    port = _rendezvous_port(job, output)
    _assert_nodes_route_to_node_1(output, port)
    # torchrun's own log (LOGLEVEL=INFO): both agents met at node 1's address, each with
    # its own per-round store (not the agent's shared one), as node ranks 0 and 1, and hand
    # their workers node 1's address for that store.
    assert output.count(f"rdzv_endpoint            : {NET}.1:{port}\n") == 2, output[:6000]
    assert output.count("use_agent_store: False\n") == 2
    assert sorted(re.findall(r"\]   group_rank=(\d)\n", output)) == ["0", "1"]
    assert output.count(f"]   master_addr={NET}.1\n") == 2
    losses = _losses(output)
    _compare("TP2 x DP2 (torchrun)", losses, single_process)
    assert losses == pytest.approx(single_process, rel=1e-4), (losses, single_process)


def test_tp2_in_node_pp2_across_nodes_srun_matches_single_process(
        cluster, corpus, single_process, tmp_path):
    """pretrain_gpt_srun.sbatch with --nodes=2: srun starts the 4 ranks itself (2 per node);
    tensor parallel within each node, the two pipeline stages on different nodes."""
    job, submit_dir = _job("pretrain_gpt_srun.sbatch", "srun", tmp_path, corpus, SRUN_JOB,
                           ARGS + TP2 + ["--pipeline-model-parallel-size", "2"])
    output = _wait_job(job, submit_dir)
    port = _rendezvous_port(job, output)
    _assert_nodes_route_to_node_1(output, port, lines_per_node=2)  # one per task
    losses = _losses(output)
    assert sorted(losses) == list(range(1, ITERS + 1)), output[-4000:]
    _compare("TP2 x PP2 (srun)", losses, single_process)
    assert losses == pytest.approx(single_process, rel=1e-4), (losses, single_process)


def _workers(n):
    """Pids of the training processes on node n (not their torchrun agent)."""
    pids = subprocess.run(["ip", "netns", "pids", _node(n)], capture_output=True, text=True,
                          timeout=30).stdout.split()
    workers = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                argv = handle.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if any(arg.endswith("pretrain_gpt.py") for arg in argv) \
                and "torch.distributed.run" not in argv:
            workers.append(int(pid))
    return workers


def _job_state(job):
    return subprocess.run(ON_NODE_1 + ["squeue", "-h", "-j", job, "-o", "%T"],
                          capture_output=True, text=True, timeout=30).stdout.strip()


def _after_resume_at_iteration(n, attempt_line):
    def reached(output):
        _, started, attempt = output.partition(attempt_line)
        _, resumed, rest = attempt.partition("resuming at iteration")
        return bool(started and resumed) and _at_iteration(n)(rest)
    return reached


def test_node_2_lost_twice_torchrun_restarts_then_slurm_requeues_resuming_exactly(
        cluster, corpus, tmp_path, tmp_path_factory):
    """One job (MAX_RESTARTS=1, a checkpoint every 4 iterations), two faults on node 2:
    1. after iteration 6 every worker there is SIGKILLed: node 2's agent restarts its
       workers, node 1's fail on the broken collective and restart too, the c10d rendezvous
       re-forms (round 1) and the job resumes from the last checkpoint;
    2. after iteration 10 of the restarted run node 2 is lost whole: its link goes down (no
       packet leaves it, as when a node loses power) and every process on it, slurmd
       included, is SIGKILLed. SLURM marks it DOWN after SlurmdTimeout and requeues the job
       (--requeue); a replacement node 2 joins, and attempt 1 resumes from the last checkpoint.
    Every iteration logged, the repeated ones included, has the uninterrupted run's loss."""
    _, reference = _uninterrupted(corpus, tmp_path_factory)
    uninterrupted = _losses(reference)
    job, submit_dir = _job("pretrain_gpt.sbatch", "faults", tmp_path, corpus, TORCHRUN_JOB,
                           ARGS + TP2 + SAVE, env={"MAX_RESTARTS": "1", "LOGLEVEL": "INFO"})
    _wait_job(job, submit_dir, until=_at_iteration(6))
    workers = _workers(2)
    assert len(workers) == 2, workers
    for pid in workers:
        os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    first = f"job {job} attempt 0"
    _wait_job(job, submit_dir, until=_after_resume_at_iteration(1, first))
    TIMES["workers lost -> resumed (torchrun restart)"] = time.monotonic() - killed
    output = _wait_job(job, submit_dir, until=_after_resume_at_iteration(10, first))
    # Both agents met again (a second rendezvous round). Node 2's agent counts a restart;
    # node 1's may count none (it restarts healthy workers for the rejoining node): the
    # workers' per-round store does not depend on those counts agreeing.
    assert output.count("Rendezvous complete for workers") == 4, output[-8000:]
    assert "Worker group FAILED. 1/1 attempts left; will restart worker group" in output
    assert "]   restart_count=1\n" in output
    assert int(re.search(r"resuming at iteration (\d+)", output).group(1)) in (4, 8)

    lost = time.monotonic()
    assert _cluster("lose", "2").returncode == 0
    deadline = time.monotonic() + 120
    while _job_state(job) != "PENDING":
        assert time.monotonic() < deadline, (_job_state(job), _cluster(
            "on", "1", "sinfo", "-N").stdout)
        time.sleep(0.5)
    TIMES["node lost -> job requeued (SLURM)"] = time.monotonic() - lost
    replaced = _cluster("replace", "2")
    assert replaced.returncode == 0, replaced.stderr
    second = f"job {job} attempt 1"
    _wait_job(job, submit_dir, until=_after_resume_at_iteration(1, second))
    TIMES["node lost -> resumed (SLURM requeue)"] = time.monotonic() - lost
    output = _wait_job(job, submit_dir)
    resumed = [int(i) for i in re.findall(r"resuming at iteration (\d+)", output)]
    assert len(resumed) == 2 and resumed[1] in (8, 12, 16), output[-5000:]
    assert f"checkpoint of iteration {ITERS} saved" in output
    for i, loss in re.findall(r"^ iteration +(\d+)/ +\d+ \|.* lm loss: ([0-9.E+-]+) \|",
                              output, re.M):
        assert float(loss) == uninterrupted[int(i)], (i, loss, uninterrupted[int(i)])
    assert _losses(output) == uninterrupted
    RESULTS["faults"] = (f"resumed at iterations {resumed} (torchrun restart, SLURM requeue); "
                         f"{len(re.findall(r'^ iteration ', output, re.M))} iterations logged, "
                         f"each equal to the uninterrupted run's loss")


def test_node_slow_to_join_fails_after_rdzv_timeout_with_a_clear_error(
        cluster, corpus, tmp_path):
    """Node 2's launcher starts 120 s late (its PYTHON sleeps first); with RDZV_TIMEOUT=5
    node 1's torchrun gives up after 5 s, and the job says why instead of waiting 600 s."""
    slow_python = tmp_path / "python_slow_on_node_2"
    slow_python.write_text(f'#!/bin/sh\n[ "$(hostname)" = {_node(2)} ] && sleep 120\n'
                           f'exec {sys.executable} "$@"\n')
    slow_python.chmod(0o755)
    start = time.monotonic()
    job, submit_dir = _job("pretrain_gpt.sbatch", "slow", tmp_path, corpus, TORCHRUN_JOB,
                           ARGS + TP2, env={"PYTHON": str(slow_python), "RDZV_TIMEOUT": "5"})
    output = _wait_job(job, submit_dir, timeout=100)
    TIMES["slow node: submit -> clear error"] = time.monotonic() - start
    port = _rendezvous_port(job, output)
    assert (f"rendezvous timed out: not all 2 nodes joined {NET}.1:{port} within "
            "RDZV_TIMEOUT=5 s.") in output, output[-4000:]
    assert "RendezvousTimeoutError" in output
    assert not _losses(output)


def test_start_without_root_skips_with_the_reason(tmp_path):
    """Not permitted to make network namespaces: exit 2 and say so (the tests skip on it)."""
    import shutil
    import tempfile

    state = tmp_path / "state"
    # A clone may sit under a directory only root can enter (mktemp -d is 0700): the
    # unprivileged user runs a copy of the scripts from a directory it can read.
    readable = tempfile.mkdtemp()
    try:
        os.chmod(readable, 0o755)
        scripts = shutil.copytree(os.path.dirname(CLUSTER), os.path.join(readable, "slurm"))
        command = ["bash", os.path.join(scripts, os.path.basename(CLUSTER))]
        if os.geteuid() == 0:
            command = ["runuser", "-u", "nobody", "--"] + command
        proc = subprocess.run(command, capture_output=True, text=True, timeout=60,
                              cwd=readable, env=dict(os.environ, SLURM_TWO_NODE_STATE=str(state)))
    finally:
        shutil.rmtree(readable, ignore_errors=True)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "network namespaces not permitted: needs root" in proc.stderr
    assert not state.exists()


def _gone(pid):
    try:
        with open(f"/proc/{pid}/status") as handle:
            return "\nState:\tZ" in handle.read()  # exited; its parent has yet to reap it
    except OSError:
        return True


def test_stop_leaves_nothing_behind(cluster):
    """`stop`: the daemons (by their pid files), the namespaces with their veth pair, the
    nodes' /etc/hosts and the state directory are gone; this machine's network unchanged."""
    pid_files = [os.path.join(STATE, name) for name in
                 ("slurmctld.pid", f"{_node(1)}.pid", f"{_node(2)}.pid", "munge/munged.pid")]
    pids = [int(open(path).read()) for path in pid_files]
    assert _cluster("stop").returncode == 0
    assert all(_gone(pid) for pid in pids), pids
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                                timeout=30).stdout
    assert _node(1) not in namespaces and _node(2) not in namespaces
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True,
                           timeout=30).stdout
    assert f"{PREFIX}-v" not in links
    assert not os.path.exists(STATE)
    assert not any(os.path.exists(f"/etc/netns/{_node(n)}") for n in (1, 2))
