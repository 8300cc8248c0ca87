"""The fault injector's plan: drawn from the seed as Megatron-LM draws it (ranks, then the
fault, then the delay), and each fault really happens to the process."""
import math
import os
import random
import subprocess
import sys
import textwrap
import time

import pytest

from megatron_smp.config import ResilienceConfig
from megatron_smp.config.resilience import FAULT_TYPES
from megatron_smp.resilience.fault_injector import draw_plan


def test_plan_from_explicit_ranks_and_fixed_delay():
    config = ResilienceConfig(fault_injector_ranks="1,3", fault_injector_fault_types="crash",
                              fault_injector_fault_delay=12.5)
    plan = draw_plan(config, 4)
    assert plan[1] == plan[3] == FAULT_TYPES.index("crash")
    assert math.isnan(plan[0]) and math.isnan(plan[2]) and plan[4] == 12.5


def test_plan_drawn_from_the_seed():
    config = ResilienceConfig(fault_injector_num_ranks=2, fault_injector_fault_types="hang,slow",
                              fault_injector_fault_probabilities="0,1",
                              fault_injector_mtti_seconds=100.0,
                              fault_injector_offset_seconds=5.0, fault_injector_seed=3)
    plan = draw_plan(config, 8)
    rng = random.Random(3)
    ranks = rng.sample(range(1, 8), k=2)  # never rank 0
    rng.choices(["hang", "slow"], [0, 1], k=1)
    delay = 5.0 - math.log(1.0 - rng.random()) * 100.0
    assert sorted(r for r in range(8) if not math.isnan(plan[r])) == sorted(ranks)
    assert {plan[r] for r in ranks} == {FAULT_TYPES.index("slow")}
    assert plan[8] == pytest.approx(delay)
    assert draw_plan(config, 8)[:8] == pytest.approx(plan[:8], nan_ok=True)


@pytest.mark.parametrize("fault, returncode", [("crash", -9), ("hang", -19)])
def test_faults_happen_to_the_process(fault, returncode):
    """One process arms the plan (no process group: the plan is its own) and gets the fault
    0.2 s later: SIGKILL, or SIGSTOP (seen by the parent, which then kills it)."""
    script = textwrap.dedent(f'''
        import time, torch
        from megatron_smp.config import ResilienceConfig
        from megatron_smp.resilience.fault_injector import FaultInjector
        config = ResilienceConfig(fault_injector_ranks="0", fault_injector_fault_types="{fault}",
                                  fault_injector_fault_delay=0.2)
        FaultInjector(config, 0, 1, torch.device("cpu")).arm(1)
        time.sleep(30)
    ''')
    proc = subprocess.Popen([sys.executable, "-c", script])
    try:
        if fault == "hang":
            deadline = time.monotonic() + 60
            status = 0
            while time.monotonic() < deadline:  # bounded: never wait on a process for ever
                pid, status = os.waitpid(proc.pid, os.WUNTRACED | os.WNOHANG)
                if pid:
                    break
                time.sleep(0.05)
            assert os.WIFSTOPPED(status), status
            assert -os.WSTOPSIG(status) == returncode
        else:
            assert proc.wait(timeout=60) == returncode
    finally:
        proc.kill()


def test_only_the_first_attempt_injects(monkeypatch):
    """No fault after a restart: torchrun's, a SLURM requeue's, or an in-process one."""
    import torch

    from megatron_smp.parallel_state import set_inprocess_attempt
    from megatron_smp.resilience.fault_injector import FaultInjector

    config = ResilienceConfig(fault_injector_ranks="0", fault_injector_fault_types="crash",
                              fault_injector_fault_delay=0.2)

    def active():
        return FaultInjector(config, 0, 1, torch.device("cpu"), log=lambda line: None).active

    for name in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    assert active()
    for name in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"):
        monkeypatch.setenv(name, "1")
        assert not active()
        monkeypatch.setenv(name, "0")
    set_inprocess_attempt(1)
    try:
        assert not active()
    finally:
        set_inprocess_attempt(0)
