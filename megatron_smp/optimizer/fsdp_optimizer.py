"""The optimizer of an FSDP2-sharded model: a torch optimizer over the sharded fp32 params.

FSDP2's sharded parameters are fp32 DTensors (the main params: mixed precision casts them to
bf16 only when gathering), and their `.grad` are the reduce-scattered fp32 shards, so the
step is FP32Optimizer's on shards (with --fp16 the layers compute in fp16 and the dynamic
loss scaler unscales the fp32 grad shards; an inf or NaN in any rank's shard skips the step
everywhere). What differs is the statistics: each rank holds rows of
each TP-local tensor, so the grad norm and the zero count sum the local shards over the FSDP
shard group (replicas of hybrid sharding hold the same rows and are not added again) and
over tp x pp as usual, skipping TP-replicated params on tp ranks other than 0. Expert params
are sharded over the ranks holding the same experts (`ParallelState.expert_fsdp_mesh`): their
partial sums add over that shard group and over the expert-parallel group (different
experts), as Megatron adds expert norms over its expert groups.
"""
from __future__ import annotations

from typing import List, Tuple

import torch

from megatron_smp.optimizer.optimizer import FP32Optimizer


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from megatron_smp.distributed.fsdp import local_tensor

    return local_tensor(tensor)


class FSDPOptimizer(FP32Optimizer):
    """FP32Optimizer over FSDP2's sharded params (see the module docstring)."""

    grads_sharded_over_dp = True

    def _main_grads(self) -> List[torch.Tensor]:
        # The local shards: clipping scales them in place, which scales the DTensor grads.
        return [_local(p.grad) for _, p in self.param_pairs if p.grad is not None]

    def _grads_for_norm(self) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
        return self._for_norm(
            lambda param, _: None if param.grad is None else _local(param.grad))

    def _params_for_norm(self) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
        return self._for_norm(lambda param, _: _local(param.detach()))

    def _norm_groups(self):
        state = self.state
        dense = [state.model_parallel_group, state.fsdp_shard_group]
        if not self.model_has_expert_params:
            return dense, dense
        expert_shard_group, _ = state.expert_fsdp_groups
        return dense, [state.model_parallel_group, state.ep_group, expert_shard_group]


__all__ = ["FSDPOptimizer"]
