"""Rollouts to a training batch: packed rows give the loss and gradient of one rollout per
row; slices of the batch (micro-batches) add up; advantages with DAPO's filter."""
import pytest
import torch

from megatron_smp.post_training.grpo import GRPO_LOSS_TYPES, grpo_loss, weighted_grpo_loss
from megatron_smp.post_training.rollouts import (build_rollout_batch, rollout_advantages,
                                                 rollout_metrics, rollout_weights)

SEQ_LENGTH, MAX_COMPLETION, PAD = 16, 6, 0
OPTIONS = dict(clamp_eps_lower=0.2, clamp_eps_upper=0.28, kl_beta=0.04, entropy_weight=0.01)


def _rollouts(seed=0, count=8):
    generator = torch.Generator().manual_seed(seed)
    prompts, completions = [], []
    for _ in range(count):
        p = int(torch.randint(1, 6, (1,), generator=generator))
        c = int(torch.randint(1, MAX_COMPLETION + 1, (1,), generator=generator))
        prompts.append(torch.randint(1, 50, (p,), generator=generator).tolist())
        completions.append(torch.randint(1, 50, (c,), generator=generator).tolist())
    # One leaf tensor per rollout per quantity: both layouts read the same values and their
    # gradients land on the same leaves.
    def per_completion(scale, grad=False):
        return [(scale * torch.randn(len(c), generator=generator) - 1.0).requires_grad_(grad)
                for c in completions]
    logps = per_completion(0.5, grad=True)
    old = [(x.detach() + 0.3 * torch.randn(x.shape, generator=generator)) for x in logps]
    ref = [(x.detach() + 0.2 * torch.randn(x.shape, generator=generator)) for x in logps]
    entropies = [torch.rand(len(c), generator=generator).requires_grad_(True) for c in completions]
    advantages = torch.randn(count, generator=generator).tolist()
    return prompts, completions, advantages, logps, old, ref, entropies


def _unpacked(values):
    out = torch.zeros(len(values), MAX_COMPLETION)
    for i, v in enumerate(values):
        out = out.index_put((torch.tensor([i] * len(v)), torch.arange(len(v))), v)
    return out


def _scatter(batch, values):
    """Per-rollout completion values at the batch's trained label positions."""
    out = torch.zeros(batch["loss_mask"].shape)
    for index, value in enumerate(values):
        where = ((batch["sequence_ids"] == index) & (batch["loss_mask"] > 0)).nonzero(as_tuple=True)
        out = out.index_put(where, value)
    return out


@pytest.mark.parametrize("loss_type", GRPO_LOSS_TYPES)
def test_packed_batch_equals_one_rollout_per_row(loss_type):
    prompts, completions, advantages, logps, old, ref, entropies = _rollouts()
    mask = _unpacked([torch.ones(len(c)) for c in completions])
    expected, expected_metrics = grpo_loss(
        _unpacked(logps), _unpacked(old), torch.tensor(advantages), mask, loss_type=loss_type,
        ref_logps=_unpacked(ref), entropies=_unpacked(entropies),
        max_completion_length=MAX_COMPLETION, **OPTIONS)
    expected_grads = torch.autograd.grad(expected, logps + entropies)

    batch = build_rollout_batch(prompts, completions, advantages, seq_length=SEQ_LENGTH,
                                pad_id=PAD, loss_type=loss_type,
                                max_completion_length=MAX_COMPLETION, pack=True)
    assert batch["tokens"].shape[0] < len(prompts)  # rows really are shared
    loss, metrics = weighted_grpo_loss(
        _scatter(batch, logps), _scatter(batch, old), batch["advantages"], rollout_weights(batch),
        sequence_ids=batch["sequence_ids"], loss_type=loss_type, ref_logps=_scatter(batch, ref),
        entropies=_scatter(batch, entropies), **OPTIONS)
    grads = torch.autograd.grad(loss, logps + entropies)
    assert abs(loss.item() - expected.item()) < 1e-6
    for ours, theirs in zip(grads, expected_grads):
        assert torch.allclose(ours, theirs, atol=1e-7)
    for name, value in expected_metrics.items():
        assert abs(metrics[name].item() - value.item()) < 1e-6, name

    # Micro-batches of whole rows add up to the batch (the weights carry the global counts).
    total = sum(weighted_grpo_loss(
        _scatter(batch, logps)[rows], _scatter(batch, old)[rows], batch["advantages"][rows],
        {k: v[rows] for k, v in rollout_weights(batch).items()},
        sequence_ids=batch["sequence_ids"][rows], loss_type=loss_type,
        ref_logps=_scatter(batch, ref)[rows], entropies=_scatter(batch, entropies)[rows],
        **OPTIONS)[0] for rows in (slice(0, 1), slice(1, None)))
    assert abs(total.item() - loss.item()) < 1e-6


def test_batch_layout_tokens_labels_masks():
    batch = build_rollout_batch([[5, 6, 7], [8]], [[9, 10], [11, 12, 13]], [0.5, -1.0],
                                seq_length=8, pad_id=PAD, loss_type="dapo", pack=False)
    # Rollout 0 = 5 6 7 9 10: 4 positions, labels 9 and 10 are trained.
    assert batch["tokens"][0].tolist() == [5, 6, 7, 9, 0, 0, 0, 0]
    assert batch["labels"][0].tolist() == [6, 7, 9, 10, 0, 0, 0, 0]
    assert batch["loss_mask"][0].tolist() == [0, 0, 1, 1, 0, 0, 0, 0]
    assert batch["loss_mask"][1].tolist() == [1, 1, 1, 0, 0, 0, 0, 0]
    assert batch["advantages"][1, :3].tolist() == [-1.0] * 3
    assert batch["document_ids"][0].tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    # dapo: every trained token weighs 1 / (5 completion tokens).
    assert torch.allclose(batch["loss_weight"].sum(), torch.tensor(1.0, dtype=torch.float64))
    packed = build_rollout_batch([[5, 6, 7], [8]], [[9, 10], [11, 12, 13]], [0.5, -1.0],
                                 seq_length=8, pad_id=PAD, loss_type="grpo", pack=True)
    assert packed["tokens"].shape == (1, 8)
    assert packed["position_ids"][0].tolist() == [0, 1, 2, 3, 0, 1, 2, 0]
    assert packed["document_ids"][0].tolist() == [0, 0, 0, 0, 1, 1, 1, 2]
    # Context parallelism: each rollout's slot is a multiple of 2 x CP = 4 positions.
    padded = build_rollout_batch([[5, 6, 7], [8]], [[9, 10], [11, 12, 13]], [0.5, -1.0],
                                 seq_length=8, pad_id=PAD, loss_type="grpo", pad_to_multiple=4)
    assert padded["document_ids"][0].tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert padded["loss_mask"][0].tolist() == [0, 0, 1, 1, 1, 1, 1, 0]
    assert padded["position_ids"][0].tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    with pytest.raises(ValueError, match="rollout 0 needs 9 positions, more than --seq-length 8"):
        build_rollout_batch([[1] * 5], [[2] * 5], [0.0], seq_length=8, pad_id=PAD,
                            loss_type="grpo")


def test_rollout_advantages_filter_groups_with_same_reward():
    rewards = [1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.5]
    advantages, kept = rollout_advantages(rewards, group_size=3)
    assert kept == list(range(9)) and advantages[3:6].abs().max() == 0
    filtered, kept = rollout_advantages(rewards, group_size=3, filter_groups_with_same_reward=True)
    assert kept == [0, 1, 2, 6, 7, 8]
    assert torch.equal(filtered, advantages[kept])
    no_std, _ = rollout_advantages(rewards, group_size=3, scale_rewards="none")
    assert torch.allclose(no_std[:3], torch.tensor([1 / 3, -2 / 3, 1 / 3], dtype=torch.float64))
    with pytest.raises(ValueError, match="do not split into groups of --grpo-group-size 4"):
        rollout_advantages(rewards, group_size=4)


def test_rollout_metrics_under_trl_names():
    from trl.trainer.utils import nanstd

    rewards = [1.0, 0.0, 1.0, 1.0, 1.0, 1.0]
    per_function = [{"exact": r, "len": 0.1 * i} for i, r in enumerate(rewards[:4])] + \
        [{"exact": 1.0}, {"exact": 1.0}]
    metrics = rollout_metrics(rewards, per_function, [3, 5, 4, 2, 6, 1], group_size=3,
                              truncated=[False, True, False, False, False, False])
    values = torch.tensor(rewards)
    assert metrics["reward"] == pytest.approx(values.mean().item())
    assert metrics["reward_std"] == pytest.approx(nanstd(values).item())  # TRL's reward_std
    assert metrics["frac_reward_zero_std"] == 0.5
    assert metrics["rewards/len/mean"] == pytest.approx(0.15)  # only the rollouts it scored
    assert metrics["rewards/exact/mean"] == pytest.approx(5 / 6)
    assert (metrics["completions/mean_length"], metrics["completions/min_length"],
            metrics["completions/max_length"]) == (3.5, 1.0, 6.0)
    assert metrics["completions/clipped_ratio"] == pytest.approx(1 / 6)


def test_trainer_loss_fn_on_micro_batches_gives_the_whole_batch_gradient():
    """grpo_loss_fn with loss_scale = num_microbatches: the schedule's 1 / num_microbatches
    per micro-batch backward adds up to the gradient of the whole batch's loss; with
    --grpo-entropy-term-weight its entropy bonus is the logits' own entropy."""
    from megatron_smp.post_training.rl_config import RLConfig
    from megatron_smp.post_training.rollouts import grpo_loss_fn

    prompts, completions, advantages, _, _, _, _ = _rollouts(seed=4)
    config = RLConfig(loss_type="grpo", clamp_eps_lower=0.2, clamp_eps_upper=0.28, kl_beta=0.04)
    batch = build_rollout_batch(prompts, completions, advantages, seq_length=SEQ_LENGTH,
                                pad_id=PAD, loss_type="grpo", pack=False)
    vocab = 50
    logits = torch.randn(batch["tokens"].shape + (vocab,), requires_grad=True)
    logps = torch.log_softmax(logits, -1).gather(-1, batch["labels"][..., None])[..., 0]
    batch["old_logps"] = logps.detach() + 0.3 * torch.randn(logps.shape)
    batch["ref_logps"] = logps.detach() + 0.2 * torch.randn(logps.shape)
    expected, _ = weighted_grpo_loss(
        logps, batch["old_logps"], batch["advantages"], rollout_weights(batch),
        sequence_ids=batch["sequence_ids"], loss_type="grpo", clamp_eps_lower=0.2,
        clamp_eps_upper=0.28, ref_logps=batch["ref_logps"], kl_beta=0.04)
    expected_grad, = torch.autograd.grad(expected, logits)

    loss_fn = grpo_loss_fn(config, tp_group=None, vocab_size=vocab, loss_scale=2)
    total = 0.0
    for rows in (slice(0, 3), slice(3, None)):
        micro = {key: value[rows] for key, value in batch.items()}
        loss, metrics = loss_fn(logits[rows], micro)
        (loss / 2).backward()  # what the schedule does with each micro-batch's loss
        total += loss.item() / 2
    assert abs(total - expected.item()) < 1e-6
    assert torch.allclose(logits.grad, expected_grad, atol=1e-7)
    # The entropy bonus: the vocab-parallel entropy of the logits, as the loss takes it.
    bonus = RLConfig(loss_type="grpo", clamp_eps_lower=0.2, clamp_eps_upper=0.28, kl_beta=0.04,
                     entropy_term_weight=0.01)
    with torch.no_grad():
        loss, metrics = grpo_loss_fn(bonus, None, vocab)(logits, batch)
        expected, expected_metrics = weighted_grpo_loss(
            logps, batch["old_logps"], batch["advantages"], rollout_weights(batch),
            sequence_ids=batch["sequence_ids"], loss_type="grpo", clamp_eps_lower=0.2,
            clamp_eps_upper=0.28, ref_logps=batch["ref_logps"], kl_beta=0.04,
            entropies=torch.distributions.Categorical(logits=logits).entropy(),
            entropy_weight=0.01)
    assert abs(loss.item() - expected.item()) < 1e-6 and expected_metrics["entropy"] > 0
    assert abs(metrics["entropy"].item() - expected_metrics["entropy"].item()) < 1e-5
    with pytest.raises(ValueError, match="batch\\['ref_logps'\\]"):
        grpo_loss_fn(config, None, vocab)(logits, {k: v for k, v in batch.items()
                                                   if k != "ref_logps"})


def test_rollout_microbatches_pad_and_share_the_rows():
    """Every data-parallel rank gets the same number of micro-batches of micro_batch_size
    rows; together they are the batch plus untrained rows; their losses (over the schedule's
    count) and metrics add up to the whole batch's."""
    from megatron_smp.post_training.rl_config import RLConfig
    from megatron_smp.post_training.rollouts import grpo_loss_fn, rollout_microbatches

    prompts, completions, advantages, _, _, _, _ = _rollouts(seed=5, count=9)
    batch = build_rollout_batch(prompts, completions, advantages, seq_length=SEQ_LENGTH,
                                pad_id=PAD, loss_type="dapo", pack=False)
    vocab = 50
    logits = torch.randn(batch["tokens"].shape + (vocab,))
    batch["old_logps"] = torch.randn(batch["tokens"].shape) - 4.0
    config = RLConfig(loss_type="dapo", clamp_eps_lower=0.2, clamp_eps_upper=0.28,
                      kl_beta=0.0)
    whole_loss, whole_metrics = grpo_loss_fn(config, None, vocab)(logits, batch)
    shares = [rollout_microbatches(batch, 2, dp_size=2, dp_rank=rank) for rank in (0, 1)]
    assert [len(share) for share in shares] == [3, 3]  # 9 rows -> 12: 2 ranks x 3 x 2 rows
    rows = torch.cat([m["tokens"] for share in shares for m in share])
    assert rows.shape == (12, SEQ_LENGTH) and torch.equal(rows[:9], batch["tokens"])
    padding = {key: torch.cat([m[key] for m in shares[1]])[3:] for key in batch}  # rows 9-11
    assert not padding["loss_mask"].any() and not padding["loss_weight"].any()
    assert torch.equal(padding["position_ids"][0], torch.arange(SEQ_LENGTH))
    padded_logits = torch.cat([logits, torch.randn((3,) + logits.shape[1:])])
    loss_fn = grpo_loss_fn(config, None, vocab, loss_scale=3 * 2)
    total, metrics = 0.0, {key: 0.0 for key in whole_metrics}
    for rank, share in enumerate(shares):
        for index, micro in enumerate(share):
            first = (rank * 3 + index) * 2
            loss, parts = loss_fn(padded_logits[first:first + 2], micro)
            total += loss.item() / (3 * 2)  # the schedule's 1 / 3 and DP's mean over 2 ranks
            metrics = {key: value + parts[key].item() for key, value in metrics.items()}
    assert abs(total - whole_loss.item()) < 1e-6
    for key, value in whole_metrics.items():
        assert abs(metrics[key] - value.item()) < 1e-6, key
    with pytest.raises(ValueError, match="dp_rank 2"):
        rollout_microbatches(batch, 2, dp_size=2, dp_rank=2)
