"""Tensor-parallel linear and embedding layers.

Each layer is a thin module over one communication function (`mappings`, or for the column
layer `_LinearFunction`, which fuses the input's communication with the matmul
so the sequence-parallel gather need not be kept for backward):

* `ColumnParallelLinear`  Y = X A^T with A split along its output rows: Y is split along
  the last dim. Input replicated ([s, b, h]) or, with sequence parallelism, this rank's
  sequence shard ([s/tp, b, h]) which is all-gathered first.
* `RowParallelLinear`     A split along its input columns: takes the split activations and
  sums the partial products over ranks (all-reduce, or reduce-scatter along dim 0 with
  sequence parallelism). The bias is added once, after the reduction.
* `VocabParallelEmbedding` the table split along the vocabulary.

Initialisation does not depend on the tensor-parallel size: every weight's full master
tensor is drawn on the CPU from the default generator, in construction order and identically
on every rank, and each rank keeps its slice. Gathering the slices of a TP=k model therefore
gives the TP=1 model built from the same seed.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_smp.config import TransformerConfig
from megatron_smp.tensor_parallel.mappings import (
    ProcessGroup,
    _all_gather_single,
    _reduce_scatter_single,
    gather_from_tensor_model_parallel_region,
    group_rank,
    group_size,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megatron_smp.tensor_parallel.utils import (
    InitMethod,
    divide,
    hidden_init_method,
    set_tensor_model_parallel_attributes,
)


def _is_meta(device: Optional[torch.device]) -> bool:
    return device is not None and torch.device(device).type == "meta"


def _draw_master_slice(
    master_shape: Tuple[int, int],
    init_method: InitMethod,
    partition_dim: int,
    stride: int,
    tp_rank: int,
    tp_size: int,
    padded_size: Optional[int] = None,
) -> torch.Tensor:
    """Draw the full master weight on the CPU and return this rank's slice (fp32, CPU).

    `stride` > 1 splits the master into stride * tp chunks along `partition_dim` and gives
    rank r the chunks r, r + tp, ... (Megatron's `_initialize_affine_weight_cpu`): a fused
    [gate; up] weight then gives rank r gate chunk r and up chunk r.

    `padded_size` zero-pads `partition_dim` after drawing, so padding rows neither consume
    the RNG stream nor depend on the tensor-parallel size.
    """
    # Always the CPU default generator and fp32, whatever the target device and dtype: the
    # numbers then do not depend on the device, the dtype or the tensor-parallel layout.
    master = torch.empty(master_shape, dtype=torch.float32)
    init_method(master)
    if padded_size is not None and padded_size > master.shape[partition_dim]:
        pad_shape = list(master.shape)
        pad_shape[partition_dim] = padded_size - master.shape[partition_dim]
        master = torch.cat([master, master.new_zeros(pad_shape)], dim=partition_dim)
    chunk = divide(master.shape[partition_dim], tp_size * stride)
    pieces = torch.split(master, chunk, dim=partition_dim)
    return torch.cat(pieces[tp_rank::tp_size], dim=partition_dim)


def _mark_expert(module: torch.nn.Module, is_expert: bool) -> None:
    # Expert parameters differ across expert-parallel ranks: the data-parallel reduction
    # must use the expert-data-parallel group instead of the full one.
    for param in module.parameters(recurse=False):
        param.allreduce = not is_expert


class _LinearFunction(torch.autograd.Function):
    """output = x W^T + b, with the column layer's input communication fused in and, given
    `main_grad`, Megatron's gradient-accumulation fusion.

    `group` None: no communication (one rank, or a row-parallel layer, whose output is
    reduced outside). Column-parallel without sequence parallelism: x [s, b, h] is
    replicated; backward all-reduces its grad (the conjugate of a copy), overlapped with the
    weight-grad product. With sequence parallelism x is this rank's shard [s/tp, b, h];
    forward all-gathers it, and only the shard is kept for backward, which re-gathers it
    (overlapped with the input-grad product) and reduce-scatters the input grad (overlapped
    with the weight grad). This keeps 1/tp of the gathered activation alive between forward
    and backward.

    `main_grad` (the weight's fp32 grad buffer view under our DDP, --gradient-accumulation-
    fusion): the weight-grad product is added straight into it (`addmm_`, no weight-sized
    temporary, no separate accumulation pass) and the weight's autograd grad is None. The
    weight's post-accumulate hook still runs once every consumer's backward is done (also when
    every grad it receives is None), so DDP's readiness is unchanged, and a tied weight's
    other grads (the embedding's) still arrive in `.grad` and are added by the hook.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, group, sequence_parallel, main_grad):
        ctx.group = group
        ctx.sequence_parallel = sequence_parallel
        ctx.has_bias = bias is not None
        ctx.main_grad = main_grad
        ctx.save_for_backward(x, weight)
        total_input = _gather_sequence(x, group)[0] if sequence_parallel else x
        return F.linear(total_input, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        group = ctx.group
        gather_handle = reduce_handle = None
        if ctx.sequence_parallel:
            total_input, gather_handle = _gather_sequence(x, group, async_op=True)
        else:
            total_input = x
        # Under autocast forward computed in a lower precision than the saved tensors hold:
        # do the backward products in the gradient's dtype too.
        compute_dtype = grad_output.dtype
        grad_input = None
        if ctx.needs_input_grad[0] or group is not None:
            grad_input = grad_output.matmul(weight.to(compute_dtype))
        if gather_handle is not None:
            gather_handle.wait()
        if group is not None:
            if ctx.sequence_parallel:
                grad_input, reduce_handle = _reduce_scatter_sequence(grad_input, group)
            else:
                grad_input = grad_input.contiguous()
                reduce_handle = dist.all_reduce(grad_input, group=group, async_op=True)
        grad_output_2d = grad_output.reshape(-1, grad_output.shape[-1])
        grad_weight = grad_bias = None
        if ctx.needs_input_grad[1]:  # a frozen weight needs no product
            total_input_2d = total_input.reshape(-1, total_input.shape[-1]).to(compute_dtype)
            main_grad = ctx.main_grad
            if main_grad is None:
                grad_weight = grad_output_2d.t().matmul(total_input_2d).to(weight.dtype)
            elif main_grad.dtype == compute_dtype:
                main_grad.addmm_(grad_output_2d.t(), total_input_2d)
            else:  # bf16/fp16 products into fp32 main grads: one add, no autograd grad
                main_grad.add_(grad_output_2d.t().matmul(total_input_2d))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad_output_2d.sum(dim=0).to(weight.dtype)
        if reduce_handle is not None:
            reduce_handle.wait()
        if grad_input is not None:
            grad_input = grad_input.to(x.dtype)
        return grad_input, grad_weight, grad_bias, None, None, None


def _fusion_target(weight: torch.Tensor, enabled: bool) -> Optional[torch.Tensor]:
    """The `main_grad` a linear layer accumulates its weight grad into (Megatron's
    --gradient-accumulation-fusion), or None: fusion off, no grad wanted, or no main grad
    (not wrapped by our DDP, e.g. FSDP2 or a bare module)."""
    if not enabled or not weight.requires_grad or not torch.is_grad_enabled():
        return None
    return getattr(weight, "main_grad", None)


def _gather_sequence(x: torch.Tensor, group: ProcessGroup, async_op: bool = False):
    """All-gather dim 0 into a new [tp * s/tp, ...] tensor; returns (tensor, handle or None)."""
    x = x.contiguous()
    world = dist.get_world_size(group)
    out = torch.empty((world * x.shape[0],) + x.shape[1:], dtype=x.dtype, device=x.device)
    handle = _all_gather_single(out, x, group=group, async_op=async_op)
    return out, handle


def _reduce_scatter_sequence(x: torch.Tensor, group: ProcessGroup):
    """Start an async reduce-scatter along dim 0; returns (this rank's shard, handle)."""
    x = x.contiguous()
    world = dist.get_world_size(group)
    out = torch.empty((x.shape[0] // world,) + x.shape[1:], dtype=x.dtype, device=x.device)
    handle = _reduce_scatter_single(out, x, group=group, async_op=True)
    return out, handle


class _ParallelLinear(torch.nn.Module):
    """What the column- and row-parallel linears share: their sizes, group, init method and
    options, the sequence-parallel decision (the config's unless given, and only at tp > 1),
    and the end of construction (expert marks, no LoRA adapter yet, the weights drawn unless
    built on the meta device)."""

    # reset_parameters() draws what the constructor drew: delayed (meta-device)
    # initialisation replays it (distributed.delayed_init).
    REPLAYS_CONSTRUCTOR_INIT = True

    def _init_common(self, input_size: int, output_size: int, config: TransformerConfig,
                     tp_group: ProcessGroup, init_method: InitMethod, skip_bias_add: bool,
                     stride: int, is_expert: bool, sequence_parallel: Optional[bool],
                     device: Optional[torch.device]) -> Tuple[torch.device, torch.dtype]:
        """Set the shared attributes; returns (the device, the params' dtype)."""
        self.input_size = input_size
        self.output_size = output_size
        self.tp_group = tp_group
        self.tp_size = group_size(tp_group)
        self.tp_rank = group_rank(tp_group)
        self.init_method = init_method
        self.skip_bias_add = skip_bias_add
        self.stride = stride
        self.is_expert = is_expert
        self.gradient_accumulation_fusion = config.gradient_accumulation_fusion
        self.sequence_parallel = (config.sequence_parallel_at(self.tp_size)
                                  if sequence_parallel is None
                                  else sequence_parallel and self.tp_size > 1)
        device = torch.device("cpu") if device is None else torch.device(device)
        return device, config.params_dtype

    def _finish_init(self, is_expert: bool, device: torch.device) -> None:
        _mark_expert(self, is_expert)
        # A LoRAAdapter set by tensor_parallel.lora.apply_lora, else None.
        self.lora = None
        if not _is_meta(device):
            self.reset_parameters()


# Rows from which inference on the CPU takes oneDNN's fp32 GEMM (measured on an AVX-512 AMD
# CPU, one thread, [M, 384] x [384, 1024]: MKL's sgemm 22 / 64 / 217 / 1237 us at M = 1 / 4 /
# 24 / 160, oneDNN's 32 / 57 / 121 / 558 us; MKL takes its AVX2 paths off Intel CPUs).
ONEDNN_MIN_ROWS = 4


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None
           ) -> torch.Tensor:
    """F.linear(x [..., k], weight [n, k], bias [n]) -> [..., n]; under inference mode on the
    CPU in fp32 with at least ONEDNN_MIN_ROWS rows, through oneDNN's GEMM instead of the BLAS
    one (the same product, rounded in another order: training and evaluation never take it;
    nor does torch.compile, whose lowering of it takes only static shapes)."""
    if torch.compiler.is_compiling():  # (first: the checks below would break the graph)
        return F.linear(x, weight, bias)
    if (x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32
            and torch.is_inference_mode_enabled() and torch.backends.mkldnn.is_available()
            and x.numel() >= ONEDNN_MIN_ROWS * x.shape[-1]):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


class ColumnParallelLinear(_ParallelLinear):
    """Linear layer whose weight [output_size, input_size] is split along the output dim.

    forward(x [s, b, input_size], weight=None) -> (output, output_bias)
      * x is [s/tp, b, input_size] with sequence parallelism (all-gathered along dim 0 here).
      * output is [s, b, output_size/tp], or [s, b, output_size] with `gather_output`.
      * output_bias is None, or with `skip_bias_add` the bias, not added: this rank's
        [output_size/tp], or the whole [output_size] with `gather_output`.

    `weight=` supplies the weight (e.g. the tied word embedding [padded_vocab/tp, h]) of a
    layer built with `skip_weight_param_allocation=True`. `true_output_size` (< output_size)
    draws only that many output rows and zero-pads the rest (an untied output layer over a
    padded vocabulary), keeping the init independent of the padding.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config: TransformerConfig,
        tp_group: ProcessGroup,
        init_method: InitMethod,
        bias: bool = True,
        gather_output: bool = False,
        skip_bias_add: bool = False,
        stride: int = 1,
        skip_weight_param_allocation: bool = False,
        sequence_parallel: Optional[bool] = None,
        is_expert: bool = False,
        true_output_size: Optional[int] = None,
        device: Optional[torch.device] = None,
    ) -> None:
        super().__init__()
        device, dtype = self._init_common(input_size, output_size, config, tp_group,
                                          init_method, skip_bias_add, stride, is_expert,
                                          sequence_parallel, device)
        self.gather_output = gather_output
        self.true_output_size = true_output_size
        if true_output_size is not None and stride != 1:
            raise ValueError("ColumnParallelLinear: true_output_size needs stride == 1")
        self.output_size_per_partition = divide(output_size, self.tp_size)

        if skip_weight_param_allocation:
            self.weight = None
        else:
            self.weight = torch.nn.Parameter(
                torch.empty(self.output_size_per_partition, input_size, dtype=dtype, device=device)
            )
            set_tensor_model_parallel_attributes(self.weight, True, 0, stride)
        if bias:
            self.bias = torch.nn.Parameter(
                torch.empty(self.output_size_per_partition, dtype=dtype, device=device)
            )
            set_tensor_model_parallel_attributes(self.bias, True, 0, stride)
        else:
            self.register_parameter("bias", None)
        self._finish_init(is_expert, device)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """(Re)draw the weight from the default CPU generator and zero the bias. Called by the
        constructor; call it after `to_empty()` on a module built on the meta device."""
        if self.weight is not None:
            rows = self.true_output_size or self.output_size
            local = _draw_master_slice(
                (rows, self.input_size),
                self.init_method,
                partition_dim=0,
                stride=self.stride,
                tp_rank=self.tp_rank,
                tp_size=self.tp_size,
                padded_size=self.output_size,
            )
            self.weight.copy_(local)
        if self.bias is not None:
            self.bias.zero_()

    def forward(
        self, x: torch.Tensor, weight: Optional[torch.Tensor] = None
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        if weight is None:
            if self.weight is None:
                raise ValueError(
                    "ColumnParallelLinear was built with skip_weight_param_allocation=True: "
                    "pass weight= to forward"
                )
            weight = self.weight
        elif tuple(weight.shape) != (self.output_size_per_partition, self.input_size):
            raise ValueError(
                f"ColumnParallelLinear: weight= has shape {tuple(weight.shape)}, expected "
                f"{(self.output_size_per_partition, self.input_size)}"
            )
        bias = None if self.skip_bias_add else self.bias
        main_grad = _fusion_target(weight, self.gradient_accumulation_fusion)
        if self.tp_size == 1 and main_grad is None:
            output = linear(x, weight, bias)
        else:
            output = _LinearFunction.apply(
                x, weight, bias, self.tp_group if self.tp_size > 1 else None,
                self.sequence_parallel, main_grad,
            )
        if self.lora is not None and self.lora.enabled:
            output = output + self.lora(x)
        if self.gather_output:
            output = gather_from_tensor_model_parallel_region(output, self.tp_group)
        output_bias = self.bias if self.skip_bias_add else None
        if output_bias is not None and self.gather_output:
            # The caller adds the bias to the gathered output, so it gets the whole bias.
            output_bias = gather_from_tensor_model_parallel_region(output_bias, self.tp_group)
        return output, output_bias

    def extra_repr(self) -> str:
        return (
            f"in={self.input_size}, out={self.output_size} (local {self.output_size_per_partition})"
            f", tp={self.tp_size}, bias={self.bias is not None}, gather_output={self.gather_output}"
            f", sequence_parallel={self.sequence_parallel}, stride={self.stride}"
        )


class RowParallelLinear(_ParallelLinear):
    """Linear layer whose weight [output_size, input_size] is split along the input dim.

    forward(x [s, b, input_size/tp]) -> (output, output_bias)
      * with `input_is_parallel=False` x is [s, b, input_size] and is split here.
      * output is [s, b, output_size] summed over ranks, or [s/tp, b, output_size] with
        sequence parallelism (reduce-scattered along dim 0).
      * output_bias is None, or with `skip_bias_add` the bias [output_size], not added.

    The bias is replicated; with sequence parallelism its gradient comes from this rank's
    sequence shard only, so it is marked `sequence_parallel = True` and its gradient must be
    all-reduced over the tensor-parallel group (like the norm weights).
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config: TransformerConfig,
        tp_group: ProcessGroup,
        init_method: InitMethod,
        bias: bool = True,
        input_is_parallel: bool = True,
        skip_bias_add: bool = False,
        sequence_parallel: Optional[bool] = None,
        stride: int = 1,
        is_expert: bool = False,
        device: Optional[torch.device] = None,
    ) -> None:
        super().__init__()
        device, dtype = self._init_common(input_size, output_size, config, tp_group,
                                          init_method, skip_bias_add, stride, is_expert,
                                          sequence_parallel, device)
        self.input_is_parallel = input_is_parallel
        if self.sequence_parallel and not input_is_parallel:
            raise ValueError(
                "RowParallelLinear: sequence parallelism needs input_is_parallel=True"
            )
        self.input_size_per_partition = divide(input_size, self.tp_size)

        self.weight = torch.nn.Parameter(
            torch.empty(output_size, self.input_size_per_partition, dtype=dtype, device=device)
        )
        set_tensor_model_parallel_attributes(self.weight, True, 1, stride)
        if bias:
            self.bias = torch.nn.Parameter(torch.empty(output_size, dtype=dtype, device=device))
            set_tensor_model_parallel_attributes(self.bias, False, -1, 1)
            self.bias.sequence_parallel = self.sequence_parallel
        else:
            self.register_parameter("bias", None)
        self._finish_init(is_expert, device)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """(Re)draw the weight from the default CPU generator and zero the bias."""
        local = _draw_master_slice(
            (self.output_size, self.input_size),
            self.init_method,
            partition_dim=1,
            stride=self.stride,
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
        )
        self.weight.copy_(local)
        if self.bias is not None:
            self.bias.zero_()

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        if not self.input_is_parallel:
            x = scatter_to_tensor_model_parallel_region(x, self.tp_group)
        main_grad = _fusion_target(self.weight, self.gradient_accumulation_fusion)
        if main_grad is None:
            partial = linear(x, self.weight)
        else:
            partial = _LinearFunction.apply(x, self.weight, None, None, False, main_grad)
        if self.sequence_parallel:
            output = reduce_scatter_to_sequence_parallel_region(partial, self.tp_group)
        else:
            output = reduce_from_tensor_model_parallel_region(partial, self.tp_group)
        if self.lora is not None and self.lora.enabled:
            output = output + self.lora(x)
        if self.bias is not None and not self.skip_bias_add:
            output = output + self.bias
        output_bias = self.bias if self.skip_bias_add else None
        return output, output_bias

    def extra_repr(self) -> str:
        return (
            f"in={self.input_size} (local {self.input_size_per_partition}), "
            f"out={self.output_size}, tp={self.tp_size}, bias={self.bias is not None}, "
            f"sequence_parallel={self.sequence_parallel}"
        )


class VocabParallelEmbedding(torch.nn.Module):
    """Embedding table [padded_vocab, h] split along the vocabulary.

    `num_embeddings` is the true vocabulary; the table is padded to
    `config.padded_vocab_size(tp)` rows (with `make_vocab_size_divisible_by`). Padded rows
    are zero, are not drawn from the RNG and receive no gradient from valid ids.

    forward(ids [b, s] or any shape) -> [..., h], summed over ranks.
    With `reduce_scatter_embeddings=True` the caller passes ids [s, b] and gets this rank's
    sequence shard [s/tp, b, h] (reduce-scattered along dim 0, for sequence parallelism).
    """

    # reset_parameters() draws what the constructor drew: delayed (meta-device)
    # initialisation replays it (distributed.delayed_init).
    REPLAYS_CONSTRUCTOR_INIT = True

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        config: TransformerConfig,
        tp_group: ProcessGroup,
        init_method: InitMethod,
        reduce_scatter_embeddings: bool = False,
        device: Optional[torch.device] = None,
    ) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.tp_group = tp_group
        self.tp_size = group_size(tp_group)
        self.tp_rank = group_rank(tp_group)
        self.init_method = init_method
        self.reduce_scatter_embeddings = reduce_scatter_embeddings
        # Pad the vocabulary we are given (which may differ from config.vocab_size) by the
        # config's rule, so the padded size is the same everywhere it is computed.
        if num_embeddings == config.vocab_size:
            self.padded_vocab_size = config.padded_vocab_size(self.tp_size)
        else:
            self.padded_vocab_size = config.replace(vocab_size=num_embeddings).padded_vocab_size(
                self.tp_size
            )
        self.num_embeddings_per_partition = divide(self.padded_vocab_size, self.tp_size)
        self.vocab_start_index = self.tp_rank * self.num_embeddings_per_partition
        self.vocab_end_index = self.vocab_start_index + self.num_embeddings_per_partition
        device = torch.device("cpu") if device is None else torch.device(device)

        self.weight = torch.nn.Parameter(
            torch.empty(
                self.num_embeddings_per_partition,
                embedding_dim,
                dtype=config.params_dtype,
                device=device,
            )
        )
        set_tensor_model_parallel_attributes(self.weight, True, 0, 1)
        self.weight.allreduce = True
        if not _is_meta(device):
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """(Re)draw the true-vocabulary rows from the default CPU generator; padding is zero."""
        local = _draw_master_slice(
            (self.num_embeddings, self.embedding_dim),
            self.init_method,
            partition_dim=0,
            stride=1,
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            padded_size=self.padded_vocab_size,
        )
        self.weight.copy_(local)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size > 1:
            # Ids owned by another rank look up row 0 and are zeroed; the all-reduce then
            # fills them in from their owner.
            outside = (input_ids < self.vocab_start_index) | (input_ids >= self.vocab_end_index)
            local_ids = (input_ids - self.vocab_start_index).masked_fill(outside, 0)
            output = F.embedding(local_ids, self.weight)
            output = output.masked_fill(outside.unsqueeze(-1), 0.0)
        else:
            output = F.embedding(input_ids, self.weight)
        if self.reduce_scatter_embeddings:
            return reduce_scatter_to_sequence_parallel_region(output, self.tp_group)
        return reduce_from_tensor_model_parallel_region(output, self.tp_group)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings} (padded {self.padded_vocab_size}, local "
            f"{self.num_embeddings_per_partition}), {self.embedding_dim}, tp={self.tp_size}"
        )


class ReplicatedLinear(torch.nn.Module):
    """A linear layer every TP rank holds whole (MLA's down-projections, the MoE latent
    projections): forward(x [..., input_size]) -> [..., output_size].

    Drawn on the CPU from the init scope's generator with `init_method` (default: normal with
    config.init_method_std), so every layout holds the same values; the bias (`bias=True`)
    starts at zero. `sequence_parallel` marks the params for the TP sum of their grads when
    each rank feeds the layer another sequence shard."""

    # reset_parameters() draws what the constructor drew: delayed (meta-device)
    # initialisation replays it (distributed.delayed_init).
    REPLAYS_CONSTRUCTOR_INIT = True

    def __init__(self, input_size: int, output_size: int, config: TransformerConfig,
                 sequence_parallel: bool, device: Optional[torch.device],
                 init_method: Optional[InitMethod] = None, bias: bool = False) -> None:
        super().__init__()
        self.init_method = init_method or hidden_init_method(config)
        self.weight = torch.nn.Parameter(
            torch.empty(output_size, input_size, dtype=config.params_dtype, device=device))
        self.bias = None
        if bias:
            self.bias = torch.nn.Parameter(
                torch.empty(output_size, dtype=config.params_dtype, device=device))
            self.bias.sequence_parallel = sequence_parallel
        if not _is_meta(device):  # as the parallel linears: delayed init draws on replay
            self.reset_parameters()
        self.weight.sequence_parallel = sequence_parallel

    def reset_parameters(self) -> None:
        """Draw the weight on the CPU (also what delayed initialisation replays)."""
        master = torch.empty(self.weight.shape)
        self.init_method(master)
        if self.weight.device.type != "meta":
            with torch.no_grad():
                self.weight.copy_(master)
                if self.bias is not None:
                    self.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


__all__ = ["ColumnParallelLinear", "RowParallelLinear", "ReplicatedLinear",
           "VocabParallelEmbedding"]
