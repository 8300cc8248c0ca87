"""Data parallelism over contiguous grad buffers, with reduction overlapped with backward.

Each parameter's grad is accumulated into `param.main_grad` (a view into an fp32 grad
buffer) by a post-accumulate-grad hook, which then frees `param.grad` (Megatron's non-fused
path). On the last microbatch (outside `no_sync()`), the hook also marks the parameter
ready; when every parameter of a bucket is ready, the bucket's reduction is launched
asynchronously (`--overlap-grad-reduce`) while backward continues. `finish_grad_sync()`
waits for them (or, without overlap, runs them all then).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Dict, List

import torch
import torch.distributed as dist

from megatron_smp.config import ConfigError, OptimizerConfig
from megatron_smp.distributed.param_and_grad_buffer import Bucket, ParamAndGradBuffer
from megatron_smp.tensor_parallel.utils import is_expert_param, is_muon_parameter

# Megatron's default when overlapping: large enough to keep the link busy, and at least
# 1M elements per data-parallel rank so each shard is not tiny.
_DEFAULT_BUCKET_SIZE = 40_000_000


class DistributedDataParallel(torch.nn.Module):
    """Wraps one model chunk: `forward` passes through, grads go through the buffers.

    Args:
        module: the model chunk (its params are moved into the buffers in place).
        config: `OptimizerConfig` (overlap_grad_reduce, overlap_param_gather,
            use_distributed_optimizer, ddp_bucket_size, ddp_average_in_collective,
            accumulate_allreduce_grads_in_fp32).
        state: `ParallelState`; grads are reduced over `state.dp_cp_group`, expert grads
            (params with `allreduce == False`) over `state.expert_dp_group`.
    """

    def __init__(self, module: torch.nn.Module, config: OptimizerConfig, state):
        super().__init__()
        self.module = module
        self.config = config
        self.state = state
        self.overlap_grad_reduce = config.overlap_grad_reduce
        self.use_distributed_optimizer = config.use_distributed_optimizer
        self.overlap_param_gather = config.overlap_param_gather and config.use_distributed_optimizer

        dp_cp_size = state.dp_cp_size
        bucket_size = config.ddp_bucket_size
        if bucket_size is None and self.overlap_grad_reduce:
            bucket_size = max(_DEFAULT_BUCKET_SIZE, 1_000_000 * dp_cp_size)
        if not self.overlap_grad_reduce and config.ddp_bucket_size is None:
            bucket_size = None  # nothing to overlap with: one collective per buffer
        self.bucket_size = bucket_size

        param_names = {p: n for n, p in module.named_parameters()}
        dense: Dict[tuple, List[torch.nn.Parameter]] = {}
        expert: Dict[tuple, List[torch.nn.Parameter]] = {}
        # Muon's layer-wise distributed optimizer: the matrices Muon steps go to buffers that
        # keep each whole in one rank's shard; the scalar optimizer's params stay byte-sharded
        # (with --no-use-layer-wise-param-layout they are kept whole too).
        layer_wise = config.use_layer_wise_distributed_optimizer
        all_whole = layer_wise and not config.use_layer_wise_param_layout
        for param in module.parameters():
            if not param.requires_grad:
                continue
            grad_dtype = torch.float32 if config.accumulate_allreduce_grads_in_fp32 else param.dtype
            # Expert grads are reduced only among the replicas holding the same experts.
            target = expert if is_expert_param(param) else dense
            whole = all_whole or (layer_wise and is_muon_parameter(param_names[param], param))
            target.setdefault((param.dtype, grad_dtype, whole), []).append(param)

        # Loss is averaged over all dp x cp replicas. Expert grads are summed over fewer
        # replicas (expert_dp), so they are scaled by 1/(dp x cp) as well, and with AVG the
        # collective's 1/expert_dp is corrected by expert_dp/(dp x cp).
        if config.ddp_average_in_collective:
            dense_scale = 1.0
            expert_dp_size = dist.get_world_size(state.expert_dp_group)
            expert_scale = expert_dp_size / dp_cp_size
        else:
            dense_scale = expert_scale = 1.0 / dp_cp_size

        # --num-distributed-optimizer-instances: reduce-scatter (and shard) within an instance,
        # then all-reduce each shard across the instances (AVG twice gives the same mean).
        groups = {"dense": (state.dp_cp_group, None), "expert": (state.expert_dp_group, None)}
        instances = config.num_distributed_optimizer_instances
        if self.use_distributed_optimizer and instances > 1:
            groups = state.optimizer_instance_groups(instances)
            if expert and groups["expert"][0] is None:
                raise ConfigError(f"--num-distributed-optimizer-instances ({instances}) must "
                                  "divide the expert-data-parallel size")
        self.param_and_grad_buffers: List[ParamAndGradBuffer] = []
        for params_by_dtype, (group, inter_group), replicas, scale in (
            (dense, groups["dense"], state.dp_cp_group, dense_scale),
            (expert, groups["expert"], state.expert_dp_group, expert_scale),
        ):
            for (param_dtype, grad_dtype, whole), params in params_by_dtype.items():
                self.param_and_grad_buffers.append(
                    ParamAndGradBuffer(
                        params, param_dtype, grad_dtype, group, bucket_size, scale,
                        config.ddp_average_in_collective, self.use_distributed_optimizer,
                        param_names, layer_wise=whole, inter_instance_group=inter_group,
                        replica_group=replicas,
                    )
                )
        self.param_to_bucket: Dict[torch.nn.Parameter, Bucket] = {}
        for buffer in self.param_and_grad_buffers:
            self.param_to_bucket.update(buffer.param_to_bucket)

        self._grad_hook_handles = [
            param.register_post_accumulate_grad_hook(self._make_grad_hook())
            for param in self.param_to_bucket
        ]
        self._forward_pre_hook_handles = []
        if self.overlap_param_gather:
            self.enable_forward_pre_hook()

    # Hooks -----------------------------------------------------------------------------------
    def _make_grad_hook(self):
        def hook(param: torch.nn.Parameter) -> None:
            if param.grad is not None:
                param.main_grad.add_(param.grad)
                param.grad = None
            if self.overlap_grad_reduce:
                self.param_to_bucket[param].register_grad_ready(param)

        return hook

    def remove_hooks(self) -> None:
        """Drop every hook this wrapper put on its parameters and submodules (a failed run
        that restarts in process: the hooks' closures hold this wrapper, and through it the
        grad buffers and process groups, in a cycle through the parameters that the garbage
        collector does not free)."""
        for handle in self._grad_hook_handles + self._forward_pre_hook_handles:
            handle.remove()
        self._grad_hook_handles, self._forward_pre_hook_handles = [], []

    def enable_forward_pre_hook(self) -> None:
        """Wait, just before each submodule runs, for the all-gather of its params."""
        if self._forward_pre_hook_handles:
            return
        for submodule in self.module.modules():
            buckets = []
            for param in submodule.parameters(recurse=False):
                bucket = self.param_to_bucket.get(param)
                if bucket is not None and all(bucket is not b for b in buckets):
                    buckets.append(bucket)
            if buckets:
                self._forward_pre_hook_handles.append(
                    submodule.register_forward_pre_hook(self._make_forward_pre_hook(buckets))
                )

    def disable_forward_pre_hook(self) -> None:
        """Remove the hooks and wait for every pending all-gather (e.g. before evaluation)."""
        for handle in self._forward_pre_hook_handles:
            handle.remove()
        self._forward_pre_hook_handles = []
        self.finish_param_sync()

    @staticmethod
    def _make_forward_pre_hook(buckets: List[Bucket]):
        def hook(module, args):
            for bucket in buckets:
                bucket.finish_param_sync()

        return hook

    # Public interface -------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self):
        """Accumulate grads locally (earlier microbatches); the reduction waits for the last."""
        for buffer in self.param_and_grad_buffers:
            buffer.set_is_last_microbatch(False)
        try:
            yield
        finally:
            for buffer in self.param_and_grad_buffers:
                buffer.set_is_last_microbatch(True)

    def start_grad_sync(self) -> None:
        """Launch the reduction of every bucket not launched yet (async when overlapping)."""
        for buffer in self.param_and_grad_buffers:
            for bucket in buffer.buckets:
                if bucket.grad_reduce_handle is None:
                    bucket.start_grad_sync(async_op=self.overlap_grad_reduce)

    def finish_grad_sync(self) -> None:
        """Make every grad reduction complete. After it, main_grad holds the DP average
        (with the distributed optimizer: only this rank's shard of each bucket)."""
        if not self.overlap_grad_reduce:
            self.start_grad_sync()
        for buffer in self.param_and_grad_buffers:
            for bucket in buffer.buckets:
                bucket.finish_grad_sync()

    def zero_grad_buffer(self) -> None:
        """Zero every main_grad and reset the bucket state; call before each step's first
        microbatch."""
        for param in self.param_to_bucket:
            param.grad = None
        for buffer in self.param_and_grad_buffers:
            buffer.reset()

    def start_param_sync(self, force_sync: bool = False) -> None:
        """All-gather the updated param shards (distributed optimizer only).

        With --overlap-param-gather (and not `force_sync`) the all-gathers are left in
        flight and the forward pre-hooks wait for each bucket just before it is used.
        Buckets are launched in forward order (the buffer holds params reversed).
        """
        if not self.use_distributed_optimizer:
            return
        async_op = self.overlap_param_gather and not force_sync
        for buffer in self.param_and_grad_buffers:
            for bucket in reversed(buffer.buckets):
                bucket.start_param_sync(async_op=async_op)

    def finish_param_sync(self) -> None:
        for buffer in self.param_and_grad_buffers:
            for bucket in buffer.buckets:
                bucket.finish_param_sync()

    def broadcast_params(self) -> None:
        """Copy data-parallel rank 0's params to every replica (random init per rank)."""
        for buffer in self.param_and_grad_buffers:
            group = buffer.replica_group
            source = dist.get_global_rank(group, 0)
            dist.broadcast(buffer.param_data, src=source, group=group)

    # Checkpoints hold the wrapped module's names, not "module.<name>".
    def state_dict(self, *args, **kwargs):
        self.finish_param_sync()
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True):
        return self.module.load_state_dict(state_dict, strict=strict)
