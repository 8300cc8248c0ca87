"""How long does a checkpoint block training? async_save versus save, plus save/load MB/s.

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


if __name__ == "__main__":
    main()
