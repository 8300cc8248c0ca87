"""TopKRouter: the losses equal a direct computation (and HF Mixtral's), the aux-loss autograd
scaling, and capacity dropping equal to a per-expert reference of each drop policy."""
import math
from types import SimpleNamespace

import pytest
import torch

from megatron_smp.models.llama import llama_config
from megatron_smp.transformer.moe.moe_utils import apply_capacity, topk_routing
from megatron_smp.transformer.moe.router import TopKRouter

STATE = SimpleNamespace(tp_group=None, tp_size=1, cp_size=1)  # one process, no groups


def _router(**moe):
    settings = dict(num_moe_experts=4, moe_router_topk=2)
    settings.update(moe)
    config = llama_config(num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=10,
                          **settings)
    torch.manual_seed(0)
    return TopKRouter(config, STATE).train()


def test_aux_and_z_loss_equal_direct_computation_and_hf():
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    router = _router(moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01)
    hidden = torch.randn(6, 3, 16)
    router(hidden)
    logits = hidden.reshape(-1, 16) @ router.weight.detach().t()
    scores = torch.softmax(logits, dim=-1)
    top = torch.topk(scores, 2, dim=-1).indices
    counts = torch.zeros(4).scatter_add(0, top.flatten(), torch.ones(top.numel()))
    tokens = logits.shape[0]
    # Switch loss, Megatron's normalisation: E / (k T^2) sum_e P_e counts_e.
    direct = 4 / (2 * tokens * tokens) * (scores.sum(0) * counts).sum()
    assert router.metrics["load_balancing_loss"].item() == pytest.approx(direct.item(), rel=1e-6)
    hf = load_balancing_loss_func((logits,), num_experts=4, top_k=2)
    assert hf.item() == pytest.approx(2 * direct.item(), rel=1e-6)  # HF's = top-k x ours
    z = torch.logsumexp(logits, dim=-1).square().mean()
    assert router.metrics["z_loss"].item() == pytest.approx(z.item(), rel=1e-6)


def test_seq_aux_loss_is_per_sequence():
    router = _router(moe_aux_loss_coeff=1.0, moe_router_load_balancing_type="seq_aux_loss")
    hidden = torch.randn(5, 2, 16)  # [s, b, h]
    router(hidden)
    logits = (hidden @ router.weight.detach().t())  # [s, b, E]
    scores = torch.softmax(logits, dim=-1)
    top = torch.topk(scores, 2, dim=-1).indices
    losses = []
    for b in range(2):
        counts = torch.zeros(4).scatter_add(0, top[:, b].flatten(), torch.ones(10))
        losses.append((counts * 4 / (5 * 2) * scores[:, b].mean(0)).sum())
    expected = torch.stack(losses).mean()
    assert router.metrics["load_balancing_loss"].item() == pytest.approx(expected.item(), rel=1e-6)


def test_aux_losses_enter_backward_with_the_loop_scale():
    """grad of sum(probs * w) with aux losses attached = grad of it + scale * (aux + z)."""
    router = _router(moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01)
    router.aux_loss_scale.fill_(0.25)
    hidden = torch.randn(8, 1, 16)
    weights = torch.randn(8, 4)
    probs, _ = router(hidden)
    (probs * weights).sum().backward()
    got = router.weight.grad.clone()

    weight = router.weight.detach().clone().requires_grad_()
    logits = hidden.reshape(-1, 16) @ weight.t()
    plain, _ = topk_routing(logits, 2)
    scores = torch.softmax(logits, dim=-1)
    top = torch.topk(scores, 2, dim=-1).indices
    counts = torch.zeros(4).scatter_add(0, top.flatten(), torch.ones(top.numel()))
    aux = 0.1 * 4 / (2 * 64) * (scores.sum(0) * counts).sum()
    z = 0.01 * torch.logsumexp(logits, dim=-1).square().mean()
    ((plain * weights).sum() + 0.25 * (aux + z)).backward()
    torch.testing.assert_close(got, weight.grad, rtol=1e-5, atol=1e-7)


def _reference_capacity(probs, routing_map, capacity, policy, pad):
    """Per expert: the routed tokens ranked by probability (or position), first `capacity`
    kept; with `pad`, the next tokens by the same order fill the rest with probability 0."""
    keep = torch.zeros_like(routing_map)
    tokens = probs.shape[0]
    for expert in range(probs.shape[1]):
        routed = [t for t in range(tokens) if routing_map[t, expert]]
        if policy == "probs":
            routed.sort(key=lambda t: -probs[t, expert].item())
        chosen = routed[:capacity]
        if pad:
            others = [t for t in range(tokens) if not routing_map[t, expert]]
            chosen += others[: capacity - len(chosen)]
        keep[chosen, expert] = True
    return keep


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("pad", [False, True])
def test_capacity_drops_exactly_the_reference_tokens(policy, pad):
    torch.manual_seed(1)
    tokens, experts, topk, factor = 24, 4, 2, 0.5
    logits = torch.randn(tokens, experts)
    logits[:, 0] += 2.0  # overload expert 0
    probs, routing_map = topk_routing(logits, topk)
    capacity = math.ceil(tokens * topk / experts * factor)
    final_probs, final_map = apply_capacity(probs, routing_map, topk, factor, policy, pad)
    reference = _reference_capacity(probs, routing_map, capacity, policy, pad)
    if pad:
        # Padding rows beyond the routed ones are any unrouted tokens under "probs" (all of
        # probability 0); compare the routed tokens kept, and the row count.
        assert final_map.sum(0).tolist() == [capacity] * experts
        assert torch.equal(final_map & routing_map, reference & routing_map)
        if policy == "position":
            assert torch.equal(final_map, reference)
    else:
        assert torch.equal(final_map, reference)
    assert routing_map[:, 0].sum() > capacity  # something was dropped
    torch.testing.assert_close(final_probs, probs * (final_map & routing_map))


def test_pre_softmax_and_sinkhorn_routing():
    logits = torch.randn(10, 4)
    probs, routing_map = topk_routing(logits, 2, pre_softmax=True)
    full = torch.softmax(logits, dim=-1)
    torch.testing.assert_close(probs, full * routing_map)
    router = _router(moe_router_load_balancing_type="sinkhorn")
    probs, routing_map = router(torch.randn(10, 1, 16))
    assert routing_map.sum(1).tolist() == [2] * 10
    assert torch.all((probs > 0) == routing_map)
