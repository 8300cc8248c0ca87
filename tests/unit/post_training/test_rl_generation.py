"""Rollouts from the inference engine: at temperature 0 they equal HF `generate` on the same
weights (tokens and log-probs); sampled rollouts are reproducible from (seed, step, index);
rewards are scored on the decoded completions."""
import copy
import os

import pytest
import torch

import megatron_smp as smp
from megatron_smp.inference import InferenceEngine
from megatron_smp.post_training.envs import addition
from megatron_smp.post_training.rl_config import RLConfig
from megatron_smp.post_training.rl_env import PromptSampler, load_env_config
from megatron_smp.post_training.rl_generation import (generate_rollouts, rollout_fields,
                                                      sampling_params, score_rollouts)
from megatron_smp.post_training.rollouts import build_rollout_batch, rollout_advantages
from tests.unit.inference.common import build
from tests.unit.inference.test_generation import _stage

SHIPPED = os.path.join(os.path.dirname(addition.__file__), "addition.yaml")
EOS = 0  # the small HF GPT-2's eos
STEPS = 16


class CharTokenizer:
    """Digits, '+', '=' and newline as ids 3..15; other ids decode to '?'."""
    alphabet = "0123456789+=\n"

    def tokenize(self, text):
        return [3 + self.alphabet.index(c) for c in text]

    def detokenize(self, ids):
        return "".join(self.alphabet[i - 3] if 3 <= i < 3 + len(self.alphabet) else "?"
                       for i in ids)


@pytest.fixture(scope="module")
def setup():
    smp.init({"random_seed": 3})
    hf = build("gpt2").eval()
    engine = InferenceEngine(_stage(hf, smp.state.parallel_state), max_tokens=512)
    environments = load_env_config(SHIPPED)
    return hf, engine, environments


def test_greedy_rollouts_equal_hf_generate(setup):
    hf, engine, environments = setup
    prompts = PromptSampler(environments, seed=0).sample(3)
    config = RLConfig(group_size=2, prompts_per_step=3, temperature=0.0, top_k=-1, top_p=0.0,
                      max_completion_length=8)
    rollouts = generate_rollouts(engine, CharTokenizer(), prompts, config, step=0, seed=0,
                                 end_token_ids=[EOS])
    assert len(rollouts) == 6
    for index, rollout in enumerate(rollouts):
        assert rollout.prompt is prompts[index // 2]
        ids = torch.tensor([rollout.prompt_ids])
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                              do_sample=False, eos_token_id=EOS, pad_token_id=EOS)[0]
            expected = out[ids.shape[1]:].tolist()
            if EOS in expected:
                expected = expected[:expected.index(EOS) + 1]
            assert rollout.completion_ids == expected
            logits = hf(torch.tensor([rollout.prompt_ids + rollout.completion_ids])).logits[0]
        n = len(rollout.prompt_ids)
        logprobs = torch.log_softmax(logits[n - 1:-1].float(), -1).gather(
            1, torch.tensor(rollout.completion_ids)[:, None])[:, 0]
        assert (torch.tensor(rollout.logprobs) - logprobs).abs().max() < 1e-5
        assert rollout.finish_reason == ("stop" if rollout.completion_ids[-1] == EOS
                                         else "length")
    # Greedy: the members of a group are the same completion.
    assert rollouts[0].completion_ids == rollouts[1].completion_ids

    score_rollouts(environments, rollouts)
    for rollout in rollouts:
        expected = addition.exact_match("", rollout.completion, rollout.prompt.answer)
        assert rollout.reward == expected and list(rollout.rewards.values()) == [expected]


def test_sampled_rollouts_are_seeded_by_step_and_index(setup):
    _, engine, environments = setup
    prompts = PromptSampler(environments, seed=1).sample(2)
    config = RLConfig(group_size=4, prompts_per_step=2, temperature=1.0, top_k=-1, top_p=0.0,
                      max_completion_length=6)
    params = sampling_params(config, seed=5, stop_token_ids=[EOS])
    assert (params.top_k, params.top_p, params.temperature, params.seed) == (0, 1.0, 1.0, 5)
    nucleus = sampling_params(RLConfig(temperature=0.7, top_k=20, top_p=0.9), seed=5)
    assert (nucleus.top_k, nucleus.top_p, nucleus.temperature) == (20, 0.9, 0.7)
    assert sampling_params(RLConfig(temperature=0.0), seed=5).seed is None  # greedy
    tokenizer = CharTokenizer()
    first = generate_rollouts(engine, tokenizer, prompts, config, step=3, seed=11,
                              end_token_ids=[EOS])
    again = generate_rollouts(engine, tokenizer, prompts, config, step=3, seed=11,
                              end_token_ids=[EOS])
    other_step = generate_rollouts(engine, tokenizer, prompts, config, step=4, seed=11,
                                   end_token_ids=[EOS])
    assert [r.completion_ids for r in first] == [r.completion_ids for r in again]
    assert [r.completion_ids for r in first] != [r.completion_ids for r in other_step]
    assert len({tuple(r.completion_ids) for r in first[:4]}) > 1  # members of a group differ

    # The rollouts become a training batch.
    score_rollouts(environments, first)
    fields = rollout_fields(first)
    advantages, kept = rollout_advantages(fields["rewards"], config.group_size)
    batch = build_rollout_batch(fields["prompt_ids"], fields["completion_ids"], advantages,
                                seq_length=32, pad_id=EOS, loss_type="dapo")
    assert int(batch["loss_mask"].sum()) == sum(fields["completion_lengths"])
    # Every completion token is a trained label once (packing only reorders the rollouts).
    assert (sorted(batch["labels"][batch["loss_mask"] > 0].tolist())
            == sorted(sum(fields["completion_ids"], [])))


def test_one_grpo_update_on_engine_weights():
    """Rollouts -> fixed rewards -> packed batch -> the model's log-probs (they equal the
    engine's sampling log-probs) -> one clipped-objective update -> the engine, sharing the
    model's parameters, scores the rollouts with the updated weights: the positive-advantage
    completions became likelier and the negative ones less likely."""
    from megatron_smp.post_training.grpo import weighted_grpo_loss
    from megatron_smp.post_training.rollouts import rollout_weights
    from megatron_smp.inference import SamplingParams

    smp.init({"random_seed": 3})
    hf = build("gpt2", seed=1)
    model = _stage(hf, smp.state.parallel_state)
    engine = InferenceEngine(model, max_tokens=512)
    environments = load_env_config(SHIPPED)
    prompts = PromptSampler(environments, seed=2).sample(2)
    config = RLConfig(group_size=4, prompts_per_step=2, temperature=1.0, max_completion_length=5,
                      loss_type="grpo", kl_beta=0.0)
    rollouts = generate_rollouts(engine, CharTokenizer(), prompts, config, step=0, seed=0,
                                 end_token_ids=[EOS])
    rewards = [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0]  # fixed, so both signs are present
    advantages, _ = rollout_advantages(rewards, config.group_size)
    fields = rollout_fields(rollouts)
    batch = build_rollout_batch(fields["prompt_ids"], fields["completion_ids"], advantages,
                                seq_length=32, pad_id=EOS, loss_type=config.loss_type)

    def batch_logps():
        logits = model(batch["tokens"], position_ids=batch["position_ids"],
                       document_ids=batch["document_ids"])[..., :hf.config.vocab_size]
        return torch.log_softmax(logits.float(), -1).gather(
            -1, batch["labels"].unsqueeze(-1)).squeeze(-1)

    def per_rollout(values):
        trained = batch["loss_mask"] > 0
        return [values[trained & (batch["sequence_ids"] == i)] for i in range(len(rollouts))]

    # No dropout (RL runs set --hidden-dropout 0 --attention-dropout 0): the policy that is
    # trained is the one that sampled.
    model.eval()
    logps = batch_logps()
    # The training forward's log-probs equal what the engine reported while sampling.
    for ours, rollout in zip(per_rollout(logps.detach()), rollouts):
        assert (ours - torch.tensor(rollout.logprobs)).abs().max() < 1e-5
    engine_logps = build_rollout_batch(
        fields["prompt_ids"], fields["completion_ids"], advantages, seq_length=32, pad_id=EOS,
        loss_type=config.loss_type, old_logprobs=[r.logprobs for r in rollouts])["old_logps"]
    assert ((engine_logps - logps.detach()) * batch["loss_mask"]).abs().max() < 1e-5
    loss, metrics = weighted_grpo_loss(
        logps, logps.detach(), batch["advantages"], rollout_weights(batch),
        sequence_ids=batch["sequence_ids"], loss_type="grpo", clamp_eps_lower=0.2,
        clamp_eps_upper=0.2)
    assert metrics["clip_fraction"] == 0 and abs(metrics["ratio_mean"] - 1) < 1e-6
    loss.backward()
    torch.optim.SGD(model.parameters(), lr=0.5).step()

    # The engine reads the updated parameters directly: its prompt log-probs of each rollout
    # equal a fresh forward of the updated model, and moved with the advantage's sign.
    requests = engine.generate(
        [r.prompt_ids + r.completion_ids for r in rollouts],
        [SamplingParams(max_new_tokens=0, prompt_logprobs=True)] * len(rollouts))
    with torch.no_grad():
        after = per_rollout(batch_logps())
    before = per_rollout(logps.detach())
    for index, (rollout, request) in enumerate(zip(rollouts, requests)):
        engine_after = torch.tensor(request.prompt_logprobs[len(rollout.prompt_ids):])
        assert (engine_after - after[index]).abs().max() < 1e-5
        change = (after[index] - before[index]).mean().item()
        assert change * advantages[index].item() > 0, (index, change)


class _Run:
    """The pieces of an RL step in sequence, as a loop will run them (a plain optimizer and
    the model's own forward stand in for the trainer)."""

    def __init__(self):
        from megatron_smp.post_training.rollouts import grpo_loss_fn

        smp.init({"random_seed": 3})
        self.hf = build("gpt2", seed=2)
        self.model = _stage(self.hf, smp.state.parallel_state)
        self.engine = InferenceEngine(self.model, max_tokens=2048, max_requests=64)
        self.sampler = PromptSampler(load_env_config(SHIPPED), seed=0)
        self.config = RLConfig(group_size=4, prompts_per_step=8, iterations=2, temperature=1.0,
                               max_completion_length=2, loss_type="dapo", clamp_eps_lower=0.2,
                               clamp_eps_upper=0.28, kl_beta=0.0)
        self.vocab = self.hf.config.vocab_size
        self.loss_fn = grpo_loss_fn(self.config, smp.state.parallel_state.tp_group, self.vocab)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-2)

    def state_dict(self):
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "sampler": self.sampler.state_dict()}

    def load_state_dict(self, state):
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.sampler.load_state_dict(state["sampler"])

    def steps(self, first, last):
        """Steps first..last-1: each step's mean reward and its updates' losses."""
        config, means, losses = self.config, [], []
        for step in range(first, last):
            rollouts = generate_rollouts(self.engine, CharTokenizer(),
                                         self.sampler.sample(config.prompts_per_step), config,
                                         step=step, seed=0)
            rewards = [float(r.completion_ids[0] < self.vocab // 2) for r in rollouts]
            means.append(sum(rewards) / len(rewards))
            advantages, kept = rollout_advantages(rewards, config.group_size,
                                                  filter_groups_with_same_reward=True)
            if not kept:
                continue
            # Old log-probs: the sampling policy's, as the engine reported them.
            batch = build_rollout_batch([rollouts[i].prompt_ids for i in kept],
                                        [rollouts[i].completion_ids for i in kept], advantages,
                                        seq_length=32, pad_id=EOS, loss_type=config.loss_type,
                                        old_logprobs=[rollouts[i].logprobs for i in kept])
            for _ in range(config.iterations):
                self.optimizer.zero_grad()
                logits = self.model(batch["tokens"], position_ids=batch["position_ids"],
                                    document_ids=batch["document_ids"])
                loss, _ = self.loss_fn(logits, batch)
                loss.backward()
                self.optimizer.step()
                losses.append(loss.item())
        return means, losses


def test_grpo_steps_raise_a_reward_and_resume_exactly():
    """Rollouts from the engine on the trained weights, rewards, advantages (DAPO's filter),
    packed batch, two clipped updates per batch against the sampling policy's log-probs: a
    reward the random model earns half the time (the first completion token is in the lower
    half of the vocabulary) rises from about 0.5 to above 0.8. Resumed from step 8's state
    (weights, optimizer, prompt sampler; rollout seeds follow the step), the run repeats the
    uninterrupted run's rewards and losses."""
    run = _Run()
    means, losses = run.steps(0, 8)
    state = copy.deepcopy(run.state_dict())
    later_means, later_losses = run.steps(8, STEPS)
    means += later_means
    # Measured: 0.59 0.44 0.34 0.53 ... 0.91 0.94 0.97 0.97 0.91 (first four 0.48, last four 0.94).
    first, last = sum(means[:4]) / 4, sum(means[-4:]) / 4
    assert first < 0.6 and last > first + 0.3, means

    resumed = _Run()
    resumed.load_state_dict(state)
    resumed_means, resumed_losses = resumed.steps(8, STEPS)
    assert resumed_means == later_means
    assert resumed_losses == later_losses
