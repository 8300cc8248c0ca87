import pytest

from megatron_smp.config import ConfigError, ParallelConfig
from megatron_smp.parallel_state import build_parallel_state, rank_groups
from megatron_smp.testing import run_distributed


def test_rank_groups_follow_megatron_order():
    sizes = {"tp": 2, "cp": 1, "dp": 2, "pp": 2}
    assert rank_groups(sizes, ["tp"]) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert rank_groups(sizes, ["dp"]) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert rank_groups(sizes, ["pp"]) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert rank_groups(sizes, ["tp", "pp"]) == [[0, 1, 4, 5], [2, 3, 6, 7]]


def test_single_process_without_launcher():
    state = build_parallel_state(ParallelConfig())
    assert (state.world_size, state.tp_size, state.dp_size, state.pp_size) == (1, 1, 1, 1)
    assert state.is_pipeline_first_stage and state.is_pipeline_last_stage


def _layout(rank, world_size, tp, pp, ep):
    import torch
    import torch.distributed as dist

    state = build_parallel_state(
        ParallelConfig(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            expert_model_parallel_size=ep,
        )
    )
    # Each group really connects the ranks it claims: sum of ranks over the group.
    sums = {}
    for name in ("tp", "dp", "pp", "dp_cp", "mp", "ep", "expert_dp", "embedding"):
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=state.groups[name])
        sums[name] = (t.item(), float(sum(state.group_ranks[name])))
    return state.coords, state.ep_rank, sums


def test_groups_world_8():
    results = run_distributed(_layout, 8, args=(2, 2, 2))
    for rank, (coords, ep_rank, sums) in enumerate(results):
        assert coords["tp"] == rank % 2
        assert coords["dp"] == (rank // 2) % 2
        assert coords["pp"] == rank // 4
        assert ep_rank == coords["dp"]
        for name, (got, expected) in sums.items():
            assert got == expected, (rank, name)


def _bad(rank, world_size):
    build_parallel_state(ParallelConfig(tensor_model_parallel_size=3))


def test_bad_layout_raises_on_every_rank():
    errors = run_distributed(_bad, 2, allow_errors=True, timeout=60)
    for text in errors:
        assert "ConfigError" in text and "tensor-model-parallel-size (3)" in text
