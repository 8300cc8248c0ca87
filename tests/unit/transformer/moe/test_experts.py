"""MoEExperts: torch._grouped_mm (--moe-grouped-gemm) gives the per-expert loop's outputs and
grads, falls back to the loop where the op cannot run, and empty experts are fine."""
from types import SimpleNamespace

import pytest
import torch

from megatron_smp.models.llama import llama_config
from megatron_smp.transformer.moe.experts import MoEExperts, grouped_gemm_supported

STATE = SimpleNamespace(tp_group=None, tp_size=1, etp_group=None, etp_rank=0, etp_size=1)


def _experts(hidden, ffn, grouped, bias=False):
    config = llama_config(num_layers=1, hidden_size=hidden, num_attention_heads=2, vocab_size=10,
                          num_moe_experts=4, moe_ffn_hidden_size=ffn, moe_grouped_gemm=grouped,
                          add_bias_linear=bias)
    torch.manual_seed(0)
    return MoEExperts(config, STATE, num_local_experts=4, expert_offset=0)


@pytest.mark.parametrize("bias", [False, True])
def test_grouped_gemm_matches_the_loop(bias):
    if not grouped_gemm_supported(torch.float32, 16, 48, 24):
        pytest.skip("torch._grouped_mm is not in this torch build")
    counts = [5, 0, 7, 3]  # an expert without tokens too
    tokens = torch.randn(sum(counts), 16)
    results = []
    for grouped in (False, True):
        experts = _experts(16, 24, grouped, bias)
        x = tokens.clone().requires_grad_()
        out = experts(x, counts)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        results.append((out.detach(), x.grad, [p.grad for p in experts.parameters()]))
    (loop_out, loop_dx, loop_grads), (gmm_out, gmm_dx, gmm_grads) = results
    torch.testing.assert_close(gmm_out, loop_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gmm_dx, loop_dx, rtol=1e-5, atol=1e-6)
    for a, b in zip(gmm_grads, loop_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_unaligned_shapes_fall_back_to_the_loop(monkeypatch):
    """--moe-grouped-gemm with 60-byte rows (torch._grouped_mm needs 16-byte alignment) runs
    the per-expert loop, which gives each expert's SwiGLU MLP of its own rows."""
    assert not grouped_gemm_supported(torch.float32, 15)  # 60-byte rows
    counts = [2, 3, 0, 3]
    tokens = torch.randn(8, 15)
    experts = _experts(15, 6, True)
    monkeypatch.setattr(experts, "_grouped_forward", lambda *args: pytest.fail("grouped path"))
    output = experts(tokens, counts)
    expected, start = [], 0
    for expert, count in zip(experts.local_experts, counts):
        rows = tokens[start:start + count]
        start += count
        gate, up = (rows @ expert.linear_fc1.weight.t()).chunk(2, dim=-1)
        expected.append((torch.nn.functional.silu(gate) * up) @ expert.linear_fc2.weight.t())
    torch.testing.assert_close(output, torch.cat(expected), rtol=1e-6, atol=1e-6)


def test_expert_params_are_marked_with_their_global_index():
    config = llama_config(num_layers=1, hidden_size=8, num_attention_heads=2, vocab_size=10,
                          num_moe_experts=8, moe_ffn_hidden_size=8)
    torch.manual_seed(0)
    experts = MoEExperts(config, STATE, num_local_experts=2, expert_offset=6)
    weight = experts.local_experts[1].linear_fc1.weight
    assert weight.allreduce is False
    assert weight.expert_checkpoint_rename == (".local_experts.1.", ".local_experts.7.")
    # Expert 7's weights do not depend on which rank builds it.
    torch.manual_seed(0)
    alone = MoEExperts(config, STATE, num_local_experts=8, expert_offset=0)
    torch.testing.assert_close(alone.local_experts[7].linear_fc1.weight, weight)


def test_moe_layer_exposes_per_expert_token_counts():
    from megatron_smp.config import ParallelConfig
    from megatron_smp.parallel_state import build_parallel_state
    from megatron_smp.transformer.moe.moe_layer import MoELayer

    config = llama_config(num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=10,
                          num_moe_experts=4, moe_ffn_hidden_size=8, moe_router_topk=2)
    torch.manual_seed(0)
    layer = MoELayer(config, build_parallel_state(ParallelConfig()))
    hidden = torch.randn(6, 3, 16)
    layer(hidden)
    counts = layer.last_tokens_per_expert
    assert counts.shape == (4,) and int(counts.sum()) == 6 * 3 * 2  # dropless, top-2
    probs, routing_map = layer.router(hidden)
    assert torch.equal(counts, routing_map.sum(0))
