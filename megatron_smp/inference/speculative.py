"""Speculative decoding: drafts proposed cheaply, verified by the model in one step.

A speculating request's decode step runs its last token and its k drafts d_1..d_k through
the model at once (k + 1 rows, the cache written for all of them); row j's logits are the
model's distribution p_j after the tokens up to d_j. The accept / resample rule of Leviathan
et al. (2023, "Fast Inference from Transformers via Speculative Decoding") then keeps a
prefix of the drafts and adds one token of the model's own, so every step emits 1 .. k + 1
tokens whose distribution is exactly the model's:

* greedy: d_j is kept while it is p_(j-1)'s argmax; the first mismatch is replaced by that
  argmax (or, all kept, row k's argmax follows) -- the tokens of plain greedy decoding;
* sampling: d_j (drawn from the drafter's q_j) is kept with probability
  min(1, p_j(d_j) / q_j(d_j)); on the first rejection a token is drawn from the residual
  norm(max(0, p_j - q_j)) and the step ends; all kept, one more is drawn from p_k. p and q are
  the warped distributions (temperature, top-k, top-p) the request samples from. A drafter
  that proposes deterministically (n-gram lookup) has q_j = one-hot(d_j).

Keys written for rejected drafts are left in the cache: the next step starts at the first
position not accepted and overwrites them before any query reads them (a query attends only
to positions below its own, and a step's keys are written before its queries read).

Drafters (`SpeculativeConfig.method`, the names of vLLM's `speculative_config`):
* "ngram": prompt lookup -- the longest suffix of the request's tokens (between
  `prompt_lookup_max` and `prompt_lookup_min` tokens) found earlier in them proposes the
  tokens that followed it there (on the leader, from the tokens it holds);
* "mtp": the model's own multi-token-prediction layers (`--mtp-num-layers`), run on the last
  pipeline stage after each step over the step's accepted rows (`MTPDrafter`); Megatron-LM's
  `--num-speculative-tokens`;
* "draft_model": a smaller model sharing the tokenizer, whole (unsharded) on the leader with a
  paged cache of its own (`DraftModelRunner`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from megatron_smp.config import ConfigError
from megatron_smp.distributed.unwrap import unwrap_model
from megatron_smp.inference.kv_cache import (
    BlockAllocator,
    CacheLayout,
    PagedKVCache,
    StepBatch,
    StepRequest,
    blocks_for,
    recurrent_layers,
)
from megatron_smp.inference.sampling import SamplingParams, warp_logits
from megatron_smp.models.gpt import output_logits
from megatron_smp.tensor_parallel.layers import linear
from megatron_smp.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

METHODS = ("ngram", "mtp", "draft_model")


@dataclass
class SpeculativeConfig:
    """vLLM's `speculative_config` (`--speculative-config '{"method": ...}'`), Megatron-LM's
    `--num-speculative-tokens`: `method` one of ngram / mtp / draft_model, up to
    `num_speculative_tokens` drafts per request and step; n-gram lookup matches suffixes of
    `prompt_lookup_max` down to `prompt_lookup_min` tokens. `model`: the draft checkpoint's
    directory (method draft_model, for the tools that load it; the engine takes the built
    model)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 5
    prompt_lookup_min: int = 1
    model: Optional[str] = None

    def validate(self) -> "SpeculativeConfig":
        if self.method not in METHODS:
            raise ConfigError(f"speculative_config: method must be one of {list(METHODS)}, "
                              f"got {self.method!r}")
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 1:
            raise ConfigError("speculative_config: num_speculative_tokens "
                              "(--num-speculative-tokens) must be an integer >= 1, got "
                              f"{self.num_speculative_tokens!r}")
        for name in ("prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"speculative_config: {name} must be an integer >= 1, "
                                  f"got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError("speculative_config: prompt_lookup_min "
                              f"({self.prompt_lookup_min}) is above prompt_lookup_max "
                              f"({self.prompt_lookup_max})")
        if self.model is not None and self.method != "draft_model":
            raise ConfigError(f"speculative_config: 'model' (a draft checkpoint) goes with "
                              f"method 'draft_model', not {self.method!r}")
        return self

    @classmethod
    def from_dict(cls, values: Dict) -> "SpeculativeConfig":
        """From vLLM's dict form; unknown keys are a ConfigError naming them."""
        if not isinstance(values, dict):
            raise ConfigError("--speculative-config must be a JSON object, e.g. "
                              '\'{"method": "ngram", "num_speculative_tokens": 4}\'')
        known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
                 "model"}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"--speculative-config: unknown keys {unknown} (this engine "
                              f"takes {sorted(known)})")
        if "method" not in values or "num_speculative_tokens" not in values:
            raise ConfigError("--speculative-config needs 'method' and "
                              "'num_speculative_tokens'")
        return cls(**values).validate()


# The accept / resample rule --------------------------------------------------------------------

def acceptance_probability(target: torch.Tensor, draft: Optional[torch.Tensor],
                           token: int) -> float:
    """min(1, p(token) / q(token)) for target p [V] and draft q [V] (None: one-hot at token)."""
    q = 1.0 if draft is None else float(draft[token])
    return min(1.0, float(target[token]) / q)


def residual_distribution(target: torch.Tensor, draft: Optional[torch.Tensor],
                          token: int) -> torch.Tensor:
    """norm(max(0, p - q)) [V], what a rejected draft is replaced from (q None: one-hot at
    token). Where it is all zero (p <= q everywhere, so p == q and no draft is ever rejected)
    p itself."""
    if draft is None:
        residual = target.clone()
        residual[token] = 0.0
    else:
        residual = (target - draft).clamp(min=0.0)
    total = residual.sum()
    return target if float(total) <= 0.0 else residual / total


def accept_drafts(target: torch.Tensor, drafts: Sequence[int], draft_probs: Optional[torch.Tensor],
                  generator: Optional[torch.Generator]) -> Tuple[List[int], int]:
    """The rule for one request: target [k + 1, V] (the warped probabilities of its verified
    rows), drafts [k], draft_probs [k, V] (None: a deterministic drafter) -> (emitted tokens,
    1 .. k + 1 of them; how many drafts were accepted)."""
    emitted: List[int] = []
    for j, token in enumerate(drafts):
        q = None if draft_probs is None else draft_probs[j]
        u = float(torch.rand((), generator=generator))
        if u < acceptance_probability(target[j], q, token):
            emitted.append(int(token))
            continue
        residual = residual_distribution(target[j], q, token)
        emitted.append(int(torch.multinomial(residual, 1, generator=generator)))
        return emitted, j
    emitted.append(int(torch.multinomial(target[len(drafts)], 1, generator=generator)))
    return emitted, len(drafts)


def warped_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [R, V] -> the probabilities [R, V] (fp32) the request samples from."""
    logits = logits.float()
    return torch.stack([warp_logits(row, params.temperature, params.top_k, params.top_p)
                        for row in logits]).softmax(dim=-1)


def verify(logits: torch.Tensor, drafts: Sequence[int], params: SamplingParams,
           draft_probs: Optional[torch.Tensor], generator: Optional[torch.Generator]
           ) -> Tuple[List[int], int]:
    """logits [k + 1, V] of a request's verified rows -> (emitted tokens, drafts accepted)."""
    if params.greedy:
        best = logits.argmax(dim=-1).tolist()
        accepted = 0
        while accepted < len(drafts) and best[accepted] == drafts[accepted]:
            accepted += 1
        return list(drafts[:accepted]) + [best[accepted]], accepted
    return accept_drafts(warped_probs(logits, params), drafts, draft_probs, generator)


def pick_draft(logits: torch.Tensor, params: SamplingParams,
               generator: Optional[torch.Generator]) -> Tuple[int, Optional[torch.Tensor]]:
    """A drafter's next token from its logits [V]: the argmax for a greedy request, else a
    draw from its warped distribution q, returned with it."""
    if params.greedy:
        return int(logits.argmax()), None
    probs = warped_probs(logits[None], params)[0]
    return int(torch.multinomial(probs, 1, generator=generator)), probs


def draft_generator(params: SamplingParams) -> Optional[torch.Generator]:
    """The drafter's own generator of a sampled request (its seed's, offset; greedy: None)."""
    if params.greedy:
        return None
    generator = torch.Generator()
    seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,)))
    generator.manual_seed((seed + 0x5EED) % 2**63)
    return generator


# Drafters ---------------------------------------------------------------------------------------

def ngram_propose(tokens: Sequence[int], count: int, lookup_max: int,
                  lookup_min: int) -> List[int]:
    """Prompt lookup: for n from lookup_max down to lookup_min, the last n tokens' latest
    earlier occurrence in `tokens` proposes the (up to) `count` tokens after it; [] if none."""
    length = len(tokens)
    if count < 1:
        return []
    for n in range(min(lookup_max, length - 1), lookup_min - 1, -1):
        suffix = list(tokens[length - n:])
        for start in range(length - n - 1, -1, -1):
            if tokens[start] == suffix[0] and list(tokens[start:start + n]) == suffix:
                return list(tokens[start + n:start + n + count])
    return []


def vocab_logits(model: torch.nn.Module, hidden: torch.Tensor, tp_group) -> torch.Tensor:
    """hidden [R, h] -> logits [R, vocab] through `model`'s output layer (its vocabulary
    shard, gathered over `tp_group`; soft-capped as the model is)."""
    layer = model.output_layer
    weight = layer.weight if layer.weight is not None \
        else model.embedding.word_embeddings.weight
    logits = output_logits(linear(hidden, weight, layer.bias), model.config)
    logits = gather_from_tensor_model_parallel_region(logits, tp_group)
    return logits[:, : model.config.vocab_size]


class DraftModelRunner:
    """A draft model whole on the engine's leader, with a paged cache of its own (the same
    token capacity and block size as the engine's): `propose` runs, per request, the tokens
    its cache lacks (the first time its prompt), then one token at a time for the rest of
    the drafts. `written[r]`: the tokens whose keys the cache holds, in position order; a new
    step keeps the prefix they share with the request's tokens (drafts that were rejected
    are run again, as keys of the tokens now there)."""

    def __init__(self, model: torch.nn.Module, vocab_size: int, num_blocks: int,
                 block_size: int, max_requests: int, device) -> None:
        model = unwrap_model(model)
        config = model.config
        if config.vocab_size != vocab_size:
            raise ConfigError(f"speculative draft model: its vocabulary ({config.vocab_size}) "
                              f"differs from the model's ({vocab_size}); the draft must share "
                              "the tokenizer")
        state = model.state
        if any(len(ranks) > 1 for ranks in state.group_ranks.values()):
            raise ConfigError("speculative draft model: it runs whole on the leader, alone; "
                              "build it on a state of that rank only "
                              "(parallel_state.local_parallel_state())")
        if recurrent_layers(model):
            raise ConfigError("speculative draft model: Mamba / Gated DeltaNet layers cannot "
                              "take back rejected tokens; use a draft of attention layers")
        self.model = model.eval()
        self.layout = CacheLayout(config, num_blocks, block_size, max_requests)
        if self.layout.kinds != [None]:
            raise ConfigError("speculative draft model: its layers must all keep full "
                              "attention (sliding windows are not supported for the draft)")
        self.block_size = block_size
        self.device = device
        self.cache = PagedKVCache(model, self.layout, config.params_dtype, device)
        self.allocator = BlockAllocator(num_blocks)
        self.tables: Dict[int, List[int]] = {}
        self.written: Dict[int, List[int]] = {}

    def can_admit(self, total_tokens: int) -> bool:
        return blocks_for(total_tokens, self.block_size) <= self.allocator.num_free

    def admit(self, request_id: int, total_tokens: int) -> None:
        self.tables[request_id] = self.allocator.allocate(blocks_for(total_tokens,
                                                                     self.block_size))
        self.written[request_id] = []

    def release(self, request_id: int) -> None:
        self.allocator.free(self.tables.pop(request_id, []))
        self.written.pop(request_id, None)

    @torch.inference_mode()
    def _logits(self, steps: List[StepRequest]) -> torch.Tensor:
        """Each step's last-row logits [len(steps), V]."""
        model = self.model
        batch = StepBatch(self.cache, steps, self.device)
        tokens, positions = batch.tokens[None], batch.positions[None]
        hidden = model.embedding(tokens, positions)
        hidden = model.decoder(hidden, batch, model._rotary(hidden, positions))
        last = torch.tensor([rows[-1] for rows in batch.request_rows], device=hidden.device)
        return vocab_logits(model, hidden[:, 0].index_select(0, last), model.state.tp_group)

    def propose(self, items: Sequence[Tuple[int, List[int], int, SamplingParams,
                                            Optional[torch.Generator]]]
                ) -> List[Tuple[List[int], Optional[torch.Tensor]]]:
        """items (request id, its tokens, drafts wanted >= 1, params, drafter generator) ->
        per item (drafts, their q [k, V] for a sampled request, else None)."""
        drafts: List[List[int]] = [[] for _ in items]
        probs: List[List[torch.Tensor]] = [[] for _ in items]
        steps = []
        for request_id, tokens, _, _, _ in items:
            written = self.written[request_id]
            keep = 0
            limit = min(len(written), len(tokens) - 1)  # the last token runs: its logits
            while keep < limit and written[keep] == tokens[keep]:
                keep += 1
            steps.append(StepRequest(list(tokens[keep:]), keep, {None: self.tables[request_id]}))
        active = list(range(len(items)))
        while active:
            logits = self._logits(steps)
            for index, row in zip(active, logits):
                _, _, _, params, generator = items[index]
                token, q = pick_draft(row, params, generator)
                drafts[index].append(token)
                if q is not None:
                    probs[index].append(q)
            active = [i for i in active if len(drafts[i]) < items[i][2]]
            steps = [StepRequest([drafts[i][-1]], len(items[i][1]) + len(drafts[i]) - 1,
                                 {None: self.tables[items[i][0]]}) for i in active]
        results = []
        for (request_id, tokens, _, _, _), proposed, q in zip(items, drafts, probs):
            self.written[request_id] = list(tokens) + proposed[:-1]
            results.append((proposed, torch.stack(q) if q else None))
        return results


class MTPDrafter:
    """Drafts from the model's multi-token-prediction layers, on every rank of the last
    pipeline stage, after each step.

    Depth k's layer at position i reads (h^(k-1)_i, the token at i + k) as in training
    (`models.multi_token_prediction`), with a paged cache of its own (pools beside the
    decoder's, same block tables). After a step, depth 1 runs over the rows whose tokens were
    accepted (their next tokens now known) and its last row's logits give d_1; depth k <= D
    runs over the same rows with the tokens k places on (the drafts so far at the end) and
    gives d_k; beyond D drafts come from depth D one position further on at a time, fed its
    own last output and the previous draft (vLLM's reuse of the MTP layer). Keys written from
    drafts are overwritten when their positions are accepted. Drafts are only proposals: the
    verification keeps the model's tokens exact whatever they are."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.layers = list(model.mtp.layers)
        self.depth = len(self.layers)

    def layer_numbers(self) -> List[int]:
        return [self.model.config.num_layers + k for k in range(1, self.depth + 1)]

    def run(self, cache: PagedKVCache, depth: int, hidden: torch.Tensor,
            steps: List[StepRequest], positions_ahead: int, pad_to: int,
            sequence_parallel: bool) -> torch.Tensor:
        """Depth `depth`'s layer over hidden [R, h] (the steps' rows in order) with
        steps[i].tokens the tokens `positions_ahead` places on (embedded at their own
        positions) -> its output [R, h] (final-normed)."""
        from megatron_smp.tensor_parallel.mappings import (
            gather_from_sequence_parallel_region,
            scatter_to_sequence_parallel_region,
        )

        model, state = self.model, self.model.state
        batch = StepBatch(cache, steps, hidden.device, pad_to)
        rows = hidden.shape[0]
        padded = len(batch.tokens)
        if padded > rows:
            hidden = torch.cat([hidden, hidden.new_zeros(padded - rows, hidden.shape[1])])
        hidden = hidden[:, None]
        positions = batch.positions[None]
        if sequence_parallel:
            hidden = scatter_to_sequence_parallel_region(hidden, state.tp_group)
        token_positions = positions + positions_ahead
        rotary = model._rotary(hidden, positions)
        output = self.layers[depth - 1](hidden, batch.tokens[None], token_positions, batch,
                                        rotary, model.embedding)
        if sequence_parallel:
            output = gather_from_sequence_parallel_region(output, state.tp_group, False)
        return output[:rows, 0]

    def propose(self, cache: PagedKVCache, items, pick, pad_to: int,
                sequence_parallel: bool) -> List[List[int]]:
        """items: per request (hidden [m, h] of its accepted rows, their first position,
        the m tokens after them, its block tables, drafts wanted (0: only fill depth 1's
        cache, a prompt chunk)); pick(item index, logits [V]) -> a draft token (the same on
        every rank) -> per item its drafts."""
        model = self.model
        drafts: List[List[int]] = [[] for _ in items]
        hidden = [item[0] for item in items]
        wanted = max([item[4] for item in items] + [1])

        def advance(depth, members, steps, ahead):
            rows = torch.cat([hidden[i] for i in members])
            output = self.run(cache, depth, rows, steps, ahead, pad_to, sequence_parallel)
            sizes = [hidden[i].shape[0] for i in members]
            chunks = list(output.split(sizes))
            last = [chunk[-1] for chunk, i in zip(chunks, members) if items[i][4] > len(drafts[i])]
            takers = [i for i in members if items[i][4] > len(drafts[i])]
            for i, chunk in zip(members, chunks):
                hidden[i] = chunk
            if takers:
                logits = vocab_logits(model, torch.stack(last), model.state.tp_group)
                for i, row in zip(takers, logits):
                    drafts[i].append(pick(i, row))

        for depth in range(1, min(self.depth, wanted) + 1):
            members = [i for i, item in enumerate(items) if item[4] >= depth or depth == 1]
            steps = []
            for i in members:
                _, start, after, blocks, _ = items[i]
                ahead = list(after) + drafts[i]
                steps.append(StepRequest(ahead[depth - 1:depth - 1 + len(after)], start, blocks))
            advance(depth, members, steps, depth)
        for j in range(self.depth + 1, wanted + 1):  # depth D again, a position further on
            members = [i for i, item in enumerate(items) if item[4] >= j]
            for i in members:
                hidden[i] = hidden[i][-1:]
            steps = [StepRequest([drafts[i][-1]],
                                 items[i][1] + len(items[i][2]) - 1 + j - self.depth,
                                 items[i][3]) for i in members]
            advance(self.depth, members, steps, self.depth)
        return drafts


def speculative_config_of(args) -> Optional["SpeculativeConfig"]:
    """The SpeculativeConfig of --speculative-config / --num-speculative-tokens (an
    InferenceConfig's, or a namespace's of the same names), or None."""
    import json

    if args.speculative_config is not None and args.num_speculative_tokens is not None:
        raise ConfigError("give --speculative-config (vLLM's form) or --num-speculative-tokens "
                          "(MTP drafts, Megatron-LM's form), not both")
    if args.num_speculative_tokens is not None:
        return SpeculativeConfig("mtp", args.num_speculative_tokens).validate()
    if args.speculative_config is None:
        return None
    try:
        values = json.loads(args.speculative_config)
    except json.JSONDecodeError as error:
        raise ConfigError(f"--speculative-config is not JSON ({error})") from error
    config = SpeculativeConfig.from_dict(values)
    if config.method == "draft_model" and config.model is None:
        raise ConfigError("--speculative-config method 'draft_model' needs \"model\": the "
                          "draft checkpoint's directory (sharing the tokenizer)")
    return config


__all__ = ["SpeculativeConfig", "acceptance_probability", "residual_distribution",
           "accept_drafts", "verify", "pick_draft", "draft_generator", "ngram_propose",
           "vocab_logits", "DraftModelRunner", "MTPDrafter", "METHODS", "warped_probs",
           "speculative_config_of"]
