"""The straggler report (--log-straggler, Megatron-LM's flags): a rank that is merely slow (a
bad host, a throttled CPU, thermal limits) drags every step of the job and is invisible in the
log line, since the collectives make every rank's iteration time the same.

What tells it apart is the time each rank spends *before* it first waits for the others: from
the start of its step to the moment its forward and backward are done and the gradient
reduction begins (a rank that arrives late there is slower; the others then wait). Every log
interval the ranks gather the shortest of these times in the interval -- each rank's fastest
step: a rank whose every step is slow (a CPU quota, a throttled clock) stays slow in it, while
a burst of load from other processes on the host, which delays some steps of any rank, drops
out (the median of five steps still moved by 2-3x with such bursts) --; the last rank prints
the --straggler-minmax-count slowest and fastest ranks with their throughput relative to the
median (median time / rank's time; the low median), names every rank below
STRAGGLER_THRESHOLD of it in this report and the one before (a rank slowed for a moment --
another process took its core -- is no straggler), and
writes the figures as TensorBoard scalars (straggler/...).

Phases outside the training step are timed on their own (`phase_finished`): train_rl.py's
"rollout" phase (generating the completions, with no collective in it at data parallelism) is
reported beside the forward-backward ("train") phase in each interval that had one, each
rank's fastest rollout relative to the median, with the same straggler rule and
straggler/rollout/... scalars.

--disable-straggler-on-startup starts with the report off; rank 0 then serves a toggle on
127.0.0.1:--straggler-ctrlr-port (`curl 127.0.0.1:PORT` turns the report on or off; the
times are gathered either way, rank 0's switch decides for everyone).
"""
from __future__ import annotations

import statistics
import threading
import time
from typing import Callable, List, Optional

# A rank below this fraction of the median throughput is named a straggler: a rank twice as
# slow as the others is at 0.5x; an even run on a loaded host stays above 0.8x in all but
# single intervals (hence: in two reports running).
STRAGGLER_THRESHOLD = 0.7
# The phases timed outside the training step (`phase_finished`), in the gathered order.
PHASES = ("rollout",)


class _Toggle:
    """Rank 0's on/off switch, served over HTTP on 127.0.0.1."""

    def __init__(self, enabled: bool, port: int, log: Callable[[str], None]) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.enabled = enabled
        toggle = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - the http.server name
                toggle.enabled = not toggle.enabled
                body = f"straggler report {'on' if toggle.enabled else 'off'}\n".encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        try:
            self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        except OSError as exc:
            self.server = None
            log(f"WARNING: --straggler-ctrlr-port {port}: cannot listen ({exc}); the straggler "
                f"report stays {'on' if enabled else 'off'}")
            return
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True,
                         name="straggler-toggle").start()
        log(f"straggler report {'on' if enabled else 'off'}; toggle: curl 127.0.0.1:{self.port}")

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()


class StragglerDetector:
    """One rank's step timings and the collective report (see the module doc)."""

    def __init__(self, config, rank: int, world_size: int, device,
                 log: Optional[Callable[[str], None]] = None) -> None:
        self.rank, self.world_size, self.device = rank, world_size, device
        self.minmax_count = config.straggler_minmax_count
        self._log = log or print
        self.toggle = (_Toggle(not config.disable_straggler_on_startup,
                               config.straggler_ctrlr_port, self._log) if rank == 0 else None)
        self.compute_times: List[float] = []
        self.step_times: List[float] = []
        self.first_iteration: Optional[int] = None
        self._start: Optional[float] = None
        self._compute: Optional[float] = None
        self._hosts: Optional[List[str]] = None
        self._below: set = set()  # ranks under the threshold in the previous report
        self.phase_times = {name: [] for name in PHASES}
        self._phase_below = {name: set() for name in PHASES}

    def step_started(self, iteration: int) -> None:
        if self.first_iteration is None:
            self.first_iteration = iteration
        self._start, self._compute = time.perf_counter(), None

    def compute_finished(self) -> None:
        """The step's forward and backward are done; its gradient reduction starts."""
        if self._start is not None and self._compute is None:
            self._compute = time.perf_counter() - self._start

    def step_finished(self) -> None:
        if self._start is None:
            return
        total = time.perf_counter() - self._start
        self.compute_times.append(self._compute if self._compute is not None else total)
        self.step_times.append(total)
        self._start = None

    def phase_finished(self, name: str, seconds: float) -> None:
        """One of PHASES took `seconds` on this rank (outside the training step)."""
        self.phase_times[name].append(seconds)

    def report(self, iteration: int, add_scalar: Optional[Callable] = None) -> List[str]:
        """The interval's report lines (the same on every rank; empty while off). Collective
        over the world: every rank calls it at the same log interval."""
        import socket

        import torch
        import torch.distributed as dist

        enabled = self.toggle.enabled if self.toggle is not None else False
        width = 3 + len(PHASES)
        local = torch.tensor([min(self.compute_times or [0.0]),
                              statistics.median(self.step_times or [0.0]), float(enabled)]
                             + [min(self.phase_times[name] or [0.0]) for name in PHASES],
                             dtype=torch.float64, device=self.device)
        first = self.first_iteration
        self.compute_times, self.step_times, self.first_iteration = [], [], None
        self.phase_times = {name: [] for name in PHASES}
        if dist.is_initialized() and self.world_size > 1:
            gathered = torch.empty(self.world_size * width, dtype=torch.float64,
                                   device=self.device)
            dist.all_gather_into_tensor(gathered, local)
            if self._hosts is None:
                self._hosts = [None] * self.world_size
                dist.all_gather_object(self._hosts, socket.gethostname())
        else:
            gathered, self._hosts = local, [socket.gethostname()]
        rows = gathered.view(self.world_size, width).tolist()
        if not rows[0][2]:  # rank 0's switch
            return []
        lines = self._phase_report(f"iterations {first}-{iteration}", "forward-backward",
                                   [row[0] for row in rows], "", iteration, add_scalar)
        for index, name in enumerate(PHASES):
            times = [row[3 + index] for row in rows]
            if min(times) > 0:  # every rank had the phase in this interval
                lines += self._phase_report(
                    f"{name} phase, iterations {first}-{iteration}", name, times,
                    f"{name}/", iteration, add_scalar, below_key=name)
        return lines

    def _phase_report(self, title: str, what: str, compute: List[float], prefix: str,
                      iteration: int, add_scalar: Optional[Callable],
                      below_key: Optional[str] = None) -> List[str]:
        """The lines (and scalars) of one phase: `compute` is each rank's fastest time."""
        # The low median: with an even number of ranks the faster of the middle two, so that
        # at two ranks the slow one is measured against the other (not against their mean).
        median = statistics.median_low(compute)
        relative = [median / t if t > 0 else float("inf") for t in compute]
        order = sorted(range(self.world_size), key=lambda r: relative[r])
        count = min(self.minmax_count, self.world_size)

        def name(r):
            return f"rank {r} ({self._hosts[r]}) {compute[r] * 1000:.1f} ms {relative[r]:.2f}x"

        lines = [f" straggler report, {title} (each rank's fastest "
                 f"{what}, throughput relative to the median {median * 1000:.1f} ms): "
                 "slowest "
                 + ", ".join(name(r) for r in order[:count]) + " | fastest "
                 + ", ".join(name(r) for r in reversed(order[-count:]))]
        below = {r for r in order if relative[r] < STRAGGLER_THRESHOLD}
        if below_key is None:
            persistent, self._below = below & self._below, below
        else:
            persistent = below & self._phase_below[below_key]
            self._phase_below[below_key] = below
        phase = "" if below_key is None else f" in its {below_key} phase"
        for r in order:
            if r in persistent:
                lines.append(f" STRAGGLER: rank {r} ({self._hosts[r]}) at {relative[r]:.2f}x "
                             f"the median throughput{phase} ({what} {compute[r] * 1000:.1f} "
                             f"ms{' per iteration' if below_key is None else ''}, median "
                             f"{median * 1000:.1f} ms; also in the "
                             "previous report)")
        if add_scalar is not None:
            add_scalar(f"straggler/{prefix}min_relative_throughput", relative[order[0]],
                       iteration)
            add_scalar(f"straggler/{prefix}max_relative_throughput", relative[order[-1]],
                       iteration)
            add_scalar(f"straggler/{prefix}slowest_rank", float(order[0]), iteration)
            add_scalar(f"straggler/{prefix}fastest_rank", float(order[-1]), iteration)
            add_scalar(f"straggler/{prefix}median_{what.replace('-', '_')}_ms", median * 1000,
                       iteration)
        return lines

    def close(self) -> None:
        if self.toggle is not None:
            self.toggle.close()


__all__ = ["PHASES", "STRAGGLER_THRESHOLD", "StragglerDetector"]
