"""Checkpoint throughput of a training run's state beside the raw disk, and how long an
asynchronous save blocks the loop.

    python tools/bench/bench_checkpoint.py                       # GPT ~0.33B, bf16, DP=2
    python tools/bench/bench_checkpoint.py --layers 8 --hidden 2048 --repeats 3 --json
    python tools/bench/bench_checkpoint.py --engine --total-mb 300   # the DCP engine alone

Default mode: every rank builds what `pretrain` builds for pretrain_gpt.py -- a GPT model in
bf16 with fp32 main params and Adam (moments filled, as after training) under the distributed
optimizer at data-parallel `--world-size` -- and saves and loads it through the loop's own
`checkpointing.loop` (torch_dist format, fsynced data files with their CRC-32 sidecars,
published by rename). Per repeat, into fresh directories, on the same disk:

  sync save     `save(run)`: the loop is blocked for all of it;
  raw write     each rank writes as many bytes as its checkpoint data file, in 16 MiB
                blocks, then fsync, once before and once after the sync save (the mean):
                the disk's write bandwidth in the same run, drift between steps averaged
                out as for the read below;
  fresh read    the second raw write's file read back from the disk at once;
  raw read      the rank's own data files of the sync save read with plain 16 MiB reads,
                once before and once after the load (the mean): the disk's read bandwidth
                for the bytes the load reads, written as long ago. (On this VM a file read
                right after it was written comes back faster than one written some GB of
                writes earlier -- the host caches the virtual disk: 2.43 s against 3.33 s
                for the same 2.3 GB per rank, medians of one run -- so the fresh read is no
                baseline for a checkpoint written before it; both are printed.)
  load          `load(run)` of the sync save from the disk, into zeroed params (checked
                equal to the saved values afterwards);
  async save    `save(run)` with --async-save as the loop does it: the call returns before
                the copy to CPU memory, which runs in the background during a simulated
                forward/backward of `--step-seconds` (matmuls); `wait_for_staging(run)` is
                where the loop waits before optimizer.step(). Blocked = the call + that wait.
                Then `finalize(run)` waits for the write and the publish: the async MB/s
                count from the call to the published checkpoint.

Every timed step starts with none of the run's files in the page cache: each is fsynced and
evicted (posix_fadvise DONTNEED; dropping every cache needs root, a file's own clean pages do
not), so reads come from the disk and no write pays for evicting what an earlier step read.
Times are the maximum over ranks (a collective waits for the slowest); bandwidths are the
bytes of all ranks over that time; the report gives the median over repeats and the spread.
Peak memory the save adds: VmHWM (reset before each save through /proc/self/clear_refs)
minus VmRSS before it, per rank (the largest rank's). The staging buffers of an async save
are prepared once, as the loop does after its first step with --async-save
(`prepare_async_save`: allocated and written in the background), and reused by every save:
they are reported apart.

--engine runs the older engine-level bench (`checkpointing.engine` save / async_save /
load of synthetic TP-sharded fp32 tensors; see `_engine_body`).
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from megatron_smp.testing import proc_status_kib, run_distributed  # noqa: E402

_BLOCK = 16 * 2**20


def _files_under(root: str):
    return [os.path.join(d, name) for d, _, names in os.walk(root) for name in names]


def _evict(paths) -> None:
    """Drop files' pages from the page cache (their data is on disk: they were fsynced)."""
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:  # removed meanwhile (another rank's clean-up)
            continue
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _raw_write(path: str, nbytes: int, block: bytes) -> None:
    with open(path, "wb", buffering=0) as handle:
        left = nbytes
        while left > 0:
            left -= handle.write(block[:min(left, len(block))])
        os.fsync(handle.fileno())


def _raw_read(*paths: str) -> int:
    total = 0
    for path in paths:
        with open(path, "rb", buffering=0) as handle:
            while chunk := handle.read(_BLOCK):
                total += len(chunk)
    return total


def _reset_peak_rss() -> int:
    """Reset VmHWM to the current RSS; returns the RSS in KiB."""
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")
    return proc_status_kib("VmRSS")


def _added_peak_mb(rss_before_kib: int) -> float:
    return (proc_status_kib("VmHWM") - rss_before_kib) / 1024


def _build_run(argv):
    """What `pretrain` builds before the data: configs, parallel state, model chunks (DDP),
    optimizer, scheduler, as the `CheckpointRecord` the loop's checkpoints take."""
    import pretrain_gpt
    from megatron_smp.data import build_tokenizer
    from megatron_smp.optimizer import get_megatron_optimizer
    from megatron_smp.parallel_state import build_parallel_state
    from megatron_smp.tensor_parallel.random import model_parallel_seed
    from megatron_smp.training.arguments import parse_args, validate_configs
    from megatron_smp.training.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_smp.checkpointing.record import CheckpointRecord, Progress

    trainer = importlib.import_module("megatron_smp.training.trainer")
    configs = parse_args(argv)
    configs.model.vocab_size = build_tokenizer(configs.data).vocab_size
    validate_configs(configs)
    state = build_parallel_state(configs.parallel)
    model_parallel_seed(configs.training.seed, state)
    model = trainer.build_model_chunks(pretrain_gpt.model_provider, configs, state)
    optimizer = get_megatron_optimizer(configs.optimizer, model, state)
    scheduler = OptimizerParamScheduler(
        optimizer, configs.optimizer, configs.training.train_iters,
        global_batch_size=configs.training.global_batch_size)
    return CheckpointRecord(configs, state, model, optimizer, scheduler, Progress())


def _fill_optimizer_state(run, seed: int) -> None:
    """Adam's moments as after training (non-zero pages: zeros would be the kernel's shared
    zero page and cost no memory to read)."""
    import torch

    from megatron_smp.checkpointing.sharded_state import init_optimizer_state

    optimizer = run.optimizer.optimizer
    init_optimizer_state(optimizer)
    generator = torch.Generator().manual_seed(seed)
    for per_param in optimizer.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            if key in per_param:
                per_param[key].copy_(torch.rand(per_param[key].shape, generator=generator))


def _training_body(rank, world_size, argv, root, repeats, step_seconds):
    import torch
    import torch.distributed as dist

    sys.path.insert(0, ROOT)  # pretrain_gpt
    from megatron_smp.checkpointing import checkpoint_dir
    from megatron_smp.checkpointing.engine.async_queue import DEFAULT_ASYNC_QUEUE
    from megatron_smp.checkpointing import loop as checkpointing

    run = _build_run(argv)
    _fill_optimizer_state(run, seed=rank)
    configs = run.configs
    save_dir = os.path.join(root, "checkpoints")
    configs.checkpoint.save = save_dir
    configs.checkpoint.load = save_dir
    params = [p for chunk in run.model for p in chunk.parameters()]
    model_bytes = sum(p.numel() * p.element_size() for p in params)
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    block = os.urandom(_BLOCK)
    # What the loop does after its first step with --async-save: allocate and write the
    # staging memory in the background (timed here to its end).
    configs.checkpoint.async_save = True
    rss = _reset_peak_rss()
    start = time.perf_counter()
    checkpointing.prepare_async_save(run)
    DEFAULT_ASYNC_QUEUE.wait_for_staging_preparation()
    prepare = {"prepare_s": time.perf_counter() - start, "prepare_added_peak_mb": _added_peak_mb(rss)}
    configs.checkpoint.async_save = False

    def settle():
        """Every timed step starts with none of the run's files in the page cache (all are
        fsynced), so no step pays for evicting what an earlier one read or wrote."""
        _evict(_files_under(root))
        dist.barrier()

    def barrier_then_time(fn):
        settle()
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    def simulated_step(seconds):
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            a @ b

    # Untimed: one save and one raw write of the same size first. On this VM the first
    # writes of a process into memory the guest has not touched for a while run 3-4x slower
    # (the host faults the page cache's memory in: a plain 16 MiB-block writer shows 5.6 s
    # for 2.3 GB per rank, then 1.2-1.9 s), which would land on whichever timed step ran first.
    run.progress.iteration = 0
    settle()
    checkpointing.save(run)
    warm = os.path.join(root, f"raw_rank{rank}.bin")
    settle()
    rank_bytes = sum(os.path.getsize(f) for f in _files_under(checkpoint_dir(save_dir, 0))
                     if os.path.basename(f).startswith(f"__{rank}_"))  # a save's, within bytes
    _raw_write(warm, rank_bytes, block)
    os.remove(warm)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(checkpoint_dir(save_dir, 0), ignore_errors=True)
    dist.barrier()

    records = []
    for repeat in range(repeats):
        record = {}
        # -- sync save, between two raw writes of the same bytes per rank
        raw = os.path.join(root, f"raw_rank{rank}.bin")
        before = barrier_then_time(lambda: _raw_write(raw, rank_bytes, block))
        os.remove(raw)
        run.progress.iteration = 10 * repeat + 1
        configs.checkpoint.async_save = False
        rss = _reset_peak_rss()
        record["sync_s"] = barrier_then_time(lambda: checkpointing.save(run))
        record["sync_added_peak_mb"] = _added_peak_mb(rss)
        path = checkpoint_dir(save_dir, run.iteration)
        own = [f for f in _files_under(path) if os.path.basename(f).startswith(f"__{rank}_")]
        record["rank_data_bytes"] = sum(os.path.getsize(f) for f in own)
        dist.barrier()
        record["checkpoint_bytes"] = sum(os.path.getsize(f) for f in _files_under(path))
        after = barrier_then_time(lambda: _raw_write(raw, rank_bytes, block))
        record["raw_write_s"] = (before + after) / 2
        record["fresh_read_s"] = barrier_then_time(lambda: _raw_read(raw))
        os.remove(raw)

        # -- load the sync save, from the disk, between two plain reads of the same files
        expected = [p.detach().clone() for p in params[:2]]
        total = float(sum(p.detach().float().sum() for p in params))
        with torch.no_grad():
            for p in params:
                p.zero_()
        before = barrier_then_time(lambda: _raw_read(*sorted(own)))
        record["load_s"] = barrier_then_time(lambda: checkpointing.load(run))
        after = barrier_then_time(lambda: _raw_read(*sorted(own)))
        record["raw_read_s"] = (before + after) / 2
        assert all(torch.equal(p, e) for p, e in zip(params, expected)), "load differs"
        assert float(sum(p.detach().float().sum() for p in params)) == total, "load differs"

        # -- async save, as the loop runs it
        run.progress.iteration += 1
        configs.checkpoint.async_save = True
        rss = _reset_peak_rss()
        settle()
        start = time.perf_counter()
        checkpointing.save(run)
        record["async_return_s"] = time.perf_counter() - start
        staged_at, written_at = [], []
        request = DEFAULT_ASYNC_QUEUE._pending[-1]
        request.staged.add_done_callback(lambda _: staged_at.append(time.perf_counter()))
        request.future.add_done_callback(lambda _: written_at.append(time.perf_counter()))
        simulated_step(step_seconds)  # forward + backward: the saved state is left alone
        wait_start = time.perf_counter()
        checkpointing.wait_for_staging(run)  # where the loop waits, before optimizer.step()
        record["async_wait_s"] = time.perf_counter() - wait_start
        record["async_blocked_s"] = record["async_return_s"] + record["async_wait_s"]
        record["async_staging_s"] = staged_at[0] - start  # the background copy's end
        checkpointing.finalize(run)
        record["async_total_s"] = time.perf_counter() - start
        record["async_write_s"] = written_at[0] - staged_at[0]  # the write alone
        record["async_added_peak_mb"] = _added_peak_mb(rss)
        configs.checkpoint.async_save = False
        records.append(record)
        dist.barrier()
        if rank == 0:  # keep the disk's use to one checkpoint at a time
            for iteration in (run.iteration - 1, run.iteration):
                shutil.rmtree(checkpoint_dir(save_dir, iteration), ignore_errors=True)
        dist.barrier()
    return {"records": records, "model_bytes": model_bytes,
            "params": sum(p.numel() for p in params), **prepare}


def _training_argv(args) -> list:
    return [
        "--num-layers", str(args.layers), "--hidden-size", str(args.hidden),
        "--num-attention-heads", str(args.heads), "--seq-length", "128",
        "--max-position-embeddings", "128", "--micro-batch-size", "1",
        "--global-batch-size", str(args.world_size), "--train-iters", "100",
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(args.vocab - 1),
        "--lr", "1e-4", "--bf16", "--use-distributed-optimizer", "--seed", "1234",
    ]


def _training_main(args) -> None:
    root = tempfile.mkdtemp(prefix="bench_ckpt_", dir=args.dir)
    try:
        results = run_distributed(
            _training_body, args.world_size,
            args=(_training_argv(args), root, args.repeats, args.step_seconds),
            timeout=3600, collective_timeout=1200)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    repeats = args.repeats

    def per_repeat(key):  # the slowest rank of each repeat
        return [max(r["records"][i][key] for r in results) for i in range(repeats)]

    checkpoint_mb = statistics.median(results[0]["records"][i]["checkpoint_bytes"]
                                      for i in range(repeats)) / 1e6
    data_mb = sum(r["records"][0]["rank_data_bytes"] for r in results) / 1e6
    summary = {"params": results[0]["params"], "world_size": args.world_size,
               "checkpoint_mb": checkpoint_mb, "data_files_mb": data_mb, "repeats": repeats,
               "step_seconds": args.step_seconds}
    for key, megabytes in (("sync_s", checkpoint_mb), ("raw_write_s", data_mb),
                           ("raw_read_s", data_mb), ("fresh_read_s", data_mb),
                           ("load_s", checkpoint_mb),
                           ("async_total_s", checkpoint_mb),
                           ("async_write_s", checkpoint_mb)):
        times = per_repeat(key)
        rates = [megabytes / t for t in times]
        summary[key] = {"median": statistics.median(times), "times": times,
                        "mb_s": statistics.median(rates), "mb_s_min": min(rates),
                        "mb_s_max": max(rates)}
    for key in ("async_return_s", "async_wait_s", "async_blocked_s", "async_staging_s",
                "sync_added_peak_mb",
                "async_added_peak_mb"):
        values = per_repeat(key)
        summary[key] = {"median": statistics.median(values), "values": values}
    summary["prepare_s"] = max(r["prepare_s"] for r in results)
    summary["prepare_added_peak_mb"] = max(r["prepare_added_peak_mb"] for r in results)
    summary["save_vs_raw_write"] = summary["sync_s"]["mb_s"] / summary["raw_write_s"]["mb_s"]
    summary["async_vs_raw_write"] = (summary["async_total_s"]["mb_s"]
                                     / summary["raw_write_s"]["mb_s"])
    summary["async_write_vs_raw_write"] = (summary["async_write_s"]["mb_s"]
                                           / summary["raw_write_s"]["mb_s"])
    summary["load_vs_raw_read"] = summary["load_s"]["mb_s"] / summary["raw_read_s"]["mb_s"]
    summary["async_blocked_fraction_of_sync"] = (summary["async_blocked_s"]["median"]
                                                 / summary["sync_s"]["median"])
    if args.json:
        print(json.dumps(summary, indent=1))
        return

    def line(name, key, vs=None):
        entry = summary[key]
        times = ", ".join(f"{t:.2f}" for t in entry["times"])
        ratio = f"   {100 * vs:5.1f}% of raw" if vs is not None else ""
        return (f"  {name:12s} {entry['median']:7.2f} s  {entry['mb_s']:7.0f} MB/s "
                f"({entry['mb_s_min']:.0f}..{entry['mb_s_max']:.0f}){ratio}   [{times}]")

    print(f"GPT {summary['params'] / 1e9:.2f}B params, bf16 + fp32 main params + Adam, "
          f"distributed optimizer, DP={args.world_size}: checkpoint {checkpoint_mb:.0f} MB "
          f"(data files {data_mb:.0f} MB); median of {repeats} (spread), max over ranks")
    print(line("raw write", "raw_write_s"))
    print(line("sync save", "sync_s", summary["save_vs_raw_write"]))
    print(line("async save", "async_total_s", summary["async_vs_raw_write"])
          + "  (call to published)")
    print(line("  its write", "async_write_s", summary["async_write_vs_raw_write"])
          + "  (staged to written)")
    print(line("raw read", "raw_read_s") + "  (the checkpoint's files, before and after "
          "the load)")
    print(line("load", "load_s", summary["load_vs_raw_read"]))
    print(line("  fresh read", "fresh_read_s") + "  (the raw write's file, just written)")
    blocked = summary["async_blocked_s"]
    print(f"  async blocks the loop {blocked['median']:.3f} s = "
          f"{100 * summary['async_blocked_fraction_of_sync']:.1f}% of a sync save (call "
          f"{summary['async_return_s']['median']:.3f} s + wait_for_staging "
          f"{summary['async_wait_s']['median']:.3f} s after a {args.step_seconds:.1f} s step; "
          f"per repeat {', '.join(f'{v:.3f}' for v in blocked['values'])}; the background "
          f"copy ended {', '.join(f'{v:.2f}' for v in summary['async_staging_s']['values'])} s"
          " after the call)")
    print(f"  --async-save's staging memory, prepared after the first step (in the background):"
          f" {summary['prepare_added_peak_mb']:.0f} MB per rank, written in "
          f"{summary['prepare_s']:.2f} s")
    print(f"  peak memory added: sync save "
          f"{summary['sync_added_peak_mb']['median']:.0f} MB, async save "
          + ", ".join(f"{v:.0f}" for v in summary["async_added_peak_mb"]["values"])
          + " MB per repeat (largest rank)")


def _engine_body(rank, world_size, root, total_mb, num_tensors, repeats, train_seconds):
    """--engine: How long does a checkpoint block training? async_save versus save, plus save/load MB/s.
    
        python tools/bench/bench_checkpoint.py --total-mb 300 --world-size 2 --repeats 3
    
    Every rank holds half of each of `--tensors` fp32 tensors (TP-style `ShardedTensorView`s),
    `--total-mb` in all. For each repeat, into fresh directories:
      * sync:        `save` wall time (the time training is blocked);
      * async:       time until `async_save` returns (blocked: the CPU staging copy), then the time
                     until the save is finalised while the rank runs matmuls ("training": first one
                     training step as below, timed, then single matmuls), and how many it ran;
      * background:  `async_save(stage_in_background=True)`, then one training step of matmuls
                     lasting about a sync save (forward + backward, which leave the state alone),
                     then `wait_for_staging()` (where the loop calls it: before optimizer.step()),
                     then the state is modified. Blocked = return time + that wait. The step's
                     duration is compared with the same step without a checkpoint running: the
                     slowdown is what the background copy and write cost the compute;
      * load:        `load` of the background-staged checkpoint into a zeroed template, checked
                     equal to the values at the call (the state was modified after the wait).
    Times are the maximum over ranks (a collective step waits for the slowest); medians reported.
    Data files are fsynced (FileSystemWriter sync_files=True), so this includes the disk.
    """
    import torch

    from megatron_smp.checkpointing import engine as dcp

    numel = int(total_mb * 2**20 / 4 / num_tensors)
    rows = max(world_size, numel // 1024 // world_size * world_size)
    local_rows = rows // world_size
    tensors = [torch.randn(local_rows, 1024) for _ in range(num_tensors)]
    state_dict = {
        f"layer{i}.weight": dcp.tp_sharded_tensor(t, rank, world_size, partition_dim=0)
        for i, t in enumerate(tensors)
    }
    local_bytes = sum(t.numel() * t.element_size() for t in tensors)
    a, b = torch.randn(256, 256), torch.randn(256, 256)

    def matmul():
        return a @ b

    # How many matmuls fit in train_seconds with no checkpoint running.
    start, baseline_steps = time.perf_counter(), 0
    while time.perf_counter() - start < train_seconds:
        matmul()
        baseline_steps += 1
    matmul_s = train_seconds / baseline_steps

    def finish_while_training():
        steps = 0
        while dcp.DEFAULT_ASYNC_QUEUE.get_num_unfinalized_calls():
            matmul()
            steps += 1
            if steps % 16 == 0:
                dcp.maybe_finalize_async_calls(blocking=False)
        return steps

    # The floor of the blocked time: one copy of this rank's tensors into warm CPU memory.
    buffers = [torch.empty_like(t) for t in tensors]
    for dst, src in zip(buffers, tensors):
        dst.copy_(src)

    # The "training step": about as long as a sync save (all ranks run the same count).
    path = os.path.join(root, "calibrate")
    torch.distributed.barrier()
    start = time.perf_counter()
    dcp.save(state_dict, checkpoint_id=path)
    calibration = torch.tensor([time.perf_counter() - start])
    torch.distributed.all_reduce(calibration, op=torch.distributed.ReduceOp.MAX)
    step_matmuls = max(1, int(float(calibration) / matmul_s))

    def training_step():
        for _ in range(step_matmuls):
            matmul()

    records = []
    for repeat in range(repeats):
        record = {}
        start = time.perf_counter()
        for dst, src in zip(buffers, tensors):
            dst.copy_(src)
        record["memcpy_s"] = time.perf_counter() - start
        sync_path = os.path.join(root, f"sync{repeat}")
        torch.distributed.barrier()
        start = time.perf_counter()
        dcp.save(state_dict, checkpoint_id=sync_path)
        record["sync_s"] = time.perf_counter() - start

        async_path = os.path.join(root, f"async{repeat}")
        torch.distributed.barrier()
        start = time.perf_counter()
        dcp.async_save(state_dict, checkpoint_id=async_path)
        record["async_blocked_s"] = time.perf_counter() - start
        for t in tensors:  # training may overwrite params at once
            t.mul_(2.0)
        step_start = time.perf_counter()
        training_step()
        record["step_during_async_s"] = time.perf_counter() - step_start
        record["train_steps_during_async"] = step_matmuls + finish_while_training()
        record["async_total_s"] = time.perf_counter() - start
        for t in tensors:
            t.div_(2.0)  # exact: scaling by a power of two

        torch.distributed.barrier()
        start = time.perf_counter()
        training_step()
        record["step_alone_s"] = time.perf_counter() - start

        background_path = os.path.join(root, f"background{repeat}")
        torch.distributed.barrier()
        start = time.perf_counter()
        dcp.async_save(state_dict, checkpoint_id=background_path, stage_in_background=True)
        record["background_return_s"] = time.perf_counter() - start
        step_start = time.perf_counter()
        training_step()  # forward + backward: the saved state is left alone
        record["step_during_background_s"] = time.perf_counter() - step_start
        wait_start = time.perf_counter()
        dcp.wait_for_staging()  # where the loop waits: before optimizer.step()
        record["background_wait_s"] = time.perf_counter() - wait_start
        record["background_blocked_s"] = (
            record["background_return_s"] + record["background_wait_s"]
        )
        for t in tensors:  # the optimizer step
            t.mul_(2.0)
        finish_while_training()
        record["background_total_s"] = time.perf_counter() - start
        for t in tensors:
            t.div_(2.0)

        template = {k: dcp.tp_sharded_tensor(torch.zeros_like(t), rank, world_size, 0)
                    for k, t in zip(state_dict, tensors)}
        torch.distributed.barrier()
        start = time.perf_counter()
        dcp.load(template, checkpoint_id=background_path)
        record["load_s"] = time.perf_counter() - start
        for key, tensor in zip(state_dict, tensors):
            assert torch.equal(template[key].local_tensors()[0], tensor), key
        records.append(record)
        if rank == 0:
            for done in (sync_path, async_path, background_path):
                shutil.rmtree(done, ignore_errors=True)
    return {"records": records, "local_bytes": local_bytes, "baseline_steps": baseline_steps,
            "step_matmuls": step_matmuls}


def _engine_main(args) -> None:
    root = tempfile.mkdtemp(prefix="bench_ckpt_", dir=args.dir)
    try:
        results = run_distributed(
            _engine_body,
            args.world_size,
            args=(root, args.total_mb, args.tensors, args.repeats, args.train_seconds),
            timeout=1800,
            collective_timeout=600,
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)

    total_mb = sum(r["local_bytes"] for r in results) / 2**20
    summary = {}
    keys = ("memcpy_s", "sync_s", "async_blocked_s", "async_total_s", "step_alone_s",
            "step_during_async_s",
            "background_return_s", "step_during_background_s", "background_wait_s",
            "background_blocked_s", "background_total_s", "load_s")
    for key in keys:
        per_repeat = [max(r["records"][i][key] for r in results) for i in range(args.repeats)]
        summary[key] = statistics.median(per_repeat)
    summary["total_mb"] = total_mb
    summary["step_matmuls"] = results[0]["step_matmuls"]
    summary["blocked_fraction"] = summary["async_blocked_s"] / summary["sync_s"]
    summary["background_blocked_fraction"] = summary["background_blocked_s"] / summary["sync_s"]
    summary["step_slowdown"] = (
        summary["step_during_background_s"] / summary["step_alone_s"] - 1.0
    )
    summary["step_slowdown_staged_at_call"] = (
        summary["step_during_async_s"] / summary["step_alone_s"] - 1.0
    )
    summary["sync_save_mb_s"] = total_mb / summary["sync_s"]
    summary["async_save_mb_s"] = total_mb / summary["async_total_s"]
    summary["load_mb_s"] = total_mb / summary["load_s"]
    for key in ("sync_s", "async_blocked_s", "background_blocked_s"):
        summary[f"per_repeat_{key}"] = [
            max(r["records"][i][key] for r in results) for i in range(args.repeats)
        ]
    steps = [rec["train_steps_during_async"] for r in results for rec in r["records"]]
    rate = statistics.median(r["baseline_steps"] for r in results) / args.train_seconds
    summary["train_step_rate_alone_per_s"] = rate
    summary["train_step_rate_during_async_per_s"] = (
        statistics.median(steps) / summary["async_total_s"]
    )
    if args.json:
        print(json.dumps(summary, indent=1))
        return

    def ms(key):
        return f"{summary[key] * 1e3:8.0f} ms"

    def per_repeat(key):
        return ", ".join(f"{t * 1e3:.0f}" for t in summary[f"per_repeat_{key}"]) + " ms"

    print(f"checkpoint of {total_mb:.0f} MB over {args.world_size} ranks "
          f"(median of {args.repeats}, max over ranks)")
    print(f"  sync save                 {ms('sync_s')}   {summary['sync_save_mb_s']:7.0f} MB/s"
          f"   ({per_repeat('sync_s')})")
    print(f"  async, staged at the call {ms('async_blocked_s')} blocked = "
          f"{100 * summary['blocked_fraction']:.1f}% of sync   ({per_repeat('async_blocked_s')})")
    print(f"    training step after it  {ms('step_during_async_s')} vs {ms('step_alone_s')}"
          f" alone: {100 * summary['step_slowdown_staged_at_call']:+.0f}% (the write shares "
          "the cores)")
    print(f"  async, staged in the background:")
    print(f"    async_save returns      {ms('background_return_s')}")
    print(f"    wait_for_staging        {ms('background_wait_s')}   after a training step of "
          f"{summary['step_matmuls']} matmuls")
    print(f"    blocked                 {ms('background_blocked_s')} = "
          f"{100 * summary['background_blocked_fraction']:.1f}% of sync   "
          f"({per_repeat('background_blocked_s')})")
    print(f"    training step           {ms('step_during_background_s')} vs {ms('step_alone_s')}"
          f" alone: {100 * summary['step_slowdown']:+.0f}% (the copy and the write share "
          "the cores)")
    print(f"  (memcpy floor             {ms('memcpy_s')}: one copy into warm CPU memory)")
    print(f"  async complete            {ms('async_total_s')}   "
          f"{summary['async_save_mb_s']:7.0f} MB/s")
    print(f"  background complete       {ms('background_total_s')}")
    print(f"  load                      {ms('load_s')}   {summary['load_mb_s']:7.0f} MB/s")
    print(f"  matmul steps/s alone {rate:.0f}, while the async write runs "
          f"{summary['train_step_rate_during_async_per_s']:.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--step-seconds", type=float, default=2.0,
                        help="the simulated forward/backward between an async save's call "
                             "and wait_for_staging")
    parser.add_argument("--engine", action="store_true",
                        help="the engine-level bench of synthetic tensors instead")
    parser.add_argument("--total-mb", type=float, default=300.0, help="--engine: state size")
    parser.add_argument("--tensors", type=int, default=24, help="--engine: tensor count")
    parser.add_argument("--train-seconds", type=float, default=1.0,
                        help="--engine: duration of the no-checkpoint matmul baseline")
    args = parser.parse_args()
    if args.engine:
        _engine_main(args)
    else:
        _training_main(args)


if __name__ == "__main__":
    main()
