"""GRPO-family losses, advantages and the same-reward filter against TRL's GRPOTrainer.

TRL's own `GRPOTrainer._compute_loss` runs on a stand-in for the trainer object whose log-prob
function returns our tensors, so the value, the gradient and the metrics compared are TRL's.
"""
from collections import defaultdict
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megatron_smp.post_training.grpo import (group_advantages, groups_with_distinct_rewards,
                                             grpo_loss)

trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")

# float32 inputs, as in training; TRL and ours differ only by the order of float operations.
VALUE_TOLERANCE = 1e-6
GRAD_TOLERANCE = 1e-6
BATCH, LENGTH, MAX_COMPLETION_LENGTH = 6, 9, 12


class _Accelerator:
    num_processes = 1
    sync_gradients = True

    def gather(self, tensor):
        return tensor

    gather_for_metrics = gather

    def reduce(self, tensor, reduction="sum"):
        return tensor


def _rollouts(seed=0):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(BATCH, LENGTH, 11, generator=generator)
    tokens = torch.randint(0, 11, (BATCH, LENGTH), generator=generator)
    logps = torch.log_softmax(logits, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    # Spread enough that ratios leave [0.8, 1.28] on both sides, so clipping is exercised.
    old = logps + 0.3 * torch.randn(BATCH, LENGTH, generator=generator)
    ref = logps + 0.2 * torch.randn(BATCH, LENGTH, generator=generator)
    lengths = torch.tensor([9, 4, 1, 7, 9, 3])
    mask = (torch.arange(LENGTH).unsqueeze(0) < lengths.unsqueeze(1)).float()
    advantages = torch.tensor([1.2, -0.7, 0.4, -1.5, 0.0, 0.9])
    entropies = torch.distributions.Categorical(logits=logits).entropy()
    return logps, old, ref, advantages, mask, entropies


def _trl_loss(loss_type, logps, old, ref, advantages, mask, entropies, *, eps_low, eps_high,
              beta, entropy_coef, importance_sampling_level="token"):
    """TRL's _compute_loss on a stand-in trainer (one process, no accumulation, no vLLM)."""
    metrics = {"train": defaultdict(list)}
    trainer = SimpleNamespace(
        top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        importance_sampling_level=importance_sampling_level, beta=beta, loss_type=loss_type,
        epsilon_low=eps_low, epsilon_high=eps_high, use_vllm=False,
        args=SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1),
        model=SimpleNamespace(training=True), current_gradient_accumulation_steps=1,
        max_completion_length=MAX_COMPLETION_LENGTH, accelerator=_Accelerator(),
        _entropy_bonus_enabled=entropy_coef != 0.0, entropy_coef=entropy_coef,
        use_adaptive_entropy=False, aux_loss_enabled=False, _metrics=metrics,
        _get_per_token_logps_and_entropies=lambda *args, **kwargs: (logps, entropies, None))
    inputs = {
        "prompt_ids": torch.zeros(BATCH, 1, dtype=torch.long), "prompt_mask": torch.ones(BATCH, 1),
        "completion_ids": torch.zeros(BATCH, LENGTH, dtype=torch.long), "completion_mask": mask,
        "advantages": advantages, "old_per_token_logps": old, "ref_per_token_logps": ref,
        "num_items_in_batch": mask.sum(),
    }
    loss = trl_grpo.GRPOTrainer._compute_loss(trainer, None, inputs)
    return loss, {key: values[-1] for key, values in metrics["train"].items()}


CASES = [
    # (ours, TRL loss_type, TRL importance_sampling_level, eps_low, eps_high, beta, entropy)
    ("grpo", "grpo", "token", 0.2, 0.2, 0.0, 0.0),
    ("grpo", "grpo", "token", 0.2, 0.2, 0.04, 0.01),
    ("dapo", "dapo", "token", 0.2, 0.28, 0.0, 0.0),
    ("dapo", "dapo", "token", 0.2, 0.28, 0.04, 0.01),
    ("dr_grpo", "dr_grpo", "token", 0.2, 0.2, 0.0, 0.0),
    ("dr_grpo", "dr_grpo", "token", 0.2, 0.2, 0.04, 0.01),
    ("gspo", "grpo", "sequence", 3e-2, 4e-2, 0.0, 0.0),
    ("gspo", "grpo", "sequence", 3e-2, 4e-2, 0.04, 0.01),
]


@pytest.mark.parametrize("loss_type,trl_type,level,eps_low,eps_high,beta,entropy_coef", CASES)
def test_loss_value_gradient_and_metrics_equal_trl(loss_type, trl_type, level, eps_low, eps_high,
                                                   beta, entropy_coef):
    logps, old, ref, advantages, mask, entropies = _rollouts()
    ours_logps = logps.clone().requires_grad_(True)
    ours_entropies = entropies.clone().requires_grad_(True)
    loss, metrics = grpo_loss(ours_logps, old, advantages, mask, loss_type=loss_type,
                              clamp_eps_lower=eps_low, clamp_eps_upper=eps_high, ref_logps=ref,
                              kl_beta=beta, entropies=ours_entropies, entropy_weight=entropy_coef,
                              max_completion_length=MAX_COMPLETION_LENGTH)
    loss.backward()

    trl_logps = logps.clone().requires_grad_(True)
    trl_entropies = entropies.clone().requires_grad_(True)
    trl_loss, trl_metrics = _trl_loss(trl_type, trl_logps, old, ref, advantages, mask,
                                      trl_entropies, eps_low=eps_low, eps_high=eps_high,
                                      beta=beta, entropy_coef=entropy_coef,
                                      importance_sampling_level=level)
    trl_loss.backward()

    assert abs(loss.item() - trl_loss.item()) <= VALUE_TOLERANCE
    assert torch.allclose(ours_logps.grad, trl_logps.grad, atol=GRAD_TOLERANCE, rtol=0)
    assert ours_logps.grad.abs().max() > 1e-3  # the gradient is not trivially zero
    if entropy_coef:
        assert torch.allclose(ours_entropies.grad, trl_entropies.grad, atol=GRAD_TOLERANCE, rtol=0)
    for name in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
                 "entropy") + (("kl",) if beta else ()):
        assert abs(metrics[name].item() - trl_metrics[name]) <= 1e-6, name
    if loss_type != "gspo":
        # The inputs do clip on both sides, so these metrics are exercised, not just zero.
        assert metrics["clip_ratio/low_mean"] > 0 and metrics["clip_ratio/high_mean"] > 0
        assert metrics["clip_fraction"] >= metrics["clip_ratio/region_mean"]


def test_split_batch_with_global_counts_sums_to_whole_batch():
    """Micro-batches given the batch's token / sequence counts add up to the whole batch's loss
    and gradient, for every loss type (what the trainer relies on when it splits a batch)."""
    logps, old, ref, advantages, mask, entropies = _rollouts(seed=1)
    for loss_type in ("grpo", "dapo", "dr_grpo", "gspo"):
        kwargs = dict(loss_type=loss_type, clamp_eps_lower=0.2, clamp_eps_upper=0.28,
                      kl_beta=0.04, entropy_weight=0.01,
                      max_completion_length=MAX_COMPLETION_LENGTH)
        whole_logps = logps.clone().requires_grad_(True)
        whole, _ = grpo_loss(whole_logps, old, advantages, mask, ref_logps=ref,
                             entropies=entropies, **kwargs)
        whole.backward()
        parts_logps = logps.clone().requires_grad_(True)
        total = 0.0
        for rows in (slice(0, 2), slice(2, 6)):
            part, _ = grpo_loss(parts_logps[rows], old[rows], advantages[rows], mask[rows],
                                ref_logps=ref[rows], entropies=entropies[rows],
                                num_tokens_in_batch=mask.sum().item(),
                                num_sequences_in_batch=BATCH, **kwargs)
            total = total + part
        total.backward()
        assert abs(total.item() - whole.item()) < 1e-6, loss_type
        assert torch.allclose(parts_logps.grad, whole_logps.grad, atol=1e-7), loss_type


def test_megatron_per_token_form_with_token_mean():
    """dapo is Megatron-LM's train_rl.py loss: its calculate_grpo_loss per-token term
    -min(r A, clamp(r, 1-lo, 1+hi) A) + beta k3, summed over masked tokens / their count."""
    logps, old, ref, advantages, mask, _ = _rollouts(seed=2)
    ratio = (logps - old).exp()
    per_token = (-torch.min(ratio * advantages[:, None],
                            ratio.clamp(1 - 0.2, 1 + 0.28) * advantages[:, None])
                 + 0.04 * ((ref - logps).exp() - (ref - logps) - 1))
    expected = (per_token * mask).sum() / mask.sum()
    loss, metrics = grpo_loss(logps, old, advantages, mask, loss_type="dapo",
                              clamp_eps_lower=0.2, clamp_eps_upper=0.28, ref_logps=ref,
                              kl_beta=0.04)
    assert abs(loss.item() - expected.item()) < 1e-7
    outside = ((ratio > 1.28) | (ratio < 0.8)).float()
    expected_fraction = ((outside * mask).sum() / mask.sum()).item()
    assert abs(metrics["clip_fraction"].item() - expected_fraction) < 1e-7


def test_on_policy_first_iteration_gradient_is_policy_gradient():
    """With old = current (the first of --grpo-iterations) and no KL, the gradient of the grpo
    loss is -A / |o_i| / B per response token: the plain policy gradient, clipping inactive."""
    logps, _, _, advantages, mask, _ = _rollouts(seed=3)
    current = logps.clone().requires_grad_(True)
    loss, metrics = grpo_loss(current, logps, advantages, mask, loss_type="grpo")
    loss.backward()
    expected = -advantages[:, None] * mask / mask.sum(-1, keepdim=True) / BATCH
    assert torch.allclose(current.grad, expected, atol=1e-7)
    assert metrics["clip_fraction"].item() == 0.0


def test_loss_errors_name_what_is_missing():
    logps, old, ref, advantages, mask, _ = _rollouts()
    with pytest.raises(ValueError, match="unknown loss_type 'ppo'"):
        grpo_loss(logps, old, advantages, mask, loss_type="ppo")
    with pytest.raises(ValueError, match="kl_beta != 0 needs ref_logps"):
        grpo_loss(logps, old, advantages, mask, kl_beta=0.1)
    with pytest.raises(ValueError, match="entropy_weight != 0 needs entropies"):
        grpo_loss(logps, old, advantages, mask, entropy_weight=0.1)
    with pytest.raises(ValueError, match="needs max_completion_length"):
        grpo_loss(logps, old, advantages, mask, loss_type="dr_grpo")
    with pytest.raises(ValueError, match="old_logps has shape"):
        grpo_loss(logps, old[:, :3], advantages, mask)


REWARDS = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5], [0.0, 0.2, 0.9, 0.3]])


def test_group_advantages_equal_trl_and_megatron():
    from trl.trainer.utils import nanstd

    # TRL (scale_rewards="group"): Bessel-corrected std, epsilon 1e-4.
    trl = (REWARDS - REWARDS.mean(1, keepdim=True)) / (nanstd(REWARDS, dim=1).unsqueeze(1) + 1e-4)
    assert torch.allclose(group_advantages(REWARDS, "group", unbiased_std=True), trl, atol=1e-6)
    # TRL scale_rewards="batch": the whole batch's std.
    trl_batch = (REWARDS - REWARDS.mean(1, keepdim=True)) / (nanstd(REWARDS) + 1e-4)
    assert torch.allclose(group_advantages(REWARDS, "batch", unbiased_std=True), trl_batch,
                          atol=1e-6)
    # Megatron-LM's calculate_grpo_advantages: population std, epsilon 1e-4.
    rewards = REWARDS.double().numpy()
    megatron = (rewards - rewards.mean(-1, keepdims=True)) / (1e-4 + rewards.std(-1, keepdims=True))
    assert np.allclose(group_advantages(REWARDS.double()).numpy(), megatron, atol=1e-12)
    # Dr. GRPO: no std; the all-equal group gets zero advantages in every mode.
    no_std = group_advantages(REWARDS, "none")
    assert torch.allclose(no_std, REWARDS - REWARDS.mean(1, keepdim=True))
    for scale in ("group", "batch", "none"):
        assert group_advantages(REWARDS, scale)[1].abs().max() == 0


def test_groups_with_distinct_rewards_drops_all_equal_groups():
    keep = groups_with_distinct_rewards(REWARDS)
    assert keep.tolist() == [True, False, True]
    assert groups_with_distinct_rewards(torch.zeros(2, 3)).tolist() == [False, False]
    with pytest.raises(ValueError, match="num_groups, group_size"):
        groups_with_distinct_rewards(torch.zeros(4))
    with pytest.raises(ValueError, match="scale_rewards 'std'"):
        group_advantages(REWARDS, "std")
