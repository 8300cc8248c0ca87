"""Megatron-LM's precision and sharding flags (core_v0.16.1): --grad-reduce-in-bf16 (grads
accumulated and reduced in bf16), FP8/FP4 flags (clear errors), --use-megatron-fsdp with
--data-parallel-sharding-strategy (mapped onto our engines), --empty-unused-memory-level."""
import copy
from types import SimpleNamespace

import pytest
import torch

from megatron_smp.config import ConfigError, OptimizerConfig, ParallelConfig
from megatron_smp.distributed import DistributedDataParallel
from megatron_smp.parallel_state import build_parallel_state
from megatron_smp.testing import run_distributed
from megatron_smp.training.arguments import parse_args
from tests.unit.models.common import to_numpy

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "16", "--train-iters", "2", "--mock-data", "--vocab-size", "100"]

# Every FP8/FP4 flag of Megatron-LM core_v0.16.1's parser (its --fp8-*/--fp4-* and the flags
# that only act under FP8), with a value where it takes one.
LOW_PRECISION_FLAGS = [
    ["--fp8-format", "hybrid"], ["--fp8-recipe", "delayed"], ["--fp8-margin", "0"],
    ["--fp8-interval", "1"], ["--fp8-amax-history-len", "1024"],
    ["--fp8-amax-compute-algo", "max"], ["--fp8-param-gather"],
    ["--fp8-quantizer-factory", "x.y"], ["--no-fp8-wgrad"], ["--disable-fp8-wgrad"],
    ["--keep-fp8-transpose-cache"], ["--reuse-grad-buf-for-mxfp8-param-ag"],
    ["--first-last-layers-bf16"], ["--num-layers-at-start-in-bf16", "1"],
    ["--num-layers-at-end-in-bf16", "1"], ["--te-precision-config-file", "p.yaml"],
    ["--fp4-format", "e2m1"], ["--fp4-recipe", "nvfp4"], ["--fp4-param-gather"],
    ["--fp4-quantizer-factory", "x.y"],
]


@pytest.mark.parametrize("flag", LOW_PRECISION_FLAGS, ids=lambda f: f[0])
def test_fp8_and_fp4_flags_name_transformer_engine_and_the_gpu_they_need(flag):
    with pytest.raises(ConfigError, match=rf"{flag[0]} .*Transformer Engine.*Hopper.*Blackwell"
                                          r".*--bf16"):
        parse_args(BASE + ["--bf16"] + flag)


# --grad-reduce-in-bf16 ---------------------------------------------------------------------------


def _grads_body(rank, world_size, in_fp32):
    state = build_parallel_state(ParallelConfig())
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 48).to(torch.bfloat16)
    local = copy.deepcopy(model)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(rank)).bfloat16()
    local(x).float().pow(2).sum().backward()
    ddp = DistributedDataParallel(
        model, OptimizerConfig(accumulate_allreduce_grads_in_fp32=in_fp32), state)
    ddp.zero_grad_buffer()
    ddp(x).float().pow(2).sum().backward()
    ddp.finish_grad_sync()
    return to_numpy({"reduced": model.weight.main_grad.float(),
                     "dtype": str(model.weight.main_grad.dtype),
                     "local": local.weight.grad.float()})


def test_grad_reduce_in_bf16_reduces_in_bf16():
    configs = parse_args(BASE + ["--bf16", "--grad-reduce-in-bf16"])
    assert not configs.optimizer.accumulate_allreduce_grads_in_fp32
    assert parse_args(BASE + ["--bf16"]).optimizer.accumulate_allreduce_grads_in_fp32
    with pytest.raises(ConfigError, match="--grad-reduce-in-bf16.*--bf16"):
        parse_args(BASE + ["--grad-reduce-in-bf16"])

    bf16 = run_distributed(_grads_body, 2, args=(False,))
    fp32 = run_distributed(_grads_body, 2, args=(True,))
    g0, g1 = (torch.from_numpy(r["local"]) for r in bf16)
    assert [r["dtype"] for r in bf16] == ["torch.bfloat16"] * 2
    assert [r["dtype"] for r in fp32] == ["torch.float32"] * 2
    # The DP average of the bf16 grads, rounded to bf16 once (the halving is exact).
    expected_bf16 = ((g0 + g1).bfloat16() * 0.5).float()
    for rank in range(2):
        assert torch.equal(torch.from_numpy(bf16[rank]["reduced"]), expected_bf16)
        assert torch.equal(torch.from_numpy(fp32[rank]["reduced"]), (g0 + g1) * 0.5)
    rounded = (torch.from_numpy(bf16[0]["reduced"]) != (g0 + g1) * 0.5).float().mean()
    assert rounded > 0.1  # the bf16 reduction really rounds


# --use-megatron-fsdp / --data-parallel-sharding-strategy -----------------------------------------


def _engine(configs):
    return (configs.parallel.use_torch_fsdp2, configs.optimizer.use_distributed_optimizer,
            configs.optimizer.overlap_grad_reduce, configs.optimizer.overlap_param_gather)


def test_megatron_fsdp_strategies_map_onto_our_engines():
    fsdp = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy"]
    recipe = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]
    full = parse_args(BASE + fsdp + ["optim_grads_params"] + recipe)
    assert _engine(full) == _engine(parse_args(BASE + ["--use-torch-fsdp2"]))
    assert _engine(full) == (True, False, False, False)
    assert full.parallel == parse_args(BASE + ["--use-torch-fsdp2"]).parallel
    optim = parse_args(BASE + fsdp + ["optim"])
    assert optim.optimizer == parse_args(BASE + ["--use-distributed-optimizer"]).optimizer
    assert _engine(optim) == (False, True, False, False)
    assert _engine(parse_args(BASE + ["--use-megatron-fsdp"])) == _engine(parse_args(BASE))
    assert _engine(parse_args(BASE + fsdp + ["no_shard"])) == _engine(parse_args(BASE))
    with pytest.raises(ConfigError, match="optim_grads .*not built.*optim_grads_params"):
        parse_args(BASE + fsdp + ["optim_grads"])
    with pytest.raises(ConfigError, match="--data-parallel-sharding-strategy optim .*"
                                          "--use-megatron-fsdp"):
        parse_args(BASE + ["--data-parallel-sharding-strategy", "optim"])
    with pytest.raises(ConfigError, match="--use-megatron-fsdp and --use-torch-fsdp2"):
        parse_args(BASE + fsdp + ["optim_grads_params", "--use-torch-fsdp2"])
    # Megatron-FSDP's checkpoint format: FSDP2 runs write our DCP format (global tensors).
    dtensor = ["--ckpt-format", "fsdp_dtensor"]
    assert parse_args(BASE + fsdp + ["optim_grads_params"] + dtensor).checkpoint == \
        parse_args(BASE + ["--use-torch-fsdp2"]).checkpoint
    assert parse_args(BASE + ["--use-torch-fsdp2"] + dtensor).checkpoint.ckpt_format == \
        "torch_dist"
    with pytest.raises(ConfigError, match="--ckpt-format fsdp_dtensor .*optim_grads_params"):
        parse_args(BASE + dtensor)


# --empty-unused-memory-level ---------------------------------------------------------------------


@pytest.mark.parametrize("level, calls", [(0, 0), (1, 2), (2, 3)])
def test_empty_unused_memory_level_empties_the_cuda_cache_where_megatron_does(
        monkeypatch, level, calls):
    """Megatron empties the cache after forward-backward (level >= 1), after the optimizer
    step (level 2) and after each evaluation step (>= 1): one train step plus one
    evaluation step calls it 0, 2, 3 times. Nothing happens on a CPU device."""
    from megatron_smp.training.pretrain import empty_unused_memory

    assert parse_args(BASE + ["--empty-unused-memory-level", str(level)]
                      ).training.empty_unused_memory_level == level
    emptied = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    training = SimpleNamespace(empty_unused_memory_level=level)
    for device, expected in (("cuda", calls), ("cpu", 0)):
        emptied.clear()
        run = SimpleNamespace(configs=SimpleNamespace(training=training),
                              state=SimpleNamespace(device=torch.device(device)))
        for point in (1, 2, 1):  # after forward-backward, after step, after an eval step
            empty_unused_memory(run, point)
        assert len(emptied) == expected
