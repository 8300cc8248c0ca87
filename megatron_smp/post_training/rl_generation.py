"""Rollout generation for RL: `group_size` completions per prompt from the in-framework
inference engine running on the weights being trained, then their rewards.

Megatron-LM's sampling flags keep their conventions here (`--rl-default-top-k` <= 0 and
`--rl-default-top-p` 0 mean off) and are mapped onto the engine's `SamplingParams` (top_k 0,
top_p 1.0 mean off). Each sampled completion has its own seed, derived from the run's seed, the
step and its index, so a step's rollouts do not depend on batching and a resumed run draws the
same ones.
"""
import hashlib
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

from megatron_smp.inference import SamplingParams
from megatron_smp.post_training.rl_config import RLConfig
from megatron_smp.post_training.rl_env import Environment, Prompt, score_completions


@dataclass
class Rollout:
    prompt: Prompt
    prompt_ids: List[int]
    completion_ids: List[int]
    completion: str                 # decoded completion (without the end token)
    logprobs: List[float]           # the engine's log-prob of each completion token
    finish_reason: str              # "stop" (end token) or "length" (--rl-max-completion-length)
    reward: float = 0.0
    rewards: Optional[Dict[str, float]] = None  # each reward function's value


def rollout_seed(seed: int, step: int, index: int) -> int:
    """A 63-bit sampling seed for completion `index` of RL step `step`."""
    digest = hashlib.sha256(f"{seed}:{step}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def sampling_params(config: RLConfig, seed: Optional[int],
                    stop_token_ids: Sequence[int] = ()) -> SamplingParams:
    """The engine's SamplingParams for one completion under the run's --rl-default-* flags."""
    greedy = config.temperature == 0.0
    return SamplingParams(
        max_new_tokens=config.max_completion_length, temperature=config.temperature,
        top_k=max(config.top_k, 0), top_p=config.top_p if 0.0 < config.top_p <= 1.0 else 1.0,
        seed=None if greedy else seed, stop_token_ids=list(stop_token_ids))


def generate_rollouts(engine, tokenizer, prompts: Sequence[Prompt], config: RLConfig, *,
                      step: int, seed: int, end_token_ids: Sequence[int] = (),
                      group_size: Optional[int] = None) -> List[Rollout]:
    """`group_size` (default `config.group_size`) completions of each prompt, listed group by
    group (collective over the engine's ranks; every rank passes the same prompts and gets
    the same rollouts).

    tokenizer: has `tokenize(text) -> ids` and `detokenize(ids) -> text` (the project's
    tokenizers). end_token_ids: tokens that end a completion (kept in completion_ids, so the
    model learns to stop; cut from the decoded text).
    """
    group_size = config.group_size if group_size is None else group_size
    prompt_ids = [list(tokenizer.tokenize(p.prompt)) for p in prompts]
    requests_ids, params = [], []
    for number, ids in enumerate(prompt_ids):
        for member in range(group_size):
            index = number * group_size + member
            requests_ids.append(ids)
            params.append(sampling_params(config, rollout_seed(seed, step, index), end_token_ids))
    requests = engine.generate(requests_ids, params)
    rollouts = []
    for index, request in enumerate(requests):
        completion_ids = list(request.output)
        text_ids = (completion_ids[:-1] if completion_ids and completion_ids[-1] in end_token_ids
                    else completion_ids)
        rollouts.append(Rollout(prompt=prompts[index // group_size],
                                prompt_ids=requests_ids[index], completion_ids=completion_ids,
                                completion=tokenizer.detokenize(text_ids),
                                logprobs=list(request.logprobs),
                                finish_reason=request.finish_reason))
    return rollouts


def score_rollouts(environments: Sequence[Environment], rollouts: Sequence[Rollout]) -> None:
    """Fill each rollout's `reward` (weighted sum) and `rewards` (per function)."""
    totals, per_function = score_completions(environments, [r.prompt for r in rollouts],
                                             [r.completion for r in rollouts])
    for rollout, total, values in zip(rollouts, totals, per_function):
        rollout.reward, rollout.rewards = total, values


def rollout_fields(rollouts: Sequence[Rollout]) -> Dict[str, Any]:
    """Lists per rollout for `rollouts.rollout_advantages`, `build_rollout_batch` and
    `rollout_metrics`: rewards, per_function, prompt_ids, completion_ids, completion_lengths,
    truncated."""
    return {
        "rewards": [r.reward for r in rollouts],
        "per_function": [r.rewards or {} for r in rollouts],
        "prompt_ids": [r.prompt_ids for r in rollouts],
        "completion_ids": [r.completion_ids for r in rollouts],
        "completion_lengths": [len(r.completion_ids) for r in rollouts],
        "truncated": [r.finish_reason == "length" for r in rollouts],
    }
