"""Per-rank trace of a pipeline schedule: forward, backward and communication spans.

Written as Chrome trace JSON (open in chrome://tracing or https://ui.perfetto.dev): one
process per rank, one row for compute and one for communication, plus an "in flight"
counter (microbatches whose forward has run and whose backward has not). The gaps in the
compute row are the pipeline bubble.

    timeline = PipelineTimeline("trace.json", rank=3)   # writes trace.rank3.json
    with timeline.span("forward", "compute", microbatch=0, chunk=0): ...
    timeline.flush()
"""
from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Optional

import torch

# Rows of one rank's process in the trace.
_ROWS = {"compute": 0, "comm": 1}
# A trace of a long run stops growing here; the first steps show the schedule.
_MAX_EVENTS = 200_000


def per_rank_path(path: str, rank: int) -> str:
    """`trace.json` -> `trace.rank3.json` (each rank writes its own file)."""
    stem, suffix = os.path.splitext(path)
    return f"{stem}.rank{rank}{suffix or '.json'}"


class PipelineTimeline:
    """Collects spans in memory; `flush()` writes them (the schedules flush after a step).

    `synchronize` waits for the device before each timestamp so spans cover the kernels,
    not just their launch (a no-op on the CPU).
    """

    def __init__(self, path: Optional[str], rank: int, device: Optional[torch.device] = None):
        self.path = per_rank_path(path, rank) if path else None
        self.rank = rank
        self.device = device
        self.events: List[Dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}},
            {"name": "thread_name", "ph": "M", "pid": rank, "tid": _ROWS["compute"],
             "args": {"name": "compute"}},
            {"name": "thread_name", "ph": "M", "pid": rank, "tid": _ROWS["comm"],
             "args": {"name": "communication"}},
        ]
        self.step = 0

    def _now_us(self) -> float:
        # Wall-clock time, so the ranks of one machine share a time axis.
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.time_ns() / 1e3

    @contextmanager
    def span(self, name: str, row: str = "compute", **args) -> Iterator[None]:
        start = self._now_us()
        try:
            yield
        finally:
            if len(self.events) < _MAX_EVENTS:
                self.events.append({
                    "name": name, "cat": row, "ph": "X", "pid": self.rank, "tid": _ROWS[row],
                    "ts": start, "dur": self._now_us() - start,
                    "args": dict(args, step=self.step),
                })

    def counter(self, name: str, value: float) -> None:
        if len(self.events) < _MAX_EVENTS:
            self.events.append({"name": name, "ph": "C", "pid": self.rank,
                                "ts": self._now_us(), "args": {name: value}})

    def end_step(self) -> None:
        """Mark the end of one schedule call and write the trace so far."""
        self.step += 1
        self.flush()

    def flush(self) -> None:
        if self.path is None:
            return
        directory = os.path.dirname(self.path)
        if directory:
            os.makedirs(directory, exist_ok=True)
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as handle:
            json.dump({"traceEvents": self.events, "displayTimeUnit": "ms"}, handle)
        os.replace(tmp, self.path)

    def spans(self, row: str = "compute", step: Optional[int] = None) -> List[Dict[str, Any]]:
        return [
            e for e in self.events
            if e["ph"] == "X" and e["cat"] == row and (step is None or e["args"]["step"] == step)
        ]


def bubble_fraction(rank_events: List[List[Dict[str, Any]]], step: int) -> float:
    """Idle share of the pipeline in one step: 1 - busy / (ranks x step window).

    `rank_events`: the trace events of every rank of one pipeline (same machine, so one
    clock). The window runs from the first forward on any rank to the last backward on any
    rank, which is the span the (p - 1) / (v m + p - 1) estimate describes.
    """
    compute = [
        [e for e in events if e.get("ph") == "X" and e.get("cat") == "compute"
         and e["args"].get("step") == step]
        for events in rank_events
    ]
    spans = [e for events in compute for e in events]
    if not spans:
        return 0.0
    window = max(e["ts"] + e["dur"] for e in spans) - min(e["ts"] for e in spans)
    busy = sum(e["dur"] for e in spans)
    return 1.0 - busy / (len(rank_events) * window)


__all__ = ["PipelineTimeline", "bubble_fraction", "per_rank_path"]
