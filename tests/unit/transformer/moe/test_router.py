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
    hidden = torch.randn(10, 1, 16, generator=torch.Generator().manual_seed(3))
    hidden[:, :, 0] = 5.0
    with torch.no_grad():  # every token prefers expert 0 by a wide margin
        router.weight[:, 0] = 0.0
        router.weight[0, 0] = 1.0
    probs, routing_map = router(hidden)
    # Independently: Sinkhorn-Knopp balances exp(logits) by alternating column and row
    # normalisation; the row scales do not change a row's top-k, the column scales do.
    logits = (hidden[:, 0] @ router.weight.detach().t()).double()
    balanced = logits.exp()
    for _ in range(2000):
        balanced = balanced / balanced.sum(0, keepdim=True)
        balanced = balanced / balanced.sum(1, keepdim=True)
    expected = torch.zeros(10, 4, dtype=torch.bool).scatter(
        1, balanced.topk(2, dim=1).indices, True)
    plain = torch.zeros(10, 4, dtype=torch.bool).scatter(1, logits.topk(2, dim=1).indices, True)
    assert plain[:, 0].all() and not expected[:, 0].all()  # balancing changes the routing
    assert torch.equal(routing_map, expected)
    torch.testing.assert_close(probs, torch.softmax(logits.float(), dim=-1) * expected)


def _hf_deepseek_router(weight, bias, topk, groups, group_topk, scaling):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = DeepseekV3Config(hidden_size=16, n_routed_experts=weight.shape[0],
                              num_experts_per_tok=topk, n_group=groups, topk_group=group_topk,
                              routed_scaling_factor=scaling, norm_topk_prob=True)
    hf = DeepseekV3TopkRouter(config)
    with torch.no_grad():
        hf.weight.copy_(weight)
        hf.e_score_correction_bias.copy_(bias)
    return hf


def test_sigmoid_group_limited_biased_routing_equals_hf_deepseek_v3():
    """DeepSeek-V3's gate: sigmoid scores, choice on scores + bias within the best groups,
    the unbiased scores of the chosen experts renormalised and scaled."""
    router = _router(num_moe_experts=8, moe_router_topk=4, moe_router_score_function="sigmoid",
                     moe_router_enable_expert_bias=True, moe_router_num_groups=4,
                     moe_router_group_topk=2, moe_router_topk_scaling_factor=2.5)
    bias = torch.randn(8) * 0.3  # large enough to change choices
    router.expert_bias.copy_(bias)
    hidden = torch.randn(7, 3, 16)
    probs, routing_map = router(hidden)
    hf = _hf_deepseek_router(router.weight.detach(), bias, 4, 4, 2, 2.5)
    _, weights, indices = hf(hidden)
    hf_map = torch.zeros(21, 8, dtype=torch.bool).scatter(1, indices, True)
    assert torch.equal(routing_map, hf_map)
    hf_probs = torch.zeros(21, 8).scatter(1, indices, weights)
    torch.testing.assert_close(probs, hf_probs, rtol=1e-6, atol=1e-7)
    # The bias changed decisions (the test would not see it otherwise), and the counts for
    # the update are accumulated in training.
    unbiased = _hf_deepseek_router(router.weight.detach(), torch.zeros(8), 4, 4, 2, 2.5)
    assert not torch.equal(torch.zeros(21, 8, dtype=torch.bool).scatter(
        1, unbiased(hidden)[2], True), hf_map)
    assert torch.equal(router.local_tokens_per_expert, hf_map.sum(0).float())
    assert "expert_bias" in router.state_dict()
    assert "local_tokens_per_expert" not in router.state_dict()


def test_seq_aux_loss_with_sigmoid_scores_is_deepseek_v3s():
    """Sequence-wise loss on sigmoid scores normalised over the experts (DeepSeek-V3 eq. 17-20):
    E/(k s) counts per sequence . mean normalised score, averaged over sequences."""
    router = _router(moe_aux_loss_coeff=1.0, moe_router_load_balancing_type="seq_aux_loss",
                     moe_router_score_function="sigmoid")
    hidden = torch.randn(5, 2, 16)
    router(hidden)
    scores = torch.sigmoid(hidden @ router.weight.detach().t())
    scores = scores / scores.sum(-1, keepdim=True)
    top = torch.topk(scores, 2, dim=-1).indices
    losses = []
    for b in range(2):
        counts = torch.zeros(4).scatter_add(0, top[:, b].flatten(), torch.ones(10))
        losses.append((counts * 4 / (5 * 2) * scores[:, b].mean(0)).sum())
    expected = torch.stack(losses).mean()
    assert router.metrics["load_balancing_loss"].item() == pytest.approx(expected.item(), rel=1e-6)


def test_router_dtype_computes_logits_in_fp32():
    """--moe-router-dtype fp32 with bf16 params: the logits (hence choices and probs) are the
    fp32 product of the bf16 values, not the bf16 product."""
    router = _router(moe_router_dtype="fp32", params_dtype=torch.bfloat16, bf16=True)
    hidden = torch.randn(16, 2, 16).to(torch.bfloat16)
    probs, _ = router(hidden)
    logits32 = hidden.reshape(-1, 16).float() @ router.weight.detach().float().t()
    torch.testing.assert_close(probs, topk_routing(logits32, 2)[0], rtol=1e-6, atol=1e-7)
    plain = _router(params_dtype=torch.bfloat16, bf16=True)
    with torch.no_grad():
        plain.weight.copy_(router.weight)
    assert not torch.equal(plain(hidden)[0], probs)


def test_expert_bias_update_is_megatrons_formula():
    from megatron_smp.transformer.moe import update_expert_bias

    router = _router(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                     moe_router_bias_update_rate=0.05)
    router.expert_bias.copy_(torch.tensor([0.1, 0.0, -0.2, 0.0]))
    router.local_tokens_per_expert.copy_(torch.tensor([5.0, 3.0, 3.0, 1.0]))  # mean 3
    update_expert_bias([router], router.config, STATE_GROUPS)
    torch.testing.assert_close(router.expert_bias, torch.tensor([0.05, 0.0, -0.2, 0.05]))
    assert not router.local_tokens_per_expert.any()


STATE_GROUPS = SimpleNamespace(tp_group=None, dp_cp_group=None)


@pytest.mark.parametrize("settings, message", [
    (dict(moe_router_enable_expert_bias=True), "needs --moe-router-score-function sigmoid"),
    (dict(moe_router_num_groups=3, moe_router_group_topk=1), "must divide --num-experts"),
    (dict(moe_router_num_groups=2), "go together"),
    (dict(moe_router_num_groups=2, moe_router_group_topk=3), "between 1 and"),
    (dict(moe_router_score_function="sigmoid", moe_router_load_balancing_type="sinkhorn"),
     "sinkhorn"),
])
def test_router_flag_errors(settings, message):
    from megatron_smp.config import ConfigError, ParallelConfig

    config = llama_config(num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=10,
                          num_moe_experts=4, moe_router_topk=2, **settings)
    with pytest.raises(ConfigError, match=message):
        config.validate(ParallelConfig())


def _global_aux_loss_body(rank, world_size):
    """DP=2: two micro-batches with different inputs per rank; returns what the direct
    computation needs and what the router produced."""
    import torch.distributed as dist

    from megatron_smp.config import ParallelConfig
    from megatron_smp.parallel_state import build_parallel_state
    from megatron_smp.transformer.moe.training import moe_metrics, reset_global_aux_loss

    state = build_parallel_state(ParallelConfig())
    config = llama_config(num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=10,
                          num_moe_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.1,
                          moe_router_load_balancing_type="global_aux_loss")
    torch.manual_seed(0)
    router = TopKRouter(config, state).train()
    torch.manual_seed(10 + rank)
    # Rank 1's tokens lean towards expert 0: the ranks' counts differ.
    bias = torch.zeros(16) if rank == 0 else 3.0 * router.weight.detach()[0]
    hiddens = [torch.randn(5, 2, 16) + bias for _ in range(2)]
    for hidden in hiddens:
        probs, _ = router(hidden)
        (probs * 0).sum().backward()  # only the attached loss's gradient (scale 1)
    # Plain lists: tensors would travel as shared memory the exiting child takes along.
    out = dict(hiddens=[h.tolist() for h in hiddens], weight=router.weight.tolist(),
               grad=router.weight.grad.tolist(),
               metric=router.metrics["global_load_balancing_loss"].item(),
               ga_steps=router.ga_steps.item())
    out["logged"] = moe_metrics([router], config, state, 2)["global_load_balancing_loss"].item()
    reset_global_aux_loss([router])
    out["after_reset"] = (router.ga_steps.item(),
                          router.global_tokens_per_expert.abs().sum().item())
    dist.barrier()
    return out


def test_global_aux_loss_uses_counts_summed_over_data_parallel_ranks_and_micro_batches():
    from megatron_smp.testing import run_distributed

    results = run_distributed(_global_aux_loss_body, 2, timeout=120)
    coeff, experts, topk = 0.1, 4, 2

    def scores_and_counts(hidden, weight):
        scores = torch.softmax(hidden.reshape(-1, 16) @ weight.t(), dim=-1)
        top = torch.topk(scores, topk, dim=-1).indices
        counts = torch.zeros(experts).scatter_add(0, top.flatten(), torch.ones(top.numel()))
        return scores, counts

    for result in results:
        result["hiddens"] = [torch.tensor(h) for h in result["hiddens"]]
    weight = torch.tensor(results[0]["weight"])
    counts = [[scores_and_counts(h, weight)[1] for h in r["hiddens"]] for r in results]
    assert not torch.equal(counts[0][0], counts[1][0])  # the all-reduce matters
    global_counts = [counts[0][m] + counts[1][m] for m in range(2)]
    averaged = [global_counts[0], (global_counts[0] + global_counts[1]) / 2]
    tokens = 10 * 2  # global tokens per micro-batch
    total_metric = 0.0
    for rank, result in enumerate(results):
        assert result["ga_steps"] == 2
        w = weight.clone().requires_grad_()
        loss = local = 0.0
        for m, hidden in enumerate(result["hiddens"]):
            scores, _ = scores_and_counts(hidden, w)
            loss = loss + coeff * experts / (topk * tokens ** 2) * (scores.sum(0) * averaged[m]).sum()
            local = local + experts / (topk * 10 ** 2) * (scores.sum(0) * counts[rank][m]).sum()
        loss.backward()
        assert result["metric"] == pytest.approx(loss.item() / coeff, rel=1e-6)
        torch.testing.assert_close(torch.tensor(result["grad"]), w.grad, rtol=1e-6, atol=1e-9)
        assert w.grad.abs().sum() > 0
        # aux_loss (this rank's counts and tokens) gives a different value.
        assert abs(local.item() - result["metric"]) > 1e-3
        total_metric += loss.item() / coeff
        assert result["after_reset"] == (0.0, 0.0)
    # Logged: the ranks' shares summed (no average over dp), per micro-batch.
    for result in results:
        assert result["logged"] == pytest.approx(total_metric / 2, rel=1e-6)
