"""scripts/slurm/job_common.sh's run_step requeues the job when the run ended with the
progress watchdog's exit code 75 (a hang): srun's status, or the first failure of torchrun's
summary, once torchrun's own restarts are spent; not after a success, another failure,
REQUEUE=0 or MAX_HANG_REQUEUES requeues. Run without SLURM: stub `srun` and `scontrol`."""
import os
import subprocess

import pytest

from megatron_smp.resilience import HANG_EXIT_CODE

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__)))))
# torchrun's failure summary after a hang: the detecting rank exited 75 first, the frozen one
# was SIGKILLed a second later.
_SUMMARY = """E1129 agent: failed (exitcode: 75) local_rank: 0 (pid: 11) of binary: python
Failures:
[1]:
  exitcode  : -9 (pid: 12)
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  exitcode  : {code} (pid: 11)
"""


def _run_step(tmp_path, output, status, **env):
    stubs = tmp_path / "bin"
    stubs.mkdir(exist_ok=True)
    (stubs / "srun").write_text('#!/bin/bash\nshift\nexec "$@"\n')  # drops --kill-on-bad-exit
    (stubs / "scontrol").write_text(f'#!/bin/bash\necho "$@" >> {tmp_path}/scontrol\n')
    for stub in ("srun", "scontrol"):
        os.chmod(stubs / stub, 0o755)
    (tmp_path / "run.out").write_text(output)
    (tmp_path / "scontrol").write_text("")
    script = (f"set -euo pipefail; repo={ROOT}; source scripts/slurm/job_common.sh; "
              f"run_step bash -c 'cat {tmp_path}/run.out; exit {status}'")
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60,
                          env=dict(base, PATH=f"{stubs}:{os.environ['PATH']}",
                                   SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="n1",
                                   SLURM_NNODES="1", MASTER_ADDR="127.0.0.1", **env))
    return proc.returncode, proc.stdout, (tmp_path / "scontrol").read_text()


@pytest.mark.parametrize("case, output, status, env, requeued, returns", [
    ("torchrun: hang", _SUMMARY.format(code=75), 1, {}, True, 0),
    ("srun: hang", "[watchdog] rank 3 stops: hang detected\n", HANG_EXIT_CODE, {}, True, 0),
    ("torchrun restarted and finished", _SUMMARY.format(code=75) + "done\n", 0, {}, False, 0),
    ("another failure last", _SUMMARY.format(code=1), 1, {}, False, 1),
    ("REQUEUE=0", _SUMMARY.format(code=75), 1, {"REQUEUE": "0"}, False, 1),
    ("requeued enough", "", HANG_EXIT_CODE, {"SLURM_RESTART_COUNT": "3"}, False, HANG_EXIT_CODE),
    ("MAX_HANG_REQUEUES=5", "", HANG_EXIT_CODE,
     {"SLURM_RESTART_COUNT": "3", "MAX_HANG_REQUEUES": "5"}, True, 0),
])
def test_run_step_requeues_a_hang(tmp_path, case, output, status, env, requeued, returns):
    code, stdout, scontrol = _run_step(tmp_path, output, status, **env)
    assert code == returns, (case, stdout)
    assert (scontrol == "requeue 4242\n") == requeued, (case, stdout, scontrol)
    if requeued:
        assert "a rank hung (exit code 75, the progress watchdog's): requeueing job 4242" in stdout
    if case == "requeued enough":
        assert "not requeueing job 4242 again" in stdout
