"""The batch jobs of scripts/slurm/ under a real SLURM (one node, CPU), as users submit them.

`scripts/slurm/local_cluster.sh` installs (with root) and starts a one-node SLURM; where it
cannot, every test here skips with its reason. Jobs are submitted from a directory outside
the clone with the GPU directives overridden for CPU, on a corpus preprocessed by our
tools/preprocess_data.py with the tokenizer each launcher names (GPT-2 BPE files, a
SentencePiece model). Each test compares per-iteration losses with an uninterrupted job's.
"""
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CPU = ["--nodes", "1", "--gpus-per-node", "0"]
TINY = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
        "--max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 8 "
        "--log-interval 1 --save-interval 1000 --eval-interval 1000 "
        "--eval-iters 0").split()
ITERS = 80  # long enough that a signal sent at iteration 3 lands mid-run
# Per family, the launcher's own warm-up flag shortened to the tiny run; the Llama launcher's
# --ffn-hidden-size 11008 is shrunk with the rest of the model (left as it is, it is 97% of the
# tiny model's time). Its --bf16 stays: 0.25 s an iteration here, so 40 outlast the signal.
FAMILY_ITERS = {"gpt": ITERS, "llama": 40}
SCHEDULE = {"gpt": ["--lr-decay-iters", str(ITERS)],
            "llama": ["--lr-warmup-iters", "2", "--ffn-hidden-size", "172"]}
_LINE = re.compile(r"^ iteration +(\d+)/ +\d+ \|.* lm loss: ([0-9.E+-]+) \|", re.M)


def _node_idle():
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True,
                             timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return any(state.startswith(("idle", "mix", "alloc")) for state in out.split())


def _probe(cpus, timeout=90):
    """Run a one-line job that asks for `cpus` CPUs: None once it has run, else why not."""
    out = subprocess.run(["sbatch", "--parsable", "--cpus-per-task", str(cpus), "--output",
                          "/dev/null", "--wrap", "true"], capture_output=True, text=True,
                         timeout=60)
    if out.returncode != 0:
        return f"sbatch refused a {cpus}-CPU job: {out.stderr.strip()}"
    job = out.stdout.strip().split(";")[0]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T %r"], capture_output=True,
                               text=True, timeout=30).stdout.strip()
        if not state:
            return None
        time.sleep(0.5)
    subprocess.run(["scancel", job], timeout=30)
    nodes = subprocess.run(["sinfo", "-h", "-o", "%N %t %c"], capture_output=True, text=True,
                           timeout=30).stdout.strip()
    return f"a {cpus}-CPU probe job is still queued after {timeout} s ({state}; node: {nodes})"


@pytest.fixture(scope="module")
def slurm():
    """A one-node SLURM that runs 2-CPU jobs: started by local_cluster.sh where we are root
    (it leaves a healthy running one alone), checked with a probe job."""
    if os.geteuid() == 0:
        proc = subprocess.run(["bash", os.path.join(REPO, "scripts/slurm/local_cluster.sh")],
                              capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            reason = f"SLURM could not be started: {proc.stderr.strip()[-500:]}"
            print(reason)
            pytest.skip(reason)
    elif not (shutil.which("sbatch") and _node_idle()):
        pytest.skip("no SLURM running here and not root to start one "
                    "(scripts/slurm/local_cluster.sh)")
    problem = _probe(2)
    if problem:  # the scheduler is up but cannot run what the tests submit: fail at once
        pytest.fail(problem)


def _environment(data, checkpoints):
    env = dict(os.environ, CHECKPOINT_PATH=str(checkpoints), **data)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "PYTHON",
                 "GPUS_PER_NODE", "NPROC_PER_NODE", "LAUNCHER"):
        env.pop(name, None)
    if not os.path.exists(os.path.join(REPO, ".venv/bin/python")):
        env["PYTHON"] = sys.executable  # the scripts' default is the clone's .venv
    return env


def _submit(script, submit_dir, env, directives, args, client=()):
    """sbatch the script from `submit_dir`; `client` prefixes the SLURM commands (to run them
    on a node of the two-node cluster); the job id."""
    out = subprocess.run([*client, "sbatch", "--parsable"] + directives
                         + [os.path.join(REPO, "scripts/slurm", script)] + args,
                         cwd=submit_dir, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().split(";")[0]


def _output(submit_dir, job):
    names = [n for n in os.listdir(submit_dir) if n.endswith(f"_{job}.out")]
    return (submit_dir / names[0]).read_text() if names else ""


def _wait(job, submit_dir, timeout=300, until=None, client=()):
    """Wait until the job has left the queue (or `until(output)` holds); its output."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        output = _output(submit_dir, job)
        if until is not None:
            # Only the output matters here; polled often (no squeue in between, which can
            # take seconds under load) so that an action at iteration 3 of a run of a few
            # seconds lands while it is still training.
            if until(output):
                return output
            time.sleep(0.05)
            continue
        state = subprocess.run([*client, "squeue", "-h", "-j", job, "-o", "%T"],
                               capture_output=True, text=True, timeout=30)
        # (a failed squeue, as under load, says nothing; the output is read again: the job
        # may have written its last lines since)
        if until is None and state.returncode == 0 and not state.stdout.strip():
            return _output(submit_dir, job)
        time.sleep(0.3)
    reason = subprocess.run([*client, "squeue", "-h", "-j", job, "-o", "%T %r"],
                            capture_output=True, text=True, timeout=30).stdout.strip()
    subprocess.run([*client, "scancel", job], timeout=30)
    raise AssertionError(f"job {job} still queued after {timeout} s ({reason}):\n"
                         f"{_output(submit_dir, job)}")


def _losses(output):
    """{iteration: lm loss} over every attempt in the (appended) job output."""
    return {int(i): float(loss) for i, loss in _LINE.findall(output)}


def _run(script, tmp_path, data, directives, args, name):
    submit_dir = tmp_path / name
    submit_dir.mkdir()
    env = _environment(data, tmp_path / f"{name}_checkpoints")
    job = _submit(script, submit_dir, env, directives, args)
    return job, submit_dir, env


_REFERENCES = {}


def _reference(family, tmp_path_factory, corpus):
    """Losses of an uninterrupted job of the family's batch script."""
    if family not in _REFERENCES:
        tmp = tmp_path_factory.mktemp(f"reference_{family}")
        script = "pretrain_gpt.sbatch" if family == "gpt" else "pretrain_llama.sbatch"
        iters = FAMILY_ITERS[family]
        job, submit_dir, _ = _run(script, tmp, corpus[family], CPU + ["--cpus-per-task", "2"],
                                  TINY + SCHEDULE[family] + ["--train-iters", str(iters)],
                                  "reference")
        output = _wait(job, submit_dir)
        losses = _losses(output)
        assert sorted(losses) == list(range(1, iters + 1)), output[-3000:]
        assert f"checkpoint of iteration {iters} saved" in output
        _REFERENCES[family] = losses
    return _REFERENCES[family]


def _interrupted(family, tmp_path, corpus, action, name):
    """Submit the family's batch script, run `action` on the job at iteration 3, wait until
    it has left the queue; its output, after checking that it saved at the signal, resumed
    from there and logged each iteration once."""
    script = "pretrain_gpt.sbatch" if family == "gpt" else "pretrain_llama.sbatch"
    iters = FAMILY_ITERS[family]
    job, submit_dir, _ = _run(script, tmp_path, corpus[family], CPU + ["--cpus-per-task", "2"],
                              TINY + SCHEDULE[family] + ["--train-iters", str(iters)], name)
    _wait(job, submit_dir, until=lambda out: " iteration        3/" in out)
    subprocess.run(action + [job], check=True, timeout=30)
    output = _wait(job, submit_dir)
    assert "exiting program after receiving SIGTERM" in output
    resumed = re.search(r"resuming at iteration (\d+)", output)
    assert resumed and 3 <= int(resumed.group(1)) < iters, output[-3000:]
    assert f"job {job} attempt 1" in output
    assert sorted(_losses(output)) == list(range(1, iters + 1))
    return job, output


def test_gpt_job_requeues_itself_after_scancel_signal_and_resumes_exactly(
        slurm, corpus, tmp_path, tmp_path_factory):
    """`scancel --signal=TERM` (what --signal=TERM@N sends before the time limit): the run
    saves and exits, the job requeues itself, attempt 1 resumes with the same losses."""
    reference = _reference("gpt", tmp_path_factory, corpus)
    job, output = _interrupted("gpt", tmp_path, corpus, ["scancel", "--signal=TERM"],
                               "signalled")
    assert f"requeueing job {job}" in output
    assert _losses(output) == reference


def test_gpt_srun_job_stops_and_a_second_submission_resumes(
        slurm, corpus, tmp_path, tmp_path_factory):
    """One task per rank (no torchrun); the first submission stops at --exit-interval (not
    requeued: a deliberate stop), the second resumes: together the uninterrupted losses."""
    reference = _reference("gpt", tmp_path_factory, corpus)
    directives = CPU + ["--ntasks-per-node", "2", "--cpus-per-task", "1"]
    args = TINY + SCHEDULE["gpt"] + ["--train-iters", str(ITERS), "--exit-interval", "40"]
    submit_dir = tmp_path / "srun"
    submit_dir.mkdir()
    env = _environment(corpus["gpt"], tmp_path / "srun_checkpoints")
    first = _submit("pretrain_gpt_srun.sbatch", submit_dir, env, directives, args)
    first_output = _wait(first, submit_dir)
    assert "exiting program at iteration 40" in first_output and "requeueing" not in first_output
    assert sorted(_losses(first_output)) == list(range(1, 41))
    second = _submit("pretrain_gpt_srun.sbatch", submit_dir, env, directives,
                     TINY + SCHEDULE["gpt"] + ["--train-iters", str(ITERS)])
    second_output = _wait(second, submit_dir)
    assert "resuming at iteration 40" in second_output
    losses = {**_losses(first_output), **_losses(second_output)}
    assert sorted(losses) == list(range(1, ITERS + 1))
    assert losses == reference


def test_llama_job_survives_scontrol_requeue(slurm, corpus, tmp_path, tmp_path_factory):
    """`scontrol requeue` (preemption by the scheduler): SIGTERM, the run saves within
    KillWait, SLURM requeues the job, and it resumes with the uninterrupted losses."""
    reference = _reference("llama", tmp_path_factory, corpus)
    _, output = _interrupted("llama", tmp_path, corpus, ["scontrol", "requeue"], "requeued")
    assert _losses(output) == reference


def test_scripts_open_their_output_in_the_submit_directory():
    """SLURM opens --output before the script runs: it must not name a directory that a
    fresh clone lacks (the old logs/%x_%j.out killed every job at once)."""
    for script in os.listdir(os.path.join(REPO, "scripts/slurm")):
        if script.endswith(".sbatch"):
            text = open(os.path.join(REPO, "scripts/slurm", script)).read()
            output = re.search(r"^#SBATCH --output=(\S+)", text, re.M).group(1)
            assert "/" not in output, (script, output)
