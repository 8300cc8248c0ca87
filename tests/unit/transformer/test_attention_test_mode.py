"""--test-mode (Megatron-LM's real-time test): every attention forward compares the q/k norm
weights of the data- and tensor-parallel replicas and stops on every rank of a group that
disagrees."""
import pytest

from megatron_smp.testing import run_distributed
from megatron_smp.training.arguments import parse_args

ARGV = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 16 "
        "--max-position-embeddings 16 --micro-batch-size 2 --train-iters 1 --mock-data "
        "--tokenizer-type NullTokenizer --vocab-size 128 --qk-layernorm --test-mode").split()


def _body(rank, world_size):
    import torch

    from megatron_smp.config import ParallelConfig, TransformerConfig
    from megatron_smp.parallel_state import build_parallel_state
    from megatron_smp.tensor_parallel.random import model_parallel_seed
    from megatron_smp.transformer.attention import SelfAttention

    outcome = {}
    for name, tp in (("TP", 2), ("DP", 1)):
        state = build_parallel_state(ParallelConfig(tensor_model_parallel_size=tp))
        model_parallel_seed(1, state)
        config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, vocab_size=128,
                                   max_position_embeddings=16,
                                   qk_layernorm=True, test_mode=True,
                                   sequence_parallel=False)
        torch.manual_seed(0)
        attention = SelfAttention(config, state)
        hidden = torch.randn(8, 2, 64)
        attention(hidden).sum().backward()  # equal replicas: the check passes
        if rank == 1:  # one replica's k norm bias silently changed
            with torch.no_grad():
                attention.k_layernorm.bias[3] += 1e-3
        try:
            attention(hidden)
            outcome[name] = None
        except RuntimeError as error:
            outcome[name] = str(error)
    return outcome


def test_test_mode_flag_and_a_corrupted_replica_stops_every_rank():
    configs = parse_args(ARGV)
    assert configs.model.test_mode and configs.model.qk_layernorm
    for rank, outcome in enumerate(run_distributed(_body, 2, timeout=120)):
        for parallelism in ("TP", "DP"):
            message = outcome[parallelism]
            assert message is not None and "--test-mode: discrepancy between k_b" in message
            assert f"in {parallelism} ranks {1 - rank} and {rank}" in message, message
