"""Parameters and small parts the recurrent mixers share: tensor-parallel vectors drawn as
full masters on the CPU (so the weights do not depend on TP), the causal depthwise
convolution and the gated RMS norm.

Both mixers lay their channels out per group (a Mamba group, a Gated DeltaNet key head) in
every split tensor, so a contiguous split over TP ranks gives each rank whole groups and
the mixer needs no communication between its in- and out-projection.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from megatron_smp.config import ConfigError
from megatron_smp.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    hidden_init_method,
    output_init_method,
)
from megatron_smp.tensor_parallel.mappings import group_rank, group_size
from megatron_smp.tensor_parallel.utils import set_tensor_model_parallel_attributes
from megatron_smp.transformer.kv_cache import KVCacheContext
from megatron_smp.transformer.packed import PackedSequence
from megatron_smp.transformer.ssm.ops import causal_conv1d, segment_ids


def _is_meta(device) -> bool:
    return device is not None and torch.device(device).type == "meta"


def split_parameter(shape, tp_group, dtype, device) -> torch.nn.Parameter:
    """An empty parameter holding this rank's contiguous 1/tp share of dim 0 of `shape`."""
    local = (shape[0] // group_size(tp_group),) + tuple(shape[1:])
    param = torch.nn.Parameter(torch.empty(local, dtype=dtype, device=device))
    set_tensor_model_parallel_attributes(param, True, 0, 1)
    return param


@torch.no_grad()
def fill_from_master(param: torch.nn.Parameter, master: torch.Tensor, tp_group) -> None:
    """Copy rank r's contiguous share (dim 0) of the full `master` into `param`."""
    rows = param.shape[0]
    start = group_rank(tp_group) * rows
    param.copy_(master[start:start + rows])


def mixer_projections(config, tp_group, projected: int, inner: int, device):
    """A mixer's in_proj (h -> `projected` rows, split over TP) and out_proj (`inner` -> h,
    split along its input), without biases, initialised as the attention's projections."""
    init_method = hidden_init_method(config)
    output_init = output_init_method(config)
    in_proj = ColumnParallelLinear(config.hidden_size, projected, config=config,
                                   tp_group=tp_group, init_method=init_method, bias=False,
                                   gather_output=False, device=device)
    out_proj = RowParallelLinear(inner, config.hidden_size, config=config, tp_group=tp_group,
                                 init_method=output_init, bias=False, input_is_parallel=True,
                                 device=device)
    return in_proj, out_proj


@torch.no_grad()
def init_decays(A_log: torch.nn.Parameter, dt_bias: torch.nn.Parameter, heads: int,
                tp_group) -> None:
    """Both mixers' per-head decay parameters, drawn for all `heads`: A_log = log U(1, 16)
    (A = -exp(A_log)), dt_bias with softplus(dt_bias) log-uniform in [1e-3, 0.1]."""
    fill_from_master(A_log, torch.empty(heads).uniform_(1, 16).log(), tp_group)
    fill_from_master(dt_bias, time_step_bias(heads), tp_group)


def project_per_group(in_proj: torch.nn.Module, hidden_states: torch.Tensor,
                      local_groups: int) -> torch.Tensor:
    """in_proj of [s(/tp), b, h] (sequence gathered with SP) -> batch first
    [b, s, local_groups, rows per group], for the scans."""
    projected, _ = in_proj(hidden_states)
    s, b = projected.shape[:2]
    return projected.transpose(0, 1).reshape(b, s, local_groups, -1)


def inverse_softplus(x: torch.Tensor) -> torch.Tensor:
    return x + torch.log(-torch.expm1(-x))


def time_step_bias(heads: int, dt_min: float = 1e-3, dt_max: float = 0.1,
                   floor: float = 1e-4) -> torch.Tensor:
    """[heads] dt biases with softplus(bias) log-uniform in [dt_min, dt_max] (Mamba's init)."""
    dt = torch.exp(torch.rand(heads) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
    return inverse_softplus(dt.clamp(min=floor))


class CausalConv1d(torch.nn.Module):
    """Depthwise causal convolution over this rank's channels, weight [c/tp, 1, k] (nn.Conv1d's
    shape) and optional bias [c/tp]; forward(x [b, s, c/tp], segments=None) -> [b, s, c/tp]."""

    # Delayed (meta-device) initialisation replays `reset_parameters`: it draws what the
    # constructor drew.
    REPLAYS_CONSTRUCTOR_INIT = True

    def __init__(self, channels: int, kernel: int, bias: bool, tp_group, dtype, device) -> None:
        super().__init__()
        self.tp_group = tp_group
        self.kernel = kernel
        self.channels = channels
        self.weight = split_parameter((channels, 1, kernel), tp_group, dtype, device)
        self.bias = split_parameter((channels,), tp_group, dtype, device) if bias else None
        if not _is_meta(device):
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        # nn.Conv1d's default (kaiming-uniform, fan-in = kernel), drawn for all channels.
        bound = 1.0 / math.sqrt(self.kernel)
        fill_from_master(self.weight, torch.empty(self.channels, 1, self.kernel)
                         .uniform_(-bound, bound), self.tp_group)
        if self.bias is not None:
            fill_from_master(self.bias, torch.empty(self.channels).uniform_(-bound, bound),
                             self.tp_group)

    def forward(self, x: torch.Tensor, segments: Optional[torch.Tensor] = None,
                initial_state: Optional[torch.Tensor] = None) -> torch.Tensor:
        return causal_conv1d(x, self.weight[:, 0], self.bias, segments, initial_state)

    def forward_with_state(self, x: torch.Tensor, lengths: torch.Tensor,
                           state: torch.Tensor):
        """A cache step: x [n, L, c/tp] (row i's first lengths[i] tokens real, then padding),
        state [n, c/tp, k - 1] (the inputs before x) -> (out [n, L, c/tp], the new state: the
        last k - 1 real inputs)."""
        out = causal_conv1d(x, self.weight[:, 0], self.bias, None, state)
        history = torch.cat([state.transpose(1, 2).to(x.dtype), x], dim=1)  # [n, k-1+L, c]
        # history row j holds input j - (k - 1): the last k - 1 real inputs are rows
        # lengths .. lengths + k - 2.
        index = lengths[:, None] + torch.arange(self.kernel - 1, device=x.device)
        kept = history.gather(1, index[..., None].expand(-1, -1, x.shape[-1]))
        return out, kept.transpose(1, 2)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                   group_size: int, norm_before_gate: bool) -> torch.Tensor:
    """RMS norm over groups of `group_size` channels of x [..., c] with a SiLU gate [..., c],
    times weight [c]: `norm(x) * w * silu(gate)` (Gated DeltaNet) or, with
    norm_before_gate=False, `norm(x * silu(gate)) * w` (Mamba-2). Computed in fp32."""
    dtype = x.dtype
    x = x.float()
    gate = F.silu(gate.float())
    if not norm_before_gate:
        x = x * gate
    shape = x.shape
    grouped = x.view(*shape[:-1], shape[-1] // group_size, group_size)
    grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)
    x = grouped.view(shape) * weight.float()
    if norm_before_gate:
        x = x * gate
    return x.to(dtype)


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the scans compute (and a cache keeps) the recurrent state in."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def step_mask(lengths: torch.Tensor, length: int) -> torch.Tensor:
    """[n, length] bool: the real tokens of a cache step's right-padded rows."""
    return torch.arange(length, device=lengths.device)[None, :] < lengths[:, None]


class RecurrentMixer(torch.nn.Module):
    """What both mixers share: forward(hidden_states [s(/tp), b, h], attention_mask=None,
    rotary_pos_emb=None) -> [s(/tp), b, h] is in_proj, `_mix` and out_proj. attention_mask:
    None (causal rows), a `PackedSequence` (the state restarts at each document) or, in
    generation, a `KVCacheContext`, which runs `_mix` per group of requests with their
    states; rotary_pos_emb is ignored (no positions in a recurrence).

    With context parallelism (cp_size > 1) each rank scans the whole sequence for 1/cp of
    the groups (`_context_parallel_mix`).

    Subclasses call `_init_context_parallel(state, groups per TP rank, what)` and set
    layer_number, dtype, in_proj, out_proj, conv1d, local_groups, state_shape
    (the SSM / delta-rule state of one request on this rank) and
    `_mix(projected [b, s, groups/tp, per group], segments, lengths=None, conv_state=None,
    state=None) -> (y [b, s, inner/tp], (conv_state, state))`."""

    def _build_parts(self, config, tp_group, projected: int, inner: int, conv_channels: int,
                     conv_kernel: int, conv_bias: bool, heads: int, device) -> None:
        """in_proj (hidden -> `projected`), out_proj (`inner` -> hidden), the causal conv over
        `conv_channels` and the per-head A_log and dt_bias split over TP, in that order (the
        order `replay_init` draws them in)."""
        self.in_proj, self.out_proj = mixer_projections(config, tp_group, projected, inner,
                                                        device)
        self.conv1d = CausalConv1d(conv_channels, conv_kernel, conv_bias, tp_group,
                                   config.params_dtype, device)
        self.A_log = split_parameter((heads,), tp_group, config.params_dtype, device)
        self.dt_bias = split_parameter((heads,), tp_group, config.params_dtype, device)

    def replay_init(self, replay: Callable[[torch.nn.Module], int],
                    materialize: Callable[[torch.nn.Module], torch.nn.Module]) -> int:
        """Delayed initialisation of a meta-device build (`distributed.delayed_init`; the
        caller has seeded the generator as the constructor was): in_proj, out_proj and the
        conv (`replay`), then the mixer's own vectors (`materialize` gives them storage,
        `reset_parameters` draws them), the constructor's order. Returns the elements
        initialised."""
        count = sum(replay(part) for part in (self.in_proj, self.out_proj, self.conv1d))
        own = [p for p in self.parameters(recurse=False) if p.is_meta]
        if own:
            materialize(self)
            self.reset_parameters()
        return count + sum(p.numel() for p in own)

    def _init_context_parallel(self, state, local_groups: int, groups: str) -> None:
        """CP's group, rank and size; each CP rank takes local_groups / cp whole groups."""
        self.cp_size, self.cp_rank = state.cp_size, state.cp_rank
        self.cp_group = state.cp_group if self.cp_size > 1 else None
        if local_groups % self.cp_size:
            raise ConfigError(
                f"{type(self).__name__}: {groups} per tensor-parallel rank ({local_groups}) must "
                f"be divisible by --context-parallel-size ({self.cp_size}): each CP rank scans "
                "whole groups")

    def state_shapes(self):
        """A request's recurrent state on this rank, as a cache keeps it: [(shape, dtype)]
        of the conv state [conv channels/tp, k - 1] (the model's dtype) and the SSM /
        delta-rule state (`state_shape`, in the scans' dtype)."""
        return [((self.conv1d.weight.shape[0], self.conv1d.kernel - 1), self.dtype),
                (self.state_shape, state_dtype(self.dtype))]

    def forward(self, hidden_states: torch.Tensor, attention_mask=None,
                rotary_pos_emb=None) -> torch.Tensor:
        projected = project_per_group(self.in_proj, hidden_states, self.local_groups)
        if isinstance(attention_mask, KVCacheContext):  # generation: the state in a cache
            (y,) = attention_mask.recurrent(self.layer_number, (projected[0],), self._step)
            y = y[None]
        elif self.cp_size > 1:
            y = self._context_parallel_mix(projected, attention_mask)
        else:
            y, _ = self._mix(projected, packed_segments(attention_mask, type(self).__name__))
        output, _ = self.out_proj(y.to(hidden_states.dtype).transpose(0, 1))
        return output

    def _context_parallel_mix(self, projected: torch.Tensor, attention_mask) -> torch.Tensor:
        """Context parallelism as Megatron's MambaContextParallel does it: an all-to-all
        trades this rank's share of the sequence, all groups ([b, s/cp, groups/tp, ...]) for
        the whole sequence of 1/cp of the groups, `_mix` runs on them with this CP rank's
        slices of the per-group parameters (`_local`), and a second all-to-all trades back
        -> y [b, s/cp, inner/tp]. The sequence comes in CP's load-balanced order
        (`context_parallel.split`; per document for packed rows), put in order for the scan."""
        # Lazy: context_parallel builds on the transformer's attention (imports point down).
        from megatron_smp.context_parallel.attention import heads_to_sequence, sequence_to_heads
        from megatron_smp.context_parallel.split import gathered_order

        b, local = projected.shape[:2]
        gathered = sequence_to_heads(projected.transpose(0, 1), self.cp_group)  # [s, b, g, r]
        s = gathered.shape[0]
        if isinstance(attention_mask, PackedSequence) and attention_mask.rank_indices is not None:
            order = attention_mask.rank_indices.to(projected.device).permute(1, 0, 2)
            order = order.reshape(b, s)  # gathered row j of batch entry i: position order[i, j]
        else:
            order = gathered_order(s, self.cp_size, projected.device).expand(b, s)
        rows = gathered.transpose(0, 1)  # [b, s, g, r] in gathered order
        in_order = rows.gather(1, _expand_index(torch.argsort(order, dim=1), rows))
        y, _ = self._mix(in_order, packed_segments(attention_mask, type(self).__name__))
        y = y.gather(1, _expand_index(order, y))  # back to the gathered order
        y = y.view(b, s, in_order.shape[2], -1).transpose(0, 1)  # [s, b, g, w]
        return heads_to_sequence(y, self.cp_group).reshape(local, b, -1).transpose(0, 1)

    def _local(self, param: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """This CP rank's share of a per-group parameter (dim 0 laid out group by group: its
        groups' rows), the whole parameter without CP. Sliced in forward, so each rank's grad
        lands in its rows and the sum over CP (DDP's) is the whole grad."""
        if param is None or self.cp_size == 1:
            return param
        return param.chunk(self.cp_size)[self.cp_rank]

    def _step(self, rows, lengths, states):
        """`KVCacheContext.recurrent`'s step: rows [n, L, groups/tp, per group]."""
        (projected,) = rows
        y, new_states = self._mix(projected, None, lengths, *states)
        return (y,), new_states

    def _conv(self, x: torch.Tensor, segments, lengths, conv_state):
        """SiLU(causal conv) of x [b, s, c/tp], threading a cache's conv state when given
        -> (out, new conv state or None)."""
        if conv_state is None:
            weight, bias = self._local(self.conv1d.weight), self._local(self.conv1d.bias)
            return F.silu(causal_conv1d(x, weight[:, 0], bias, segments)), None
        out, conv_state = self.conv1d.forward_with_state(x, lengths, conv_state)
        return F.silu(out), conv_state


def _expand_index(index: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """index [b, s] -> the gather index of dim 1 of values [b, s, ...]."""
    return index.view(*index.shape, *([1] * (values.dim() - 2))).expand_as(values)


def packed_segments(attention_mask, mixer: str) -> Optional[torch.Tensor]:
    """The document run numbers [b, s] of a packed batch (a `PackedSequence`), None for
    plain causal rows; a dense mask cannot say where the recurrence restarts."""
    if attention_mask is None:
        return None
    if isinstance(attention_mask, PackedSequence):
        return segment_ids(attention_mask.document_ids)
    raise ValueError(f"{mixer}: an explicit attention mask cannot be followed by a recurrent "
                     "mixer; pass document_ids (packed sequences) or no mask")


__all__ = ["split_parameter", "fill_from_master", "mixer_projections", "init_decays",
           "project_per_group", "time_step_bias",
           "CausalConv1d", "RecurrentMixer",
           "gated_rms_norm", "packed_segments", "state_dtype", "step_mask"]
