"""Megatron's optimizer wrappers: fp32, and fp16/bf16 params with fp32 main params.

Every wrapper owns a torch optimizer over *main* params and a list of (model param, main
param) pairs. A step is: copy model grads (`param.main_grad`) to the main params' `.grad`;
with a loss scaler, unscale them and detect inf/nan on every rank (skipping the step when
any rank overflowed); clip by the global norm; step; copy the main params back.
"""
from __future__ import annotations

import math
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron_smp.config import OptimizerConfig
from megatron_smp.optimizer.clip_grads import (
    clip_grad_by_total_norm_fp32,
    count_zeros_fp32,
    grad_norm_power,
    param_is_not_shared,
    param_is_not_tensor_parallel_duplicate,
)
from megatron_smp.tensor_parallel.utils import is_expert_param

HALF_DTYPES = (torch.float16, torch.bfloat16)


def model_grad(param: torch.nn.Parameter) -> Optional[torch.Tensor]:
    """The accumulated grad of a model param: `main_grad` under our DDP, else `.grad`."""
    main_grad = getattr(param, "main_grad", None)
    return main_grad if main_grad is not None else param.grad


class MegatronOptimizer:
    """Common step logic. Subclasses set `self.param_pairs` and the two copy methods.

    Args:
        optimizer: the torch optimizer over the main params.
        config: OptimizerConfig (clip_grad, log_num_zeros_in_grad).
        state: ParallelState (tp rank for norm deduplication, groups for reductions).
        model_chunks: the (DDP-wrapped) model chunks; zero_grad() clears their buffers.
        grad_scaler: a ConstantGradScaler/DynamicGradScaler for fp16, else None.
    """

    # With the distributed optimizer each rank holds a DP shard of the grads, so norms and
    # zero counts also sum over the data-parallel group.
    grads_sharded_over_dp = False

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        config: OptimizerConfig,
        state,
        model_chunks: Sequence[torch.nn.Module],
        grad_scaler=None,
    ):
        self.optimizer = optimizer
        self.config = config
        self.state = state
        self.model_chunks = list(model_chunks)
        self.grad_scaler = grad_scaler
        self._param_pairs: List[Tuple[torch.nn.Parameter, torch.Tensor]] = []
        self._unit_scale = torch.ones(1, dtype=torch.float32, device=state.device)
        self._model_has_expert_params: Optional[bool] = None

    @property
    def param_pairs(self) -> List[Tuple[torch.nn.Parameter, torch.Tensor]]:
        """(model param, main param) of every param this rank steps."""
        return self._param_pairs

    @param_pairs.setter
    def param_pairs(self, pairs: List[Tuple[torch.nn.Parameter, torch.Tensor]]) -> None:
        self._param_pairs = pairs
        # Muon reads each main param's TP layout and QKV split from its model param.
        if hasattr(self.optimizer, "bind"):
            self.optimizer.bind(pairs, self.state.tp_group, self.state.etp_group)

    # Interface used by the training loop ---------------------------------------------------------
    @property
    def param_groups(self) -> list:
        return self.optimizer.param_groups

    def get_loss_scale(self) -> torch.Tensor:
        return self.grad_scaler.scale if self.grad_scaler is not None else self._unit_scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.get_loss_scale()[0]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the model chunks' grad buffers (or .grad) and the main params' grads."""
        for chunk in self.model_chunks:
            if hasattr(chunk, "zero_grad_buffer"):
                chunk.zero_grad_buffer()
            else:
                chunk.zero_grad(set_to_none=True)
        for _, main_param in self.param_pairs:
            main_param.grad = None

    @torch.no_grad()
    def step(self) -> Tuple[bool, Optional[float], Optional[int]]:
        """Returns (update_successful, grad_norm or None, num_zeros_in_grad or None)."""
        self._copy_model_grads_to_main_grads()
        if self.grad_scaler is not None:
            found_inf = self._unscale_main_grads_and_check_for_nan()
            self.grad_scaler.update(found_inf)
            if found_inf:
                return False, None, None
        grad_norm = None
        if self.config.clip_grad > 0.0:
            grad_norm = self.clip_grad_norm(self.config.clip_grad)
        num_zeros = self.count_zeros() if self.config.log_num_zeros_in_grad else None
        self.optimizer.step()
        self._copy_main_params_to_model_params()
        self._start_param_sync()
        return True, grad_norm, num_zeros

    # Grad statistics ---------------------------------------------------------------------------
    def _main_grads(self) -> List[torch.Tensor]:
        return [main.grad for _, main in self.param_pairs if main.grad is not None]

    def _for_norm(self, tensor_of: Callable) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
        """(dense, expert) tensors this rank counts in a norm: no TP duplicates, no tied
        copies. `tensor_of(model_param, main_param)` gives each pair's tensor (None: skip)."""
        dense, expert = [], []
        for model_param, main_param in self.param_pairs:
            tensor = tensor_of(model_param, main_param)
            if tensor is None or not param_is_not_shared(model_param):
                continue
            if not param_is_not_tensor_parallel_duplicate(model_param, self.state.tp_rank):
                continue
            (expert if is_expert_param(model_param) else dense).append(tensor)
        return dense, expert

    def _grads_for_norm(self) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
        return self._for_norm(lambda model_param, main_param: main_param.grad)

    def _params_for_norm(self) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
        # Main params: fp32 even for bf16/fp16 models, as Megatron's calc_params_l2_norm.
        return self._for_norm(lambda model_param, main_param: main_param.detach())

    def _norm_groups(self):
        """Groups over which partial sums of dense and of expert grads are added."""
        state = self.state
        dense = [state.model_parallel_group]
        # Each expert tensor once: over the stages and the etp x ep block of each (Megatron's
        # expert tensor-model-pipeline group; with ETP = TP the same as tp x pp, then ep).
        expert = [state.pp_group, state.tp_ep_group]
        if self.grads_sharded_over_dp:
            # Sharded within an instance (--num-distributed-optimizer-instances): the others
            # hold the same shards.
            instances = self.config.num_distributed_optimizer_instances
            if instances > 1:
                groups = state.optimizer_instance_groups(instances)
                dense.append(groups["dense"][0])
                expert.append(groups["expert"][0])
            else:
                dense.append(state.dp_cp_group)
                expert.append(state.expert_dp_group)
        return dense, expert

    def get_grad_norm(self, norm_type: float = 2.0) -> float:
        return self._total_norm(*self._grads_for_norm(), norm_type)

    @torch.no_grad()
    def get_params_norm(self) -> float:
        """L2 norm of the whole model's parameters (Megatron's --log-params-norm), each
        element counted once across tp / pp / dp / ep ranks. Collective over those groups."""
        return self._total_norm(*self._params_for_norm(), 2.0)

    @property
    def model_has_expert_params(self) -> bool:
        """Whether any rank of this model holds expert params. A pipeline stage without MoE
        layers (`--moe-layer-freq [1,1,0,0]`, DeepSeek's dense first layers) holds none but
        must still join the expert norms' collectives over the model-parallel group, or the
        stages disagree on the number of collectives and hang. Decided once, collectively
        (every rank builds the optimizer), on the first call."""
        if self._model_has_expert_params is None:
            local = any(is_expert_param(p) for p, _ in self.param_pairs)
            flag = torch.tensor([1 if local else 0], dtype=torch.int32, device=self.state.device)
            group = self.state.model_parallel_group
            if dist.is_initialized() and dist.get_world_size(group) > 1:
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
            self._model_has_expert_params = bool(flag.item())
        return self._model_has_expert_params

    def _total_norm(self, dense: List[torch.Tensor], expert: List[torch.Tensor],
                    norm_type: float) -> float:
        dense_groups, expert_groups = self._norm_groups()
        device = self.state.device
        total = grad_norm_power(dense, norm_type, dense_groups, device)
        if self.model_has_expert_params:
            expert_total = grad_norm_power(expert, norm_type, expert_groups, device)
            if norm_type == math.inf:
                total = torch.maximum(total, expert_total)
            else:
                total = total + expert_total
        if norm_type == math.inf:
            return total.item()
        return total.item() ** (1.0 / norm_type)

    def clip_grad_norm(self, max_norm: float) -> float:
        grad_norm = self.get_grad_norm()
        clip_grad_by_total_norm_fp32(self._main_grads(), max_norm, grad_norm)
        return grad_norm

    def count_zeros(self) -> int:
        dense, expert = self._grads_for_norm()
        dense_groups, expert_groups = self._norm_groups()
        total = count_zeros_fp32(dense, dense_groups, self.state.device)
        if self.model_has_expert_params:
            total += count_zeros_fp32(expert, expert_groups, self.state.device)
        return total

    def _unscale_main_grads_and_check_for_nan(self) -> bool:
        """Multiply main grads by 1/scale; True when any grad on any rank is inf/nan."""
        grads = self._main_grads()
        found_inf = torch.zeros(1, dtype=torch.float32, device=self.state.device)
        if grads:
            torch._amp_foreach_non_finite_check_and_unscale_(
                grads, found_inf, self.grad_scaler.inv_scale.to(found_inf.device)
            )
        # One rank's overflow must skip the step everywhere, or the replicas diverge.
        for group in (self.state.model_parallel_group, self.state.dp_cp_group):
            if dist.get_world_size(group) > 1:
                dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=group)
        return bool(found_inf.item() > 0)

    # Subclass hooks ------------------------------------------------------------------------------
    def _copy_model_grads_to_main_grads(self) -> None:
        raise NotImplementedError

    def _copy_main_params_to_model_params(self) -> None:
        raise NotImplementedError

    def _start_param_sync(self) -> None:
        pass

    def reload_model_params(self) -> None:
        """Refresh main params from the model params (after loading a model checkpoint
        without optimizer state)."""
        raise NotImplementedError

    # Checkpoints ---------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        state_dict = {"optimizer": self.optimizer.state_dict()}
        if self.grad_scaler is not None:
            state_dict["grad_scaler"] = self.grad_scaler.state_dict()
        return state_dict

    def load_state_dict(self, state_dict: dict) -> None:
        self.optimizer.load_state_dict(state_dict["optimizer"])
        if self.grad_scaler is not None and "grad_scaler" in state_dict:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])


class FP32Optimizer(MegatronOptimizer):
    """fp32 params: the model params are the main params, `.grad` aliases `main_grad`."""

    def __init__(self, optimizer_factory: Callable, config, state, model_chunks, param_groups,
                 grad_scaler=None):
        """`grad_scaler`: only where the model computes in fp16 on fp32 params (FSDP2)."""
        optimizer = optimizer_factory(param_groups)
        super().__init__(optimizer, config, state, model_chunks, grad_scaler=grad_scaler)
        self.param_pairs = [(p, p) for group in param_groups for p in group["params"]]

    def _copy_model_grads_to_main_grads(self) -> None:
        for param, _ in self.param_pairs:
            main_grad = getattr(param, "main_grad", None)
            if main_grad is not None:
                param.grad = main_grad

    def _copy_main_params_to_model_params(self) -> None:
        pass

    def reload_model_params(self) -> None:
        pass


class Float16OptimizerWithFloat16Params(MegatronOptimizer):
    """fp16/bf16 model params, each with an fp32 main copy the torch optimizer updates.

    fp32 params in the same model (if any) are their own main params.
    """

    def __init__(
        self, optimizer_factory: Callable, config, state, model_chunks, param_groups,
        grad_scaler=None,
    ):
        main_groups, pairs = [], []
        for group in param_groups:
            main_params = []
            for param in group["params"]:
                main = param.detach().float() if param.dtype in HALF_DTYPES else param
                pairs.append((param, main))
                main_params.append(main)
            main_groups.append({**group, "params": main_params})
        super().__init__(optimizer_factory(main_groups), config, state, model_chunks, grad_scaler)
        self.param_pairs = pairs

    def _copy_model_grads_to_main_grads(self) -> None:
        for model_param, main_param in self.param_pairs:
            grad = model_grad(model_param)
            main_param.grad = None if grad is None else grad.float()

    def _copy_main_params_to_model_params(self) -> None:
        for model_param, main_param in self.param_pairs:
            if main_param is not model_param:
                model_param.data.copy_(main_param)

    def reload_model_params(self) -> None:
        with torch.no_grad():
            for model_param, main_param in self.param_pairs:
                if main_param is not model_param:
                    main_param.copy_(model_param)

    def state_dict(self) -> dict:
        state_dict = super().state_dict()
        state_dict["fp32_from_fp16_params"] = [main for _, main in self.param_pairs]
        return state_dict

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        with torch.no_grad():
            for (_, main), saved in zip(self.param_pairs, state_dict["fp32_from_fp16_params"]):
                main.copy_(saved)
