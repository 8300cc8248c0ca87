"""The engine's decode-only steps over fixed shapes, compiled (`torch.compile`) or captured
as CUDA graphs (Megatron-LM's `--cuda-graph-impl local` for inference).

A decode step runs one token per request. Its shapes are padded to buckets so that the
number of compiled graphs (or captured CUDA graphs) stays bounded:

* the batch: up to the next of `decode_batch_sizes(max_requests, count, distribution)`
  (`--inference-dynamic-batching-num-cuda-graphs`, `...-cuda-graph-sizing-distribution`);
  padding rows decode token 0 at position 0, write their key to the cache's scratch slot
  and are dropped;
* the keys each request attends: the cache slots of positions 0 .. L - 1, L the step's
  longest context rounded up to a power-of-two number of KV blocks, the positions a
  request has not reached masked (they read the scratch slot).

The padded step is one function of tensors (`decode_forward`): the model's embedding,
layers and output projection with `PaddedDecode` as the cache context, which writes the new
keys and gathers the cached ones with tensor indices only -- no host read, so it can be
captured. Steps it does not cover (prompts, chunks, drafts to verify, prompt log-probs,
MTP drafting) run the engine's general path; so do models it does not cover
(`decode_step_support`: only full-attention layers, no ALiBi, no multi-latent attention,
no recurrent layers, tensor / pipeline / context parallel size 1).
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from megatron_smp.config import ConfigError
from megatron_smp.transformer.attention import core_attention
from megatron_smp.transformer.kv_cache import KVCacheContext

MODES = ("compile", "cuda_graph")
DISTRIBUTIONS = ("exponential", "linear")


def decode_batch_sizes(max_requests: int, count: int,
                       distribution: str = "exponential") -> List[int]:
    """The padded batch sizes, ascending, the largest `max_requests`: "exponential" halves
    from max_requests down to 1, "linear" steps down by ceil(max_requests / count); at most
    `count` of them (-1: every size the distribution gives), the largest kept."""
    if distribution not in DISTRIBUTIONS:
        raise ConfigError(f"--inference-dynamic-batching-cuda-graph-sizing-distribution "
                          f"{distribution!r}: one of {', '.join(DISTRIBUTIONS)}")
    if count == 0 or count < -1:
        raise ConfigError(f"--inference-dynamic-batching-num-cuda-graphs {count}: a positive "
                          "number of graphs, or -1 (every size the distribution gives)")
    sizes = []
    if distribution == "exponential":
        size = max_requests
        while size >= 1:
            sizes.append(size)
            size //= 2
    else:
        stride = -(-max_requests // (max_requests if count == -1 else count))
        sizes = list(range(max_requests, 0, -stride))
    sizes = sorted(set(sizes))
    return sizes if count == -1 else sizes[-count:]


def _round_up(value: int, sizes: Sequence[int]) -> int:
    return next(size for size in sizes if size >= value)


def decode_step_support(model: torch.nn.Module, layout, has_states: bool) -> Optional[str]:
    """None where the padded decode step computes what the engine's general path does for
    `model` (this rank's GPTModel); else what it lacks."""
    from megatron_smp.inference.kv_cache import attention_layers, is_latent

    state, config = model.state, model.config
    if state.tp_size > 1 or state.pp_size > 1 or state.cp_size > 1:
        return "tensor, pipeline and context parallel size 1"
    if has_states:
        return "no Mamba / Gated DeltaNet layers"
    if layout.kinds != [None]:
        return "full attention in every layer (no sliding windows)"
    if config.position_embedding_type == "alibi":
        return "no ALiBi"
    if any(is_latent(attention) for attention in attention_layers(model).values()):
        return "no multi-latent attention"
    return None


class PaddedDecode(KVCacheContext):
    """One padded decode step's view of the cache: `write_slots` [B] the slot each row's
    new key goes to, `key_slots` [B, L] the slots of the keys each row attends (its own new
    one included), `masked` bool [B, 1, 1, L] True where a key is not attended."""

    def __init__(self, pools: Dict[int, Tuple[torch.Tensor, ...]], write_slots: torch.Tensor,
                 key_slots: torch.Tensor, masked: torch.Tensor) -> None:
        self.pools = pools
        self.write_slots, self.key_slots, self.masked = write_slots, key_slots, masked

    def attend(self, layer_number, query, key, value, scale=None, window_size=None,
               sinks=None, alibi_slopes=None):
        keys, values = self.pools[layer_number]
        batch, width = self.key_slots.shape
        key, value = key.reshape(batch, *key.shape[2:]), value.reshape(batch, *value.shape[2:])
        keys.index_copy_(0, self.write_slots, key.to(keys.dtype))
        values.index_copy_(0, self.write_slots, value.to(values.dtype))
        flat = self.key_slots.reshape(-1)
        k = keys.index_select(0, flat).view(batch, width, *keys.shape[1:])
        v = values.index_select(0, flat).view(batch, width, *values.shape[1:])
        q = query.reshape(batch, 1, *query.shape[2:])
        if k.dtype != q.dtype:
            k, v = k.to(q.dtype), v.to(q.dtype)
        context = core_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                 self.masked, False, 0.0, scale, None, sinks)
        return context.transpose(1, 2).reshape(*query.shape[:3], -1)


def decode_forward(model: torch.nn.Module, pools, tokens: torch.Tensor,
                   positions: torch.Tensor, write_slots: torch.Tensor,
                   key_slots: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
    """tokens / positions / write_slots [B], key_slots [B, L], masked [B, 1, 1, L] ->
    logits [B, vocab] (tensor parallel size 1)."""
    from megatron_smp.inference.speculative import vocab_logits

    context = PaddedDecode(pools, write_slots, key_slots, masked)
    hidden = model.embedding(tokens[None], positions[None])
    hidden = model.decoder(hidden, context, model._rotary(hidden, positions[None]))
    return vocab_logits(model, hidden[:, 0], model.state.tp_group)


def _graph_api(device) -> Optional[object]:
    """The CUDA-graph API of `device` (torch.cuda; None off CUDA); tests stand another in."""
    return torch.cuda if torch.device(device).type == "cuda" else None


class DecodeStepRunner:
    """Runs an engine's decode-only steps through `decode_forward` at padded shapes.

    mode "compile": `torch.compile` of `decode_forward` (one graph per bucket of shapes at
    most; dynamo makes a dimension dynamic once it has seen it change, so fewer); mode
    "cuda_graph": one CUDA graph per (batch size, key width) bucket, captured at its first
    use after `warmup_steps` eager runs of padding rows (Megatron-LM's
    --cuda-graph-warmup-steps), then replayed with the step's inputs copied in.
    """

    def __init__(self, model: torch.nn.Module, cache, mode: str, batch_sizes: Sequence[int],
                 warmup_steps: int = 3) -> None:
        if mode not in MODES:
            raise ConfigError(f"decode step mode {mode!r}: one of {', '.join(MODES)}")
        self.model, self.cache, self.mode = model, cache, mode
        self.batch_sizes = sorted(batch_sizes)
        self.block_size = cache.block_size
        self.scratch = cache.scratch_slot[None]
        self.device = cache.device
        self.warmup_steps = warmup_steps
        # (batch, width) -> (replay, static inputs, static logits)
        self.graphs: Dict[Tuple[int, int], Tuple[Callable[[], None],
                                                 Tuple[torch.Tensor, ...], torch.Tensor]] = {}
        self.steps = 0  # decode steps run here
        if mode == "compile":
            self._forward = torch.compile(decode_forward)

    def takes(self, plan) -> bool:
        """Whether `plan` is a decode-only step this runner covers."""
        return (bool(plan.steps) and len(plan.request_ids) == len(plan.steps)
                and len(plan.steps) <= self.batch_sizes[-1]
                and not any(plan.num_drafts) and not plan.speculating
                and not any(plan.prompt_logprobs)
                and all(len(step.tokens) == 1 for step in plan.steps))

    def inputs(self, steps) -> Tuple[torch.Tensor, ...]:
        """(tokens, positions, write_slots [B_pad], key_slots [B_pad, L], masked
        [B_pad, 1, 1, L]) of the decode `steps` (one token each), padded to the buckets."""
        count, block_size = len(steps), self.block_size
        batch = _round_up(count, self.batch_sizes)
        reach = max(step.start for step in steps) + 1
        blocks = 1
        while blocks * block_size < reach:
            blocks *= 2
        width = blocks * block_size
        pad = batch - count
        starts = torch.tensor([step.start for step in steps] + [0] * pad)
        tables = [step.blocks[None] for step in steps]
        table_width = max(blocks, max(len(table) for table in tables))
        table = torch.tensor([t + [0] * (table_width - len(t)) for t in tables]
                             + [[0] * table_width] * pad)
        tokens = torch.tensor([step.tokens[0] for step in steps] + [0] * pad)
        key_positions = torch.arange(width)
        slots = table[:, key_positions // block_size] * block_size + key_positions % block_size
        masked = key_positions[None, :] > starts[:, None]  # [B, L]
        slots = slots.masked_fill(masked, self.scratch)
        if pad:  # a padding row attends the scratch slot alone
            slots[count:] = self.scratch
            masked[count:] = True
            masked[count:, 0] = False
        write_slots = slots.gather(1, starts[:, None])[:, 0]
        write_slots[count:] = self.scratch
        device = self.device
        return (tokens.to(device), starts.to(device), write_slots.to(device),
                slots.to(device), masked[:, None, None, :].to(device))

    def run(self, steps) -> torch.Tensor:
        """logits [len(steps), vocab] of the decode `steps`; their keys written to the
        cache."""
        self.steps += 1
        inputs = self.inputs(steps)
        if self.mode == "compile":
            logits = self._forward(self.model, self.cache.pools, *inputs)
        else:
            logits = self._replay(inputs)
        return logits[:len(steps)]

    def _replay(self, inputs: Tuple[torch.Tensor, ...]) -> torch.Tensor:
        key = (inputs[0].shape[0], inputs[3].shape[1])
        if key not in self.graphs:
            self.graphs[key] = self._capture(key)
        replay, static, output = self.graphs[key]
        for buffer, value in zip(static, inputs):
            buffer.copy_(value)
        replay()
        return output

    def _capture(self, key: Tuple[int, int]):
        """(replay, its static inputs, its static logits) of bucket `key` = (batch, width):
        the static inputs hold padding rows (every write to the scratch slot) until a step
        copies its own in."""
        batch, width = key
        device = self.device
        masked = torch.ones(batch, 1, 1, width, dtype=torch.bool, device=device)
        masked[..., 0] = False
        static = (torch.zeros(batch, dtype=torch.long, device=device),
                  torch.zeros(batch, dtype=torch.long, device=device),
                  torch.full((batch,), self.scratch, dtype=torch.long, device=device),
                  torch.full((batch, width), self.scratch, dtype=torch.long, device=device),
                  masked)

        def run() -> torch.Tensor:
            return decode_forward(self.model, self.cache.pools, *static)

        replay, output = capture_graph(_graph_api(device), run, self.warmup_steps)
        return replay, static, output


def capture_graph(api, run: Callable[[], torch.Tensor], warmup_steps: int):
    """(replay, output): `run` captured as a CUDA graph through `api` (torch.cuda) after
    `warmup_steps` eager runs on a side stream; replay() reruns it, refilling `output`."""
    stream = api.Stream()
    stream.wait_stream(api.current_stream())
    with api.stream(stream):  # warm-up off the default stream, as capture wants
        for _ in range(warmup_steps):
            run()
    api.current_stream().wait_stream(stream)
    graph = api.CUDAGraph()
    with api.graph(graph):
        output = run()
    return graph.replay, output


def build_decode_runner(model: torch.nn.Module, cache, layout, has_states: bool,
                        max_requests: int, mode: Optional[str], num_graphs: int = 16,
                        distribution: str = "exponential",
                        warmup_steps: int = 3) -> Optional[DecodeStepRunner]:
    """The engine's runner for `mode` (None: none), or a ConfigError naming the flag where
    the mode cannot run here (CUDA graphs off a CUDA device, a model the padded step does
    not cover)."""
    if mode is None:
        return None
    flag = ("--cuda-graph-impl local" if mode == "cuda_graph"
            else "--inference-torch-compile")
    if mode == "cuda_graph" and _graph_api(cache.device) is None:
        raise ConfigError(f"{flag} captures the decode step as CUDA graphs, which needs a "
                          f"CUDA device (this engine runs on {cache.device}); drop it, or "
                          "use --inference-torch-compile")
    if warmup_steps < 0:
        raise ConfigError(f"--cuda-graph-warmup-steps {warmup_steps}: must be >= 0")
    missing = decode_step_support(model, layout, has_states)
    if missing is not None:
        raise ConfigError(f"{flag}: the fixed-shape decode step needs {missing}; drop it")
    if mode == "cuda_graph" and getattr(model.config, "num_moe_experts", None):
        raise ConfigError(f"{flag}: MoE layers route each token by its values (token counts "
                          "per expert), which a CUDA graph cannot capture; drop it, or use "
                          "--inference-torch-compile")
    sizes = decode_batch_sizes(max_requests, num_graphs, distribution)
    return DecodeStepRunner(model, cache, mode, sizes, warmup_steps)


def decode_step_options(inference) -> dict:
    """The engine's decode-step arguments of an `InferenceConfig`."""
    return dict(decode_step=inference.decode_step, num_decode_graphs=inference.num_cuda_graphs,
                decode_graph_distribution=inference.cuda_graph_sizing_distribution,
                cuda_graph_warmup_steps=inference.cuda_graph_warmup_steps)


__all__ = ["DecodeStepRunner", "PaddedDecode", "build_decode_runner", "decode_batch_sizes",
           "decode_forward", "decode_step_options", "decode_step_support"]
