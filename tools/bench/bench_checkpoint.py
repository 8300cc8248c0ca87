"""How long does a checkpoint block training? async_save versus save, plus save/load MB/s.

    python tools/bench/bench_checkpoint.py --total-mb 300 --world-size 2 --repeats 3

Every rank holds half of each of `--tensors` fp32 tensors (TP-style `ShardedTensorView`s),
`--total-mb` in all. For each repeat, into a fresh directory:
  * sync:  `save` wall time (the time training is blocked);
  * async: time until `async_save` returns (blocked: the CPU staging copy), then the time until
           `maybe_finalize_async_calls(blocking=True)` returns while the rank runs matmuls
           ("training") in the meantime, and how many matmuls it got through;
  * load:  `load` wall time into a zeroed template (checked equal).
Times are the maximum over ranks (a collective step waits for the slowest); medians reported.
Data files are fsynced (FileSystemWriter sync_files=True), so this includes the disk.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron_smp.testing import run_distributed  # noqa: E402


def _body(rank, world_size, root, total_mb, num_tensors, repeats, train_seconds):
    import torch

    from megatron_smp.distributed import checkpoint as dcp

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

    def train_step():
        return a @ b

    # How many "training" steps fit in train_seconds with no checkpoint running.
    start, baseline_steps = time.perf_counter(), 0
    while time.perf_counter() - start < train_seconds:
        train_step()
        baseline_steps += 1

    # The floor of the blocked time: one copy of this rank's tensors into warm CPU memory.
    buffers = [torch.empty_like(t) for t in tensors]
    for dst, src in zip(buffers, tensors):
        dst.copy_(src)

    records = []
    for repeat in range(repeats):
        record = {}
        start = time.perf_counter()
        for dst, src in zip(buffers, tensors):
            dst.copy_(src)
        record["memcpy_s"] = time.perf_counter() - start
        path = os.path.join(root, f"sync{repeat}")
        torch.distributed.barrier()
        start = time.perf_counter()
        dcp.save(state_dict, checkpoint_id=path)
        record["sync_s"] = time.perf_counter() - start

        path = os.path.join(root, f"async{repeat}")
        torch.distributed.barrier()
        start = time.perf_counter()
        dcp.async_save(state_dict, checkpoint_id=path)
        record["async_blocked_s"] = time.perf_counter() - start
        steps = 0
        for t in tensors:  # training may overwrite params at once
            t.mul_(2.0)
        while dcp.DEFAULT_ASYNC_QUEUE.get_num_unfinalized_calls():
            train_step()
            steps += 1
            if steps % 16 == 0:
                dcp.maybe_finalize_async_calls(blocking=False)
        record["async_total_s"] = time.perf_counter() - start
        record["train_steps_during_async"] = steps
        for t in tensors:
            t.div_(2.0)  # exact: scaling by a power of two

        template = {k: dcp.tp_sharded_tensor(torch.zeros_like(t), rank, world_size, 0)
                    for k, t in zip(state_dict, tensors)}
        torch.distributed.barrier()
        start = time.perf_counter()
        dcp.load(template, checkpoint_id=path)
        record["load_s"] = time.perf_counter() - start
        for key, tensor in zip(state_dict, tensors):
            assert torch.equal(template[key].local_tensors()[0], tensor), key
        records.append(record)
        if rank == 0:
            shutil.rmtree(os.path.join(root, f"sync{repeat}"), ignore_errors=True)
            shutil.rmtree(path, ignore_errors=True)
    return {"records": records, "local_bytes": local_bytes, "baseline_steps": baseline_steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--total-mb", type=float, default=300.0)
    parser.add_argument("--tensors", type=int, default=24)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--train-seconds", type=float, default=1.0,
                        help="duration of the no-checkpoint matmul baseline")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    root = tempfile.mkdtemp(prefix="bench_ckpt_", dir=args.dir)
    try:
        results = run_distributed(
            _body,
            args.world_size,
            args=(root, args.total_mb, args.tensors, args.repeats, args.train_seconds),
            timeout=1800,
            collective_timeout=600,
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)

    total_mb = sum(r["local_bytes"] for r in results) / 2**20
    summary = {}
    for key in ("memcpy_s", "sync_s", "async_blocked_s", "async_total_s", "load_s"):
        per_repeat = [max(r["records"][i][key] for r in results) for i in range(args.repeats)]
        summary[key] = statistics.median(per_repeat)
    summary["total_mb"] = total_mb
    summary["blocked_fraction"] = summary["async_blocked_s"] / summary["sync_s"]
    summary["sync_save_mb_s"] = total_mb / summary["sync_s"]
    summary["async_save_mb_s"] = total_mb / summary["async_total_s"]
    summary["load_mb_s"] = total_mb / summary["load_s"]
    summary["per_repeat_blocked_s"] = [
        max(r["records"][i]["async_blocked_s"] for r in results) for i in range(args.repeats)
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
    print(f"checkpoint of {total_mb:.0f} MB over {args.world_size} ranks "
          f"(median of {args.repeats}, max over ranks)")
    print(f"  sync save        {summary['sync_s'] * 1e3:8.0f} ms   "
          f"{summary['sync_save_mb_s']:7.0f} MB/s")
    print(f"  async blocked    {summary['async_blocked_s'] * 1e3:8.0f} ms   "
          f"= {100 * summary['blocked_fraction']:.1f}% of sync")
    print(f"  (memcpy floor    {summary['memcpy_s'] * 1e3:8.0f} ms: one copy into warm CPU memory)")
    print(f"  async complete   {summary['async_total_s'] * 1e3:8.0f} ms   "
          f"{summary['async_save_mb_s']:7.0f} MB/s")
    print(f"  load             {summary['load_s'] * 1e3:8.0f} ms   "
          f"{summary['load_mb_s']:7.0f} MB/s")
    print("  blocked per repeat (the first one allocates the staging buffers): "
          + ", ".join(f"{t * 1e3:.0f} ms" for t in summary["per_repeat_blocked_s"]))
    print(f"  matmul steps/s alone {rate:.0f}, while the async write runs "
          f"{summary['train_step_rate_during_async_per_s']:.0f}")


if __name__ == "__main__":
    main()
