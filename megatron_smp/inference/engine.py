"""The continuous-batching inference engine.

One engine runs on every rank of a model (its tensor, pipeline and expert parallel ranks, and
any data-parallel replicas in the group, which then run the same batches; `inference.replicas`
gives each replica its own share of the requests instead). The *leader*
(the group's first rank) owns the requests and the schedule; every `step()`:

1. the leader admits waiting requests while a slot (`max_requests`) and cache blocks for
   the whole request (prompt + max_new_tokens, reserved up front, so a running request
   never waits for memory; models with Mamba-2 / Gated DeltaNet layers: also a recurrent-state
   slot) are free, first come first served; it then broadcasts the step's
   plan: each running request's new tokens (the whole prompt when it joins, then its last
   generated token), where they start and its block table;
2. every rank runs its pipeline stage over the step's flattened tokens with the cache
   (`kv_cache.StepBatch`); stages pass the hidden states on with send/recv;
3. the last stage gathers the logits of each request's last token (and of every prompt token
   for requests that asked for prompt log-probs) over the vocabulary shards, one rank of it
   samples (`sampling.sample`, a generator per request) and the leader gets the tokens;
4. the leader appends them; a request that hits a stop token, a stop string or its
   max_new_tokens leaves the batch and frees its blocks, and waiting requests take its place
   at the next step.

With speculative decoding (`speculative=`, `inference.speculative`) a speculating request's
decode step carries its drafts after its last token (n-gram lookup or a draft model: made by
the leader while it plans; the model's MTP layers: made on the last stage after the step
before); the sampling rank verifies them (the accept / resample rule) and the request gains
1 .. k + 1 tokens per step.

Requests therefore join and leave at token granularity, and a request's tokens do not depend
on what else is in the batch (each request attends over its own cache only).
"""
from __future__ import annotations

import collections
import itertools
import threading
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.profiler import record_function

from megatron_smp.config import ConfigError
from megatron_smp.distributed.unwrap import unwrap_model
from megatron_smp.inference.kv_cache import (
    BlockAllocator,
    CacheLayout,
    PagedKVCache,
    StepBatch,
    StepRequest,
    blocks_for,
    bytes_per_token,
    check_inference_layout,
    state_bytes_per_request,
)
from megatron_smp.inference.decode_step import build_decode_runner
from megatron_smp.inference.prefix_cache import PrefixCachingAllocator
from megatron_smp.inference.sampling import SamplingParams, sample, top_logprobs
from megatron_smp.inference.speculative import (
    DraftModelRunner,
    MTPDrafter,
    SpeculativeConfig,
    draft_generator,
    ngram_propose,
    pick_draft,
    verify,
    vocab_logits,
)
from megatron_smp.tensor_parallel.mappings import gather_from_sequence_parallel_region


@dataclass
class Request:
    """One generation request as the leader tracks it. `output` are the generated token ids,
    `logprobs` their log-probs and `top_logprobs` per token its top alternatives;
    `prompt_logprobs` (when asked) holds None for the first prompt token, then the log-prob of
    each following one; `finish_reason` is "stop", "length" or "abort" once it is done."""

    request_id: int
    prompt: List[int]
    params: SamplingParams
    output: List[int] = field(default_factory=list)
    logprobs: List[float] = field(default_factory=list)
    top_logprobs: List[List[Tuple[int, float]]] = field(default_factory=list)
    prompt_logprobs: Optional[List[Optional[float]]] = None
    prompt_top_logprobs: Optional[List[List[Tuple[int, float]]]] = None
    finish_reason: Optional[str] = None
    blocks: Dict[Optional[int], List[int]] = field(default_factory=dict)
    slot: Optional[int] = None
    prefilled: bool = False
    stop_string: Optional[str] = None
    cached_tokens: int = 0  # prompt tokens read from shared prefix blocks (prefix caching)
    prompt_done: int = 0  # prompt tokens in the cache (cached, or computed by earlier chunks)
    # Speculative decoding: the drafts for the next step (and, from a draft model, a sampled
    # request's draft probabilities [k, V]); drafts verified and accepted so far.
    drafts: List[int] = field(default_factory=list)
    draft_probs: Optional[torch.Tensor] = None
    num_drafted: int = 0
    num_accepted: int = 0

    @property
    def acceptance_rate(self) -> Optional[float]:
        return self.num_accepted / self.num_drafted if self.num_drafted else None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class _Plan:
    """What the leader broadcasts each step (None instead: the engine stops)."""

    request_ids: List[int]
    # The steps of the requests in request_ids (each samples a token), then those of prompt
    # chunks that sample nothing (chunked prefill: a prompt's chunks before its last), which
    # the step runs too (their keys join the cache) but `_forward` reads no logits of.
    steps: List[StepRequest]
    prompt_logprobs: List[bool]
    new_params: Dict[int, SamplingParams]
    finished_ids: List[int]
    # Speculative decoding. Per request of request_ids: its drafts in this step (None: a
    # prompt step); the draft probabilities of sampled requests (from a draft model);
    # the seeds of new sampled requests that gave none (every rank's generators alike);
    # for the prompt chunks after request_ids: their request ids and the prompt token after
    # each chunk; the requests that speculate (MTP drafts are made for them).
    num_drafts: List[Optional[int]] = field(default_factory=list)
    draft_probs: Dict[int, torch.Tensor] = field(default_factory=dict)
    seeds: Dict[int, int] = field(default_factory=dict)
    chunk_ids: List[int] = field(default_factory=list)
    chunk_next: List[int] = field(default_factory=list)
    speculating: List[int] = field(default_factory=list)
    # new requests' prompt + max_new_tokens (where MTP drafting stops)
    limits: Dict[int, int] = field(default_factory=dict)


def _group_ranks(group) -> List[int]:
    if group is None or group == dist.group.WORLD:
        return list(range(dist.get_world_size()))
    return dist.get_process_group_ranks(group)


def check_step_budget(max_step_tokens: Optional[int], chunked_prefill: bool) -> None:
    """A step's token budget and chunked prefill, as the engine takes them (pure)."""
    if max_step_tokens is not None and (not isinstance(max_step_tokens, int)
                                        or max_step_tokens < 1):
        raise ConfigError("--inference-dynamic-batching-max-tokens must be a positive "
                          f"integer, got {max_step_tokens!r}")
    if chunked_prefill and max_step_tokens is None:
        raise ConfigError("--enable-chunked-prefill splits prompts to fit a step's token "
                          "budget: add --inference-dynamic-batching-max-tokens N")


class RequestIntake:
    """The leader's intake of requests, shared by `InferenceEngine` and the data-parallel
    coordinator (`replicas.DataParallelEngine`): ids, the waiting queue, the requests not yet
    finished and the aborts asked for, under one lock (a server thread adds and aborts while
    the engine steps)."""

    def _init_intake(self) -> None:
        self._ids = itertools.count()
        self.waiting: collections.deque = collections.deque()
        self.requests: Dict[int, Request] = {}
        self._aborts: List[int] = []
        self._lock = threading.Lock()

    def check_request(self, prompt: Sequence[int], params: SamplingParams) -> None:
        raise NotImplementedError

    def add_request(self, prompt: Sequence[int], params: SamplingParams) -> Request:
        """Queue a request (leader only; thread-safe). It joins the batch at a later step."""
        self.check_request(prompt, params)
        with self._lock:
            request = Request(next(self._ids), [int(t) for t in prompt], params)
            self.requests[request.request_id] = request
            self.waiting.append(request)
        return request

    def abort(self, request_id: int) -> None:
        """Stop a request at the next step and free its blocks (leader; thread-safe)."""
        with self._lock:
            self._aborts.append(request_id)


class InferenceEngine(RequestIntake):
    """Continuous batching over a paged KV cache, on every rank of `model`'s group.

    model: this rank's `GPTModel` (one pipeline stage; virtual stages are not supported).
    max_tokens: tokens the cache holds over all running requests (`--inference-max-tokens`),
    rounded up to whole blocks of `block_size`; max_requests: requests running at once;
    max_seq_length: longest prompt + generation (default: the model's
    max_position_embeddings for learned positions, else unbounded);
    group: the ranks that run this model together (default all); stop_checker(request) ->
    the stop string found in the request's text, or None (the leader's tokenizer);
    prefix_caching: share the blocks of common prompt prefixes, freed by the eviction policy
    "ref_zero" or "lru" (`inference.prefix_cache`); None: off.
    max_step_tokens: tokens one step runs (each decode counts one; None: no limit): a prompt
    runs in a step with room for all of it, or, with chunked_prefill, in chunks that fill
    the room steps have (so decodes keep going beside a long prompt).
    replicate_context_parallel: under context parallelism, every CP rank runs each step
    whole (its own cache of whole requests, the attention without CP communication; the
    samples come from one rank, so the ranks agree): for a caller whose CP ranks hold the
    full weights for training (train_rl.py). Without it a CP layout is refused.
    speculative: speculative decoding (`inference.speculative`): each decode step verifies
    up to `num_speculative_tokens` drafts per request (n-gram lookup, the model's MTP layers,
    or `draft_model`: a model sharing the vocabulary, used whole on the leader, built at
    tensor / pipeline parallel size 1; other ranks may pass None). A request's
    `SamplingParams.num_speculative_tokens` lowers it (0: plain decoding).
    decode_step: "compile" or "cuda_graph" runs the decode-only steps at padded shapes,
    compiled or captured (`inference.decode_step`), with `num_decode_graphs` batch sizes
    spaced by `decode_graph_distribution` and `cuda_graph_warmup_steps` eager runs before a
    capture; None: every step eager.
    Collective over `group`: `step()`, `generate()`, `shutdown()`.
    """

    def __init__(self, model: torch.nn.Module, max_tokens: int = 4096, max_requests: int = 64,
                 block_size: int = 16, max_seq_length: Optional[int] = None, group=None,
                 stop_checker: Optional[Callable[[Request], Optional[str]]] = None,
                 prefix_caching: Optional[str] = None, max_step_tokens: Optional[int] = None,
                 chunked_prefill: bool = False, replicate_context_parallel: bool = False,
                 speculative: Optional[SpeculativeConfig] = None,
                 draft_model: Optional[torch.nn.Module] = None,
                 decode_step: Optional[str] = None, num_decode_graphs: int = 16,
                 decode_graph_distribution: str = "exponential",
                 cuda_graph_warmup_steps: int = 3) -> None:
        if isinstance(model, (list, tuple)):
            if len(model) != 1:
                raise ConfigError("inference: virtual pipeline stages are not supported "
                                  "(--num-layers-per-virtual-pipeline-stage); one model chunk "
                                  "per rank")
            model = model[0]
        model = unwrap_model(model)
        self.model = model.eval()
        self.state = model.state
        self.config = model.config
        # Recurrent layers (Mamba-2, Gated DeltaNet): one state slot per running request.
        self.state_bytes_per_request = state_bytes_per_request(model)
        check_inference_layout(self.state, replicate_context_parallel,
                               recurrent=bool(self.state_bytes_per_request))
        for name, value in (("max_tokens", max_tokens), ("max_requests", max_requests),
                            ("block_size", block_size)):
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"inference: {name} must be a positive integer, got {value!r}")
        self.block_size = block_size
        self.max_requests = max_requests
        check_step_budget(max_step_tokens, chunked_prefill)
        self.max_step_tokens = max_step_tokens
        self.chunked_prefill = chunked_prefill
        if max_seq_length is None and self.config.position_embedding_type == "learned_absolute":
            max_seq_length = self.config.max_position_embeddings
        self.max_seq_length = max_seq_length
        num_blocks = blocks_for(max_tokens, block_size)
        self.max_tokens = num_blocks * block_size
        self.dtype = self.config.params_dtype
        self.device = self.state.device
        self.layout = CacheLayout(self.config, num_blocks, block_size, max_requests)
        self.cache = PagedKVCache(model, self.layout, self.dtype, self.device)
        self.bytes_per_token = bytes_per_token(model, self.dtype)
        self.state_slots = BlockAllocator(max_requests)
        self.allocators = {kind: BlockAllocator(count)
                           for kind, count in self.layout.num_blocks.items()}
        self.prefix_cache = None
        if prefix_caching is not None:
            if self.layout.kinds != [None] or self.state_bytes_per_request:
                raise ConfigError(
                    "--inference-dynamic-batching-prefix-caching needs a model whose layers "
                    "all keep full attention (sliding-window rings and Mamba / Gated DeltaNet "
                    "states are overwritten as a request goes on); drop the flag")
            self.prefix_cache = PrefixCachingAllocator(num_blocks, block_size, prefix_caching)
            self.allocators[None] = self.prefix_cache
        self.stop_checker = stop_checker
        self.sequence_parallel = self.config.sequence_parallel_at(self.state.tp_size)

        self.distributed = dist.is_available() and dist.is_initialized()
        self.group = group
        ranks = _group_ranks(group) if self.distributed else [0]
        self.rank = dist.get_rank() if self.distributed else 0
        self.leader = ranks[0]
        # The sampling rank: the first rank of the last pipeline stage in the group.
        samples_here = self.state.is_pipeline_last_stage
        flags = [samples_here]
        if self.distributed and len(ranks) > 1:
            flags = [None] * len(ranks)
            dist.all_gather_object(flags, samples_here, group=group)
        self.sampler = ranks[flags.index(True)]
        self.group_size = len(ranks)

        self._init_speculation(speculative, draft_model, num_blocks, block_size, max_requests)
        self.decode_runner = build_decode_runner(
            model, self.cache, self.layout, bool(self.state_bytes_per_request), max_requests,
            decode_step, num_decode_graphs, decode_graph_distribution, cuda_graph_warmup_steps)

        self._init_intake()
        self.running: List[Request] = []
        self.params: Dict[int, SamplingParams] = {}
        self.generators: Dict[int, Optional[torch.Generator]] = {}
        self._finished_ids: List[int] = []
        self.steps = 0
        self.num_aborted = 0
        self.computed_tokens = 0  # tokens run through the model (prompts and decodes)
        self.num_drafted = 0  # drafts verified, and accepted (speculative decoding)
        self.num_accepted = 0
        self.draft_generators: Dict[int, Optional[torch.Generator]] = {}
        self._mtp_probs: Dict[int, torch.Tensor] = {}  # sampler: MTP drafts' q [k, V]
        self._limits: Dict[int, int] = {}  # prompt + max_new_tokens of each request

    def _init_speculation(self, speculative, draft_model, num_blocks, block_size,
                          max_requests) -> None:
        self.speculative = speculative
        self.draft_runner = None
        self.mtp_drafter = None
        if speculative is None:
            if draft_model is not None:
                raise ConfigError("inference: a draft model needs speculative decoding "
                                  "(speculative_config method 'draft_model')")
            return
        speculative.validate()
        if self.state_bytes_per_request:
            raise ConfigError("speculative decoding: Mamba / Gated DeltaNet layers cannot take "
                              "back rejected drafts (their state moves on); drop "
                              "--speculative-config / --num-speculative-tokens for this model")
        k = speculative.num_speculative_tokens
        if any(kind is not None for kind in self.layout.kinds) and k > block_size:
            raise ConfigError(
                f"speculative decoding: num_speculative_tokens ({k}) above the block size "
                f"({block_size}) with sliding-window layers (a ring could lose keys to "
                "rejected drafts); lower it or raise --inference-dynamic-batching-block-size")
        if speculative.method == "draft_model":
            if draft_model is None and self.rank == self.leader:
                raise ConfigError("speculative_config method 'draft_model' needs a draft "
                                  "model (--speculative-draft-load)")
            if draft_model is not None and self.rank == self.leader:
                self.draft_runner = DraftModelRunner(draft_model, self.config.vocab_size,
                                                     num_blocks, block_size, max_requests,
                                                     self.device)
        elif draft_model is not None:
            raise ConfigError(f"speculative_config method {speculative.method!r} takes no "
                              "draft model (method 'draft_model' does)")
        if speculative.method == "mtp":
            if not self.config.mtp_num_layers:
                raise ConfigError("speculative_config method 'mtp' drafts with the model's "
                                  "multi-token-prediction layers: the model has none "
                                  "(--mtp-num-layers 0); use method 'ngram' or 'draft_model'")
            if None not in self.layout.kinds:
                raise ConfigError("speculative_config method 'mtp' needs a model with "
                                  "full-attention layers (the MTP layers' keys use their "
                                  "block tables)")
            if self.state.is_pipeline_last_stage:
                self.mtp_drafter = MTPDrafter(self.model)
                for number, layer in zip(self.mtp_drafter.layer_numbers(),
                                         self.mtp_drafter.layers):
                    attention = layer.mtp_model_layer.self_attention
                    if getattr(attention, "window_size", None) is not None:
                        raise ConfigError("speculative_config method 'mtp': the MTP layers "
                                          "must keep full attention")
                self.cache.add_layers({number: layer.mtp_model_layer.self_attention
                                       for number, layer in zip(
                                           self.mtp_drafter.layer_numbers(),
                                           self.mtp_drafter.layers)})

    def speculation_report(self) -> Dict[str, float]:
        """Drafts verified, accepted, and the acceptance rate so far (leader)."""
        rate = self.num_accepted / self.num_drafted if self.num_drafted else 0.0
        return {"drafted_tokens": self.num_drafted, "accepted_tokens": self.num_accepted,
                "acceptance_rate": rate}

    @property
    def is_leader(self) -> bool:
        return self.rank == self.leader

    # Requests (leader) ---------------------------------------------------------------------------

    def check_request(self, prompt: Sequence[int], params: SamplingParams) -> None:
        """Raise a ConfigError naming what does not fit: an empty prompt, ids outside the
        vocabulary, a request longer than max_seq_length or than the whole cache."""
        params.validate(self.config.vocab_size)
        if len(prompt) == 0:
            raise ConfigError("inference: the prompt is empty")
        if any(not 0 <= int(t) < self.config.vocab_size for t in prompt):
            raise ConfigError(f"inference: prompt token ids must be in [0, "
                              f"{self.config.vocab_size})")
        wanted = params.num_speculative_tokens
        if wanted:
            if self.speculative is None:
                raise ConfigError("inference: num_speculative_tokens asked of an engine "
                                  "started without speculative decoding "
                                  "(--speculative-config / --num-speculative-tokens)")
            if wanted > self.speculative.num_speculative_tokens:
                raise ConfigError(
                    f"inference: num_speculative_tokens {wanted} is above the engine's "
                    f"{self.speculative.num_speculative_tokens}")
        total = len(prompt) + params.max_new_tokens
        if self.max_seq_length is not None and total > self.max_seq_length:
            raise ConfigError(
                f"inference: prompt ({len(prompt)} tokens) + max_new_tokens "
                f"({params.max_new_tokens}) = {total} is longer than the context "
                f"({self.max_seq_length} tokens)")
        if total > self.max_tokens and self.layout.kinds:  # (all-recurrent: no KV cache)
            raise ConfigError(
                f"inference: prompt ({len(prompt)} tokens) + max_new_tokens "
                f"({params.max_new_tokens}) = {total} does not fit in the KV cache "
                f"(--inference-max-tokens {self.max_tokens}); raise it or ask for fewer tokens")
        step_budget = self.max_step_tokens
        if step_budget is not None and len(prompt) > step_budget and (
                not self.chunked_prefill or params.prompt_logprobs):
            why = ("prompt log-probs are computed in one step" if self.chunked_prefill
                   else "add --enable-chunked-prefill to split it")
            raise ConfigError(
                f"inference: the prompt ({len(prompt)} tokens) does not fit in one step "
                f"(--inference-dynamic-batching-max-tokens {step_budget}); {why}")

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._aborts)

    def _finish(self, request: Request, reason: str) -> None:
        request.finish_reason = reason
        self._finished_ids.append(request.request_id)
        for kind, blocks in request.blocks.items():
            self.allocators[kind].free(blocks)
        request.blocks = {}
        if request.slot is not None:
            self.state_slots.free([request.slot])
            request.slot = None
        if self.draft_runner is not None:
            self.draft_runner.release(request.request_id)
        if request in self.running:
            self.running.remove(request)
        self.requests.pop(request.request_id, None)

    def _schedule(self) -> _Plan:
        with self._lock:
            for request_id in self._aborts:
                request = self.requests.get(request_id)
                if request is not None and not request.finished:
                    if request in self.waiting:
                        self.waiting.remove(request)
                    self._finish(request, "abort")
                    self.num_aborted += 1
            self._aborts.clear()
            new_params = {}
            steps, wants, sampled, chunks = [], [], [], []
            num_drafts, chunk_ids, chunk_next = [], [], []
            room = self.max_step_tokens  # decodes first, then prompts in order of arrival
            decoding = [request for request in self.running if request.prefilled]
            if room is not None:
                room -= len(decoding)
            drafts = self._propose(decoding, room)
            if room is not None:
                room -= sum(len(d) for d in drafts.values())

            def add(request: Request) -> None:
                nonlocal room
                if request.prefilled:
                    start = len(request.prompt) + len(request.output) - 1
                    proposed = drafts.get(request.request_id, [])
                    steps.append(StepRequest([request.output[-1]] + proposed, start,
                                             request.blocks, request.slot))
                    wants.append(False)
                    sampled.append(request.request_id)
                    num_drafts.append(len(proposed))
                    return
                step, room = self._prompt_step(request, room)
                if step is None:
                    return
                if request.prompt_done < len(request.prompt):
                    chunks.append(step)  # an earlier chunk: nothing to sample yet
                    chunk_ids.append(request.request_id)
                    chunk_next.append(request.prompt[request.prompt_done])
                    return
                steps.append(step)
                wants.append(request.params.prompt_logprobs)
                sampled.append(request.request_id)
                num_drafts.append(None)

            for request in self.running:
                add(request)
            while self.waiting and len(self.running) < self.max_requests:
                request = self.waiting[0]
                total = len(request.prompt) + request.params.max_new_tokens
                needed = {kind: self.layout.blocks_needed(kind, total)
                          for kind in self.layout.kinds}
                if self.draft_runner is not None and not self.draft_runner.can_admit(total):
                    break  # the draft model's cache: a request's whole length too
                if self.prefix_cache is not None:  # (its blocks less the shared prefix)
                    admitted = self.prefix_cache.admit(request.prompt, total,
                                                       not request.params.prompt_logprobs)
                    if admitted is None:
                        break
                    needed, (table, request.cached_tokens) = {}, admitted
                elif any(count > self.allocators[kind].num_free
                         for kind, count in needed.items()):
                    break  # first come first served: it waits for blocks to be freed
                self.waiting.popleft()
                if self.draft_runner is not None:
                    self.draft_runner.admit(request.request_id, total)
                request.blocks = {kind: self.allocators[kind].allocate(count)
                                  for kind, count in needed.items()}
                if self.prefix_cache is not None:
                    request.blocks[None] = table
                request.slot = self.state_slots.allocate(1)[0]
                self.running.append(request)
                new_params[request.request_id] = request.params
                add(request)
        finished, self._finished_ids = self._finished_ids, []
        seeds = {request_id: int(torch.randint(0, 2**62, (1,)))
                 for request_id, params in new_params.items()
                 if not params.greedy and params.seed is None}
        draft_probs = {}
        for request_id in sampled:
            request = self.requests[request_id]
            if request.draft_probs is not None and drafts.get(request_id):
                draft_probs[request_id] = request.draft_probs[:len(drafts[request_id])]
        speculating = [r.request_id for r in self.running if self._speculation(r.params)]
        limits = {request_id: len(self.requests[request_id].prompt) + params.max_new_tokens
                  for request_id, params in new_params.items()}
        return _Plan(sampled, steps + chunks, wants, new_params, finished, num_drafts,
                     draft_probs, seeds, chunk_ids, chunk_next, speculating, limits)

    def _speculation(self, params: SamplingParams) -> int:
        """Drafts a request asks for per step (0: it decodes plainly)."""
        if self.speculative is None:
            return 0
        wanted = params.num_speculative_tokens
        return self.speculative.num_speculative_tokens if wanted is None else wanted

    def _propose(self, decoding: List[Request], room: Optional[int]) -> Dict[int, List[int]]:
        """The drafts of this step's decoding requests (leader): at most what a request may
        still emit less one (the verified step adds a token of its own), within the step's
        token budget `room` (decodes first, in order)."""
        if self.speculative is None:
            return {}
        method = self.speculative.method
        wanted = {}
        for request in decoding:
            count = min(self._speculation(request.params),
                        request.params.max_new_tokens - len(request.output) - 1)
            if room is not None:
                count = min(count, room)
            if count > 0:
                wanted[request.request_id] = count
                if room is not None:
                    room -= count
        drafts = {}
        if method == "ngram":
            config = self.speculative
            for request in decoding:
                if request.request_id in wanted:
                    drafts[request.request_id] = ngram_propose(
                        request.prompt + request.output, wanted[request.request_id],
                        config.prompt_lookup_max, config.prompt_lookup_min)
        elif method == "mtp":
            for request in decoding:
                drafts[request.request_id] = request.drafts[:wanted.get(request.request_id, 0)]
        else:
            items = [(request.request_id, request.prompt + request.output,
                      wanted[request.request_id], request.params,
                      self.draft_generators.get(request.request_id))
                     for request in decoding if request.request_id in wanted]
            for (request_id, *_), (proposed, probs) in zip(
                    items, self.draft_runner.propose(items) if items else []):
                drafts[request_id] = proposed
                self.requests[request_id].draft_probs = probs
        return {request_id: d for request_id, d in drafts.items() if d}

    def _prompt_step(self, request: Request, room: Optional[int]):
        """(the step running the next piece of a request's prompt, or None while it waits for
        a step with room; the room left). Prefix caching: the prompt's full blocks this step
        completes are hashed now, so requests admitted from now on share them (the step writes
        their keys in every layer before any of its queries reads)."""
        done = max(request.prompt_done, request.cached_tokens)
        count = len(request.prompt) - done
        if room is not None:
            # (prompt log-probs come from one step's logits: such a prompt is not split)
            splits = self.chunked_prefill and not request.params.prompt_logprobs
            if count > room and not (splits and room > 0):
                return None, 0  # it waits (first come first served: so do those after it)
            count = min(count, room)
            room -= count
        request.prompt_done = done + count
        if self.prefix_cache is not None:
            self.prefix_cache.register(request.prompt, request.blocks[None], request.prompt_done)
        return StepRequest(request.prompt[done:done + count], done, request.blocks,
                           request.slot), room

    # The step (every rank) ------------------------------------------------------------------------

    def _broadcast(self, obj, src: int):
        if not self.distributed or self.group_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]

    def step(self, stop: bool = False) -> Optional[List[Request]]:
        """One engine step on every rank of the group. The leader's `stop=True` ends the
        engine on all ranks (every rank returns None); otherwise the leader gets the requests
        that advanced (finished ones included), the other ranks []."""
        with record_function("inference::step"):
            return self._step(stop)

    def _step(self, stop: bool) -> Optional[List[Request]]:
        # (the record_function ranges name the parts of a step for a profile's breakdown:
        # tools/bench/bench_inference.py --breakdown)
        with record_function("inference::schedule"):
            plan = None if stop else (self._schedule() if self.is_leader else None)
        plan = self._broadcast(plan, self.leader)
        if plan is None:
            return None
        for request_id in plan.finished_ids:  # the sampling state of requests that left
            self.params.pop(request_id, None)
            self.generators.pop(request_id, None)
            self.draft_generators.pop(request_id, None)
            self._mtp_probs.pop(request_id, None)
            self._limits.pop(request_id, None)
        for request_id, params in plan.new_params.items():
            self.params[request_id] = params
            self._limits[request_id] = plan.limits[request_id]
            generator = None
            if not params.greedy:
                seed = params.seed if params.seed is not None else plan.seeds[request_id]
                generator = torch.Generator()
                generator.manual_seed(seed)
                if self.speculative is not None:  # the drafter draws from its own stream
                    self.draft_generators[request_id] = draft_generator(
                        params.replace(seed=seed))
            self.generators[request_id] = generator
        if not plan.steps:
            return []
        self.steps += 1
        self.computed_tokens += sum(len(step.tokens) for step in plan.steps)
        results, context = self._forward(plan)
        drafts = {}
        if self.speculative is not None and self.speculative.method == "mtp" \
                and plan.speculating:
            # Every rank of the last stage runs the MTP layers over the accepted rows.
            results = self._broadcast(results, self.sampler)
            if self.mtp_drafter is not None:
                with record_function("inference::mtp_drafts"):
                    drafts = self._mtp_propose(plan, results, context)
            if self.sampler != self.leader:
                drafts = self._broadcast(drafts, self.sampler)
        elif self.sampler != self.leader:
            results = self._broadcast(results, self.sampler)
        if not self.is_leader:
            return []
        return self._apply(plan, results, drafts)

    @torch.inference_mode()  # (not only no_grad: no view / version-counter tracking either)
    def _forward(self, plan: _Plan):
        """(the sampler's results, per request of plan.request_ids: (its tokens, their
        log-probs, their top alternatives, (prompt log-probs, their alternatives), drafts
        accepted or None); on the last stage with MTP drafting (the step's final hidden
        states [T, h], its StepBatch), else None)."""
        model, state = self.model, self.state
        if self.decode_runner is not None and self.decode_runner.takes(plan):
            with record_function("inference::model"):
                logits = self.decode_runner.run(plan.steps)
            with record_function("inference::logits_sampling"):
                return self._pick(plan, logits, [(row, 1) for row in range(len(logits))]), None
        pad_to = state.tp_size if self.sequence_parallel else 1
        with record_function("inference::step_plan"):
            batch = StepBatch(self.cache, plan.steps, self.device, pad_to)
        tokens, positions = batch.tokens[None], batch.positions[None]  # [1, T]
        with record_function("inference::model"):
            if state.is_pipeline_first_stage:
                hidden = model.embedding(tokens, positions)
            else:
                rows = len(batch.tokens) // pad_to
                hidden = torch.empty(rows, 1, self.config.hidden_size, dtype=self.dtype,
                                     device=self.device)
                dist.recv(hidden, src=state.pp_prev_rank, group=state.pp_group)
            hidden = model.decoder(hidden, batch, model._rotary(hidden, positions))
        if not state.is_pipeline_last_stage:
            dist.send(hidden.contiguous(), dst=state.pp_next_rank, group=state.pp_group)
            return None, None
        drafting = self.mtp_drafter is not None and bool(plan.speculating)
        if not plan.request_ids and not drafting:  # only prompt chunks: nothing to sample
            return [], None
        if self.sequence_parallel:
            hidden = gather_from_sequence_parallel_region(hidden, state.tp_group, False)
        context = (hidden[:, 0], batch) if drafting else None
        if not plan.request_ids:
            return [], context
        with record_function("inference::logits_sampling"):
            return self._sample(plan, batch, hidden), context

    def _sample(self, plan: _Plan, batch: StepBatch, hidden: torch.Tensor):
        """The step's logits (the rows each request samples from, or verifies) and the
        sampler's results (None on other ranks); see `_forward`."""
        num_drafts = plan.num_drafts or [None] * len(plan.request_ids)
        rows, spans = [], []
        for request_rows, want, drafted in zip(batch.request_rows, plan.prompt_logprobs,
                                               num_drafts):
            chosen = request_rows if (want or drafted) else request_rows[-1:]
            spans.append((len(rows), len(chosen)))
            rows.extend(chosen)
        if rows == list(range(len(rows))):  # a decode step: every row, in order (no gather)
            logits = self._logits(hidden[:len(rows), 0])
        else:
            logits = self._logits(hidden[:, 0][torch.tensor(rows, device=hidden.device)])
        return self._pick(plan, logits, spans)

    def _pick(self, plan: _Plan, logits: torch.Tensor, spans: List[Tuple[int, int]]):
        """The sampler's results from the step's `logits` [R, vocab], request i's rows
        spans[i] = (first, count) (None on other ranks); see `_forward`."""
        num_drafts = plan.num_drafts or [None] * len(plan.request_ids)
        if self.rank != self.sampler:
            return None
        params = [self.params[i] for i in plan.request_ids]
        plain = [index for index, drafted in enumerate(num_drafts) if not drafted]
        sampled = {}
        if plain:
            last = logits[torch.tensor([spans[i][0] + spans[i][1] - 1 for i in plain],
                                       device=logits.device)]
            for index, token, chosen, alternatives in zip(plain, *sample(
                    last, [params[i] for i in plain],
                    [self.generators[plan.request_ids[i]] for i in plain])):
                sampled[index] = ([token], [chosen], [alternatives], None)
        results = []
        for index, (request_id, step) in enumerate(zip(plan.request_ids, plan.steps)):
            start, count = spans[index]
            if index not in sampled:  # verify the drafts: 1 .. k + 1 tokens
                request_logits = logits[start:start + count]
                probs = plan.draft_probs.get(request_id, self._mtp_probs.get(request_id))
                emitted, accepted = verify(
                    request_logits, step.tokens[1:], params[index],
                    None if probs is None else probs[:count - 1],
                    self.generators[request_id])
                logprobs = torch.log_softmax(request_logits[:len(emitted)].float(), dim=-1)
                chosen = logprobs.gather(1, torch.tensor(emitted, device=logprobs.device)[
                    :, None])[:, 0].tolist()
                alternatives = top_logprobs(logprobs, params[index].logprobs)
                sampled[index] = (emitted, chosen, alternatives, accepted)
            prompt_lp = prompt_top = None
            if plan.prompt_logprobs[index]:
                logprobs = torch.log_softmax(logits[start:start + count - 1].float(), dim=-1)
                targets = torch.tensor(step.tokens[1:], device=logprobs.device)
                prompt_lp = [None] + logprobs.gather(1, targets[:, None])[:, 0].tolist()
                prompt_top = [[]] + top_logprobs(logprobs, params[index].logprobs)
            emitted, chosen, alternatives, accepted = sampled[index]
            results.append((emitted, chosen, alternatives, (prompt_lp, prompt_top), accepted))
        return results

    def _mtp_propose(self, plan: _Plan, results, context) -> Dict[int, List[int]]:
        """The next step's drafts of the speculating requests from the MTP layers (every
        rank of the last stage; the sampler keeps a sampled request's q)."""
        hidden, batch = context
        speculating = set(plan.speculating)
        items, owners = [], []
        for index, request_id in enumerate(plan.request_ids):
            if request_id not in speculating:
                continue
            step, first = plan.steps[index], batch.request_rows[index][0]
            emitted = results[index][0]
            if plan.num_drafts[index] is None:  # a prompt: every row, then its first token
                after = step.tokens[1:] + emitted[:1]
            else:  # the accepted rows, each followed by the token emitted after it
                after = emitted
            # Drafts the next step can verify: its positions stay below the request's end
            # (the leader trims to the same count).
            last = step.start + len(after)  # the position of the last token emitted
            count = min(self._speculation(self.params[request_id]),
                        self._limits[request_id] - last - 2)
            items.append((hidden[first:first + len(after)], step.start, after, step.blocks,
                          max(count, 0)))
            owners.append(request_id)
        for chunk, request_id in enumerate(plan.chunk_ids):
            if request_id not in speculating:
                continue
            index = len(plan.request_ids) + chunk
            step, first = plan.steps[index], batch.request_rows[index][0]
            after = step.tokens[1:] + [plan.chunk_next[chunk]]
            items.append((hidden[first:first + len(after)], step.start, after, step.blocks, 0))
            owners.append(request_id)
        if not items:
            return {}
        probs: Dict[int, List[torch.Tensor]] = {}

        def pick(item: int, logits: torch.Tensor) -> int:
            request_id = owners[item]
            token, q = pick_draft(logits, self.params[request_id],
                                  self.draft_generators.get(request_id))
            if q is not None:
                probs.setdefault(request_id, []).append(q)
            return token

        pad_to = self.state.tp_size if self.sequence_parallel else 1
        drafts = self.mtp_drafter.propose(self.cache, items, pick, pad_to,
                                          self.sequence_parallel)
        for request_id in owners:
            self._mtp_probs.pop(request_id, None)
        self._mtp_probs.update({request_id: torch.stack(q) for request_id, q in probs.items()})
        return {request_id: d for request_id, d in zip(owners, drafts) if d}

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [R, h] -> logits [R, vocab] (this rank's vocabulary shard, gathered)."""
        return vocab_logits(self.model, hidden, self.state.tp_group)

    def _apply(self, plan: _Plan, results, drafts: Dict[int, List[int]]) -> List[Request]:
        advanced = []
        for index, (request_id, (tokens, logprobs, alternatives, prompt, accepted)) in \
                enumerate(zip(plan.request_ids, results)):
            request = self.requests.get(request_id)
            if request is None:
                continue
            if not request.prefilled:
                request.prefilled = True
                if request.params.prompt_logprobs:
                    request.prompt_logprobs, request.prompt_top_logprobs = prompt
            advanced.append(request)
            params = request.params
            if params.max_new_tokens == 0:
                self._finish(request, "length")
                continue
            if accepted is not None:
                drafted = plan.num_drafts[index]
                request.num_drafted += drafted
                request.num_accepted += accepted
                self.num_drafted += drafted
                self.num_accepted += accepted
            request.drafts = drafts.get(request_id, [])
            for token, logprob, top in zip(tokens, logprobs, alternatives):
                request.output.append(token)
                request.logprobs.append(logprob)
                request.top_logprobs.append(top)
                if token in params.stop_token_ids:
                    self._finish(request, "stop")
                elif params.stop and self.stop_checker is not None \
                        and self.stop_checker(request):
                    request.stop_string = self.stop_checker(request)
                    self._finish(request, "stop")
                elif len(request.output) >= params.max_new_tokens:
                    self._finish(request, "length")
                if request.finished:
                    break
        return advanced

    # Drivers ------------------------------------------------------------------------------------

    def run_until_done(self) -> None:
        """Step until the leader has nothing left, then stop every rank (collective)."""
        while True:
            stop = self.is_leader and not self.has_work
            if self.step(stop=stop) is None:
                return

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: Sequence[SamplingParams]) -> List[Request]:
        """Run `prompts` (all ranks pass the same) to completion; every rank gets the finished
        requests, in prompt order."""
        if len(params) != len(prompts):
            raise ConfigError("generate: one SamplingParams per prompt")
        requests = []
        if self.is_leader:
            requests = [self.add_request(p, q) for p, q in zip(prompts, params)]
        self.run_until_done()
        if self.distributed and self.group_size > 1:
            requests = self._broadcast(requests if self.is_leader else None, self.leader)
        return requests

    def worker_loop(self) -> None:
        """A non-leader rank's life in a server: follow the leader's steps until it stops."""
        while self.step() is not None:
            pass

    def shutdown(self) -> None:
        """The leader stops every rank's `worker_loop` (collective)."""
        self.step(stop=True)

    def held_bytes(self, request: Request) -> int:
        """Cache bytes a running request holds on this rank: its blocks of each kind times
        the per-token bytes of this stage's layers of that kind, plus its recurrent-state
        slot."""
        from megatron_smp.inference.kv_cache import attention_layers, layer_bytes_per_token

        total = 0
        for number, attention in attention_layers(self.model).items():
            blocks = request.blocks[self.layout.layer_kind[number]]
            total += len(blocks) * self.block_size * layer_bytes_per_token(attention,
                                                                           self.dtype)
        if request.slot is not None:
            total += self.state_bytes_per_request
        return total

    def memory_report(self) -> Dict[str, int]:
        """The cache on this rank: bytes per token, token capacity and allocated bytes."""
        report = {"bytes_per_token": self.bytes_per_token, "max_tokens": self.max_tokens,
                  "state_bytes_per_request": self.state_bytes_per_request,
                  "allocated_bytes": self.cache.allocated_bytes()}
        if self.prefix_cache is not None:  # blocks in use, and those kept for their prefix
            report["held_bytes"] = (self.prefix_cache.num_held * self.block_size
                                    * self.bytes_per_token)
            report["prefix_cached_blocks"] = self.prefix_cache.num_cached
            report["cached_prompt_tokens"] = self.prefix_cache.cached_tokens
        return report


__all__ = ["InferenceEngine", "Request", "RequestIntake", "check_step_budget"]
