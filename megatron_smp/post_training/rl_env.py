"""RL environments from a YAML file (`--langrl-env-config`).

The file has the shape of Megatron-LM's environment configs: a list of environments, each with a
sampling `weight` and an optional `evaluation_only`. Where Megatron names a registered agent class
(`agent_type` / `agent_args`), an environment here names its prompt source and reward functions:

    - name: addition                       # optional; defaults to env_<index>
      prompts: data/rl/addition.jsonl      # JSONL file (relative to this YAML file, else the cwd)
      # prompts: my_pkg.tasks:make_prompts # or a `module:function` returning a list of records
      # prompt_args: {num_prompts: 512}    # keyword arguments for that function
      prompt_key: prompt                   # record fields (these are the defaults)
      answer_key: answer
      reward_functions:
        - function: megatron_smp.post_training.envs.addition:exact_match
          weight: 1.0
      weight: 1.0
      evaluation_only: false

A reward function is called as `function(prompt, completion, answer) -> float` (answer is None
when the record has none). The reward of a completion is the weighted sum of its environment's
reward functions (TRL's `reward_weights`); each function's value is kept for logging.
"""
import importlib
import json
import math
import numbers
import os
import random
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Sequence, Tuple

_ENV_KEYS = {"name", "prompts", "prompt_args", "prompt_key", "answer_key", "reward_functions",
             "weight", "evaluation_only"}
_REWARD_KEYS = {"function", "weight"}


class EnvConfigError(ValueError):
    """An environment config that cannot work; the message names the file and the entry."""


@dataclass
class RewardFunction:
    name: str                      # the `module:function` text
    function: Callable[[str, str, Any], float]
    weight: float = 1.0


@dataclass
class Environment:
    name: str
    records: List[Dict[str, Any]]  # each has "prompt" and "answer" (None when absent)
    reward_functions: List[RewardFunction]
    weight: float = 1.0
    evaluation_only: bool = False

    def score(self, prompt: str, completion: str, answer: Any) -> Tuple[float, Dict[str, float]]:
        """The weighted reward of one completion and each reward function's own value."""
        per_function = {}
        for reward in self.reward_functions:
            value = reward.function(prompt, completion, answer)
            per_function[reward.name] = _as_reward(value, reward.name, self.name)
        total = sum(r.weight * per_function[r.name] for r in self.reward_functions)
        return total, per_function


def _as_reward(value: Any, function_name: str, env_name: str) -> float:
    # bool is a numbers.Real: an exact-match check returning True/False is a fine 1/0 reward.
    if isinstance(value, numbers.Real) and math.isfinite(float(value)):
        return float(value)
    raise EnvConfigError(f"reward function {function_name} (environment {env_name!r}) returned "
                         f"{value!r} of type {type(value).__name__}; a reward function must "
                         f"return a finite number (int or float)")


def resolve_function(text: Any, where: str) -> Callable:
    """Import `module:function` (e.g. `my_pkg.rewards:exact_match`); errors name `where`."""
    if not isinstance(text, str) or text.count(":") != 1 or not all(text.split(":")):
        raise EnvConfigError(f"{where}: {text!r} is not of the form 'module:function' "
                             f"(e.g. 'megatron_smp.post_training.envs.addition:exact_match')")
    module_name, function_name = text.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise EnvConfigError(f"{where}: cannot import module {module_name!r} of {text!r} "
                             f"({error}); is it on PYTHONPATH?") from error
    function = getattr(module, function_name, None)
    if function is None:
        raise EnvConfigError(f"{where}: module {module_name!r} has no attribute "
                             f"{function_name!r} (from {text!r})")
    if not callable(function):
        raise EnvConfigError(f"{where}: {text!r} is not callable")
    return function


def read_jsonl(path: str, where: str) -> List[Dict[str, Any]]:
    records = []
    with open(path, encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise EnvConfigError(f"{where}: {path} line {line_number} is not JSON "
                                     f"({error})") from error
            if not isinstance(record, dict):
                raise EnvConfigError(f"{where}: {path} line {line_number} is not a JSON object")
            records.append(record)
    return records


def _load_records(entry: Dict[str, Any], where: str, base_dir: str) -> List[Dict[str, Any]]:
    source = entry.get("prompts")
    prompt_key = entry.get("prompt_key", "prompt")
    answer_key = entry.get("answer_key", "answer")
    if not isinstance(source, str) or not source:
        raise EnvConfigError(f"{where}: 'prompts' must name a JSONL file or a 'module:function' "
                             f"returning a list of records; got {source!r}")
    if source.endswith((".jsonl", ".json")):
        path = source if os.path.isabs(source) else os.path.join(base_dir, source)
        if not os.path.exists(path) and os.path.exists(source):
            path = source
        if not os.path.exists(path):
            raise EnvConfigError(f"{where}: prompts file {source!r} not found (looked in "
                                 f"{base_dir!r} and the current directory)")
        if "prompt_args" in entry:
            raise EnvConfigError(f"{where}: 'prompt_args' applies to a 'module:function' prompt "
                                 f"source, not to the file {source!r}")
        raw = read_jsonl(path, where)
    else:
        function = resolve_function(source, f"{where} prompts")
        prompt_args = entry.get("prompt_args", {}) or {}
        if not isinstance(prompt_args, dict):
            raise EnvConfigError(f"{where}: 'prompt_args' must be a mapping, got {prompt_args!r}")
        raw = list(function(**prompt_args))
    if not raw:
        raise EnvConfigError(f"{where}: the prompt source {source!r} gave no records")
    records = []
    for index, record in enumerate(raw):
        if not isinstance(record, dict) or not isinstance(record.get(prompt_key), str):
            raise EnvConfigError(f"{where}: record {index} of {source!r} has no string field "
                                 f"{prompt_key!r} (set 'prompt_key' to the prompt's field)")
        records.append({"prompt": record[prompt_key], "answer": record.get(answer_key)})
    return records


def _number(entry: Dict[str, Any], key: str, default: float, where: str) -> float:
    value = entry.get(key, default)
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or value < 0:
        raise EnvConfigError(f"{where}: '{key}' must be a non-negative number, got {value!r}")
    return float(value)


def parse_environment(entry: Any, index: int, base_dir: str, path: str) -> Environment:
    where = f"{path}: environment {index}"
    if not isinstance(entry, dict):
        raise EnvConfigError(f"{where} must be a mapping with 'prompts' and 'reward_functions'")
    if "agent_type" in entry or "agent_args" in entry:
        raise EnvConfigError(f"{where}: Megatron-LM's 'agent_type'/'agent_args' name its own agent "
                             f"classes; here an environment gives 'prompts' (a JSONL file or "
                             f"'module:function') and 'reward_functions' ('module:function' "
                             f"taking (prompt, completion, answer) -> float)")
    unknown = sorted(set(entry) - _ENV_KEYS)
    if unknown:
        raise EnvConfigError(f"{where}: unknown key(s) {unknown}; known: {sorted(_ENV_KEYS)}")
    name = str(entry.get("name", f"env_{index}"))
    where = f"{path}: environment {index} ({name!r})"
    reward_entries = entry.get("reward_functions")
    if not isinstance(reward_entries, list) or not reward_entries:
        raise EnvConfigError(f"{where}: 'reward_functions' must be a non-empty list of "
                             f"'module:function' strings or {{function: ..., weight: ...}} "
                             f"mappings")
    rewards = []
    for number, reward in enumerate(reward_entries):
        reward_where = f"{where} reward_functions[{number}]"
        if isinstance(reward, str):
            reward = {"function": reward}
        if not isinstance(reward, dict) or set(reward) - _REWARD_KEYS or "function" not in reward:
            raise EnvConfigError(f"{reward_where}: expected 'module:function' or a mapping with "
                                 f"keys {sorted(_REWARD_KEYS)}, got {reward!r}")
        rewards.append(RewardFunction(reward["function"],
                                      resolve_function(reward["function"], reward_where),
                                      float(_number(reward, "weight", 1.0, reward_where))))
    evaluation_only = entry.get("evaluation_only", False)
    if not isinstance(evaluation_only, bool):
        raise EnvConfigError(f"{where}: 'evaluation_only' must be true or false")
    return Environment(name=name, records=_load_records(entry, where, base_dir),
                       reward_functions=rewards, weight=_number(entry, "weight", 1.0, where),
                       evaluation_only=evaluation_only)


def load_env_config(path: str) -> List[Environment]:
    """Read a `--langrl-env-config` YAML file into its environments (prompts loaded, reward
    functions imported). Raises EnvConfigError naming the file and entry on any problem."""
    import yaml

    if not path or not os.path.isfile(path):
        raise EnvConfigError(f"--langrl-env-config: file {path!r} not found")
    with open(path, encoding="utf-8") as handle:
        try:
            entries = yaml.safe_load(handle)
        except yaml.YAMLError as error:
            raise EnvConfigError(f"--langrl-env-config {path}: not valid YAML ({error})") from error
    if not isinstance(entries, list) or not entries:
        raise EnvConfigError(f"--langrl-env-config {path}: expected a non-empty YAML list of "
                             f"environments (Megatron-LM's shape), got {type(entries).__name__}")
    base_dir = os.path.dirname(os.path.abspath(path))
    environments = [parse_environment(entry, index, base_dir, path)
                    for index, entry in enumerate(entries)]
    names = [env.name for env in environments]
    if len(set(names)) != len(names):
        raise EnvConfigError(f"--langrl-env-config {path}: environment names repeat: {names}")
    if sum(env.weight for env in environments if not env.evaluation_only) <= 0:
        raise EnvConfigError(f"--langrl-env-config {path}: the environments used for training "
                             f"(evaluation_only false) need a positive total weight")
    return environments


@dataclass
class Prompt:
    environment: str
    prompt: str
    answer: Any


class PromptSampler:
    """Draws prompts for training: an environment by weight, then the next record of that
    environment's shuffled order (reshuffled each pass). Deterministic for a seed, and its
    `state_dict` resumes the exact sequence after a checkpoint."""

    def __init__(self, environments: Sequence[Environment], seed: int = 0):
        self.environments = [env for env in environments
                             if not env.evaluation_only and env.weight > 0]
        if not self.environments:
            raise EnvConfigError("PromptSampler: no environment is used for training "
                                 "(all are evaluation_only or weight 0)")
        self.seed = seed
        self.draws = 0
        self.positions = {env.name: 0 for env in self.environments}
        self._orders: Dict[str, Tuple[int, List[int]]] = {}

    def _order(self, env: Environment, epoch: int) -> List[int]:
        # One shuffle per pass, kept until the pass ends (a function of seed, name and pass).
        cached = self._orders.get(env.name)
        if cached is None or cached[0] != epoch:
            order = list(range(len(env.records)))
            random.Random(f"{self.seed}:{env.name}:{epoch}").shuffle(order)
            cached = self._orders[env.name] = (epoch, order)
        return cached[1]

    def sample(self, num_prompts: int) -> List[Prompt]:
        prompts = []
        weights = [env.weight for env in self.environments]
        for _ in range(num_prompts):
            env = random.Random(f"{self.seed}:draw:{self.draws}").choices(
                self.environments, weights)[0]
            self.draws += 1
            position = self.positions[env.name]
            epoch, offset = divmod(position, len(env.records))
            record = env.records[self._order(env, epoch)[offset]]
            self.positions[env.name] = position + 1
            prompts.append(Prompt(env.name, record["prompt"], record["answer"]))
        return prompts

    def state_dict(self) -> Dict[str, Any]:
        return {"seed": self.seed, "draws": self.draws, "positions": dict(self.positions)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if set(state["positions"]) != set(self.positions):
            raise EnvConfigError(f"PromptSampler: the checkpoint's environments "
                                 f"{sorted(state['positions'])} differ from the config's "
                                 f"{sorted(self.positions)}")
        self.seed, self.draws = state["seed"], state["draws"]
        self.positions = dict(state["positions"])
        self._orders = {}


def score_completions(environments: Sequence[Environment], prompts: Sequence[Prompt],
                      completions: Sequence[str]) -> Tuple[List[float], List[Dict[str, float]]]:
    """Rewards of completions[i] for prompts[i]: (weighted totals, per-function values)."""
    if len(prompts) != len(completions):
        raise ValueError(f"score_completions: {len(prompts)} prompts but "
                         f"{len(completions)} completions")
    by_name = {env.name: env for env in environments}
    totals, per_function = [], []
    for prompt, completion in zip(prompts, completions):
        total, values = by_name[prompt.environment].score(prompt.prompt, completion, prompt.answer)
        totals.append(total)
        per_function.append(values)
    return totals, per_function
