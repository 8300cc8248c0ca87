"""Sampling parameters of one request and the sampler over a step's last-token logits.

The warpers run in Hugging Face's order (temperature, then top-k, then top-p), so a seeded
sampled generation draws from the same distribution as `generate(do_sample=True)`; greedy
(temperature 0, or do_sample=False) is the argmax. Returned log-probs are the model's own
(log-softmax of the raw logits), as OpenAI's and vLLM's APIs report them.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import torch

from megatron_smp.config import ConfigError


@dataclass
class SamplingParams:
    """What one request asks for. `temperature` 0 is greedy; `top_k` 0 and `top_p` 1.0 keep
    every token; `seed` makes a sampled request reproducible whatever else is in the batch;
    generation stops at any of `stop_token_ids` (kept in the output), at a `stop` string
    (cut from the text by the caller) or after `max_new_tokens`. `logprobs`: how many top
    alternatives to report per generated token (0: only the chosen token's log-prob);
    `prompt_logprobs`: the log-prob of every prompt token after the first (and its top
    `logprobs` alternatives). `num_speculative_tokens`: drafts per step for this request in
    an engine that speculates (None: the engine's number; 0: plain decoding)."""

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: Optional[int] = None
    stop_token_ids: List[int] = field(default_factory=list)
    stop: List[str] = field(default_factory=list)
    logprobs: int = 0
    prompt_logprobs: bool = False
    num_speculative_tokens: Optional[int] = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = [int(t) for t in (self.stop_token_ids or [])]

    def validate(self, vocab_size: Optional[int] = None) -> "SamplingParams":
        """Raise a ConfigError naming the field for a value that cannot work."""
        checks = [
            (isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 0,
             "max_new_tokens must be an integer >= 0"),
            (self.temperature >= 0.0, "temperature must be >= 0"),
            (isinstance(self.top_k, int) and self.top_k >= 0,
             "top_k must be an integer >= 0 (0 = off)"),
            (0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"),
            (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20,
             "logprobs must be an integer in [0, 20]"),
            (self.seed is None or isinstance(self.seed, int), "seed must be an integer"),
            (self.num_speculative_tokens is None or (
                isinstance(self.num_speculative_tokens, int)
                and self.num_speculative_tokens >= 0),
             "num_speculative_tokens must be an integer >= 0 (0: no speculation)"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(f"sampling: {message}")
        if vocab_size is not None and any(not 0 <= t < vocab_size
                                           for t in self.stop_token_ids):
            raise ConfigError(f"sampling: stop_token_ids must be in [0, {vocab_size})")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def replace(self, **changes) -> "SamplingParams":
        return dataclasses.replace(self, **changes)


def warp_logits(logits: torch.Tensor, temperature: float, top_k: int,
                top_p: float) -> torch.Tensor:
    """HF's TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper on logits [V] (fp32):
    tokens outside top-k / the top-p nucleus get -inf (the most likely token always stays)."""
    logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=False)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative <= (1 - top_p)
        remove[-1] = False
        logits = logits.masked_fill(remove.scatter(0, order, remove), float("-inf"))
    return logits


def top_logprobs(logprobs: torch.Tensor, count: int) -> List[List[Tuple[int, float]]]:
    """[R, V] log-probs -> per row the `count` most likely (token, log-prob), best first."""
    if count == 0:
        return [[] for _ in range(logprobs.shape[0])]
    values, indices = torch.topk(logprobs, count, dim=-1)
    return [list(zip(i.tolist(), v.tolist())) for i, v in zip(indices, values)]


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[Optional[torch.Generator]]):
    """logits [R, V] (one row per request, the full vocabulary) -> (tokens [R] list,
    the chosen tokens' log-probs [R] list, per row the top `params.logprobs` alternatives)."""
    logits = logits.float()
    logprobs = torch.log_softmax(logits, dim=-1)
    tokens = logits.argmax(dim=-1)
    for row, (request, generator) in enumerate(zip(params, generators)):
        if request.greedy:
            continue
        warped = warp_logits(logits[row], request.temperature, request.top_k, request.top_p)
        probs = warped.softmax(dim=-1)
        tokens[row] = torch.multinomial(probs.cpu(), 1, generator=generator).to(tokens.device)[0]
    chosen = logprobs.gather(1, tokens[:, None])[:, 0]
    alternatives = [top_logprobs(logprobs[row:row + 1], request.logprobs)[0]
                    if request.logprobs else [] for row, request in enumerate(params)]
    return tokens.tolist(), chosen.tolist(), alternatives


__all__ = ["SamplingParams", "sample", "warp_logits", "top_logprobs"]
