"""Run a function on several gloo processes on one machine, never hanging.

Used by the tests and the CPU benchmarks:

    def body(rank, world_size, scale):          # module-level, so children can import it
        state = build_parallel_state(ParallelConfig(tensor_model_parallel_size=2))
        return some_tensor * scale               # any picklable value

    results = run_distributed(body, world_size=2, args=(3.0,))   # list, index = rank

Children are forked from a forkserver that has imported torch, megatron_smp and
transformers once (fast start, and no thread pool inherited), run with one thread each, join
a per-call file store (no port races), and get a collective timeout. The parent waits at
most `timeout` seconds, then kills every child and raises.
"""
from __future__ import annotations

import datetime
import faulthandler
import multiprocessing as mp
import os
import queue as queue_module
import shutil
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence

_CONTEXT = None
# Imported once by the forkserver, so that every child starts with them: importing them in
# each child cost ~1 s (megatron_smp, with DCP and DTensor) and ~1.9 s (transformers and its
# shared modeling code) of CPU per process -- a third of the test suite's time on 2 cores.
# The zoo's HF modeling modules are cheap once one is in. A module that fails to import is
# skipped (by the forkserver) and imported, or not, by the child as before.
PRELOAD = ["torch", "torch.distributed", "megatron_smp", "transformers"] + [
    f"transformers.models.{name}.modeling_{name}"
    for name in ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe",
                 "gpt_oss", "deepseek_v3", "gpt2")
]


def _context():
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = mp.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(PRELOAD)
    return _CONTEXT


def _child(
    fn: Callable,
    rank: int,
    world_size: int,
    init_file: str,
    collective_timeout: float,
    args: Sequence[Any],
    kwargs: Dict[str, Any],
    env: Dict[str, str],
    results,
) -> None:
    # A crash in native code (exit code -11) then prints each thread's Python stack.
    faulthandler.enable(all_threads=True)
    # The forkserver's environment is the parent's when the forkserver started (an earlier
    # test's monkeypatched variables included): a child takes the parent's environment of now.
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "OMP_NUM_THREADS": "1",
        }
    )
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        # A test may give a collective timeout of a second; gloo's init waits for its peers
        # under that same timeout, and on a loaded machine the ranks start seconds apart.
        # Every rank first waits here, under a long timeout, until all have started.
        started = dist.FileStore(init_file + ".started", world_size)
        started.set_timeout(datetime.timedelta(seconds=max(collective_timeout, 300.0)))
        started.set(f"rank_{rank}", "1")
        started.wait([f"rank_{other}" for other in range(world_size)])
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=collective_timeout),
        )
        # gloo's init returns on a rank once its own connections are up, while a peer may
        # still be completing its side: a body that fails at once (a ConfigError test) would
        # close this rank's sockets under that peer's init. Nobody leaves the barrier before
        # every rank has finished init.
        dist.barrier()
        try:
            value = fn(rank, world_size, *args, **kwargs)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        results.put((rank, "ok", value))
    except BaseException:  # report everything, including SystemExit from argparse
        results.put((rank, "error", traceback.format_exc()))


class DistributedTestError(RuntimeError):
    pass


def run_distributed(
    fn: Callable,
    world_size: int,
    args: Sequence[Any] = (),
    kwargs: Optional[Dict[str, Any]] = None,
    timeout: float = 180.0,
    collective_timeout: float = 60.0,
    env: Optional[Dict[str, str]] = None,
    allow_errors: bool = False,
) -> List[Any]:
    """Run `fn(rank, world_size, *args, **kwargs)` on `world_size` processes.

    Returns the per-rank return values. If a rank raises, raises DistributedTestError
    with that rank's traceback (or, with `allow_errors`, returns the traceback strings in
    place of values, for tests that expect every rank to fail cleanly).
    """
    ctx = _context()
    tmpdir = tempfile.mkdtemp(prefix="msmp_dist_")
    init_file = os.path.join(tmpdir, "init")
    results = ctx.Queue()
    procs = []
    for rank in range(world_size):
        proc = ctx.Process(
            target=_child,
            args=(
                fn,
                rank,
                world_size,
                init_file,
                collective_timeout,
                tuple(args),
                dict(kwargs or {}),
                {**os.environ, **(env or {})},
                results,
            ),
            daemon=True,
        )
        proc.start()
        procs.append(proc)

    outcome: Dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outcome) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(outcome))
                raise DistributedTestError(
                    f"ranks {missing} did not finish within {timeout:.0f} s; killed"
                    + _format_errors(outcome)
                )
            try:
                rank, status, value = results.get(timeout=min(remaining, 1.0))
                outcome[rank] = (status, value)
            except queue_module.Empty:
                dead = [
                    r for r, p in enumerate(procs)
                    if r not in outcome and p.exitcode is not None
                ]
                if dead:
                    # Give the queue a moment: the value may still be in flight.
                    time.sleep(0.5)
                    while True:
                        try:
                            rank, status, value = results.get_nowait()
                            outcome[rank] = (status, value)
                        except queue_module.Empty:
                            break
                    dead = [r for r in dead if r not in outcome]
                    for r in dead:
                        outcome[r] = ("error", f"rank {r} died with exit code {procs[r].exitcode}")
    finally:
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        shutil.rmtree(tmpdir, ignore_errors=True)

    errors = {r: v for r, (s, v) in outcome.items() if s == "error"}
    if errors and not allow_errors:
        raise DistributedTestError(_format_errors(outcome))
    return [outcome[r][1] for r in range(world_size)]


def _format_errors(outcome: Dict[int, Any]) -> str:
    parts = [
        f"\n--- rank {r} ---\n{v}" for r, (s, v) in sorted(outcome.items()) if s == "error"
    ]
    return "".join(parts)


def proc_status_kib(field: str) -> int:
    """A memory field of this process's /proc/self/status in KiB (Linux): "VmRSS" (resident
    now), "VmHWM" (peak resident, resettable by writing 5 to /proc/self/clear_refs)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} missing from /proc/self/status")


def reset_peak_rss_kib() -> int:
    """Start a peak-RSS measurement (Linux): collect garbage, hand the heap's free pages back
    to the OS (glibc's malloc_trim), so that memory the measured code allocates shows as new
    resident pages instead of reusing pages freed earlier, then reset VmHWM to the current
    RSS (writing 5 to /proc/self/clear_refs). Returns that RSS in KiB; the peak since is
    `proc_status_kib("VmHWM")` minus it. Standard library only: the vLLM side of
    tools/bench/bench_inference.py loads this file by path from another environment."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):  # not glibc: nothing to hand back
        pass
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")
    return proc_status_kib("VmRSS")


def assert_follows_trajectory(losses: Sequence[float], reference: Sequence[float],
                              tolerance: float, what: str = "") -> float:
    """Each loss within `tolerance` (relative) of the reference run's, where the tolerance
    is derived from a measured error and must stay a tenth of the reference's own movement
    (max_i |ref_i - ref_0| / |ref_0|): a run that did not train, or trained another model,
    then fails. Returns the largest relative error (for the closing figures)."""
    assert len(losses) == len(reference), (what, losses, reference)
    movement = max(abs(r - reference[0]) for r in reference) / abs(reference[0])
    assert tolerance <= movement / 10, (
        f"{what}: tolerance {tolerance:.1e} is not small against the trajectory's movement "
        f"{movement:.1e}; a run that does not train would pass")
    errors = [abs(a - b) / abs(b) for a, b in zip(losses, reference)]
    assert max(errors) <= tolerance, (what, max(errors), tolerance, losses, reference)
    return max(errors)


__all__ = ["run_distributed", "DistributedTestError", "proc_status_kib",
           "reset_peak_rss_kib", "assert_follows_trajectory"]
