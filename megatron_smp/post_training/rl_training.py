"""On-policy RL (GRPO / DAPO / Dr. GRPO / GSPO) on the Trainer, with rollouts from the
in-framework inference engine on the weights being trained (`train_rl.py`).

One *rollout batch* every `--grpo-iterations` optimizer iterations:

1. `--grpo-prompts-per-step` prompts from the training environments of `--langrl-env-config`
   (`rl_env.PromptSampler`: seeded by --seed, its position checkpointed);
2. `--grpo-group-size` completions of each from the `InferenceEngine` running on the training
   model's own parameters (no copy: every update is seen by the next rollouts; with FSDP2
   gathered whole for the rollout phase and sharded again after it), sampled with
   --rl-default-temperature/top-k/top-p, each completion with its own seed from (--seed,
   rollout batch, index) so that a resumed run draws the same ones;
3. rewards from the environment's reward functions, group advantages (--grpo-scale-rewards
   none is Dr. GRPO's), DAPO's filter of equal-reward groups
   (--grpo-filter-groups-with-same-reward);
4. one rollout per row of --seq-length, or with --rl-use-sequence-packing several per row
   (best fit, each attending only to itself, positions restarting at 0: the loss weights
   normalise over the rollouts, not the rows, so the loss and the update are the unpacked
   ones), shared over the data-parallel ranks in whole microbatches
   (`rollouts.rollout_microbatches`, padded with rows that train nothing), so a step after
   DAPO's filter or with packing has fewer microbatches (--global-batch-size = group size x
   prompts per step is what the consumed samples count per iteration); under context
   parallelism every CP rank generates the same rollouts (the engine runs each step whole on
   each CP rank: they hold the full weights; compared once per rollout batch), each rollout's
   slot is padded to a multiple of 2 x CP, and the training step splits every row over the
   CP ranks (--cp-comm-type all_gather: each rollout attends only to itself);
5. the old policy's log-probs (with --grpo-iterations > 1; for one iteration the policy is
   its own old policy, as in TRL) and the reference's (with --grpo-kl-beta > 0: a frozen copy
   of the starting weights, or the model with its LoRA adapters off);
6. `--grpo-iterations` optimizer iterations on the batch through `Trainer.train_step` with
   `rollouts.grpo_loss_fn`.

Every iteration prints Megatron's log line with the RL metrics appended (TRL's names: reward,
reward_std, rewards/<function>/mean, completions/mean_length, clip_fraction, kl, entropy, ...,
and the rollout batch's generation time and the iteration's training time in seconds); the
same values go to TensorBoard (--tensorboard-dir). Evaluation (--eval-interval, --eval-iters):
greedy completions of the `evaluation_only` environments' prompts, "validation reward".

Checkpoints (--save, --save-interval, --load) hold, beside the Trainer's own state, the RL
state in `<dir>/rl_state/iter_XXXXXXX/rank_XXXXX.pt` (the sampler's position, and a save inside
a rollout batch also the rest of that batch) and, for full fine-tuning with a KL term, where
the reference's starting weights came from in `<dir>/rl_state/reference_source.json`
(`reference.frozen_reference`, DPO's mechanism: a resume rebuilds the copy from it), so a
resumed run draws the same prompts and completions and reproduces the uninterrupted run's
rewards and losses.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_smp.config import ConfigError
from megatron_smp.distributed.unwrap import unwrap_model
from megatron_smp.post_training.reference import RL_REFERENCE, frozen_reference
from megatron_smp.post_training.rl_config import RLConfig, add_rl_args
from megatron_smp.post_training.rl_env import (
    EnvConfigError, Environment, Prompt, PromptSampler, load_env_config,
)
from megatron_smp.post_training.rl_generation import (
    generate_rollouts, rollout_fields, score_rollouts,
)
from megatron_smp.post_training.rollouts import (
    build_rollout_batch, grpo_loss_fn, rollout_advantages, rollout_metrics, rollout_microbatches,
)
from megatron_smp.training.arguments.validation import check_rl_configs  # noqa: F401

RL_STATE_DIR = "rl_state"
LOSS_KEY = "rl loss"
GENERATION_TIME = "generation time (s)"
TRAINING_TIME = "training time (s)"
# The loss function's reports besides the loss (grpo.weighted_grpo_loss's metrics); "kl"
# only with a reference (--grpo-kl-beta > 0).
_POLICY_METRICS = ("clip_fraction", "clip_ratio/high_mean", "clip_ratio/low_mean",
                   "clip_ratio/region_mean", "entropy", "ratio_mean")


def add_rl_training_args(parser):
    """train_rl.py's flags beyond Megatron's training ones: the --grpo-* / --rl-* flags and
    the engine's --inference-* sizes."""
    from megatron_smp.training.arguments.modes import add_inference_args

    return add_inference_args(add_rl_args(parser))


def policy_metric_keys(config: RLConfig) -> tuple:
    """The keys the RL loss function reports, the same on every pipeline stage."""
    keys = (LOSS_KEY,) + _POLICY_METRICS
    return keys + (("kl",) if config.kl_beta != 0.0 else ())


def rollout_logprobs(model, batch: Dict[str, torch.Tensor], run) -> torch.Tensor:
    """Per-token log-probs [rows, s] of `batch`'s labels under `model` (the policy or the
    reference chunks), eval mode, no grad, on every rank: the one call of the log-prob
    function, so its home can change in one line."""
    from megatron_smp.post_training.backend_api import compute_logprobs

    training = run.configs.training
    return compute_logprobs(model, batch, run.state, run.configs.model.vocab_size,
                            micro_batch_size=training.micro_batch_size,
                            pipeline_schedule=training.pipeline_schedule)["logprobs"]


@dataclass
class RolloutBatch:
    """What one rollout batch leaves for its --grpo-iterations updates: this data-parallel
    rank's microbatches (CPU tensors), the rollout metrics and the generation time."""

    number: int                                   # rollout batches before this one
    microbatches: List[Dict[str, torch.Tensor]]
    metrics: Dict[str, float]
    generation_time: float
    updates_done: int = 0

    def state_dict(self) -> Dict[str, Any]:
        return {"number": self.number, "microbatches": self.microbatches,
                "metrics": dict(self.metrics), "generation_time": self.generation_time,
                "updates_done": self.updates_done}

    @classmethod
    def from_state_dict(cls, state: Dict[str, Any]) -> "RolloutBatch":
        return cls(**state)


@dataclass
class RLResult:
    """What `train_rl` returns on every rank: per iteration the logged values (losses,
    rollout metrics, times), the evaluations, the log lines."""

    iterations: Dict[int, Dict[str, float]] = field(default_factory=dict)
    valid_rewards: Dict[int, Dict[str, float]] = field(default_factory=dict)
    log_lines: List[str] = field(default_factory=list)
    iteration: int = 0
    exit_reason: Optional[str] = None


class RLRun:
    """The RL loop over a built Trainer."""

    def __init__(self, trainer, config: RLConfig, environments: Sequence[Environment],
                 tokenizer, model_provider: Callable, logger):
        from megatron_smp.inference import InferenceEngine
        from megatron_smp.inference.decode_step import decode_step_options

        self.trainer, self.config, self.environments = trainer, config, list(environments)
        self.tokenizer, self.logger = tokenizer, logger
        self.configs, self.state = trainer.configs, trainer.state
        training = self.configs.training
        self.sampler = PromptSampler(self.environments, seed=training.seed)
        self.eval_environments = [env for env in self.environments if env.evaluation_only]
        self.end_token_ids = [tokenizer.eod] if getattr(tokenizer, "eod", None) is not None \
            else []
        self.pad_id = getattr(tokenizer, "pad", None)
        if self.pad_id is None:
            self.pad_id = self.end_token_ids[0] if self.end_token_ids else 0
        inference = self.configs.inference
        # The engine reads the training chunk's parameters in place; its KV cache is its own.
        # Under context parallelism every CP rank holds the full weights and runs each
        # generation step whole (the CP split is the training step's).
        self.engine = InferenceEngine(
            trainer.model, max_tokens=inference.max_tokens, max_requests=inference.max_requests,
            block_size=inference.block_size,
            max_seq_length=training.seq_length + 1, replicate_context_parallel=True,
            **decode_step_options(inference))
        self._train_mode()
        self.lora = bool(training.lora_rank)
        self.reference = None
        if config.kl_beta != 0.0 and not self.lora:
            # The starting weights: copied now, or on resume rebuilt from their record.
            iteration = 0 if self.configs.checkpoint.finetune else trainer.iteration
            self.reference = frozen_reference(model_provider, self.configs, self.state,
                                              trainer.model, iteration, RL_REFERENCE)
        trainer.metric_keys = policy_metric_keys(config)
        self.pending: Optional[RolloutBatch] = None
        self.result = RLResult()
        self.loss_scale = 1.0
        self.policy_loss = None

    # -- modes ------------------------------------------------------------------------------
    def _train_mode(self) -> None:
        for chunk in self.trainer.model:
            chunk.train()

    def _generate(self, prompts: Sequence[Prompt], config: RLConfig, number: int,
                  group_size: Optional[int] = None):
        for chunk in self.trainer.model:
            if hasattr(chunk, "finish_param_sync"):  # --overlap-param-gather's last gathers
                chunk.finish_param_sync()
            chunk.eval()
        try:
            with torch.no_grad(), _unsharded(self.trainer.model):
                return generate_rollouts(self.engine, self.tokenizer, prompts, config,
                                         step=number, seed=self.configs.training.seed,
                                         end_token_ids=self.end_token_ids,
                                         group_size=group_size)
        finally:
            self._train_mode()

    # -- the loss ---------------------------------------------------------------------------
    def _scale_for(self, pending: "RolloutBatch") -> None:
        """The loss of a step of n microbatches per rank: the batch weights normalise over
        the whole rollout batch, so the schedule's and the reduction's averaging over
        n x dp x cp is undone (each CP rank's loss is its tokens' share of the sum)."""
        state = self.state
        scale = float(len(pending.microbatches) * state.dp_size * state.cp_size)
        if self.policy_loss is None or scale != self.loss_scale:
            self.loss_scale = scale
            self.policy_loss = grpo_loss_fn(
                self.config, state.tp_group, self.configs.model.vocab_size, loss_scale=scale,
                cp_group=state.cp_group if state.cp_size > 1 else None)

    def loss_fn(self, logits: torch.Tensor, batch: Dict[str, torch.Tensor]):
        """`rollouts.grpo_loss_fn` with its metrics reported as the global batch's values
        (each microbatch's weighted sum, scaled like the loss, so the trainer's mean over
        microbatches and data-parallel ranks is their sum) and the policy's entropy."""
        loss, metrics = self.policy_loss(logits, batch)
        reports = {LOSS_KEY: loss.detach()}
        if "entropy" not in metrics:
            from megatron_smp.tensor_parallel.cross_entropy import vocab_parallel_entropy

            with torch.no_grad():
                entropy = vocab_parallel_entropy(logits.detach(), self.state.tp_group,
                                                 self.configs.model.vocab_size)
                metrics["entropy"] = (entropy.double() * batch["token_mean_weight"]).sum()
        for key in self.trainer.metric_keys[1:]:
            reports[key] = metrics[key].float() * self.loss_scale
        return loss, reports

    # -- a rollout batch --------------------------------------------------------------------
    def rollout_batch(self, number: int) -> RolloutBatch:
        """Sample, generate, score and lay out rollout batch `number` (collective)."""
        config, training, state = self.config, self.configs.training, self.state
        prompts = self.sampler.sample(config.prompts_per_step)
        start = time.perf_counter()
        resilience = self.trainer.resilience  # --log-straggler times the rollout phase
        with (resilience.phase("rollout") if resilience is not None
              else contextlib.nullcontext()):
            rollouts = self._generate(prompts, config, number)
        generation_time = time.perf_counter() - start
        self._check_same_over_context_parallel(rollouts, number)
        score_rollouts(self.environments, rollouts)
        fields = rollout_fields(rollouts)
        metrics = rollout_metrics(fields["rewards"], fields["per_function"],
                                  fields["completion_lengths"], config.group_size,
                                  fields["truncated"])
        advantages, kept = rollout_advantages(
            fields["rewards"], config.group_size, config.scale_rewards,
            config.unbiased_reward_std, config.filter_groups_with_same_reward)
        if not kept:
            # Every group filtered: the whole batch is trained, all its advantages 0 (only
            # the KL and entropy terms act), so the iteration still has its update.
            advantages, kept = rollout_advantages(fields["rewards"], config.group_size,
                                                  config.scale_rewards,
                                                  config.unbiased_reward_std)
        metrics["rollouts_trained"] = float(len(kept))
        batch = build_rollout_batch(
            [fields["prompt_ids"][i] for i in kept],
            [fields["completion_ids"][i] for i in kept], advantages.tolist(),
            seq_length=training.seq_length, pad_id=self.pad_id, loss_type=config.loss_type,
            max_completion_length=config.max_completion_length, pack=config.sequence_packing,
            pad_to_multiple=2 * state.cp_size if state.cp_size > 1 else 1)
        metrics["rollout_rows"] = float(batch["tokens"].shape[0])
        # This rank's share, padded with untrained rows to whole microbatches: after DAPO's
        # filter the number of microbatches varies from step to step.
        microbatches = rollout_microbatches(batch, training.micro_batch_size, state.dp_size,
                                            state.dp_rank)
        extra = {}
        if config.iterations > 1 or config.kl_beta != 0.0:
            local = {key: torch.cat([m[key] for m in microbatches]) for key in microbatches[0]}
            if config.iterations > 1:
                extra["old_logps"] = rollout_logprobs(self.trainer.model, local, self).cpu()
            if config.kl_beta != 0.0:
                extra["ref_logps"] = self._reference_logprobs(local).cpu()
        micro = training.micro_batch_size
        for index, microbatch in enumerate(microbatches):
            for key, values in extra.items():
                microbatch[key] = values[index * micro:(index + 1) * micro]
        return RolloutBatch(number, microbatches, metrics, generation_time)

    def _check_same_over_context_parallel(self, rollouts, number: int) -> None:
        """The CP ranks each split the rollout batch they built for the training step, so
        they must hold the same rollouts: a digest of every prompt's and completion's ids,
        compared over the CP group (one all-gather per rollout batch); a RuntimeError on
        every rank when they differ."""
        state = self.state
        if state.cp_size == 1:
            return
        digest = hashlib.sha256(repr([(r.prompt_ids, r.completion_ids)
                                      for r in rollouts]).encode()).digest()
        local = torch.tensor(list(digest[:8]), dtype=torch.long, device=state.device)
        gathered = [torch.empty_like(local) for _ in range(state.cp_size)]
        dist.all_gather(gathered, local, group=state.cp_group)
        if any(not torch.equal(value, gathered[0]) for value in gathered):
            raise RuntimeError(f"train_rl.py: rollout batch {number} differs between the "
                               f"context-parallel ranks (each must generate the same "
                               f"completions to split them for the training step)")

    def _reference_logprobs(self, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        if self.lora:
            from megatron_smp.tensor_parallel.lora import adapters_disabled

            model = self.trainer.model
            context = adapters_disabled([unwrap_model(chunk) for chunk in model])
        else:
            model, context = self.reference, contextlib.nullcontext()
        with context:
            return rollout_logprobs(model, batch, self)

    # -- what RL adds to the Trainer's loop (training.loop.LoopHooks) ----------------------
    def run(self, start_time: Optional[float] = None) -> RLResult:
        """`Trainer.train` with RL's hooks: each step's batch is the current rollout batch
        (a new one every --grpo-iterations updates), its metrics and times are logged beside
        the losses, the evaluation is the greedy reward of the evaluation environments, and a
        save keeps the RL state beside the Trainer's checkpoint."""
        from megatron_smp.training.loop import LoopHooks, TrainingData

        hooks = LoopHooks(batches=self._next_batches, log_values=self._log_values,
                          evaluate=self._evaluate_hook, save=self.save)
        data = TrainingData(train=None, valid=None, test_loader=None, datasets=())
        loop = self.trainer.train(data, self.logger,
                                  time.time() if start_time is None else start_time,
                                  loss_fn=self.loss_fn, hooks=hooks)
        result = self.result
        result.log_lines = loop.log_lines
        result.exit_reason, result.iteration = loop.exit_reason, loop.iteration
        return result

    def _next_batches(self):
        """(this rank's microbatches of the current rollout batch, their count)."""
        config = self.config
        if self.pending is None or self.pending.updates_done == config.iterations:
            self.pending = self.rollout_batch(self.trainer.iteration // config.iterations)
        self._scale_for(self.pending)
        self._step_start = time.perf_counter()
        return iter(self.pending.microbatches), len(self.pending.microbatches)

    def _log_values(self, step) -> Dict[str, float]:
        """The rollout batch's metrics (repeated on its --grpo-iterations lines) and times,
        logged beside the step's losses; kept per iteration in the result."""
        pending = self.pending
        pending.updates_done += 1
        values = {key: value.item() for key, value in step.losses.items()}
        values.update(pending.metrics)
        values[GENERATION_TIME] = pending.generation_time
        values[TRAINING_TIME] = time.perf_counter() - self._step_start
        self.result.iterations[self.trainer.iteration] = values
        return {key: value for key, value in values.items() if key not in step.losses}

    def _evaluate_hook(self, final: bool) -> List[str]:
        """The greedy evaluation every --eval-interval, and once after training (unless the
        last iteration had one)."""
        if self.configs.training.eval_iters <= 0 or not self.eval_environments:
            return []
        if final and self.trainer.iteration in self.result.valid_rewards:
            return []
        self.evaluate()
        return [self._last_eval_line]

    def evaluate(self) -> Dict[str, float]:
        """Greedy completions of --eval-iters x --grpo-prompts-per-step prompts of the
        evaluation-only environments (in their order, from the first): "reward" and each
        function's mean, as "validation reward" lines and scalars."""
        records = [Prompt(env.name, r["prompt"], r["answer"])
                   for env in self.eval_environments for r in env.records]
        count = min(len(records), self.configs.training.eval_iters * self.config.prompts_per_step)
        greedy = dataclasses.replace(self.config, temperature=0.0, top_k=-1, top_p=0.0)
        rollouts = self._generate(records[:count], greedy, 0, group_size=1)
        score_rollouts(self.environments, rollouts)
        fields = rollout_fields(rollouts)
        metrics = rollout_metrics(fields["rewards"], fields["per_function"],
                                  fields["completion_lengths"], 1)
        values = {key: value for key, value in metrics.items()
                  if key == "reward" or key.startswith("rewards/") and key.endswith("/mean")}
        iteration = self.trainer.iteration
        line = f" validation reward at iteration {iteration} ({count} prompts, greedy) |"
        for key, value in values.items():
            line += f" {key}: {value:.6E} |"
            self.logger.add_scalar(f"{key} validation", value, iteration)
        self.logger.print("-" * (len(line) + 1) + "\n" + line + "\n" + "-" * (len(line) + 1))
        self._last_eval_line = line
        self.result.valid_rewards[iteration] = values
        return values

    # -- checkpoints ------------------------------------------------------------------------
    def _state_path(self, directory: str, iteration: int) -> str:
        return os.path.join(directory, RL_STATE_DIR, f"iter_{iteration:07d}",
                            f"rank_{self.state.rank:05d}.pt")

    def _layout(self) -> tuple:
        # Each rank's RL state holds its own share of a rollout batch.
        return (self.state.tp_size, self.state.pp_size, self.state.dp_size)

    def save(self) -> None:
        """The Trainer's checkpoint, then this rank's RL state beside it (collective)."""
        self.trainer.save()
        directory, iteration = self.configs.checkpoint.save, self.trainer.iteration
        pending = self.pending
        if pending is not None and pending.updates_done == self.config.iterations:
            pending = None  # the next iteration starts a new rollout batch
        state = {"sampler": self.sampler.state_dict(), "layout": self._layout(),
                 "pending": None if pending is None else pending.state_dict()}
        _atomic_save(state, self._state_path(directory, iteration))
        if dist.is_initialized():
            dist.barrier()

    def restore(self) -> None:
        """After `Trainer.load` of --load at iteration > 0: the sampler's position and the
        unfinished rollout batch (collective-free; ConfigError when --load lacks them)."""
        iteration = self.trainer.iteration
        directory = self.configs.checkpoint.load
        if iteration == 0 or not directory or self.configs.checkpoint.finetune:
            return
        path = self._state_path(directory, iteration)
        if not os.path.isfile(path):
            raise ConfigError(f"--load {directory}: iteration {iteration} has no RL state "
                              f"({path}); resume an RL run from a checkpoint train_rl.py "
                              f"saved, or start one from another checkpoint with --finetune")
        state = torch.load(path, weights_only=True)
        if list(state["layout"]) != list(self._layout()):
            raise ConfigError(f"--load {directory}: the RL state of iteration {iteration} was "
                              f"saved at (tensor, pipeline, data)-parallel sizes "
                              f"{tuple(state['layout'])}, this run has {self._layout()}; resume "
                              f"an RL run at the layout that saved it")
        self.sampler.load_state_dict(state["sampler"])
        if state["pending"] is not None:
            self.pending = RolloutBatch.from_state_dict(state["pending"])


@contextlib.contextmanager
def _unsharded(chunks):
    """With --use-torch-fsdp2: every FSDP unit's parameters gathered whole for the rollout
    phase (FSDP2's `unshard()`, the same all-gathers in the same order on every rank) and
    sharded again after it, since the engine calls the model's layers directly, around the
    units' forward hooks. Without FSDP2 nothing happens."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    units = [module for chunk in chunks for module in chunk.modules()
             if isinstance(module, FSDPModule)]
    if units:
        # The root's lazy initialisation (normally at its first forward) must come first, or
        # each unit's unshard() would initialise that unit as a root of its own.
        fully_shard.state(units[0])._lazy_init()
    for unit in units:
        unit.unshard()
    try:
        yield
    finally:
        for unit in reversed(units):
            unit.reshard()


def _atomic_save(value: Any, path: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save(value, path + ".tmp")
    os.replace(path + ".tmp", path)


def check_prompt_lengths(environments: Sequence[Environment], tokenizer, config: RLConfig,
                         seq_length: int) -> None:
    """Every prompt plus --rl-max-completion-length must fit a row of --seq-length."""
    for env in environments:
        longest = max(len(tokenizer.tokenize(record["prompt"])) for record in env.records)
        if longest + config.max_completion_length - 1 > seq_length:
            raise ConfigError(
                f"train_rl.py: environment {env.name!r} has a prompt of {longest} tokens; with "
                f"--rl-max-completion-length {config.max_completion_length} a rollout needs "
                f"{longest + config.max_completion_length - 1} positions, more than "
                f"--seq-length {seq_length}")


def train_rl(model_provider: Callable, args_defaults: Optional[Dict] = None,
             argv: Optional[Sequence[str]] = None) -> RLResult:
    """Parse Megatron's flags with the RL ones, build the Trainer and the engine, and run
    the RL loop; returns the logged values (on every rank)."""
    from megatron_smp.training.pretrain import build_configs, training_logger
    from megatron_smp.training.trainer import Trainer

    start_time = time.time()
    defaults = {"mock_data": True, **(args_defaults or {})}
    # One parse: the RL flags become configs.rl (and the global batch they imply, unless
    # given), checked with the rest by validate_configs on every rank.
    configs, tokenizer = build_configs(argv, add_rl_training_args, defaults, model_provider)
    config = configs.rl
    try:
        environments = load_env_config(config.env_config)
    except EnvConfigError as error:
        raise ConfigError(str(error)) from error
    check_prompt_lengths(environments, tokenizer, config, configs.training.seq_length)
    trainer = Trainer.build(configs, model_provider, start_time)
    if configs.checkpoint.load or configs.checkpoint.pretrained_checkpoint:
        trainer.load()
    run = RLRun(trainer, config, environments, tokenizer, model_provider,
                training_logger(trainer))
    run.restore()
    return run.run(start_time)  # the loop closes the resilience services (pretrain's too)


__all__ = ["train_rl", "RLRun", "RLResult", "RolloutBatch", "add_rl_training_args",
           "check_rl_configs", "policy_metric_keys", "rollout_logprobs",
           "LOSS_KEY", "GENERATION_TIME", "TRAINING_TIME"]
