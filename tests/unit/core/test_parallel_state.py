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
    # Megatron's partial distributed optimizer: each dp x cp group (here 2 ranks) in 2 runs.
    instances = state.optimizer_instance_groups(2)
    extra = {"intra": dist.get_process_group_ranks(instances["dense"][0]),
             "inter": dist.get_process_group_ranks(instances["dense"][1])}
    # Experts on fewer TP ranks: each stage's 4 ranks are etp 1 x ep 4 (Megatron's grid).
    grid = build_parallel_state(ParallelConfig(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        expert_model_parallel_size=2 * ep, expert_tensor_parallel_size=1))
    extra.update({name: grid.group_ranks[name] for name in ("ep", "etp", "tp_ep", "expert_dp")})
    extra["expert_ranks"] = (grid.ep_rank, grid.etp_rank, grid.etp_size)
    return state.coords, state.ep_rank, sums, extra


def test_groups_world_8():
    results = run_distributed(_layout, 8, args=(2, 2, 2))
    for rank, (coords, ep_rank, sums, extra) in enumerate(results):
        assert coords["tp"] == rank % 2
        assert coords["dp"] == (rank // 2) % 2
        assert coords["pp"] == rank // 4
        assert ep_rank == coords["dp"]
        for name, (got, expected) in sums.items():
            assert got == expected, (rank, name)
        dp_cp = [rank % 2 + 4 * (rank // 4) + 2 * d for d in range(2)]
        assert extra["intra"] == [rank] and extra["inter"] == dp_cp
        stage = [4 * (rank // 4) + i for i in range(4)]
        assert extra["ep"] == extra["tp_ep"] == stage
        assert extra["etp"] == extra["expert_dp"] == [rank]
        assert extra["expert_ranks"] == (rank % 4, 0, 1)


def _bad(rank, world_size):
    build_parallel_state(ParallelConfig(tensor_model_parallel_size=3))


def test_bad_layout_raises_on_every_rank():
    errors = run_distributed(_bad, 2, allow_errors=True, timeout=60)
    for text in errors:
        assert "ConfigError" in text and "tensor-model-parallel-size (3)" in text


def test_elastic_store_per_attempt_or_per_round(monkeypatch):
    """Under torchrun: the agent's job-long store gets the attempt's key prefix (and on
    several nodes with restarts a warning, as the nodes' restart counts can differ); a store
    rank 0 hosts for this rendezvous round alone is used as it is."""
    from datetime import timedelta

    import torch.distributed as dist

    from megatron_smp.parallel_state import _elastic_attempt_store

    agent = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(agent.port),
                        "TORCHELASTIC_RESTART_COUNT": "1", "TORCHELASTIC_MAX_RESTARTS": "1",
                        "TORCHELASTIC_USE_AGENT_STORE": "True", "GROUP_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    with pytest.warns(UserWarning, match="TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
        store = _elastic_attempt_store(1, 0, timedelta(seconds=10))
    store.set("key", "attempt 1")
    assert agent.get("attempt_1/key") == b"attempt 1"

    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    monkeypatch.setenv("MASTER_PORT", "0")  # rank 0 hosts the round's store
    store = _elastic_attempt_store(1, 0, timedelta(seconds=10))
    assert isinstance(store, dist.TCPStore) and store.port not in (0, agent.port)


def _mismatched_collective(rank, world_size):
    """Every group the state creates carries the default group's timeout (here 3 s, as
    --distributed-timeout-minutes sets it): a reduction over the data-parallel group that one
    rank never joins raises within that time instead of torch's 30-minute default."""
    import datetime
    import time

    import torch
    import torch.distributed as dist

    from megatron_smp.parallel_state import default_group_timeout, new_group

    state = build_parallel_state(ParallelConfig())
    timeouts = {name: group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
                for name, group in state.groups.items()}
    extra = new_group([0, 1])._get_backend(torch.device("cpu")).options._timeout
    elapsed = None
    if rank == 0:
        start = time.monotonic()
        try:
            dist.all_reduce(torch.ones(1), group=state.dp_group)
        except RuntimeError:
            elapsed = time.monotonic() - start
    else:
        time.sleep(6.0)  # never joins; long enough for rank 0 to time out
    return timeouts, extra.total_seconds(), default_group_timeout().total_seconds(), elapsed


def test_distributed_timeout_bounds_every_group():
    results = run_distributed(_mismatched_collective, 2, collective_timeout=3.0, timeout=120)
    for timeouts, extra, default, _ in results:
        assert set(timeouts.values()) == {3.0}, timeouts
        assert (extra, default) == (3.0, 3.0)
    elapsed = results[0][3]
    assert elapsed is not None and 2.5 < elapsed < 7.5, elapsed
