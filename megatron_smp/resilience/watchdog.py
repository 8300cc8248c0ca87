"""The progress watchdog (--enable-ft-package): a rank that stops making progress without
dying -- frozen, blocked in its data loader, cut off from the others -- is named in the log
with its Python stack, beside where every other rank waits, and the job exits with
HANG_EXIT_CODE so that torchrun --max-restarts (or the SLURM script) restarts it from the last
checkpoint, instead of every rank waiting in its collective for the collective timeout.

How it knows. The training loop marks its progress on the main thread (cheap: no I/O):
sections "setup" (until the first step), "step" (each training step after
--ft-num-warmup-iters) and "checkpointing" (each save), and phases inside a step (waiting for
a batch, computing). A monitor thread per rank -- outside every collective -- publishes a
heartbeat to the job's store every --ft-heartbeat-interval seconds: the progress count, the
open section and for how long, and the main thread's Python stack. It raises the alarm when

* its own rank has been in one section longer than that section's timeout
  (--ft-rank-section-timeouts; between sections --ft-rank-out-of-section-timeout), or
* the next rank's heartbeat has not changed for --ft-rank-heartbeat-timeout (that rank's
  process is frozen, or its node cut off; each rank watches one neighbour, so the checks
  grow with the world size, not its square).

The rank that raises the alarm reads every heartbeat twice, one interval apart, and names
the culprits: the ranks whose heartbeats stopped; else the ranks whose progress count is
behind the others' (the rest wait for them in a collective); else every rank. The report
(culprits with their stacks, the others' stacks) goes to the log and to the store, every rank
that sees it exits with HANG_EXIT_CODE, and a frozen culprit on the same host is SIGKILLed
(it could not exit by itself).

With --inprocess-restart (`interrupt` given) a hang whose culprits are all alive -- each one
still sends heartbeats: blocked in its data loader, stuck in a step -- is recovered without a
relaunch: every rank that sees the report calls `interrupt(report)` instead of exiting, which
aborts its collectives and restarts its run in process (inprocess.py). A silent culprit
(frozen, dead, cut off) still ends the job with HANG_EXIT_CODE.

--calc-ft-timeouts learns the section timeouts from the run: after each save and at the
end, each timeout becomes SAFETY_FACTOR x the longest such section seen (steps after the
warm-up iterations only), at least MIN_LEARNED_TIMEOUT_S; rank 0 keeps them in
<--save>/ft_state.json, which a restarted job reads at startup (Megatron-LM's ft_integration).
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import traceback
from typing import Any, Callable, Dict, List, Optional

from megatron_smp.config import ResilienceConfig
from megatron_smp.config.resilience import parse_section_timeouts

# EX_TEMPFAIL: a temporary failure, the job should be retried (torchrun restarts on any
# non-zero exit; the distinct code tells a hang from a crash in the launcher's summary).
HANG_EXIT_CODE = 75
SAFETY_FACTOR = 5.0  # nvidia-resiliency-ext's default safety factor
# A learned timeout is never shorter than this: a loaded host pauses a process for seconds.
MIN_LEARNED_TIMEOUT_S = 30.0
# Megatron-LM: the step timeout is learned only from at least this many timed steps.
MIN_STEPS_FOR_STEP_TIMEOUT = 16
FT_STATE_FILE = "ft_state.json"
KILL_DELAY_S = 1.0
_STACK_FRAMES = 14
_FAULT_KEY = "fault"
# The last line of a report all of whose culprits are alive, with --inprocess-restart.
_INPROCESS_ACTION = "[watchdog] every rank restarts in process (--inprocess-restart)"


def _heartbeat_key(rank: int) -> str:
    return f"hb/{rank}"


def _process_identity() -> Dict[str, Any]:
    """Where this process lives: a peer may signal it only from the same host and pid
    namespace."""
    try:
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        namespace = None
    try:
        boot = open("/proc/sys/kernel/random/boot_id").read().strip()
    except OSError:
        boot = None
    return {"pid": os.getpid(), "host": socket.gethostname(), "pidns": namespace, "boot": boot}


def format_thread_stack(thread_id: int, limit: int = _STACK_FRAMES) -> List[str]:
    """The Python stack of one thread of this process, innermost last (its last `limit`
    frames), read with sys._current_frames (no signal, no ptrace)."""
    frame = sys._current_frames().get(thread_id)
    if frame is None:
        return ["<thread gone>"]
    lines = []
    for entry in traceback.extract_stack(frame)[-limit:]:
        lines.append(f'File "{entry.filename}", line {entry.lineno}, in {entry.name}')
        if entry.line:
            lines.append(f"    {entry.line.strip()}")
    return lines


class ProgressWatchdog:
    """One rank's progress marks (main thread) and monitor thread (see the module doc).

    `store`: a torch.distributed Store every rank of this job (and attempt) reaches, used by
    the monitor thread only; `save_dir`: where --calc-ft-timeouts keeps ft_state.json;
    `log`: prints one line (to stderr by default); `exit`: ends the process (os._exit);
    `interrupt(report)`: with --inprocess-restart, fails this rank's run for a restart in
    process (called from the monitor thread)."""

    def __init__(self, config: ResilienceConfig, rank: int, world_size: int, store,
                 save_dir: Optional[str] = None,
                 log: Optional[Callable[[str], None]] = None,
                 exit: Callable[[int], None] = os._exit,
                 interrupt: Optional[Callable[[str], None]] = None) -> None:
        self.config, self.rank, self.world_size = config, rank, world_size
        self._interrupt = interrupt
        self.store, self.save_dir = store, save_dir
        self._log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self._exit = exit
        self._hang_reported = False  # this rank is stopping the job for a hang (exit 75)
        self.section_timeouts = parse_section_timeouts(config.ft_rank_section_timeouts)
        self.out_of_section_timeout = config.ft_rank_out_of_section_timeout
        self._load_state()
        self._lock = threading.Lock()
        now = time.monotonic()
        self._section: Optional[str] = None
        self._since = now  # when the open section (or the time out of sections) began
        self.progress_count = 0
        self.phase = "setup"
        self.iteration = 0
        self._steps_seen = 0
        self.observed: Dict[str, float] = {}  # the longest time seen per section (seconds)
        self._step_samples = 0
        self._saves_seen = 0
        self._closed = False
        self._main_thread = threading.main_thread().ident
        self._identity = _process_identity()
        self._seq = 0
        self._neighbour = (rank + 1) % world_size
        self._neighbour_seen = (None, now)  # (its last heartbeat seq, when it changed)
        self._store_ok_at = now  # when a heartbeat last got through to the store
        self._store_error: Optional[Exception] = None
        self._stop = threading.Event()
        self.fault_report: Optional[str] = None
        self.start_section("setup")
        # The first heartbeat before the thread starts: a rank frozen at once (before its
        # thread got to run) is still named with its pid and stack.
        store.set(_heartbeat_key(rank), json.dumps(self._heartbeat()))
        self._thread = threading.Thread(target=self._monitor, name="progress-watchdog",
                                        daemon=True)
        self._thread.start()

    # -- main thread: progress marks ------------------------------------------------------

    def start_section(self, name: str) -> None:
        with self._lock:
            now = time.monotonic()
            if self._section is None:
                self._observe("out_of_section", now - self._since)
            self._section, self._since = name, now
            self.progress_count += 1

    def end_section(self, name: str) -> None:
        with self._lock:
            if self._section != name:
                return
            now = time.monotonic()
            duration = now - self._since
            if name != "step" or self._steps_seen > 0:
                self._observe(name, duration)
            self._section, self._since = None, now
            self.progress_count += 1

    def _observe(self, name: str, duration: float) -> None:
        self.observed[name] = max(self.observed.get(name, 0.0), duration)

    def mark(self, phase: str) -> None:
        """A step's phase changes ("data": waiting for a batch, "compute"): progress."""
        with self._lock:
            self.phase = phase
            self.progress_count += 1

    def step_started(self, iteration: int) -> None:
        """Before training iteration `iteration` (1-based): closes "setup"; after the warm-up
        iterations each step is a "step" section."""
        self.end_section("setup")
        self.iteration = iteration
        self.mark("step")
        if self._steps_seen >= self.config.ft_num_warmup_iters:
            self.start_section("step")

    def step_finished(self) -> None:
        if self._section == "step":
            self._step_samples += 1
        self.end_section("step")
        self._steps_seen += 1
        self.mark("between steps")

    def checkpointing_started(self) -> None:
        self.end_section("setup")
        self.start_section("checkpointing")

    def checkpointing_finished(self) -> None:
        self.end_section("checkpointing")
        self._saves_seen += 1
        self.maybe_update_timeouts()

    # -- learned timeouts ------------------------------------------------------------------

    def _state_path(self) -> Optional[str]:
        return os.path.join(self.save_dir, FT_STATE_FILE) if self.save_dir else None

    def _load_state(self) -> None:
        path = self._state_path()
        if not self.config.enable_ft_package or path is None or not os.path.exists(path):
            return
        with open(path) as f:
            state = json.load(f)
        self.section_timeouts.update(state.get("section_timeouts", {}))
        if state.get("out_of_section_timeout"):
            self.out_of_section_timeout = state["out_of_section_timeout"]
        if self.rank == 0:
            self._log(f"FT: loaded timeouts from {path}: {self.describe_timeouts()}")

    def describe_timeouts(self) -> str:
        sections = ", ".join(f"{k} {v:.1f} s" for k, v in sorted(self.section_timeouts.items()))
        return f"{sections}, out-of-section {self.out_of_section_timeout:.1f} s"

    def learned_timeouts(self, closing: bool = False) -> Dict[str, float]:
        """What --calc-ft-timeouts would set now: {section or "out_of_section": seconds}
        for the sections seen enough (Megatron-LM's rules: the step after
        MIN_STEPS_FOR_STEP_TIMEOUT timed steps, checkpointing after a save, out-of-section
        only at the end of a run that saw every section)."""
        with self._lock:
            observed = dict(self.observed)
        learned = {}
        for name in ("setup", "checkpointing"):
            if name in observed:
                learned[name] = observed[name]
        if self._step_samples >= MIN_STEPS_FOR_STEP_TIMEOUT and "step" in observed:
            learned["step"] = observed["step"]
        if closing and {"setup", "step", "checkpointing"} <= set(learned):
            learned["out_of_section"] = observed.get("out_of_section", 0.0)
        return {k: max(MIN_LEARNED_TIMEOUT_S, SAFETY_FACTOR * v) for k, v in learned.items()}

    def maybe_update_timeouts(self, closing: bool = False) -> None:
        if not self.config.calc_ft_timeouts:
            return
        learned = self.learned_timeouts(closing)
        if not learned:
            return
        with self._lock:
            self.out_of_section_timeout = learned.pop("out_of_section",
                                                      self.out_of_section_timeout)
            self.section_timeouts.update(learned)
        if self.rank == 0:
            path = self._state_path()
            state = {"section_timeouts": self.section_timeouts,
                     "out_of_section_timeout": self.out_of_section_timeout,
                     "observed_max_seconds": self.observed}
            with open(path + ".tmp", "w") as f:
                json.dump(state, f, indent=1)
            os.replace(path + ".tmp", path)
            self._log(f"FT: updated timeouts saved to {path}: {self.describe_timeouts()}")

    # -- the monitor thread ---------------------------------------------------------------

    def close(self, failed: bool = False) -> None:
        """The run ended (normally: learn the timeouts a last time), tell the watchers this
        rank is done (its heartbeats stop), stop the thread."""
        if failed and self._hang_reported:
            # The main thread failed (a peer's exit closed its connections) while the watchdog
            # was stopping the job for a hang: the process ends with the hang's status all the
            # same, so that the launcher sees the distinct code and restarts the job.
            sys.stdout.flush()
            sys.stderr.flush()
            self._exit(HANG_EXIT_CODE)
            return
        if not failed:
            self.maybe_update_timeouts(closing=True)
        with self._lock:
            self._closed = True
        self._stop.set()
        self._thread.join(timeout=5 * self.config.ft_heartbeat_interval + 5)
        try:
            self.store.set(_heartbeat_key(self.rank), json.dumps({"closed": True}))
        except Exception:  # noqa: BLE001 - the store may be gone with the job
            pass

    def _heartbeat(self) -> Dict[str, Any]:
        with self._lock:
            section, since, count = self._section, self._since, self.progress_count
            phase, iteration = self.phase, self.iteration
        self._seq += 1
        return {"rank": self.rank, "seq": self._seq, "count": count, "section": section,
                "open_s": round(time.monotonic() - since, 1), "phase": phase,
                "iteration": iteration, "stack": format_thread_stack(self._main_thread),
                **self._identity}

    def _overdue(self) -> Optional[str]:
        with self._lock:
            if self._closed:
                return None
            section, open_s = self._section, time.monotonic() - self._since
            timeout = (self.section_timeouts.get(section) if section is not None
                       else self.out_of_section_timeout)
        if timeout is None or open_s <= timeout:
            return None
        where = f"section {section!r}" if section else "no section (between sections)"
        return (f"rank {self.rank} made no progress for {open_s:.1f} s in {where}, "
                f"timeout {timeout:.1f} s")

    def _monitor(self) -> None:
        """Heartbeats go through a thread of their own: a store call across a cut link
        blocks (the connection sees no reset; the store's timeout does not end every call),
        so this thread only watches when the last one got through."""
        interval = self.config.ft_heartbeat_interval
        self._store_ok_at, self._store_error = time.monotonic(), None
        threading.Thread(target=self._store_loop, name="progress-watchdog-store",
                         daemon=True).start()
        while not self._stop.wait(interval):
            silent = time.monotonic() - self._store_ok_at
            if silent > self.config.ft_rank_heartbeat_timeout:
                self._stop_job(
                    f"[watchdog] rank {self.rank}: the job's store has been unreachable "
                    f"for {silent:.1f} s ({self._store_error or 'no answer'}); this rank is "
                    "cut off from the others (network partition, or the store's host "
                    "stopped). Its main thread:\n"
                    + "\n".join(_indent(format_thread_stack(self._main_thread))))
                return

    def _store_loop(self) -> None:
        interval = self.config.ft_heartbeat_interval
        while not self._stop.wait(interval):
            try:
                self._tick()
                self._store_ok_at, self._store_error = time.monotonic(), None
            except Exception as exc:  # noqa: BLE001 - the store is unreachable
                self._store_error = exc

    def _tick(self) -> None:
        store = self.store
        if store.check([_FAULT_KEY]):
            self._join_fault(store.get(_FAULT_KEY).decode())
            return
        store.set(_heartbeat_key(self.rank), json.dumps(self._heartbeat()))
        trigger = self._overdue() or self._neighbour_silent()
        if trigger is not None:
            self._raise_alarm(trigger)

    def _neighbour_silent(self) -> Optional[str]:
        if self._neighbour == self.rank:
            return None
        now = time.monotonic()
        key = _heartbeat_key(self._neighbour)
        seq = None
        if self.store.check([key]):
            beat = json.loads(self.store.get(key))
            if beat.get("closed"):
                self._neighbour_seen = ("closed", now)
                return None
            seq = beat["seq"]
        last_seq, changed_at = self._neighbour_seen
        if seq != last_seq:
            self._neighbour_seen = (seq, now)
            return None
        silent = now - changed_at
        if silent <= self.config.ft_rank_heartbeat_timeout:
            return None
        return (f"rank {self._neighbour} sent no heartbeat for {silent:.1f} s, timeout "
                f"{self.config.ft_rank_heartbeat_timeout:.1f} s")

    def _read_heartbeats(self) -> Dict[int, Dict[str, Any]]:
        beats = {}
        for rank in range(self.world_size):
            key = _heartbeat_key(rank)
            if self.store.check([key]):
                beats[rank] = json.loads(self.store.get(key))
        return beats

    def diagnose(self, trigger: str) -> str:
        """The report: who is stuck (with the stack), and where every other rank waits."""
        first = self._read_heartbeats()
        self._stop.wait(2.5 * self.config.ft_heartbeat_interval)
        second = self._read_heartbeats()
        second[self.rank] = self._heartbeat()
        live = {r: b for r, b in second.items() if not b.get("closed")}
        silent = [r for r in range(self.world_size)
                  if r not in second or (not second[r].get("closed")
                                         and first.get(r, {}).get("seq") == second[r].get("seq"))]
        iterations = {r: b["iteration"] for r, b in live.items()}
        in_data = [r for r, b in live.items() if b["phase"] == "data"
                   and first.get(r, {}).get("count") == b["count"]]
        if silent:
            culprits, why = silent, "sends no heartbeat (process frozen, or its node cut off)"
        elif len(set(iterations.values())) > 1:
            behind = min(iterations.values())
            culprits = [r for r, i in iterations.items() if i == behind]
            why = "is an iteration behind the others (they wait for it in a collective)"
        elif in_data and len(in_data) < len(live):
            culprits, why = in_data, "waits for its data (the others wait for it in a collective)"
        else:
            culprits, why = sorted(live), "every rank stopped at the same point: see the stacks"
        lines = [f"[watchdog] hang detected by rank {self.rank}: {trigger}",
                 f"[watchdog] stuck: rank(s) {', '.join(map(str, culprits))} -- {why}"]
        for rank in culprits:
            beat = second.get(rank) or first.get(rank)
            if beat is None:
                lines.append(f"  rank {rank}: never sent a heartbeat")
                continue
            lines.append(f"  rank {rank} {_where(beat)}"
                         + (", its last heartbeat's stack:" if rank in silent else ", stack:"))
            lines += _indent(beat["stack"], 4)
        for rank in sorted(set(live) - set(culprits)):
            lines.append(f"  rank {rank} waits: {_where(live[rank])}, at:")
            lines += _indent(live[rank]["stack"][-6:], 4)
        self._silent = [(r, (second.get(r) or first.get(r))) for r in silent]
        return "\n".join(lines)

    def _raise_alarm(self, trigger: str) -> None:
        self._silent = []
        report = self.diagnose(trigger)
        if self._interrupt is not None and not self._silent:
            report += "\n" + _INPROCESS_ACTION
        winner = self.store.compare_set(_FAULT_KEY, "", report).decode()
        if winner != report:
            self._join_fault(winner)
            return
        self._hang_reported = not (report.endswith(_INPROCESS_ACTION)
                                   and self._interrupt is not None)
        self._log(report)
        # The others read the report at their next heartbeat and stop themselves (with their
        # stacks in the log), rather than die of closed connections; then the frozen ranks go.
        time.sleep(2.5 * self.config.ft_heartbeat_interval)
        for rank, beat in self._silent:
            self._kill_if_local(rank, beat)
        self._stop_job(None, in_process=report.endswith(_INPROCESS_ACTION),
                       reason=report.splitlines()[0])

    def _kill_if_local(self, rank: int, beat: Optional[Dict[str, Any]]) -> None:
        """A frozen rank cannot exit by itself: SIGKILL it when it is this host's process,
        KILL_DELAY_S after this rank has exited (from a forked helper), so that the launcher
        records this rank's HANG_EXIT_CODE as the job's first failure."""
        if beat is None or any(beat.get(k) != self._identity[k]
                               for k in ("host", "pidns", "boot")):
            return
        self._log(f"[watchdog] rank {self.rank}: SIGKILLs rank {rank} (pid {beat['pid']}) "
                  f"{KILL_DELAY_S:.0f} s after exiting")
        sys.stdout.flush()
        sys.stderr.flush()
        # A shell outlives this rank's exit; a fork of this threaded process could block in
        # the at-fork handlers of its thread pools before it ever signals.
        subprocess.Popen(["/bin/sh", "-c", f"sleep {KILL_DELAY_S}; kill -9 {int(beat['pid'])}"],
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, start_new_session=True)

    def _join_fault(self, report: str) -> None:
        first_line = report.splitlines()[0] if report else "a hang"
        self._stop_job(f"[watchdog] rank {self.rank} stops: {first_line.removeprefix('[watchdog] ')}"
                       f"; this rank was at:\n"
                       + "\n".join(_indent(format_thread_stack(self._main_thread)[-6:], 4)),
                       in_process=report.endswith(_INPROCESS_ACTION), reason=first_line)

    def _stop_job(self, message: Optional[str], in_process: bool = False,
                  reason: Optional[str] = None) -> None:
        self._hang_reported = not (in_process and self._interrupt is not None)
        if message:
            self._log(message)
        self.fault_report = message
        sys.stdout.flush()
        sys.stderr.flush()
        self._stop.set()
        if in_process and self._interrupt is not None:
            self._interrupt((reason or message.splitlines()[0]).removeprefix("[watchdog] "))
            return
        self._exit(HANG_EXIT_CODE)


def _where(beat: Dict[str, Any]) -> str:
    section = beat.get("section")
    place = f"in section {section!r} for {beat.get('open_s')} s" if section else \
        f"between sections for {beat.get('open_s')} s"
    return (f"(host {beat.get('host')}, pid {beat.get('pid')}): iteration "
            f"{beat.get('iteration')}, {place}, phase {beat.get('phase')!r}")


def _indent(lines: List[str], width: int = 4) -> List[str]:
    return [" " * width + line for line in lines]


class ProgressIterator:
    """A data iterator whose `next` is marked as the "data" phase: a rank blocked on its
    data (storage, a loader worker) is then told apart from one computing or waiting in a
    collective."""

    def __init__(self, iterator, watchdog: ProgressWatchdog) -> None:
        self.iterator, self.watchdog = iterator, watchdog

    def __iter__(self):
        return self

    def __next__(self):
        self.watchdog.mark("data")
        try:
            return next(self.iterator)
        finally:
            self.watchdog.mark("compute")

    def __getattr__(self, name):  # e.g. ReplayIterator's replay()
        return getattr(self.iterator, name)


__all__ = ["HANG_EXIT_CODE", "ProgressWatchdog", "ProgressIterator", "format_thread_stack"]
