"""A checkpoint saved at one TP/DP layout loads at another (ShardedTensorView + DCP)."""
import pytest
import torch

from megatron_smp.testing import run_distributed

ROWS, COLS = 8, 3  # the TP-sharded weight, split along dim 0
FUSED_ROWS = 8  # a stride-2 fused weight ([gate; up]), split along dim 0
FLAT = 10  # a 1-D buffer split unevenly, as the distributed optimizer does


def _full_weight():
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)


def _full_fused():
    return torch.arange(FUSED_ROWS * 2, dtype=torch.float64).reshape(FUSED_ROWS, 2) * -1.0


def _full_flat():
    return torch.arange(FLAT, dtype=torch.float32) + 100.0


def _fused_local(full, tp_rank, tp_size):
    # Megatron's strided split: chunks of rows/(2*tp), chunk i goes to rank i % tp.
    pieces = full.chunk(2 * tp_size, dim=0)
    return torch.cat([pieces[tp_rank], pieces[tp_rank + tp_size]], dim=0)


def _state(tp_size, tp_rank, flat_range, fill):
    from megatron_smp.checkpointing.engine import flat_sharded_tensor, tp_sharded_tensor

    weight = _full_weight().chunk(tp_size)[tp_rank].clone()
    fused = _fused_local(_full_fused(), tp_rank, tp_size).clone()
    start, end = flat_range
    flat = _full_flat()[start:end].clone()
    replicated = torch.linspace(0, 1, 5)
    if not fill:
        for t in (weight, fused, flat, replicated):
            t.zero_()
    tensors = {"weight": weight, "fused": fused, "flat": flat, "replicated": replicated}
    state_dict = {
        "model": {
            "weight": tp_sharded_tensor(weight, tp_rank, tp_size, partition_dim=0),
            "fused": tp_sharded_tensor(fused, tp_rank, tp_size, 0, partition_stride=2),
            "replicated": replicated,
        },
        "optimizer": {"flat": flat_sharded_tensor(flat, FLAT, start)},
    }
    return state_dict, tensors


def _expected(tp_size, tp_rank, flat_range):
    _, tensors = _state(tp_size, tp_rank, flat_range, fill=True)
    return tensors


def _save_two_way(rank, world_size, path):
    from megatron_smp.checkpointing.engine import save

    # TP=2, world 2; flat buffer split unevenly 7 + 3.
    flat_range = [(0, 7), (7, 10)][rank]
    state_dict, _ = _state(2, rank, flat_range, fill=True)
    save(state_dict, checkpoint_id=path)


def _load(state_dict, tensors, path):
    from megatron_smp.checkpointing.engine import load

    load(state_dict, checkpoint_id=path)
    # Lists, not tensors: tensors cross the result queue through shared memory that dies with
    # the child.
    return {k: v.tolist() for k, v in tensors.items()}


def _load_four_way_then_save_tp2_dp2(rank, world_size, path_a, path_b):
    from megatron_smp.checkpointing.engine import save

    # Load the TP=2 checkpoint at TP=4 with a different uneven flat split (rank 1 owns nothing).
    flat_range = [(0, 3), (3, 3), (3, 9), (9, 10)][rank]
    state_dict, tensors = _state(4, rank, flat_range, fill=False)
    loaded = _load(state_dict, tensors, path_a)
    expected = {k: v.tolist() for k, v in _expected(4, rank, flat_range).items()}
    # Save at TP=2 x DP=2 (ranks 0,1 = dp 0; 2,3 = dp 1): weights are replicated over dp.
    tp_rank = rank % 2
    flat_range_b = [(0, 2), (2, 5), (5, 6), (6, 10)][rank]
    state_dict_b, _ = _state(2, tp_rank, flat_range_b, fill=True)
    save(state_dict_b, checkpoint_id=path_b)
    return loaded, expected


def _load_one_way(rank, world_size, paths):
    results = []
    for path in paths:
        state_dict, tensors = _state(1, 0, (0, FLAT), fill=False)
        results.append(_load(state_dict, tensors, path))
    return results


def test_reshard_tp2_to_tp4_and_tp1_and_dp_replicas(tmp_path):
    from megatron_smp.checkpointing.engine import read_dcp_metadata

    path_a, path_b = str(tmp_path / "a"), str(tmp_path / "b")
    run_distributed(_save_two_way, 2, args=(path_a,))
    results = run_distributed(_load_four_way_then_save_tp2_dp2, 4, args=(path_a, path_b))
    for loaded, expected in results:
        for key in expected:
            assert loaded[key] == expected[key], key

    (results,) = run_distributed(_load_one_way, 1, args=([path_a, path_b],))
    for loaded in results:
        assert loaded["weight"] == _full_weight().tolist()
        assert loaded["fused"] == _full_fused().tolist()
        assert loaded["flat"] == _full_flat().tolist()
        assert loaded["replicated"] == torch.linspace(0, 1, 5).tolist()

    # Replicas over dp are written once: one stored chunk per (key, offset).
    metadata = read_dcp_metadata(path_b)
    chunks = metadata.state_dict_metadata["model.weight"].chunks
    assert sorted(tuple(c.offsets) for c in chunks) == [(0, 0), (4, 0)]
    stored = [i for i in metadata.storage_data if i.fqn == "model.weight"]
    assert len(stored) == 2
    assert len([i for i in metadata.storage_data if i.fqn == "model.replicated"]) == 1


def test_sharded_view_rejects_bad_chunks():
    from megatron_smp.checkpointing.engine import make_sharded_tensor

    with pytest.raises(ValueError, match="leaves the global shape"):
        make_sharded_tensor(torch.zeros(3, 2), (4, 2), (2, 0))
    view = make_sharded_tensor(torch.zeros(2, 2), (4, 2), (2, 0))
    assert view.size() == torch.Size([4, 2]) and "ShardedTensorView" in repr(view)
    with pytest.raises(TypeError, match="only describes"):
        view.sum()


def test_sharded_state_dict_uses_tensor_parallel_attributes():
    import types

    from megatron_smp.checkpointing.engine import ShardedTensorView, sharded_state_dict

    module = torch.nn.Module()
    module.column = torch.nn.Parameter(torch.arange(8.0).reshape(4, 2))  # rank 1 of a [8, 2]
    module.fused = torch.nn.Parameter(torch.arange(8.0).reshape(4, 2))  # [gate; up] stride 2
    module.norm = torch.nn.Parameter(torch.ones(2))
    for name, stride in (("column", 1), ("fused", 2)):
        param = getattr(module, name)
        param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, 0, stride
    module.register_buffer("step", torch.tensor(3))
    state = types.SimpleNamespace(tp_size=2, tp_rank=1)

    result = sharded_state_dict(module, state, prefix="model.")
    assert isinstance(result["model.column"], ShardedTensorView)
    assert [(o, list(t.shape)) for o, t in result["model.column"].chunks] == [((4, 0), [4, 2])]
    assert [o for o, _ in result["model.fused"].chunks] == [(2, 0), (6, 0)]
    assert result["model.fused"].global_shape == torch.Size([8, 2])
    assert not isinstance(result["model.norm"], ShardedTensorView)
    # Chunks are views of the parameters: an in-place load writes into the module.
    result["model.column"].local_tensors()[0].fill_(7.0)
    result["model.fused"].local_tensors()[1].fill_(-1.0)
    assert module.column.detach().eq(7.0).all()
    assert module.fused.detach()[2:].eq(-1.0).all() and module.fused.detach()[:2].ne(-1.0).any()
    assert int(result["model.step"]) == 3
