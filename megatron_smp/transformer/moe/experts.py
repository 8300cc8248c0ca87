"""The local experts of one MoE layer: `num_local_experts` feed-forward blocks.

Each expert is the dense `MLP` (SwiGLU or GeLU, split like the dense one, over the
expert-tensor-parallel group: the TP group, or --expert-tensor-parallel-size ranks) with `moe_ffn_hidden_size`; its parameters are marked as expert parameters
(`allreduce = False`: reduced over the expert-data-parallel group) and carry the rename of
their local index to the global expert index for checkpoints.

forward(tokens [N, h] sorted by local expert, tokens_per_expert [num_local_experts])
-> [N, h], this rank's expert-tensor-parallel partial sums. The experts do no communication: the
token dispatcher gathers their input and reduce-scatters their output once for all of them.
Computation is one matmul per expert and projection, or with `moe_grouped_gemm` one
`torch._grouped_mm` for all experts where torch has it (a tested fallback otherwise); LoRA
adapters on the experts' projections (tensor_parallel.lora) add their terms per expert.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from megatron_smp.config import TransformerConfig, recompute_modules
from megatron_smp.tensor_parallel.layers import linear
from megatron_smp.tensor_parallel.mappings import group_rank
from megatron_smp.tensor_parallel.random import CheckpointWithoutOutput
from megatron_smp.tensor_parallel.utils import mark_expert_param
from megatron_smp.transformer.mlp import MLP, activation_function, gated_linear_unit
from megatron_smp.transformer.utils import derive_seed, init_rng_scope


def grouped_gemm_supported(dtype: torch.dtype, *row_sizes: int) -> bool:
    """Whether `torch._grouped_mm` can run here on operands whose rows hold `row_sizes`
    elements: the op exists (torch >= 2.8, CPU and CUDA) and every row is a multiple of
    16 bytes (its alignment rule)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    element_size = torch.empty((), dtype=dtype).element_size()
    return all(size * element_size % 16 == 0 for size in row_sizes)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous (`_grouped_mm`'s backward
    rejects the broadcast gradients some reductions produce)."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def _with_adapter(linear, inputs: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
    """`output` of `linear` on `inputs` plus its LoRA adapter's term, where it has one (the
    experts call F.linear on the weights, not the layer: tensor_parallel.lora)."""
    if linear.lora is None or not linear.lora.enabled:
        return output
    return output + linear.lora(inputs)


class MoEExperts(torch.nn.Module):
    def __init__(
        self,
        config: TransformerConfig,
        state,
        num_local_experts: int,
        expert_offset: int,
        layer_number: int = 1,
        device: Optional[torch.device] = None,
    ) -> None:
        super().__init__()
        self.num_local_experts = num_local_experts
        self.expert_offset = expert_offset
        self.config = config
        self.gated = config.gated_linear_unit
        self.activation = activation_function(config.activation)
        self.use_grouped_gemm = config.moe_grouped_gemm
        # --recompute-modules moe_act (Megatron's, with --moe-grouped-gemm): the activation's
        # output is freed once fc2 has used it and recomputed from fc1's output in backward.
        self.recompute_activation = "moe_act" in recompute_modules(config)
        # The replicated output bias is added by one tensor-parallel rank, so the partial
        # sums add up to one bias (its grad is then summed over TP, like a norm weight's).
        # The other ranks add it times zero: every TP rank uses it alike, so a sum of its
        # grad inside backward (torch FSDP, see smp.fsdp_grads) runs on all of them.
        self.adds_output_bias = group_rank(state.etp_group) == 0
        # Latent experts (--moe-latent-size) read and write the latent width.
        expert_config = config.replace(ffn_hidden_size=config.moe_ffn_hidden_size,
                                       hidden_size=config.moe_latent_size or config.hidden_size)
        # One draw (the same on every rank), then expert g is built under its own seed: its
        # weights do not depend on how the experts are spread over ranks.
        base_seed = int(torch.randint(0, 2**62, (1,)).item())
        experts = []
        for local_index in range(num_local_experts):
            global_index = expert_offset + local_index
            with init_rng_scope(derive_seed(base_seed, global_index)):
                expert = MLP(expert_config, state, layer_number=layer_number, device=device,
                             tp_group=state.etp_group)
            for param in expert.parameters():
                mark_expert_param(
                    param, f".local_experts.{local_index}.", f".local_experts.{global_index}.",
                    (state.etp_rank, state.etp_size),
                )
            experts.append(expert)
        self.local_experts = torch.nn.ModuleList(experts)

    def replay_init(self, replay, materialize) -> int:
        """Delayed initialisation of a meta-device build (`distributed.delayed_init`): the
        constructor's base-seed draw, then each expert's projections (`replay`) under the
        seed of its global index."""
        base_seed = int(torch.randint(0, 2**62, (1,)).item())
        count = 0
        for local_index, expert in enumerate(self.local_experts):
            with init_rng_scope(derive_seed(base_seed, self.expert_offset + local_index)):
                count += sum(replay(module) for module in expert.modules())
        return count

    def _activate(self, intermediate: torch.Tensor) -> torch.Tensor:
        if self.gated:
            return gated_linear_unit(intermediate, self.activation, self.config)
        return self.activation(intermediate)

    def _contiguous_activation(self, intermediate: torch.Tensor) -> torch.Tensor:
        return self._activate(intermediate).contiguous()

    def _activated(self, intermediate: torch.Tensor, consumer) -> torch.Tensor:
        """consumer(activation(intermediate)) [N, f] -> [N, h]; with --recompute-modules
        moe_act the activation's output is discarded after the consumer saved it and
        recomputed when the consumer's output gets its grad."""
        if not (self.recompute_activation and self.training and torch.is_grad_enabled()):
            return consumer(self._contiguous_activation(intermediate))
        discarding = CheckpointWithoutOutput()
        output = consumer(discarding.checkpoint(self._contiguous_activation, intermediate))
        discarding.discard_output_and_register_recompute(output)
        return output

    def _expert_forward(self, expert: MLP, tokens: torch.Tensor) -> torch.Tensor:
        fc1, fc2 = expert.linear_fc1, expert.linear_fc2
        return self._activated(
            _with_adapter(fc1, tokens, linear(tokens, fc1.weight, fc1.bias)),
            lambda activated: _with_adapter(
                fc2, activated, linear(activated, fc2.weight, self._output_bias(fc2.bias))))

    def _adapter_terms(self, projection: str, inputs: torch.Tensor,
                       counts: Sequence[int]) -> Optional[torch.Tensor]:
        """The LoRA terms of every local expert's `projection` ("linear_fc1" or
        "linear_fc2") on its rows of `inputs` [N, in] -> [N, out], or None when the experts
        have no (enabled) adapters."""
        linears = [getattr(expert, projection) for expert in self.local_experts]
        # apply_lora adapts a projection by its name, so every expert's alike (or none).
        if not all(linear.lora is not None and linear.lora.enabled for linear in linears):
            return None
        return torch.cat([linear.lora(rows)
                          for linear, rows in zip(linears, torch.split(inputs, counts))])

    def _output_bias(self, bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if bias is None or self.adds_output_bias:
            return bias
        return bias * 0.0

    def _grouped_forward(self, tokens: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        experts = self.local_experts
        offsets = torch.tensor(counts, device=tokens.device).cumsum(0).to(torch.int32)
        fc1 = torch.stack([e.linear_fc1.weight.t() for e in experts])  # [E_l, h, f1]
        intermediate = torch._grouped_mm(_ContiguousGrad.apply(tokens), fc1, offs=offsets)
        if experts[0].linear_fc1.bias is not None:
            biases = torch.stack([e.linear_fc1.bias for e in experts])
            intermediate = intermediate + biases.repeat_interleave(
                torch.tensor(counts, device=tokens.device), dim=0, output_size=tokens.shape[0]
            )
        adapters = self._adapter_terms("linear_fc1", tokens, counts)
        if adapters is not None:
            intermediate = intermediate + adapters
        fc2 = torch.stack([e.linear_fc2.weight.t() for e in experts])  # [E_l, f, h]

        def fc2_of(activated: torch.Tensor) -> torch.Tensor:
            activated = _ContiguousGrad.apply(activated)
            output = torch._grouped_mm(activated, fc2, offs=offsets)
            adapters = self._adapter_terms("linear_fc2", activated, counts)
            return output if adapters is None else output + adapters

        output = self._activated(intermediate, fc2_of)
        if experts[0].linear_fc2.bias is not None:
            biases = self._output_bias(torch.stack([e.linear_fc2.bias for e in experts]))
            output = output + biases.repeat_interleave(
                torch.tensor(counts, device=tokens.device), dim=0, output_size=tokens.shape[0]
            )
        return output

    def forward(self, tokens: torch.Tensor, tokens_per_expert: Sequence[int]) -> torch.Tensor:
        counts: List[int] = [int(c) for c in tokens_per_expert]
        first = self.local_experts[0]
        fc1_rows, hidden = first.linear_fc1.weight.shape
        if (self.use_grouped_gemm and tokens.shape[0] > 0 and grouped_gemm_supported(
                tokens.dtype, hidden, fc1_rows, first.linear_fc2.weight.shape[1])):
            return self._grouped_forward(tokens, counts)
        outputs = [
            self._expert_forward(expert, chunk)
            for expert, chunk in zip(self.local_experts, torch.split(tokens, counts))
        ]
        return torch.cat(outputs, dim=0)


__all__ = ["MoEExperts", "grouped_gemm_supported"]
