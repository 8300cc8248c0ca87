"""Per-token log-probabilities (and entropies) of given sequences under a built model, at any
layout: the one implementation behind `Trainer.compute_logprobs` and the backend API's
`post_training.backend_api.compute_logprobs` (a DPO reference, a GRPO old policy, verl's and
NeMo-RL's `compute_log_prob`).

Vocab-parallel: log-softmax and gather from each rank's shard of the logits [b, s, v/tp]
(three all-reduces over TP, never a [s, b, V] gather), fp32; packed rows (document_ids) or
not; TP/SP, PP (the last stage's values broadcast), CP (each rank's share gathered back into
sequence order), EP and FSDP2 through the model's own forward.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron_smp.config import ConfigError


def model_chunks(model) -> List[torch.nn.Module]:
    """`model` (one chunk or a list of pipeline chunks) as a list."""
    return list(model) if isinstance(model, (list, tuple)) else [model]


def split_batch_for_context_parallel(batch: Dict[str, torch.Tensor], state):
    """This rank's share of `batch` under context parallelism (the batch itself without)."""
    if state.cp_size == 1:
        return batch
    from megatron_smp.context_parallel import get_batch_on_this_cp_rank

    return get_batch_on_this_cp_rank(batch, state.cp_size, state.cp_rank)


def model_outputs(model: torch.nn.Module, batch: Optional[Dict[str, torch.Tensor]]):
    """Forward of one (CP-local) microbatch without labels ("tokens", "position_ids",
    "attention_mask", "document_ids"): logits [b, s, v/tp] on the last stage, the hidden
    states elsewhere. An empty or None batch: a stage past the first (its input comes from
    the previous stage)."""
    batch = batch or {}
    return model(batch.get("tokens"), position_ids=batch.get("position_ids"),
                 attention_mask=batch.get("attention_mask"),
                 document_ids=batch.get("document_ids"))


def context_parallel_local_indices(document_ids: Optional[torch.Tensor], seq_length: int,
                                   batch: int, state) -> torch.Tensor:
    """Row positions [cp, b, s / cp] of each CP rank's tokens (as `get_batch_on_this_cp_rank`
    takes them: per document for packed rows, else the load-balanced chunks)."""
    from megatron_smp.context_parallel.split import local_positions, packed_rank_indices

    if document_ids is not None:
        return packed_rank_indices(document_ids, state.cp_size)
    return torch.stack([local_positions(seq_length, state.cp_size, rank).expand(
        batch, seq_length // state.cp_size) for rank in range(state.cp_size)])


def gather_tokens_from_context_parallel(values: torch.Tensor, indices: torch.Tensor,
                                        state) -> torch.Tensor:
    """[b, s / cp] per-token values of every CP rank -> [b, s] in sequence order (no grad).
    `indices`: `context_parallel_local_indices` of the batch."""
    if state.cp_size == 1:
        return values
    values = values.contiguous()
    gathered = values.new_empty((state.cp_size,) + tuple(values.shape))
    dist.all_gather_into_tensor(gathered.view(-1, *values.shape[1:]), values,
                                group=state.cp_group)
    b = values.shape[0]
    full = values.new_zeros(b, values.shape[1] * state.cp_size)
    full.scatter_(1, indices.to(values.device).permute(1, 0, 2).reshape(b, -1),
                  gathered.permute(1, 0, 2).reshape(b, -1))
    return full


def token_log_probs(logits: torch.Tensor, labels: torch.Tensor, state, vocab_size: int,
                    with_entropy: bool = False, temperature: float = 1.0):
    """log p(label) [b, s] fp32 (and the entropy [b, s], else None) from this rank's
    vocabulary shard of the logits [b, s, v/tp] (divided by `temperature`, as samplers do);
    differentiable, nothing gathered over the vocabulary."""
    from megatron_smp.tensor_parallel.cross_entropy import (
        vocab_parallel_cross_entropy, vocab_parallel_entropy,
    )

    if temperature != 1.0:
        if not temperature > 0.0:
            raise ConfigError(f"temperature must be positive, got {temperature}")
        logits = logits.float() / temperature
    logps = -vocab_parallel_cross_entropy(logits, labels, state.tp_group, vocab_size=vocab_size)
    if not with_entropy:
        return logps, None
    return logps, vocab_parallel_entropy(logits, state.tp_group, vocab_size=vocab_size)


def logprobs_of_microbatches(model, microbatches: Sequence[Dict[str, torch.Tensor]], state,
                             vocab_size: int, with_entropy: bool = False,
                             pipeline_schedule: str = "1f1b", temperature: float = 1.0
                             ) -> List[Dict[str, torch.Tensor]]:
    """Per-token log-probs of each microbatch's "labels", fp32, on every rank.

    microbatches: dicts of tokens [b, s], labels [b, s] (the next tokens), optional
        position_ids / attention_mask / document_ids (packed rows: each document attends to
        itself only); whole sequences (this rank's share is taken here under context
        parallelism), the same on every rank of the model-parallel group. With pipeline
        parallelism every microbatch has the same [b, s] (the stages exchange that shape).
    model: this rank's model chunk(s) as built for training (DDP / FSDP2 wrapped, pipeline
        chunks); run in eval mode, no grad. `temperature`: the logits are divided by it.
    Returns one {"logprobs": [b, s]} (+ "entropy": [b, s]) per microbatch, whole sequences,
    the same on every rank of the TP / CP / PP groups (broadcast from the last stage).
    """
    from megatron_smp.pipeline_parallel.schedules import (
        get_forward_backward_func, schedule_name,
    )

    chunks = model_chunks(model)
    if not microbatches:
        return []
    shapes = [tuple(mb["tokens"].shape) for mb in microbatches]
    if state.pp_size > 1 and len(set(shapes)) > 1:
        raise ConfigError(f"compute_logprobs with pipeline parallelism: the stages exchange one "
                          f"activation shape, but the microbatches' [b, s] differ: "
                          f"{sorted(set(shapes))}; pad them to one length")
    micro_batch_size, seq_length = shapes[0]
    device = state.device

    def on_device(mb):
        return {key: value.to(device, non_blocking=True) for key, value in mb.items()
                if value is not None}

    def forward_step(data_iterator, chunk):
        full = on_device(next(data_iterator))
        local = split_batch_for_context_parallel(full, state)
        output = model_outputs(chunk, local)

        def loss_func(logits):
            logps, entropy = token_log_probs(logits, local["labels"], state, vocab_size,
                                             with_entropy, temperature)
            indices = (context_parallel_local_indices(full.get("document_ids"),
                                                      full["tokens"].shape[1],
                                                      logps.shape[0], state)
                       if state.cp_size > 1 else None)
            report = {"logprobs": gather_tokens_from_context_parallel(logps, indices, state)}
            if entropy is not None:
                report["entropy"] = gather_tokens_from_context_parallel(entropy, indices, state)
            return logps.sum() * 0.0, report

        return output, loss_func

    training = [chunk.training for chunk in chunks]
    for chunk in chunks:
        chunk.eval()
    try:
        forward_backward = get_forward_backward_func(
            state.pp_size, schedule_name(pipeline_schedule, len(chunks)))
        with torch.no_grad():
            reports = forward_backward(
                forward_step_func=forward_step, data_iterator=iter(microbatches), model=chunks,
                num_microbatches=len(microbatches), seq_length=seq_length,
                micro_batch_size=micro_batch_size, forward_only=True)
    finally:
        for chunk, mode in zip(chunks, training):
            chunk.train(mode)
    keys = ["logprobs"] + (["entropy"] if with_entropy else [])
    if reports:
        out = [{key: report[key].float() for key in keys} for report in reports]
    else:  # a stage before the last: filled by the broadcast below
        out = [{key: torch.empty(shape, dtype=torch.float32, device=device) for key in keys}
               for shape in shapes]
    if state.pp_size > 1:
        last_stage = dist.get_global_rank(state.pp_group, state.pp_size - 1)
        for values in out:
            for key in keys:
                dist.broadcast(values[key], last_stage, group=state.pp_group)
    return out


def token_budget_microbatches(lengths: Sequence[int], max_tokens: int, multiple: int,
                              seq_length: int) -> List[Tuple[List[int], int]]:
    """Rows of these `lengths` (their real tokens; the rest of each row is padding) grouped
    into micro-batches of at most `max_tokens` tokens, counting rows x the micro-batch's
    width: its longest row rounded up to `multiple` (at most `seq_length`). Longest first
    (verl's dynamic batch size, NeMo-RL's dynamic batching, greedily). Returns [(row indices,
    width)]."""
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    groups: List[Tuple[List[int], int]] = []
    for row in order:
        length = int(lengths[row])
        if not 0 < length <= seq_length:
            raise ConfigError(f"compute_logprobs: row {row} has length {length}, outside "
                              f"1..{seq_length} (the batch's sequence length)")
        width = min(seq_length, -(-length // multiple) * multiple)
        if width > max_tokens:
            raise ConfigError(f"compute_logprobs: max_tokens_per_microbatch={max_tokens} is "
                              f"less than row {row}'s {width} positions; raise it to at least "
                              f"{width}")
        if groups and (len(groups[-1][0]) + 1) * groups[-1][1] <= max_tokens:
            groups[-1][0].append(row)
        else:
            groups.append(([row], width))
    return groups


def compute_logprobs(model, batch: Dict[str, torch.Tensor], state, vocab_size: int,
                     micro_batch_size: Optional[int] = None, with_entropy: bool = False,
                     pipeline_schedule: str = "1f1b", temperature: float = 1.0,
                     max_tokens_per_microbatch: Optional[int] = None
                     ) -> Dict[str, torch.Tensor]:
    """Per-token log-probs of `batch["labels"]` under the model, fp32, on every rank: the
    rows of `batch` (tokens [B, s], labels [B, s], optional position_ids / document_ids) in
    microbatches of `micro_batch_size` (default all B) through `logprobs_of_microbatches`.

    max_tokens_per_microbatch: instead of a fixed size, micro-batches of at most this many
    tokens (`token_budget_microbatches`), each cut to its longest row: batch["lengths"] [B]
    gives each row's real length (default s; the positions past it are padding and come back
    0). The values of the real positions are those of fixed micro-batches. Collective over
    the data-parallel group, whose ranks may hold different rows: they agree on the number of
    micro-batches (expert parallelism's all-to-alls and FSDP2's all-gathers pair up); with
    pipeline parallelism each micro-batch of its own width goes through the schedule alone.

    Returns {"logprobs": [B, s]} (+ "entropy": [B, s]), the whole sequences, shared by every
    rank of the TP / CP / PP groups.
    """
    total = batch["tokens"].shape[0]
    if max_tokens_per_microbatch is not None:
        return _token_budget_logprobs(model, batch, state, vocab_size, max_tokens_per_microbatch,
                                      micro_batch_size, with_entropy, pipeline_schedule,
                                      temperature)
    micro_batch_size = micro_batch_size or total
    if total % micro_batch_size:
        raise ConfigError(f"compute_logprobs: {total} sequences do not split into micro "
                          f"batches of {micro_batch_size}")
    microbatches = [{key: value[i:i + micro_batch_size] for key, value in batch.items()
                     if value is not None and key != "lengths"}
                    for i in range(0, total, micro_batch_size)]
    reports = logprobs_of_microbatches(model, microbatches, state, vocab_size, with_entropy,
                                       pipeline_schedule, temperature)
    return {key: torch.cat([report[key] for report in reports]) for key in reports[0]}


def _agree_over_data_parallel(microbatches: List[Dict[str, torch.Tensor]], state
                              ) -> List[Dict[str, torch.Tensor]]:
    """Token-budget micro-batches of data-parallel ranks that may hold different rows: every
    rank runs as many forwards (FSDP2's all-gathers pair up across them), the shorter lists
    repeating their last micro-batch; with expert parallelism also of the same [b, s] (the
    token dispatcher exchanges equal shares), each padded to the largest over the ranks by
    repeating its last row and adding padding columns. Whatever is added is dropped after."""
    count = torch.tensor([len(microbatches)], device=state.device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=state.dp_group)
    microbatches = microbatches + microbatches[-1:] * (int(count.item()) - len(microbatches))
    if state.ep_size == 1:
        return microbatches
    shapes = torch.tensor([list(mb["tokens"].shape) for mb in microbatches],
                          device=state.device)
    dist.all_reduce(shapes, op=dist.ReduceOp.MAX, group=state.dp_group)
    padded = []
    for microbatch, (rows, width) in zip(microbatches, shapes.tolist()):
        out = {}
        for key, value in microbatch.items():
            value = torch.cat([value, value[-1:].expand(rows - value.shape[0],
                                                        *value.shape[1:])])
            out[key] = torch.nn.functional.pad(value, (0, width - value.shape[1]))
        padded.append(out)
    return padded


def _token_budget_logprobs(model, batch, state, vocab_size: int, max_tokens: int,
                           micro_batch_size: Optional[int], with_entropy: bool,
                           pipeline_schedule: str, temperature: float):
    """`compute_logprobs` with max_tokens_per_microbatch (see there)."""
    total, seq_length = batch["tokens"].shape
    if micro_batch_size is not None:
        raise ConfigError("compute_logprobs: give micro_batch_size or "
                          "max_tokens_per_microbatch, not both")
    for key in ("document_ids", "attention_mask"):
        if batch.get(key) is not None:
            raise ConfigError(f"compute_logprobs: max_tokens_per_microbatch cuts the padding of "
                              f"causal rows; rows with {key} (packed or masked) keep their "
                              f"width: give micro_batch_size")
    lengths = batch.get("lengths")
    lengths = [seq_length] * total if lengths is None else [int(n) for n in lengths.tolist()]
    multiple = math.lcm(state.tp_size, 2 * state.cp_size if state.cp_size > 1 else 1)
    groups = token_budget_microbatches(lengths, max_tokens, multiple, seq_length)
    microbatches = []
    for rows, width in groups:
        index = torch.tensor(rows)
        microbatches.append({key: value[index, :width] for key, value in batch.items()
                             if value is not None and key != "lengths"})
    if state.dp_size > 1:
        microbatches = _agree_over_data_parallel(microbatches, state)
    if state.pp_size > 1:  # the stages exchange one shape per schedule
        reports = [report for microbatch in microbatches for report in logprobs_of_microbatches(
            model, [microbatch], state, vocab_size, with_entropy, pipeline_schedule,
            temperature)]
    else:
        reports = logprobs_of_microbatches(model, microbatches, state, vocab_size, with_entropy,
                                           pipeline_schedule, temperature)
    out = {key: torch.zeros(total, seq_length, dtype=torch.float32, device=state.device)
           for key in reports[0]}
    for (rows, width), report in zip(groups, reports):
        for key, values in report.items():
            for position, row in enumerate(rows):
                out[key][row, :lengths[row]] = values[position, :lengths[row]]
    return out


__all__ = ["compute_logprobs", "logprobs_of_microbatches", "token_budget_microbatches",
           "token_log_probs", "model_outputs",
           "model_chunks", "split_batch_for_context_parallel",
           "gather_tokens_from_context_parallel", "context_parallel_local_indices"]
