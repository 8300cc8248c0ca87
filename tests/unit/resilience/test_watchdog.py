"""The progress watchdog in one process: section timeouts name the stuck rank with its stack,
a silent neighbour is named and (on this host) SIGKILLed, --calc-ft-timeouts learns and keeps
the timeouts, and bad flags are ConfigErrors naming them."""
import json
import subprocess
import threading
import time

import pytest
import torch.distributed as dist

from megatron_smp.config import ConfigError
from megatron_smp.resilience import HANG_EXIT_CODE
from megatron_smp.config import ResilienceConfig
from megatron_smp.resilience.watchdog import (
    MIN_LEARNED_TIMEOUT_S, SAFETY_FACTOR, ProgressWatchdog,
)


class _Exit:
    def __init__(self):
        self.codes, self.event = [], threading.Event()

    def __call__(self, code):
        self.codes.append(code)
        self.event.set()


def _watchdog(config, rank=0, world_size=1, store=None, save_dir=None):
    lines, exit = [], _Exit()
    watchdog = ProgressWatchdog(config, rank, world_size, store or dist.HashStore(),
                                save_dir=save_dir, log=lines.append, exit=exit)
    return watchdog, lines, exit


def _blocked_on_storage(event, seconds):
    event.wait(seconds)


def test_step_timeout_names_the_rank_with_its_stack():
    config = ResilienceConfig(enable_ft_package=True, ft_num_warmup_iters=0,
                              ft_rank_section_timeouts="step:1", ft_heartbeat_interval=0.1,
                              ft_rank_heartbeat_timeout=5)
    watchdog, lines, exit = _watchdog(config)
    watchdog.step_started(1)
    start = time.monotonic()
    _blocked_on_storage(exit.event, 30)
    elapsed = time.monotonic() - start
    assert exit.codes == [HANG_EXIT_CODE]
    assert 1.0 <= elapsed < 4.0, elapsed
    report = lines[-1]
    assert "rank 0 made no progress for" in report and "in section 'step'" in report
    assert "in _blocked_on_storage" in report and "event.wait(seconds)" in report


def test_a_run_failing_while_its_watchdog_reports_a_hang_exits_with_the_hang_code():
    """A peer's exit can break this rank's collective while its watchdog, having named the
    hang, waits for the others to read the report: the process still ends with status 75."""
    config = ResilienceConfig(enable_ft_package=True, ft_num_warmup_iters=0,
                              ft_rank_section_timeouts="step:0.5", ft_heartbeat_interval=2,
                              ft_rank_heartbeat_timeout=30)
    watchdog, lines, exit = _watchdog(config)
    watchdog.step_started(1)
    deadline = time.monotonic() + 20
    while not any("hang detected" in line for line in lines) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert exit.codes == []  # still waiting 2.5 heartbeat intervals for the others
    watchdog.close(failed=True)  # the main thread's collective failed meanwhile
    assert exit.codes == [HANG_EXIT_CODE]


def test_silent_neighbour_is_named_and_killed_on_this_host(monkeypatch):
    """Rank 1's monitor stops (a frozen process): rank 0 names it after the heartbeat timeout
    and SIGKILLs its process (here a stand-in `sleep`, the pid rank 1's heartbeats give)."""
    from megatron_smp.resilience import watchdog as watchdog_module

    config = ResilienceConfig(enable_ft_package=True, ft_heartbeat_interval=0.1,
                              ft_rank_heartbeat_timeout=1.0)
    store = dist.HashStore()
    stand_in = subprocess.Popen(["sleep", "60"])
    identity = watchdog_module._process_identity()
    try:
        monkeypatch.setattr(watchdog_module, "_process_identity",
                            lambda: dict(identity, pid=stand_in.pid))
        frozen, _, _ = _watchdog(config, rank=1, world_size=2, store=store)
        monkeypatch.undo()
        time.sleep(0.5)  # a few heartbeats
        frozen._stop.set()
        lines, exit, interrupts = [], _Exit(), []
        # A frozen rank cannot restart in process: even with --inprocess-restart's interrupt
        # the job exits for the launcher to replace the process.
        watcher = ProgressWatchdog(config, 0, 2, store, log=lines.append, exit=exit,
                                   interrupt=interrupts.append)
        assert exit.event.wait(10)
        assert interrupts == []
        assert stand_in.wait(timeout=10) == -9
    finally:
        stand_in.kill()
    report = "\n".join(lines)
    assert "rank 1 sent no heartbeat for" in report
    assert "stuck: rank(s) 1 -- sends no heartbeat" in report
    assert f"SIGKILLs rank 1 (pid {stand_in.pid}) 1 s after exiting" in report
    watcher._stop.set()


def test_calc_ft_timeouts_learns_keeps_and_reloads(tmp_path):
    config = ResilienceConfig(enable_ft_package=True, calc_ft_timeouts=True,
                              ft_num_warmup_iters=2, ft_heartbeat_interval=0.2)
    watchdog, lines, exit = _watchdog(config, save_dir=str(tmp_path))
    for iteration in range(1, 21):
        watchdog.step_started(iteration)
        time.sleep(0.002)
        watchdog.step_finished()
    watchdog.checkpointing_started()
    watchdog.checkpointing_finished()
    observed = dict(watchdog.observed)
    watchdog.close()
    assert not exit.codes
    state = json.loads((tmp_path / "ft_state.json").read_text())
    for section in ("setup", "step", "checkpointing"):
        expected = max(MIN_LEARNED_TIMEOUT_S, SAFETY_FACTOR * observed[section])
        assert state["section_timeouts"][section] == pytest.approx(expected)
    assert state["out_of_section_timeout"] == pytest.approx(
        max(MIN_LEARNED_TIMEOUT_S, SAFETY_FACTOR * observed["out_of_section"]))
    assert any("FT: updated timeouts saved to" in line for line in lines)
    again, lines, _ = _watchdog(ResilienceConfig(enable_ft_package=True),
                                save_dir=str(tmp_path))
    assert again.section_timeouts == state["section_timeouts"]
    assert any("FT: loaded timeouts from" in line for line in lines)
    again.close()


@pytest.mark.parametrize("kwargs, flag", [
    ({"ft_rank_section_timeouts": "step:0"}, "--ft-rank-section-timeouts"),
    ({"ft_rank_section_timeouts": "train:5"}, "--ft-rank-section-timeouts"),
    ({"calc_ft_timeouts": True}, "--calc-ft-timeouts"),
    ({"ft_rank_heartbeat_timeout": 1.0}, "--ft-rank-heartbeat-timeout"),
    ({"fault_injector_fault_types": "explode", "fault_injector_ranks": "1",
      "fault_injector_fault_delay": 1.0}, "--fault-injector-fault-types"),
    ({"fault_injector_ranks": "1"}, "--fault-injector-ranks"),
    ({"fault_injector_fault_types": "hang", "fault_injector_ranks": "5",
      "fault_injector_fault_delay": 1.0}, "--fault-injector-ranks"),
    ({"fault_injector_fault_types": "hang", "fault_injector_ranks": "1"},
     "--fault-injector-fault-delay"),
    ({"disable_straggler_on_startup": True}, "--disable-straggler-on-startup"),
    ({"straggler_minmax_count": 0}, "--straggler-minmax-count"),
])
def test_bad_flags_name_themselves(kwargs, flag):
    with pytest.raises(ConfigError, match=flag):
        ResilienceConfig(**kwargs).validate(save=None, world_size=2)


@pytest.mark.parametrize("kwargs, flag", [
    ({"inprocess_max_iterations": 2}, "--inprocess-max-iterations applies to --inprocess-restart"),
    ({"inprocess_empty_cuda_cache": True}, "--inprocess-empty-cuda-cache applies to"),
    ({"inprocess_restart": True, "inprocess_max_iterations": 0}, "--inprocess-max-iterations"),
    ({"inprocess_restart": True}, "--inprocess-restart .*--save DIR and --load DIR"),
    ({"inprocess_restart": True, "save": "a", "load": "b"}, "--inprocess-restart .*same DIR"),
    ({"inprocess_restart": True, "save": "a", "load": "a"}, "--inprocess-restart .*torchrun"),
])
def test_inprocess_flags_that_cannot_work_name_themselves(monkeypatch, kwargs, flag):
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    save, load = kwargs.pop("save", None), kwargs.pop("load", None)
    with pytest.raises(ConfigError, match=flag):
        ResilienceConfig(**kwargs).validate(save=save, world_size=2, load=load)


def test_inprocess_flags_of_nvidia_resiliency_ext_are_clear_errors():
    from megatron_smp.training.arguments import parse_args

    argv = ("--num-layers 1 --hidden-size 8 --num-attention-heads 2 --seq-length 8 "
            "--max-position-embeddings 8 --micro-batch-size 1 --train-iters 1 "
            "--inprocess-restart --inprocess-soft-timeout 30").split()
    with pytest.raises(ConfigError, match="--inprocess-soft-timeout.*--inprocess-restart takes "
                       "its timeouts from --enable-ft-package"):
        parse_args(argv)


def test_inprocess_restart_with_rl_or_replica_groups_is_a_clear_error(tmp_path):
    from megatron_smp.post_training.rl_training import add_rl_training_args
    from megatron_smp.training.arguments import parse_args, validate_configs

    argv = ("--num-layers 1 --hidden-size 8 --num-attention-heads 2 --seq-length 8 "
            "--max-position-embeddings 8 --micro-batch-size 1 --train-iters 1 --vocab-size 64 "
            f"--tokenizer-type NullTokenizer --mock-data --save {tmp_path} --load {tmp_path} "
            "--inprocess-restart").split()
    validate_configs(parse_args(argv), world_size=1)
    with pytest.raises(ConfigError, match="--inprocess-restart and --fault-tolerance"):
        validate_configs(parse_args(argv + ["--fault-tolerance", "--fault-tolerance-group-size",
                                            "2", "--fault-tolerance-lighthouse", "http://h:1"]),
                         world_size=1)
    with pytest.raises(ConfigError, match="--inprocess-restart .*train_rl.py"):
        validate_configs(parse_args(argv, add_rl_training_args), world_size=1)


def test_stuck_live_rank_interrupts_for_an_inprocess_restart():
    """With --inprocess-restart a rank stuck past its step timeout but alive (its heartbeats
    go on) is recovered in process: the watchdog calls `interrupt` and does not exit."""
    config = ResilienceConfig(enable_ft_package=True, ft_num_warmup_iters=0,
                              ft_rank_section_timeouts="step:0.5", ft_heartbeat_interval=0.1,
                              ft_rank_heartbeat_timeout=5)
    lines, exit, reasons, called = [], _Exit(), [], threading.Event()
    watchdog = ProgressWatchdog(config, 0, 1, dist.HashStore(), log=lines.append, exit=exit,
                                interrupt=lambda reason: (reasons.append(reason), called.set()))
    watchdog.step_started(1)
    assert called.wait(10)
    assert exit.codes == []
    assert reasons[0].startswith("hang detected by rank 0: rank 0 made no progress")
    assert lines[-1].endswith("every rank restarts in process (--inprocess-restart)")


class _CutOffStore:
    """A store whose every call fails after `cut` (the connection was reset), or blocks
    (`block`: a cut link, where the connection sees no reset)."""

    def __init__(self, cut, block=False):
        self.inner, self.cut, self.block = dist.HashStore(), cut, block

    def __getattr__(self, name):
        method = getattr(self.inner, name)

        def call(*args):
            if self.cut.is_set():
                if self.block:
                    time.sleep(3600)
                raise dist.DistStoreError("Socket Timeout")
            return method(*args)
        return call


@pytest.mark.parametrize("block", [False, True], ids=["reset", "blocked"])
def test_a_rank_cut_off_from_the_store_stops_with_the_hang_code(block):
    cut = threading.Event()
    config = ResilienceConfig(enable_ft_package=True, ft_heartbeat_interval=0.1,
                              ft_rank_heartbeat_timeout=1.0)
    watchdog, lines, exit = _watchdog(config, store=_CutOffStore(cut, block))
    time.sleep(0.3)
    cut.set()
    start = time.monotonic()
    assert exit.event.wait(10)
    assert exit.codes == [HANG_EXIT_CODE] and 0.9 <= time.monotonic() - start < 4.0
    assert "the job's store has been unreachable" in lines[-1]
    assert ("no answer" if block else "Socket Timeout") in lines[-1]
    assert "cut off from the others" in lines[-1]
