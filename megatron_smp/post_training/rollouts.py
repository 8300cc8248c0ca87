"""From generated rollouts to a training batch: advantages per group (with DAPO's filter), and
the token layout the training step reads, packed or one rollout per row.

The batch has the keys of the SFT / GPT datasets (tokens, labels, loss_mask, position_ids,
document_ids, all [rows, seq_length]) so the model runs on it as on any packed batch, plus per
label position: `advantages`, `sequence_ids` (the rollout each position belongs to) and the
`loss_weights` of `grpo.loss_weights` over the whole batch (`loss_weight`, `token_mean_weight`,
`sequence_mean_weight`), which make the loss of any row, micro-batch or shard a weighted sum.
"""
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from megatron_smp.data.gpt_dataset import document_ids_and_position_ids
from megatron_smp.data.sft_dataset import pack_best_fit
from megatron_smp.post_training.grpo import (group_advantages, groups_with_distinct_rewards,
                                             loss_weights, weighted_grpo_loss)


def rollout_advantages(rewards: Sequence[float], group_size: int, scale_rewards: str = "group",
                       unbiased_std: bool = False, filter_groups_with_same_reward: bool = False,
                       ) -> Tuple[torch.Tensor, List[int]]:
    """Advantages of rollouts listed group by group (the group_size completions of prompt 0,
    then of prompt 1, ...).

    Returns:
        (advantages [kept rollouts] float64, kept rollout indices into `rewards`): with
        `filter_groups_with_same_reward`, the groups whose rewards are all equal are left out.
    """
    if group_size < 1 or len(rewards) % group_size:
        raise ValueError(f"rollout_advantages: {len(rewards)} rewards do not split into groups "
                         f"of --grpo-group-size {group_size}")
    grouped = torch.tensor(list(rewards), dtype=torch.float64).view(-1, group_size)
    advantages = group_advantages(grouped, scale_rewards, unbiased_std)
    keep = (groups_with_distinct_rewards(grouped) if filter_groups_with_same_reward
            else torch.ones(grouped.shape[0], dtype=torch.bool))
    kept = [group * group_size + member for group in keep.nonzero().flatten().tolist()
            for member in range(group_size)]
    return advantages.flatten()[kept], kept


def build_rollout_batch(prompt_ids: Sequence[Sequence[int]],
                        completion_ids: Sequence[Sequence[int]],
                        advantages: Sequence[float], *, seq_length: int, pad_id: int,
                        loss_type: str, max_completion_length: Optional[int] = None,
                        pack: bool = True, pad_to_multiple: int = 1,
                        old_logprobs: Optional[Sequence[Sequence[float]]] = None,
                        ) -> Dict[str, torch.Tensor]:
    """The training batch of rollouts i = prompt_ids[i] + completion_ids[i].

    A rollout of n tokens gives n - 1 (input, label) positions; those whose label is a
    completion token are trained (loss_mask 1). With `pack`, rollouts share rows (best-fit
    decreasing, each attending only to itself, positions restarting at 0); otherwise one
    rollout per row. Padding is never trained on. `pad_to_multiple` (2 x context-parallel
    size, as for SFT packs) rounds each rollout's slot up, so that every rollout splits evenly
    over the context-parallel ranks.

    old_logprobs: per rollout, the sampling policy's log-prob of each completion token (the
    engine's `Request.logprobs`), stored as "old_logps" at the trained positions. In fp32 they
    equal a training forward on the same weights; where inference numerics differ (bf16
    kernels), compute "old_logps" with a training-side forward instead.
    """
    if not len(prompt_ids) == len(completion_ids) == len(advantages):
        raise ValueError(f"build_rollout_batch: {len(prompt_ids)} prompts, {len(completion_ids)} "
                         f"completions and {len(advantages)} advantages must match")
    lengths, slots = [], []
    for index, (prompt, completion) in enumerate(zip(prompt_ids, completion_ids)):
        if not prompt or not completion:
            raise ValueError(f"build_rollout_batch: rollout {index} has an empty prompt or "
                             f"completion")
        lengths.append(len(prompt) + len(completion) - 1)
        slots.append(-(-lengths[-1] // pad_to_multiple) * pad_to_multiple)
        if slots[-1] > seq_length:
            raise ValueError(f"build_rollout_batch: rollout {index} needs {slots[-1]} positions, "
                             f"more than --seq-length {seq_length}; shorten the prompt or "
                             f"--rl-max-completion-length")
    if old_logprobs is not None and [len(x) for x in old_logprobs] != [len(c) for c in
                                                                       completion_ids]:
        raise ValueError("build_rollout_batch: old_logprobs needs one value per completion token")
    rows = pack_best_fit(slots, seq_length) if pack else [[i] for i in range(len(lengths))]
    shape = (len(rows), seq_length)
    batch = {
        "tokens": torch.full(shape, pad_id, dtype=torch.long),
        "labels": torch.full(shape, pad_id, dtype=torch.long),
        "loss_mask": torch.zeros(shape),
        "advantages": torch.zeros(shape),
        "sequence_ids": torch.zeros(shape, dtype=torch.long),
    }
    if old_logprobs is not None:
        batch["old_logps"] = torch.zeros(shape)
    position_ids, document_ids = [], []
    for row, members in enumerate(rows):
        starts, position = [], 0
        for index in members:
            ids = torch.tensor(list(prompt_ids[index]) + list(completion_ids[index]))
            n, first_trained = lengths[index], len(prompt_ids[index]) - 1
            span = slice(position, position + n)
            batch["tokens"][row, span] = ids[:-1]
            batch["labels"][row, span] = ids[1:]
            batch["loss_mask"][row, position + first_trained:position + n] = 1.0
            batch["advantages"][row, span] = float(advantages[index])
            batch["sequence_ids"][row, span] = index
            if old_logprobs is not None:
                batch["old_logps"][row, position + first_trained:position + n] = torch.tensor(
                    [float(x) for x in old_logprobs[index]])
            starts.append(position)
            position += slots[index]
        if position < seq_length:
            starts.append(position)  # the padding is a document of its own
        positions, documents = document_ids_and_position_ids(starts, seq_length, True, True)
        position_ids.append(positions)
        document_ids.append(documents)
    batch["position_ids"] = torch.stack(position_ids)
    batch["document_ids"] = torch.stack(document_ids)
    completion_lengths = torch.tensor([float(len(c)) for c in completion_ids],
                                      dtype=torch.float64)
    weights = loss_weights(loss_type, batch["loss_mask"], batch["sequence_ids"],
                           num_sequences=len(lengths), num_tokens=completion_lengths.sum().item(),
                           max_completion_length=max_completion_length,
                           tokens_per_sequence=completion_lengths)
    for name, values in weights.items():
        batch[f"{name}_weight"] = values
    return batch


def rollout_microbatches(batch: Dict[str, torch.Tensor], micro_batch_size: int,
                         dp_size: int = 1, dp_rank: int = 0) -> List[Dict[str, torch.Tensor]]:
    """This data-parallel rank's micro-batches of a rollout batch that every rank holds whole.

    The rows are padded with untrained rows (loss mask and weights 0, positions 0..s-1) to a
    multiple of micro_batch_size x dp_size; rank r takes the r-th contiguous share and cuts it
    into micro-batches of exactly micro_batch_size rows (the shape pipeline stages exchange).
    Every rank gets the same number of micro-batches, n = len(result): the step's
    `Trainer.train_step(num_microbatches=n)`, and `grpo_loss_fn`'s loss_scale is
    n x dp_size x context-parallel size. As the weights are global, the padding changes
    neither the loss nor the gradient.

    Returns:
        n dicts with the batch's keys, each tensor [micro_batch_size, seq_length].
    """
    if micro_batch_size < 1 or dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"rollout_microbatches: micro_batch_size {micro_batch_size}, dp_size "
                         f"{dp_size} and dp_rank {dp_rank} must be positive (rank < size)")
    rows, seq_length = batch["tokens"].shape
    per_rank = -(-rows // (micro_batch_size * dp_size)) * micro_batch_size
    missing = per_rank * dp_size - rows
    padded = {}
    for key, value in batch.items():
        filler = torch.zeros((missing,) + tuple(value.shape[1:]), dtype=value.dtype)
        if key == "position_ids":
            filler += torch.arange(seq_length, dtype=value.dtype)
        padded[key] = torch.cat([value, filler])
    start = dp_rank * per_rank
    return [{key: value[first:first + micro_batch_size] for key, value in padded.items()}
            for first in range(start, start + per_rank, micro_batch_size)]


def rollout_weights(batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The `weights` argument of `grpo.weighted_grpo_loss` from (a slice of) a rollout batch."""
    return {"loss": batch["loss_weight"], "token_mean": batch["token_mean_weight"],
            "sequence_mean": batch["sequence_mean_weight"]}


def rollout_metrics(rewards: Sequence[float], per_function: Sequence[Dict[str, float]],
                    completion_lengths: Sequence[int], group_size: int,
                    truncated: Optional[Sequence[bool]] = None) -> Dict[str, float]:
    """The rollout half of an RL step's log line, under TRL's metric names: `reward`,
    `reward_std` (over all rollouts, Bessel-corrected), `rewards/<function>/mean|std` (over the
    rollouts that function scored), `frac_reward_zero_std` (groups whose rewards are all equal),
    `completions/mean_length|min_length|max_length` and, given `truncated` (stopped by the
    length limit, not by an end token), `completions/clipped_ratio`."""
    if not len(rewards) == len(per_function) == len(completion_lengths):
        raise ValueError("rollout_metrics: rewards, per_function and completion_lengths must "
                         "have one entry per rollout")
    if group_size < 1 or len(rewards) % group_size:
        raise ValueError(f"rollout_metrics: {len(rewards)} rewards do not split into groups of "
                         f"--grpo-group-size {group_size}")
    values = torch.tensor(list(rewards), dtype=torch.float64)
    lengths = torch.tensor(list(completion_lengths), dtype=torch.float64)
    grouped = values.view(-1, group_size)
    metrics = {
        "reward": values.mean().item(),
        "reward_std": values.std().item() if values.numel() > 1 else 0.0,
        "frac_reward_zero_std": (~groups_with_distinct_rewards(grouped)).double().mean().item(),
        "completions/mean_length": lengths.mean().item(),
        "completions/min_length": lengths.min().item(),
        "completions/max_length": lengths.max().item(),
    }
    names = sorted({name for scores in per_function for name in scores})
    for name in names:
        scored = torch.tensor([s[name] for s in per_function if name in s], dtype=torch.float64)
        metrics[f"rewards/{name}/mean"] = scored.mean().item()
        metrics[f"rewards/{name}/std"] = scored.std().item() if scored.numel() > 1 else 0.0
    if truncated is not None:
        metrics["completions/clipped_ratio"] = sum(map(bool, truncated)) / len(truncated)
    return metrics


def grpo_loss_fn(config, tp_group, vocab_size: int, loss_scale: float = 1.0, cp_group=None):
    """A trainer loss function `loss_fn(logits, batch) -> (loss, metrics)` over a micro-batch
    of `build_rollout_batch` rows: log-probs of the labels from this rank's vocabulary shard
    of the logits [b, s, v/tp], then `weighted_grpo_loss` with the batch's weights.

    config: an RLConfig (loss_type, clamp eps, kl_beta). The batch may carry "old_logps"
    (Trainer.compute_logprobs before the first of --grpo-iterations updates; without them the
    rollouts are on-policy: old = current, detached, as TRL does for one iteration) and must
    carry "ref_logps" when kl_beta != 0.
    loss_scale: undoes the schedule's and the gradient reduction's averaging, since the
    weights already normalise over the whole batch: num_microbatches x dp_size x cp_size.
    cp_group: the context-parallel group when the micro-batches are split over it; gspo's
    sequence ratios are summed over it (the other loss types need no communication).
    """
    from megatron_smp.tensor_parallel.cross_entropy import (
        vocab_parallel_cross_entropy, vocab_parallel_entropy,
    )

    entropy_weight = config.entropy_term_weight

    def loss_fn(logits: torch.Tensor, batch: Dict[str, torch.Tensor]):
        logps = -vocab_parallel_cross_entropy(logits, batch["labels"], tp_group, vocab_size)
        # The entropy bonus (--grpo-entropy-term-weight): the policy's entropy per token from
        # the vocabulary-sharded logits (two all-reduces over TP, with grad).
        entropies = (vocab_parallel_entropy(logits, tp_group, vocab_size)
                     if entropy_weight != 0.0 else None)
        old = batch.get("old_logps")
        if config.kl_beta != 0.0 and "ref_logps" not in batch:
            raise ValueError("--grpo-kl-beta != 0 needs the reference log-probs "
                             "(batch['ref_logps']) in each micro-batch")
        loss, metrics = weighted_grpo_loss(
            logps, logps.detach() if old is None else old, batch["advantages"],
            rollout_weights(batch), sequence_ids=batch["sequence_ids"],
            loss_type=config.loss_type, clamp_eps_lower=config.clamp_eps_lower,
            clamp_eps_upper=config.clamp_eps_upper, ref_logps=batch.get("ref_logps"),
            kl_beta=config.kl_beta, entropies=entropies, entropy_weight=entropy_weight,
            sequence_group=cp_group if config.loss_type == "gspo" else None)
        return loss * loss_scale, metrics

    return loss_fn
