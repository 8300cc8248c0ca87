"""The --langrl-env-config environments, the prompt sampler, the shipped addition task and the
RL flags' typed config."""
import argparse
import json
import os
import sys

import pytest

from megatron_smp.config import ConfigError
from megatron_smp.post_training.envs import addition
from megatron_smp.post_training.rl_config import RLConfig, add_rl_args, rl_config
from megatron_smp.post_training.rl_env import (EnvConfigError, PromptSampler, load_env_config,
                                               score_completions)

SHIPPED = os.path.join(os.path.dirname(addition.__file__), "addition.yaml")


def _write(tmp_path, text, name="env.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.fixture
def reward_module(tmp_path, monkeypatch):
    """A user's reward module on sys.path, with good and bad reward functions."""
    (tmp_path / "my_rewards.py").write_text(
        "def length_reward(prompt, completion, answer):\n"
        "    return len(completion) / 10\n"
        "def says_text(prompt, completion, answer):\n"
        "    return 'high'\n"
        "def says_none(prompt, completion, answer):\n"
        "    return None\n"
        "def says_nan(prompt, completion, answer):\n"
        "    return float('nan')\n"
        "NOT_CALLABLE = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_rewards"
    sys.modules.pop("my_rewards", None)


def test_shipped_addition_environment_scores_exact_matches():
    environments = load_env_config(SHIPPED)
    assert [env.name for env in environments] == ["addition", "addition_eval"]
    train, evaluation = environments
    assert len(train.records) == 2000 and evaluation.evaluation_only
    # Different seeds: the evaluation sums are not the training prompts.
    assert {r["prompt"] for r in evaluation.records} != {r["prompt"] for r in train.records[:200]}
    sampler = PromptSampler(environments, seed=3)
    prompts = sampler.sample(4)
    assert all(p.environment == "addition" for p in prompts)  # evaluation_only is never drawn
    a, b = prompts[0].prompt.rstrip("=").split("+")
    right = str(int(a) + int(b))
    completions = [right + "\nmore text", " " + right, right + "1", ""]
    totals, per_function = score_completions(environments, [prompts[0]] * 4, completions)
    assert totals == [1.0, 1.0, 0.0, 0.0]
    assert per_function[0] == {"megatron_smp.post_training.envs.addition:exact_match": 1.0}


def test_addition_generator_cli_writes_rl_and_sft_records(tmp_path):
    out = tmp_path / "add.jsonl"
    addition.main(["--output", str(out), "--num-prompts", "5", "--seed", "4"])
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert records == addition.prompts(5, seed=4)
    for record in records:
        a, b = record["prompt"].rstrip("=").split("+")
        assert 10 <= int(a) <= 99 and int(record["answer"]) == int(a) + int(b)
    addition.main(["--output", str(out), "--num-prompts", "2", "--format", "sft"])
    sft = [json.loads(line) for line in out.read_text().splitlines()]
    assert set(sft[0]) == {"prompt", "response"} and sft[0]["response"].endswith("\n")
    assert addition.digit_match("", "46", "47") == 0.5


def test_jsonl_prompts_user_rewards_and_weights(tmp_path, reward_module):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "q.jsonl").write_text(
        json.dumps({"question": "2+2=", "solution": "4"}) + "\n\n"
        + json.dumps({"question": "3+3=", "solution": "6"}) + "\n")
    path = _write(tmp_path, f"""
- name: arithmetic
  prompts: data/q.jsonl
  prompt_key: question
  answer_key: solution
  reward_functions:
    - function: megatron_smp.post_training.envs.addition:exact_match
      weight: 2.0
    - function: {reward_module}:length_reward
      weight: 0.5
""")
    (env,) = load_env_config(path)  # the JSONL path is relative to the YAML file
    assert env.records == [{"prompt": "2+2=", "answer": "4"}, {"prompt": "3+3=", "answer": "6"}]
    total, values = env.score("2+2=", "4", "4")
    assert values == {"megatron_smp.post_training.envs.addition:exact_match": 1.0,
                      f"{reward_module}:length_reward": 0.1}
    assert total == pytest.approx(2.0 * 1.0 + 0.5 * 0.1)


@pytest.mark.parametrize("body,message", [
    ("- prompts: nowhere.jsonl\n  reward_functions: [my_rewards:length_reward]\n",
     "prompts file 'nowhere.jsonl' not found"),
    ("- prompts: megatron_smp.post_training.envs.addition:prompts\n"
     "  reward_functions: [exact_match]\n", "'exact_match' is not of the form 'module:function'"),
    ("- prompts: megatron_smp.post_training.envs.addition:prompts\n"
     "  reward_functions: [no_such_module_xyz:f]\n", "cannot import module 'no_such_module_xyz'"),
    ("- prompts: megatron_smp.post_training.envs.addition:prompts\n"
     "  reward_functions: [megatron_smp.post_training.envs.addition:nope]\n",
     "has no attribute 'nope'"),
    ("- prompts: megatron_smp.post_training.envs.addition:prompts\n"
     "  reward_functions: [my_rewards:NOT_CALLABLE]\n",
     "'my_rewards:NOT_CALLABLE' is not callable"),
    ("- prompts: megatron_smp.post_training.envs.addition:prompts\n  reward_functions: []\n",
     "'reward_functions' must be a non-empty list"),
    ("- agent_type: CountdownAgent\n  agent_args: {}\n  weight: 1.0\n",
     "Megatron-LM's 'agent_type'/'agent_args'"),
    ("- prompts: megatron_smp.post_training.envs.addition:prompts\n"
     "  reward_functions: [my_rewards:length_reward]\n  temperature: 0.5\n",
     r"unknown key\(s\) \['temperature'\]"),
    ("- prompts: megatron_smp.post_training.envs.addition:prompts\n"
     "  reward_functions: [my_rewards:length_reward]\n  weight: -1\n",
     "'weight' must be a non-negative number"),
    ("- prompts: megatron_smp.post_training.envs.addition:prompts\n"
     "  reward_functions: [my_rewards:length_reward]\n  evaluation_only: true\n",
     "need a positive total weight"),
    ("name: not-a-list\n", "expected a non-empty YAML list"),
    ("- [unclosed\n", "not valid YAML"),
])
def test_env_config_errors_name_the_problem(tmp_path, reward_module, body, message):
    with pytest.raises(EnvConfigError, match=message):
        load_env_config(_write(tmp_path, body))


def test_missing_env_file_and_bad_records(tmp_path, reward_module):
    with pytest.raises(EnvConfigError, match="--langrl-env-config: file .* not found"):
        load_env_config(str(tmp_path / "absent.yaml"))
    (tmp_path / "bad.jsonl").write_text('{"text": "1+1="}\n')
    with pytest.raises(EnvConfigError, match="has no string field 'prompt'"):
        load_env_config(_write(tmp_path, "- prompts: bad.jsonl\n"
                                         "  reward_functions: [my_rewards:length_reward]\n"))
    (tmp_path / "broken.jsonl").write_text('{"prompt": \n')
    with pytest.raises(EnvConfigError, match="broken.jsonl line 1 is not JSON"):
        load_env_config(_write(tmp_path, "- prompts: broken.jsonl\n"
                                         "  reward_functions: [my_rewards:length_reward]\n"))


@pytest.mark.parametrize("function,shown", [("says_text", "'high' of type str"),
                                            ("says_none", "None of type NoneType"),
                                            ("says_nan", "nan of type float")])
def test_reward_returning_a_non_number_is_a_clear_error(tmp_path, reward_module, function, shown):
    environments = load_env_config(_write(
        tmp_path, "- name: maths\n  prompts: megatron_smp.post_training.envs.addition:prompts\n"
                  "  prompt_args: {num_prompts: 3}\n"
                  f"  reward_functions: [{reward_module}:{function}]\n"))
    prompt = PromptSampler(environments).sample(1)
    with pytest.raises(EnvConfigError, match=f"reward function {reward_module}:{function} "
                                             f"\\(environment 'maths'\\) returned {shown}"):
        score_completions(environments, prompt, ["12"])


def test_sampler_is_deterministic_weighted_and_resumes(tmp_path, reward_module):
    path = _write(tmp_path, """
- name: small
  prompts: megatron_smp.post_training.envs.addition:prompts
  prompt_args: {num_prompts: 5, seed: 1}
  reward_functions: [my_rewards:length_reward]
  weight: 1.0
- name: large
  prompts: megatron_smp.post_training.envs.addition:prompts
  prompt_args: {num_prompts: 50, seed: 2}
  reward_functions: [my_rewards:length_reward]
  weight: 3.0
""")
    environments = load_env_config(path)
    uninterrupted = PromptSampler(environments, seed=7).sample(40)
    assert uninterrupted == PromptSampler(environments, seed=7).sample(40)
    counts = {name: sum(p.environment == name for p in uninterrupted)
              for name in ("small", "large")}
    assert counts["large"] > counts["small"] > 0
    # Each pass over an environment visits every record once before any repeats.
    small = [p.prompt for p in uninterrupted if p.environment == "small"][:5]
    assert sorted(small) == sorted(r["prompt"] for r in environments[0].records)
    first = PromptSampler(environments, seed=7)
    head = first.sample(17)
    state = json.loads(json.dumps(first.state_dict()))  # survives a JSON/checkpoint round trip
    resumed = PromptSampler(environments, seed=0)
    resumed.load_state_dict(state)
    assert head + resumed.sample(23) == uninterrupted


def test_rl_flags_parse_into_a_validated_config(tmp_path):
    parser = add_rl_args(argparse.ArgumentParser())
    defaults = rl_config(parser.parse_args([]))
    # Megatron-LM's defaults.
    assert (defaults.group_size, defaults.prompts_per_step, defaults.iterations) == (2, 32, 2)
    assert (defaults.clamp_eps_lower, defaults.clamp_eps_upper, defaults.kl_beta) == (0.01, 0.01,
                                                                                     0.001)
    assert (defaults.temperature, defaults.top_k, defaults.top_p) == (1.0, -1, 0.0)
    config = rl_config(parser.parse_args([
        "--grpo-group-size", "8", "--grpo-prompts-per-step", "4", "--grpo-iterations", "1",
        "--grpo-kl-beta", "0", "--grpo-clamp-eps-lower", "0.2", "--grpo-clamp-eps-upper", "0.28",
        "--grpo-entropy-term-weight", "0.01", "--grpo-filter-groups-with-same-reward",
        "--grpo-loss-type", "dr_grpo", "--grpo-scale-rewards", "none",
        "--rl-default-temperature", "0.7", "--rl-default-top-k", "20", "--rl-default-top-p", "0.9",
        "--rl-max-completion-length", "16", "--langrl-env-config", SHIPPED]))
    assert config == RLConfig(group_size=8, prompts_per_step=4, iterations=1, kl_beta=0.0,
                              clamp_eps_lower=0.2, clamp_eps_upper=0.28, entropy_term_weight=0.01,
                              filter_groups_with_same_reward=True, loss_type="dr_grpo",
                              scale_rewards="none", temperature=0.7, top_k=20, top_p=0.9,
                              max_completion_length=16, env_config=SHIPPED)
    assert config.rollouts_per_step == 32


@pytest.mark.parametrize("flags,message", [
    (["--grpo-group-size", "1"], "--grpo-group-size must be at least 2"),
    (["--grpo-iterations", "0"], "--grpo-iterations must be positive"),
    (["--grpo-clamp-eps-lower", "1.0"], "--grpo-clamp-eps-lower must be in"),
    (["--grpo-kl-beta", "-0.1"], "--grpo-kl-beta must be >= 0"),
    (["--rl-default-top-p", "1.5"], "--rl-default-top-p must be in"),
    (["--rl-default-temperature", "0", "--rl-default-top-k", "5"], "greedy decoding"),
    (["--langrl-env-config", "/no/such/env.yaml"], "--langrl-env-config: file"),
])
def test_rl_flag_errors_name_the_flag(flags, message):
    parser = add_rl_args(argparse.ArgumentParser())
    with pytest.raises(ConfigError, match=message):
        rl_config(parser.parse_args(flags))


def test_pretraining_parser_does_not_take_rl_flags():
    """The RL flags belong to an RL entry script; pretraining rejects them instead of ignoring."""
    from megatron_smp.training.arguments import build_parser

    options = {option for action in build_parser()._actions for option in action.option_strings}
    assert "--grpo-group-size" not in options and "--langrl-env-config" not in options
