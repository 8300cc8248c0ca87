"""What the training loop calls between the last backward and `optimizer.step()`."""
from __future__ import annotations

from typing import Iterable, List

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.tensor import DTensor

from megatron_smp.tensor_parallel.utils import is_expert_param


def _grad_of(param: torch.nn.Parameter):
    main_grad = getattr(param, "main_grad", None)
    grad = main_grad if main_grad is not None else param.grad
    # FSDP2: this rank's shard; TP peers hold the same rows, so sums over TP stay valid.
    return grad.to_local() if isinstance(grad, DTensor) else grad


def _allreduce_coalesced(grads: List[torch.Tensor], group, device: torch.device) -> None:
    """Sum `grads` over `group` with one collective per dtype, on `device` (the state's):
    FSDP2's cpu_offload leaves grads on the CPU, which NCCL does not reduce."""
    by_dtype = {}
    for grad in grads:
        by_dtype.setdefault(grad.dtype, []).append(grad)
    for same_dtype in by_dtype.values():
        flat = _flatten_dense_tensors(same_dtype).to(device)
        dist.all_reduce(flat, group=group)
        for grad, synced in zip(same_dtype, _unflatten_dense_tensors(flat, same_dtype)):
            grad.copy_(synced)


def allreduce_sequence_parallel_grads(model_chunks: Iterable[torch.nn.Module], state) -> None:
    """Sum over TP the grads of TP-replicated params used on sequence-parallel activations.

    With sequence parallelism each TP rank sees a different slice of the sequence, so the
    grads of replicated params (norm weights, marked `sequence_parallel=True`) are partial.
    """
    if state.tp_size == 1:
        return
    dense, expert = [], []
    for chunk in model_chunks:
        for param in chunk.parameters():
            if param.requires_grad and getattr(param, "sequence_parallel", False) \
                    and _grad_of(param) is not None:
                (expert if is_expert_param(param) else dense).append(_grad_of(param))
    # An expert's replicated params are partial over its own (expert-tensor-parallel) group.
    # The ranks of a group hold the same modules, so each call is collective.
    if state.etp_group is state.tp_group:
        dense, expert = dense + expert, []
    if dense:
        _allreduce_coalesced(dense, state.tp_group, state.device)
    if expert and state.etp_size > 1:
        _allreduce_coalesced(expert, state.etp_group, state.device)


def _language_model(chunk: torch.nn.Module) -> torch.nn.Module:
    """The module under the wrappers that knows whether its embedding is tied."""
    for module in chunk.modules():
        if hasattr(module, "share_embeddings_and_output_weights"):
            return module
    raise TypeError(
        f"{type(chunk).__name__} holds no module with share_embeddings_and_output_weights; "
        "pipeline-parallel models must say whether their output layer is tied"
    )


def allreduce_embedding_grads(model_chunks: List[torch.nn.Module], state) -> None:
    """Sum the grads of the tied word embedding over the first and last pipeline stage.

    The copies are the input embedding on the first stage and the output layer weight on the
    last (`shared_embedding_or_output_weight()`); with one stage they are one tensor already.
    Whether to reduce at all comes from the model's `share_embeddings_and_output_weights`, a
    config value equal on every rank, so both ends of the group take the same branch; an
    untied model (Llama) has nothing to sum.
    """
    group = state.embedding_group
    if state.pp_size == 1 or group is None or not state.is_in_embedding_group:
        return
    if dist.get_world_size(group) == 1:
        return
    # The first stage's copy lives in its first chunk, the last stage's in its last chunk.
    model = _language_model(model_chunks[0] if state.is_pipeline_first_stage else model_chunks[-1])
    copies = getattr(model, "embedding_copies_on_end_stages", None)
    if not (copies() if copies is not None else model.share_embeddings_and_output_weights):
        return
    dist.all_reduce(_grad_of(model.shared_embedding_or_output_weight()), group=group)


def finalize_model_grads(model_chunks: List[torch.nn.Module], state) -> None:
    """Finish DP reductions, then the TP (sequence-parallel) and tied-embedding reductions.

    The DP reduction comes first: with the distributed optimizer only this rank's shard of
    each bucket is then valid, and the later sums keep the valid parts valid because TP
    peers hold identically laid out buffers and the tied embedding has a bucket of its own
    on both end stages.
    """
    for chunk in model_chunks:
        if hasattr(chunk, "finish_grad_sync"):
            chunk.finish_grad_sync()
    allreduce_sequence_parallel_grads(model_chunks, state)
    allreduce_embedding_grads(model_chunks, state)
