"""The load-balanced split and the configuration rules of context parallelism (pure)."""
import pytest
import torch

from megatron_smp.config import ConfigError, ParallelConfig, TransformerConfig
from megatron_smp.context_parallel import (
    get_batch_on_this_cp_rank,
    local_positions,
    split_for_context_parallel,
)
from megatron_smp.context_parallel.split import gathered_order


def test_rank_i_keeps_chunks_i_and_2n_minus_1_minus_i():
    assert local_positions(16, 4, 0).tolist() == [0, 1, 14, 15]
    assert local_positions(16, 4, 1).tolist() == [2, 3, 12, 13]
    assert local_positions(16, 4, 3).tolist() == [6, 7, 8, 9]
    # Every position is held exactly once, and causal work is balanced: the sum over a
    # rank's positions (keys each query sees, minus one) is the same on every rank.
    for cp in (1, 2, 4):
        held = torch.cat([local_positions(32, cp, r) for r in range(cp)])
        assert sorted(held.tolist()) == list(range(32))
        assert torch.equal(held, gathered_order(32, cp))
        assert len({int(local_positions(32, cp, r).sum()) for r in range(cp)}) == 1


def test_batch_split_keeps_global_positions_and_splits_mask_queries_only():
    b, s = 2, 8
    tokens = torch.arange(b * s).reshape(b, s)
    batch = {"tokens": tokens, "labels": tokens + 1, "loss_mask": torch.ones(b, s),
             "position_ids": torch.arange(s).expand(b, s),
             "attention_mask": torch.ones(b, 1, s, s, dtype=torch.bool).triu(1)}
    local = get_batch_on_this_cp_rank(batch, 2, 1)
    assert local["tokens"][0].tolist() == [2, 3, 4, 5]
    assert local["position_ids"][1].tolist() == [2, 3, 4, 5]
    assert local["labels"].shape == local["loss_mask"].shape == (b, 4)
    assert local["attention_mask"].shape == (b, 1, 4, s)
    assert torch.equal(local["attention_mask"], batch["attention_mask"][:, :, 2:6])
    assert torch.equal(split_for_context_parallel(tokens, 1, 2, 0), tokens[:, [0, 1, 6, 7]])
    assert get_batch_on_this_cp_rank(batch, 1, 0)["tokens"] is tokens


def _model(**changes):
    fields = dict(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                  vocab_size=10, max_position_embeddings=64, attention_dropout=0.0)
    fields.update(changes)
    return TransformerConfig(**fields)


@pytest.mark.parametrize("model, tp, cp, seq, message", [
    ({}, 1, 2, 30, r"--seq-length \(30\) must be divisible by 2 x --context-parallel-size"),
    ({"cp_comm_type": "a2a"}, 1, 4, 32, r"--num-query-groups \(2\) must be divisible"),
    ({"cp_comm_type": "a2a"}, 2, 2, 32, r"tensor-model-parallel-size x context-parallel"),
    ({"cp_comm_type": "ring"}, 1, 2, 32, "--cp-comm-type must be one of p2p, all_gather, a2a"),
    ({"sequence_parallel": True, "num_query_groups": 4}, 4, 2, 36,
     r"--seq-length \(36\) must be divisible by tensor-model-parallel-size x context-par"),
])
def test_context_parallel_settings_that_cannot_work_are_config_errors(model, tp, cp, seq,
                                                                      message):
    parallel = ParallelConfig(tensor_model_parallel_size=tp, context_parallel_size=cp)
    with pytest.raises(ConfigError, match=message):
        _model(**model).validate(parallel, seq)


def test_context_parallel_settings_that_work():
    """Sliding window and attention dropout work with every --cp-comm-type; each accepted
    setting sits next to one that the same validation rejects (so it is really checked)."""
    for comm_type in ("p2p", "all_gather", "a2a"):
        parallel = ParallelConfig(tensor_model_parallel_size=1, context_parallel_size=2)
        windowed = _model(cp_comm_type=comm_type, window_size=(7, 0))
        assert windowed.validate(parallel, 32) is None
        with pytest.raises(ConfigError, match=r"--seq-length \(30\) must be divisible"):
            windowed.validate(parallel, 30)
    for comm_type in ("p2p", "all_gather", "a2a"):
        parallel = ParallelConfig(context_parallel_size=4)
        assert _model(cp_comm_type=comm_type, attention_dropout=0.1,
                      num_query_groups=4).validate(parallel, 64) is None
    with pytest.raises(ConfigError, match=r"--num-query-groups \(2\) must be divisible"):
        _model(cp_comm_type="a2a", attention_dropout=0.1, num_query_groups=2).validate(
            ParallelConfig(context_parallel_size=4), 64)


def test_flags_and_smp_keys_fill_cp_comm_type(monkeypatch):
    from megatron_smp.training.arguments import parse_args, validate_configs

    monkeypatch.setenv("WORLD_SIZE", "4")
    base = ("--num-layers 1 --hidden-size 32 --num-attention-heads 4 --seq-length 32 "
            "--train-iters 1 --mock-data --tokenizer-type NullTokenizer --vocab-size 10 "
            "--attention-dropout 0").split()
    configs = parse_args(base + ["--context-parallel-size", "2", "--cp-comm-type", "a2a"])
    assert configs.model.cp_comm_type == "a2a" and configs.parallel.context_parallel_size == 2
    validate_configs(configs, world_size=4)
    configs = parse_args(base + ["--smp-config", '{"context_parallel_degree": 4, '
                                 '"cp_comm_type": "all_gather"}'])
    assert configs.model.cp_comm_type == "all_gather"
    assert configs.parallel.context_parallel_size == 4
    with pytest.raises(ConfigError, match="cp_comm_type must be one of p2p, all_gather, a2a"):
        parse_args(base + ["--smp-config", '{"cp_comm_type": "ring"}'])
    with pytest.raises(ConfigError, match="--reset-attention-mask .* needs --cp-comm-type all"):
        validate_configs(parse_args(base + ["--context-parallel-size", "2",
                                            "--reset-attention-mask"]), world_size=4)
