"""The trainer loss function at TP=2 (vocabulary-sharded logits), DP=2 (rollouts split over
ranks, gradients averaged as the data-parallel reduction does) and CP=2 (each packed row split
as the trainer splits it; dapo, and gspo whose sequence ratios sum over the ranks) gives the
single-process loss and gradient."""
import torch
import torch.distributed as dist

from megatron_smp.testing import run_distributed

VOCAB, HIDDEN = 40, 8


def _case(rank, world_size):
    from megatron_smp.post_training.grpo import weighted_grpo_loss
    from megatron_smp.post_training.rl_config import RLConfig
    from megatron_smp.post_training.rollouts import (build_rollout_batch, grpo_loss_fn,
                                                     rollout_weights)

    torch.manual_seed(0)  # every rank builds the same batch and weights
    prompts = [[1 + i, 2 + i, 3] for i in range(6)]
    completions = [[4 + (i * j) % 30 for j in range(1 + i % 4)] for i in range(6)]
    advantages = torch.randn(6).tolist()
    config = RLConfig(loss_type="dapo", clamp_eps_lower=0.2, clamp_eps_upper=0.28, kl_beta=0.05)
    batch = build_rollout_batch(prompts, completions, advantages, seq_length=8, pad_id=0,
                                loss_type="dapo", pack=False)
    features = torch.randn(batch["tokens"].shape + (HIDDEN,))
    weight = torch.randn(HIDDEN, VOCAB, requires_grad=True)
    with torch.no_grad():
        logps = torch.log_softmax(features @ weight, -1).gather(
            -1, batch["labels"][..., None])[..., 0]
    batch["old_logps"] = logps + 0.3 * torch.randn(logps.shape)
    batch["ref_logps"] = logps + 0.2 * torch.randn(logps.shape)

    # One process, the whole batch.
    current = torch.log_softmax(features @ weight, -1).gather(
        -1, batch["labels"][..., None])[..., 0]
    expected, _ = weighted_grpo_loss(
        current, batch["old_logps"], batch["advantages"], rollout_weights(batch),
        sequence_ids=batch["sequence_ids"], loss_type="dapo", clamp_eps_lower=0.2,
        clamp_eps_upper=0.28, ref_logps=batch["ref_logps"], kl_beta=0.05)
    expected_grad, = torch.autograd.grad(expected, weight)

    # TP=2: this rank holds half the vocabulary's columns.
    columns = slice(rank * VOCAB // 2, (rank + 1) * VOCAB // 2)
    shard = weight.detach()[:, columns].clone().requires_grad_(True)
    tp_loss, _ = grpo_loss_fn(config, dist.group.WORLD, VOCAB)(features @ shard, batch)
    tp_loss.backward()
    gathered = [torch.empty_like(shard.grad) for _ in range(world_size)]
    dist.all_gather(gathered, shard.grad)
    tp_grad = torch.cat(gathered, dim=1)

    # DP=2: this rank holds half the rollouts; loss_scale = dp_size; grads averaged.
    rows = slice(rank * 3, (rank + 1) * 3)
    replica = weight.detach().clone().requires_grad_(True)
    micro = {key: value[rows] for key, value in batch.items()}
    # Each rank is its own tensor-parallel group of one (new_group is collective: all ranks
    # make every group).
    own_group = [dist.new_group([r]) for r in range(world_size)][rank]
    dp_loss, _ = grpo_loss_fn(config, own_group, VOCAB, loss_scale=world_size)(
        features[rows] @ replica, micro)
    dp_loss.backward()
    dist.all_reduce(replica.grad)
    dp_total = dp_loss.detach().clone()
    dist.all_reduce(dp_total)
    # CP=2: each rank holds its share of every (packed) row, split as the trainer splits a
    # micro-batch; the logits of a token depend on the token only here (an embedding table),
    # so the attention's context-parallel exchange is not what is tested, the loss's sums are.
    from megatron_smp.context_parallel import get_batch_on_this_cp_rank

    errors = {}
    for loss_type in ("dapo", "gspo"):  # gspo: one ratio per rollout, from both ranks' tokens
        cp_config = RLConfig(loss_type=loss_type, clamp_eps_lower=0.2, clamp_eps_upper=0.28,
                             kl_beta=0.05)
        packed = build_rollout_batch(prompts, completions, advantages, seq_length=16, pad_id=0,
                                     loss_type=loss_type, pad_to_multiple=2 * world_size)
        table = torch.randn(VOCAB, HIDDEN)
        with torch.no_grad():
            packed_logps = torch.log_softmax(table[packed["tokens"]] @ weight, -1).gather(
                -1, packed["labels"][..., None])[..., 0]
        packed["old_logps"] = packed_logps + 0.3 * torch.randn(packed_logps.shape)
        packed["ref_logps"] = packed_logps + 0.2 * torch.randn(packed_logps.shape)
        whole, _ = grpo_loss_fn(cp_config, own_group, VOCAB)(
            table[packed["tokens"]] @ weight, packed)
        whole_grad, = torch.autograd.grad(whole, weight)
        local = get_batch_on_this_cp_rank(packed, world_size, rank)
        cp_replica = weight.detach().clone().requires_grad_(True)
        cp_loss, _ = grpo_loss_fn(cp_config, own_group, VOCAB, loss_scale=world_size,
                                  cp_group=dist.group.WORLD)(
            table[local["tokens"]] @ cp_replica, local)
        cp_loss.backward()
        dist.all_reduce(cp_replica.grad)
        cp_total = cp_loss.detach().clone()
        dist.all_reduce(cp_total)
        errors[f"{loss_type} cp_loss"] = abs(cp_total.item() / world_size - whole.item())
        errors[f"{loss_type} cp_grad"] = (cp_replica.grad / world_size - whole_grad).abs().max(
            ).item()
    return {**errors,
            "tp_loss": abs(tp_loss.item() - expected.item()),
            "tp_grad": (tp_grad - expected_grad).abs().max().item(),
            "dp_loss": abs(dp_total.item() / world_size - expected.item()),
            "dp_grad": (replica.grad / world_size - expected_grad).abs().max().item()}


def test_loss_fn_at_tp2_dp2_cp2_equals_one_process():
    for result in run_distributed(_case, 2):
        assert result["tp_loss"] < 1e-6 and result["tp_grad"] < 1e-6, result
        assert result["dp_loss"] < 1e-6 and result["dp_grad"] < 1e-6, result
        for loss_type in ("dapo", "gspo"):
            assert result[f"{loss_type} cp_loss"] < 1e-6, result
            assert result[f"{loss_type} cp_grad"] < 1e-6, result
