"""In-process restart (--inprocess-restart, Megatron-LM's flag): a failed training run is
restarted inside the same processes. No process is relaunched, nothing is imported again; every
rank tears its process groups down, forms new ones in a fresh namespace of the job's store,
rebuilds the run and resumes from the last checkpoint.

What fails a run:

* an exception on any rank (a step that raises, a collective that errors);
* with --enable-ft-package, a rank that is alive but stuck -- blocked in its data loader, in a
  step past its section timeout: the watchdog names it (see watchdog.py) and every rank's
  monitor thread interrupts its own main thread (`RunController.interrupt`).

How the others are released. A rank whose run failed aborts its collectives at once: for NCCL
torch's communicator abort; for gloo, whose `abort()` does nothing, it shuts down the TCP
connections its process groups opened (every TCP connection the run opened other than the job
store's). A peer waiting in a collective with it then fails with "connection closed" within
milliseconds, instead of waiting for the collective timeout, and restarts too; the failure
spreads through every group to the whole job. Freeing the failed run's process groups would
close the connections as well, but gloo closes them only once nothing references a group, and
the failed run's model keeps references alive (its gradient hooks) that a restart cannot
reliably find. nvidia-resiliency-ext's Wrapper (0.4.1) runs on CPU, but its abort destroys
the process groups the same way, so on gloo a waiting peer was released only by the collective
timeout; its monitor process and timeouts repeat the watchdog's.

What it does not cover: a frozen or dead process (SIGSTOP, SIGKILL, a lost node) cannot take
part in a new process group. The watchdog then ends the job with HANG_EXIT_CODE and torchrun
(--max-restarts) or the SLURM script relaunches it: the process is replaced. A main thread that
does not return to Python within INTERRUPT_GRACE_S of an interrupt ends the process the same
way. After --inprocess-max-iterations restarts the next failure is raised as it is.
"""
from __future__ import annotations

import gc
import os
import queue
import signal
import socket
import sys
import threading
import time
from typing import Callable, Optional, Set, TypeVar

from megatron_smp.config import ConfigError

T = TypeVar("T")

# A main thread told to restart that has not returned to Python this long after (stuck in C
# code no abort reaches) ends the process with HANG_EXIT_CODE, for the launcher to replace it.
INTERRUPT_GRACE_S = 30.0
# The signal that interrupts the main thread (a real-time one: SIGUSR1/2 are often taken, e.g.
# by SLURM's --signal).
INTERRUPT_SIGNAL = signal.SIGRTMIN + 3


class InProcessRestart(Exception):
    """Raised in the main thread when its run must restart in process (the watchdog's
    report is the message)."""


def _tcp_sockets() -> Set[int]:
    """The inodes of this process's open sockets."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def shutdown_connections(opened_before: Set[int], keep_ports: Set[int]) -> int:
    """Shut down (not close: the file descriptors stay theirs) every connected TCP socket of
    this process that is not in `opened_before` and has no end on a port in `keep_ports`.
    Returns how many."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if not target.startswith("socket:[") or int(target[8:-1]) in opened_before:
            continue
        try:
            sock = socket.socket(fileno=int(fd))
        except OSError:
            continue
        try:
            if sock.family not in (socket.AF_INET, socket.AF_INET6) or \
                    sock.type != socket.SOCK_STREAM:
                continue
            try:
                peer = sock.getpeername()
            except OSError:  # listening, or not connected
                continue
            if peer[1] in keep_ports or sock.getsockname()[1] in keep_ports:
                continue
            sock.shutdown(socket.SHUT_RDWR)
            count += 1
        except OSError:
            pass
        finally:
            sock.detach()
    return count


class RunController:
    """Runs `body()` until it returns, restarting it in process after a failure (see the
    module doc). One per process, made active by `run`; `interrupt` may be called from any
    thread."""

    def __init__(self, max_iterations: Optional[int] = None, empty_cuda_cache: bool = False,
                 log: Optional[Callable[[str], None]] = None) -> None:
        self.max_iterations = max_iterations
        self.empty_cuda_cache = empty_cuda_cache
        self._log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self.attempt = 0
        self.restart_times = []  # time.monotonic() of each restart's start
        self._lock = threading.Lock()
        self._armed = False
        self._interrupted: Optional[str] = None
        self._raised = False
        self._sockets_before: Set[int] = set()
        self._main = threading.main_thread().ident
        self._interrupt_times: "queue.SimpleQueue" = queue.SimpleQueue()

    # -- any thread ---------------------------------------------------------------------------

    def interrupt(self, reason: str, attempt: Optional[int] = None) -> None:
        """Fail the current run (of `attempt`, if given: a late call for an earlier run is
        ignored): abort its collectives and raise InProcessRestart in the main thread."""
        with self._lock:
            if not self._armed or self._interrupted is not None or \
                    (attempt is not None and attempt != self.attempt):
                return
            self._interrupted = reason
            self.abort_collectives()
        if threading.get_ident() == self._main:
            self._raised = True
            raise InProcessRestart(reason)
        signal.pthread_kill(self._main, INTERRUPT_SIGNAL)
        self._interrupt_times.put((time.monotonic(), self.attempt))

    def abort_collectives(self) -> int:
        """Release every peer waiting in a collective with this process (see the module doc).
        Returns the number of connections shut down."""
        import torch.distributed as dist

        if dist.is_initialized():
            try:
                if dist.get_backend() == "nccl":
                    dist.distributed_c10d._abort_process_group()
            except Exception:  # noqa: BLE001 - aborting is best effort; the sockets follow
                pass
        keep = set()
        for name in ("MASTER_PORT",):  # the job store (its clients and, on rank 0, server)
            if os.environ.get(name, "").isdigit():
                keep.add(int(os.environ[name]))
        return shutdown_connections(self._sockets_before, keep)

    def _watch_interrupts(self) -> None:
        """(A thread started with the run.) End the process when the main thread has not
        begun its restart INTERRUPT_GRACE_S after an interrupt."""
        while True:
            when, attempt = self._interrupt_times.get()
            if attempt is None:
                return
            time.sleep(max(0.0, when + INTERRUPT_GRACE_S - time.monotonic()))
            if self.attempt == attempt and _ACTIVE is self:
                self._give_up()

    def _give_up(self) -> None:
        from megatron_smp.resilience.watchdog import HANG_EXIT_CODE

        self._log(f"[inprocess] the main thread did not return to Python within "
                  f"{INTERRUPT_GRACE_S:.0f} s of its interrupt; exiting with "
                  f"{HANG_EXIT_CODE} for the launcher to relaunch the process")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(HANG_EXIT_CODE)

    # -- the main thread ----------------------------------------------------------------------

    def _on_signal(self, signum, frame) -> None:
        if self._armed and self._interrupted is not None and not self._raised:
            self._raised = True
            raise InProcessRestart(self._interrupted)

    def _call(self, body: Callable[[], T]) -> T:
        with self._lock:
            self._sockets_before = _tcp_sockets()
            self._interrupted, self._raised = None, False
            self._armed = True
        try:
            return body()
        finally:
            self._armed = False

    def run(self, body: Callable[[], T]) -> T:
        """`body()` until it returns; after an exception (other than a ConfigError), restart
        it, at most `max_iterations` times."""
        global _ACTIVE
        previous = signal.signal(INTERRUPT_SIGNAL, self._on_signal)
        _ACTIVE = self
        threading.Thread(target=self._watch_interrupts, name="inprocess-interrupts",
                         daemon=True).start()
        try:
            while True:
                try:
                    return self._call(body)
                except ConfigError:
                    raise
                except Exception as exc:  # noqa: BLE001 - every failure of a run restarts it
                    self._armed = False
                    rank = _rank()
                    if self.max_iterations is not None and self.attempt >= self.max_iterations:
                        self._log(f"[inprocess] rank {rank}: {type(exc).__name__} after "
                                  f"{self.attempt} in-process restarts "
                                  f"(--inprocess-max-iterations {self.max_iterations})")
                        raise
                    failure = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}" \
                        if str(exc) else type(exc).__name__
                # Out of the except block: the traceback, and with it the failed run's frames,
                # is released.
                self._restart(rank, failure)
        finally:
            from megatron_smp.parallel_state import set_inprocess_attempt

            _ACTIVE = None
            self._interrupt_times.put((0.0, None))
            set_inprocess_attempt(0)  # the run is over: a later one starts afresh
            signal.signal(INTERRUPT_SIGNAL, previous)

    def _restart(self, rank, failure: str) -> None:
        import torch
        import torch.distributed as dist

        from megatron_smp.parallel_state import set_inprocess_attempt

        self.restart_times.append(time.monotonic())
        self._log(f"[inprocess] rank {rank}: {failure}; restarting in process (restart "
                  f"{self.attempt + 1}) from the last checkpoint")
        with self._lock:
            self.abort_collectives()
            if dist.is_initialized():
                try:
                    dist.destroy_process_group()
                except Exception:  # noqa: BLE001 - its connections are shut down already
                    pass
            self.attempt += 1
        set_inprocess_attempt(self.attempt)
        gc.collect()
        if self.empty_cuda_cache and torch.cuda.is_available():
            torch.cuda.empty_cache()


_ACTIVE: Optional[RunController] = None


def active_controller() -> Optional[RunController]:
    """The RunController whose run is in progress in this process, if any."""
    return _ACTIVE


def _rank():
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else os.environ.get("RANK", "?")


__all__ = ["INTERRUPT_GRACE_S", "InProcessRestart", "RunController", "active_controller",
           "shutdown_connections"]
