"""The grad reductions torch's own FSDP cannot do for a transformed model, done inside autograd.

Our DDP and `smp.fully_shard` finish two kinds of grads outside the data-parallel reduction
(`distributed.finalize_model_grads`, DDP's expert buckets); under torch's FSDP1 / FSDP2 the
script calls `optimizer.step()` right after `backward()`, so the transformed model carries
them itself:

* Sequence parallelism (tensor_parallel_degree > 1 with `sequence_parallel`, which MoE layers
  need): the TP-replicated params used on this rank's sequence shard (norm weights, the MoE
  router, the shared-expert gate, row-parallel biases: marked `sequence_parallel`) get a
  partial grad on each TP rank. Their use in forward goes through an identity whose
  backward sums the grad over the TP group, so autograd hands FSDP the whole grad (equal on
  every TP rank) before FSDP reduces it over the data-parallel ranks.
* Expert parallelism (expert_parallel_degree > 1): expert params (marked `allreduce =
  False`) differ across the EP ranks, and each rank's experts already saw the tokens of its
  whole EP group. FSDP reduces them over the expert-data-parallel group (their own FSDP1
  units / FSDP2 param groups, see `smp.torch_fsdp`), an average over dp x cp / ep ranks;
  the identity's backward scales their grads by 1 / ep so that the result is the average
  over all dp x cp ranks, as for the dense params (and as our DDP reduces them).

`transform` attaches one `TorchFSDPGrads` to the model: forward pre/post hooks on the modules
that use such params (the owner, or the `MoEExperts` that reads its experts' weights
directly), which swap each param for the identity's output during that forward and put it
back after. They stay idle until torch's FSDP entry points (FullyShardedDataParallel,
fully_shard on SMP's default mesh) activate them, so our own DDP / smp.fully_shard path,
which reduces these grads in finalize_model_grads, is unchanged.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch

ATTRIBUTE = "_smp_torch_fsdp_grads"


class _ReduceParamGrad(torch.autograd.Function):
    """Identity on a parameter; backward sums its grad over `group` (None: no sum) and
    multiplies it by `scale`."""

    @staticmethod
    def forward(ctx, param, group, scale):
        ctx.group, ctx.scale = group, scale
        return param.view_as(param)

    @staticmethod
    def backward(ctx, grad):
        from megatron_smp.tensor_parallel.mappings import _all_reduce

        if ctx.group is not None:
            # In fp32 under bf16/fp16 compute, as our DDP sums these grads (in main_grad).
            grad = _all_reduce(grad.float(), ctx.group).to(grad.dtype)
        if ctx.scale != 1.0:
            grad = grad * ctx.scale
        return grad, None, None


def _lookup(owner: torch.nn.Module, name: str) -> Optional[torch.Tensor]:
    """The tensor `owner.name` gives now: a plain attribute (FSDP1 sets its views so during
    forward, and with use_orig_params also in `_parameters`) wins over a registered
    parameter, as in attribute lookup."""
    tensor = owner.__dict__.get(name)
    if isinstance(tensor, torch.Tensor):
        return tensor
    return owner._parameters.get(name)


def _replace(owner: torch.nn.Module, name: str, old: torch.Tensor, new: torch.Tensor) -> None:
    """Put `new` wherever `owner` holds `old` under `name` (its instance dict, its
    parameters: a non-leaf there for one forward)."""
    if owner.__dict__.get(name) is old:
        owner.__dict__[name] = new
    if owner._parameters.get(name) is old:
        owner._parameters[name] = new


class TorchFSDPGrads:
    """The hooks of one transformed model (see the module docstring); `active` turns them
    on."""

    def __init__(self, model: torch.nn.Module, parallel_state) -> None:
        from megatron_smp.tensor_parallel.utils import is_expert_param
        from megatron_smp.transformer.moe.experts import MoEExperts

        self.active = False
        tp_group = parallel_state.tp_group if parallel_state.tp_size > 1 else None
        ep_size = parallel_state.ep_size
        self.expert_scale = 1.0 / ep_size
        # Modules under an MoEExperts: it reads their weights directly (their own forward
        # never runs), so the hooks go on the MoEExperts.
        user_of: Dict[int, torch.nn.Module] = {}
        for experts in model.modules():
            if isinstance(experts, MoEExperts):
                for sub in experts.modules():
                    user_of[id(sub)] = experts
        entries: Dict[torch.nn.Module, List[tuple]] = {}
        for owner in model.modules():
            for name, param in owner.named_parameters(recurse=False):
                partial = tp_group is not None and getattr(param, "sequence_parallel", False)
                expert = ep_size > 1 and is_expert_param(param)
                if partial or expert:
                    user = user_of.get(id(owner), owner)
                    entries.setdefault(user, []).append(
                        (owner, name, tp_group if partial else None,
                         self.expert_scale if expert else 1.0))
        self._swapped: Dict[int, list] = {}
        for user, items in entries.items():
            setattr(user, ATTRIBUTE, self)
            user.register_forward_pre_hook(self._pre_hook(items))
            user.register_forward_hook(self._post_hook(), always_call=True)

    def _pre_hook(self, items):
        def swap_in(module, args) -> None:  # a returned value would replace args
            if not self.active or not torch.is_grad_enabled():
                return
            swapped = []
            for owner, name, group, scale in items:
                tensor = _lookup(owner, name)
                if tensor is None or not tensor.requires_grad:
                    continue
                used = _ReduceParamGrad.apply(tensor, group, scale)
                _replace(owner, name, tensor, used)
                swapped.append((owner, name, tensor, used))
            self._swapped.setdefault(id(module), []).append(swapped)

        return swap_in

    def _post_hook(self):
        def swap_out(module, args, output) -> None:
            stack = self._swapped.get(id(module))
            if not stack:
                return
            for owner, name, tensor, used in stack.pop():
                # Where FSDP already put its own (sharded) param back, that stays.
                _replace(owner, name, used, tensor)

        return swap_out


def find_grad_hooks(module: torch.nn.Module) -> List[TorchFSDPGrads]:
    """The TorchFSDPGrads of the transformed models in `module`'s tree (each once)."""
    found: Dict[int, TorchFSDPGrads] = {}
    for sub in module.modules():
        hooks = getattr(sub, ATTRIBUTE, None)
        if hooks is not None:
            found[id(hooks)] = hooks
    return list(found.values())


__all__ = ["TorchFSDPGrads", "find_grad_hooks"]
