"""The distributed optimizer saves resident memory in fact, not only in tensor sizes.

Each configuration runs in fresh processes that measure their own peak RSS (VmHWM, reset
after the imports) over building a model, wrapping it, and two training steps. Megatron's
table predicts the saving over plain DP per parameter: (8 Adam bytes + 4 main-param bytes
for bf16) x (1 - 1/dp). Host memory leaks in the step (a gathered buffer staged in a
temporary, params' freed storage kept by the allocator) show up here as a smaller saving.
"""
import os

import pytest
import torch

from megatron_smp.config import OptimizerConfig, ParallelConfig
from megatron_smp.testing import proc_status_kib, run_distributed

HIDDEN, LAYERS = 1024, 16  # 16.8M params: 64 MiB of fp32
SHARDED_BYTES_PER_PARAM = {torch.float32: 8, torch.bfloat16: 4 + 8}

pytestmark = pytest.mark.skipif(
    not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux /proc peak RSS reset"
)


def _peak_body(rank, world_size, use_distributed_optimizer, dtype):
    from megatron_smp.distributed import DistributedDataParallel, finalize_model_grads
    from megatron_smp.distributed.param_and_grad_buffer import release_freed_host_memory
    from megatron_smp.optimizer import get_megatron_optimizer
    from megatron_smp.parallel_state import build_parallel_state

    state = build_parallel_state(ParallelConfig())
    release_freed_host_memory()
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")  # VmHWM := VmRSS
    start = proc_status_kib("VmRSS")

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        *[torch.nn.Linear(HIDDEN, HIDDEN, bias=False) for _ in range(LAYERS)]
    ).to(dtype)
    config = OptimizerConfig(
        lr=1e-3, clip_grad=1.0, use_distributed_optimizer=use_distributed_optimizer,
    )
    ddp = DistributedDataParallel(model, config, state)
    optimizer = get_megatron_optimizer(config, [ddp], state)
    for _ in range(2):
        optimizer.zero_grad()
        ddp(torch.randn(2, HIDDEN, dtype=dtype)).float().square().mean().backward()
        finalize_model_grads([ddp], state)
        optimizer.step()
    ddp.finish_param_sync()
    num_params = sum(p.numel() for p in model.parameters())
    return (proc_status_kib("VmHWM") - start) * 1024, num_params


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_distributed_optimizer_peak_rss_saves_the_sharded_state(dtype):
    plain = run_distributed(_peak_body, world_size=2, args=(False, dtype))
    sharded = run_distributed(_peak_body, world_size=2, args=(True, dtype))
    num_params = plain[0][1]
    theory = num_params * SHARDED_BYTES_PER_PARAM[dtype] * (1 - 1 / 2)
    saved = max(peak for peak, _ in plain) - max(peak for peak, _ in sharded)
    # Measured: fp32 72 of 64 MiB, bf16 100 of 96 MiB; with the param all-gather staged by
    # gloo and the params' old storage kept by glibc: fp32 0.2, bf16 80 MiB. Peak RSS of a
    # 2-rank run on a loaded machine varies by about +-15 MiB per rank (once fp32 saved 51 MiB),
    # so this guard only asks for half the theory: the fp32 case still fails by two orders of
    # magnitude if the gather temporary or the retained heap comes back. The >= 90% figures
    # are checked by hand with tools/bench/bench_memory.py at 105M parameters.
    assert saved >= 0.5 * theory, (
        f"saved {saved / 2**20:.1f} MiB of the {theory / 2**20:.1f} MiB theory; "
        f"peaks plain {[p >> 20 for p, _ in plain]} MiB, "
        f"distributed {[p >> 20 for p, _ in sharded]} MiB"
    )
