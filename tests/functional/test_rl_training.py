"""train_rl.py as users run it (torchrun, two data-parallel ranks, a small GPT, GRPO with a KL
term and two updates per rollout batch): the log line and TensorBoard carry the same RL values,
they are consistent with each other (the first update of a rollout batch is on-policy: ratio 1,
nothing clipped), and a run resumed from a checkpoint saved inside a rollout batch reproduces
the uninterrupted run's rewards, losses and grad norms; the run at TP=2 and the run with FSDP2
(rollouts on the parameters gathered whole) give the same values.
LoRA (the reference is the model with its adapters off) with packed rollouts, DAPO's filter of
equal-reward groups and the distributed optimizer gives the values of an unpacked run whose
reference is a frozen copy of the base, and trains exactly the rollouts of the groups with
distinct rewards. A small MoE at EP=2 gives one process's values, and so do runs at CP=2
(rollouts generated whole on each CP rank; unpacked, packed and gspo).
Plus the flags train_rl.py refuses, with the flag named."""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FUNCTION = "tests.functional.test_rl_training:char_sum"
REWARD = f"rewards/{FUNCTION}/mean"
RL_KEYS = ("rl loss", "reward", "reward_std", REWARD, "completions/mean_length",
           "clip_fraction", "kl", "entropy", "ratio_mean", "generation time (s)",
           "training time (s)")


def char_sum(prompt, completion, answer):
    """A reward that differs between a random model's completions: the last digit of the sum
    of its characters' code points, over 10."""
    return (sum(map(ord, completion)) % 10) / 10


def odd_char_sum(prompt, completion, answer):
    """char_sum for prompts with an odd answer, a constant for the others: each of the latter
    groups has equal rewards, and DAPO's filter drops exactly those groups."""
    return char_sum(prompt, completion, answer) if int(answer) % 2 else 0.5


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    import json

    from tokenizers import pre_tokenizers

    # GPT-2's byte-level BPE with no merges: one token per byte (no transformers import).
    directory = tmp_path_factory.mktemp("rl")
    vocab = {char: index for index, char in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    vocab["<|endoftext|>"] = len(vocab)
    (directory / "vocab.json").write_text(json.dumps(vocab))
    (directory / "merges.txt").write_text("#version: 0.2\n")
    (directory / "env.yaml").write_text(
        "- name: addition\n"
        "  prompts: megatron_smp.post_training.envs.addition:prompts\n"
        "  prompt_args: {num_prompts: 50, digits: 1, seed: 1}\n"
        f"  reward_functions: ['{FUNCTION}']\n"
        "- name: held_out\n"
        "  prompts: megatron_smp.post_training.envs.addition:prompts\n"
        "  prompt_args: {num_prompts: 20, digits: 1, seed: 2}\n"
        f"  reward_functions: ['{FUNCTION}']\n"
        "  evaluation_only: true\n")
    (directory / "odd.yaml").write_text(
        "- name: addition\n"
        "  prompts: megatron_smp.post_training.envs.addition:prompts\n"
        "  prompt_args: {num_prompts: 50, digits: 1, seed: 5}\n"
        "  reward_functions: ['tests.functional.test_rl_training:odd_char_sum']\n")
    flags = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file",
             str(directory / "vocab.json"), "--merge-file", str(directory / "merges.txt"),
             "--num-layers", "2", "--hidden-size", "32",
             "--num-attention-heads", "4", "--max-position-embeddings", "32",
             "--seq-length", "12", "--micro-batch-size", "2", "--train-iters", "4",
             "--lr", "1e-3", "--hidden-dropout", "0", "--attention-dropout", "0",
             "--langrl-env-config", str(directory / "env.yaml"), "--grpo-group-size", "4",
             "--grpo-prompts-per-step", "2", "--grpo-iterations", "2", "--grpo-kl-beta", "0.05",
             "--grpo-clamp-eps-lower", "0.2", "--grpo-clamp-eps-upper", "0.28",
             "--rl-max-completion-length", "6", "--log-interval", "1", "--seed", "5",
             "--eval-iters", "1", "--eval-interval", "2"]
    return directory, flags


def _train_rl(flags, world_size=2):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={world_size}", os.path.join(ROOT, "train_rl.py")] + flags
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    done = subprocess.run(command, capture_output=True, text=True, timeout=180, cwd=ROOT,
                          env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def _validation(stdout):
    """{iteration: reward} from the greedy evaluation lines."""
    return {int(i): float(v) for i, v in re.findall(
        r"validation reward at iteration (\d+) \(2 prompts, greedy\) \| reward: (\S+) \|",
        stdout)}


def _lines(stdout):
    """{iteration: {key: value}} from Megatron's log lines."""
    out = {}
    for line in stdout.splitlines():
        match = re.match(r"\s*iteration\s+(\d+)/", line)
        if match:
            fields = [part.strip().rsplit(": ", 1) for part in line.split("|")[1:]]
            out[int(match.group(1))] = {k: float(v) for k, v in
                                        (f for f in fields if len(f) == 2)}
    return out


def test_train_rl_log_tensorboard_and_resume(setup):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    directory, flags = setup
    board = directory / "tensorboard"
    # --log-straggler with rank 1 slowed 4x from iteration 1 on (the injected "slow" fault
    # stretches its rollouts and its forward-backward; the values do not change).
    stdout = _train_rl(flags + ["--tensorboard-dir", str(board), "--save",
                                str(directory / "ckpt"), "--save-interval", "3",
                                "--log-straggler", "--straggler-ctrlr-port", "0",
                                "--fault-injector-ranks", "1", "--fault-injector-fault-types",
                                "slow", "--fault-injector-fault-delay", "0",
                                "--fault-injector-slow-factor", "4"])
    whole, valid = _lines(stdout), _validation(stdout)
    assert sorted(whole) == [1, 2, 3, 4]
    scalars = EventAccumulator(str(board)).Reload()
    for iteration, values in whole.items():
        for key in RL_KEYS:
            assert key in values, (key, values)
            logged = {e.step: e.value for e in scalars.Scalars(key)}
            assert logged[iteration] == pytest.approx(values[key], rel=1e-5, abs=1e-9), key
        # One reward function of weight 1: the reward is its mean, of 8 rewards in tenths.
        assert values["reward"] == values[REWARD]
        assert values["reward"] * 80 == pytest.approx(round(values["reward"] * 80), abs=1e-4)
        assert values["reward_std"] > 0
        assert 1 <= values["completions/mean_length"] <= 6
        assert values["global batch size"] == 8
    # Greedy evaluation of the evaluation-only environment every --eval-interval iterations.
    assert sorted(valid) == [2, 4]
    assert {e.step: e.value for e in scalars.Scalars("reward validation")} == pytest.approx(valid)
    for first in (1, 3):  # the first update of a rollout batch: old policy = policy
        assert whole[first]["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
        assert whole[first]["clip_fraction"] == 0.0
        # Both updates of a batch share its rollouts.
        assert whole[first]["reward"] == whole[first + 1]["reward"]
    assert whole[2]["ratio_mean"] != whole[1]["ratio_mean"]  # the policy moved
    assert whole[1]["kl"] == pytest.approx(0.0, abs=1e-7) and whole[3]["kl"] > 0
    # The straggler report covers both phases of the RL loop: the forward-backward every
    # iteration, the rollouts where a rollout batch was generated (iterations 1 and 3); the
    # slowed rank 1 is the slowest of the rollouts generated after the fault.
    reports = re.findall(r" straggler report, (rollout phase, )?iterations (\d+)-\d+ .*?: "
                         r"slowest rank (\d) \(.*?\) [\d.]+ ms ([\d.]+)x", stdout)
    assert sorted(int(it) for phase, it, _, _ in reports if not phase) == [1, 2, 3, 4], stdout
    rollouts = {int(it): (int(rank), float(rel)) for phase, it, rank, rel in reports if phase}
    assert sorted(rollouts) == [1, 3] and rollouts[3][0] == 1 and rollouts[3][1] < 0.7, rollouts
    assert {e.step: e.value for e in scalars.Scalars("straggler/rollout/slowest_rank")}[3] == 1

    # Resume from iteration 3, inside the second rollout batch (its checkpoint holds the
    # batch's rollouts, old and reference log-probs, and the prompt sampler's position).
    assert os.path.isfile(directory / "ckpt" / "rl_state" / "iter_0000003" / "rank_00001.pt")
    # The KL reference (full fine-tuning) is rebuilt from its recorded starting point.
    assert (directory / "ckpt" / "rl_state" / "reference_source.json").read_text() == \
        '{"seed": 5}'
    (directory / "ckpt" / "latest_checkpointed_iteration.txt").write_text("3")
    stdout = _train_rl(flags + ["--load", str(directory / "ckpt")])
    resumed = _lines(stdout)
    assert sorted(resumed) == [4] and _validation(stdout) == {4: valid[4]}
    for key in ("rl loss", "reward", "kl", "entropy", "grad norm", "ratio_mean"):
        assert resumed[4][key] == whole[4][key], key

    # The same run at TP=2 (rollouts generated and trained over the vocabulary shards), and
    # with FSDP2 (the rollouts generated on the parameters gathered whole, then resharded):
    # the same sampled rollouts (rewards), greedy evaluations, losses and grad norms (the
    # loss is a sum of terms of ~1e-2 that nearly cancel: 1e-6 absolute).
    for layout in (["--tensor-model-parallel-size", "2"], ["--use-torch-fsdp2"]):
        stdout = _train_rl(flags + layout)
        other = _lines(stdout)
        assert _validation(stdout) == valid, layout
        for iteration, values in whole.items():
            assert other[iteration]["reward"] == values["reward"], (layout, iteration)
            for key in ("rl loss", "kl", "entropy", "grad norm", "ratio_mean"):
                assert other[iteration][key] == pytest.approx(values[key], rel=1e-5, abs=1e-6), (
                    layout, iteration, key)


def _train_rl_in_process(rank, world_size, argv, frozen_copy):
    """train_rl's logged values per iteration, with its log line's "global batch size";
    `frozen_copy`: a LoRA run's KL reference is a frozen copy of the base (as DPO's
    --dpo-reference frozen) instead of the adapters off."""
    from megatron_smp.post_training import rl_training
    from megatron_smp.post_training.reference import build_reference_chunks, copy_base_weights
    from pretrain_gpt import model_provider

    if frozen_copy:
        def reference_logprobs(self, batch):
            if self.reference is None:
                self.reference = build_reference_chunks(model_provider, self.configs,
                                                        self.state)
                copy_base_weights(self.reference, self.trainer.model)
            return rl_training.rollout_logprobs(self.reference, batch, self)

        rl_training.RLRun._reference_logprobs = reference_logprobs
    result = rl_training.train_rl(model_provider, argv=argv)
    lines = _lines("\n".join(result.log_lines))
    return {iteration: {**values, "global batch size": lines[iteration]["global batch size"]}
            for iteration, values in result.iterations.items()}


def _train_rl_runs(rank, world_size, runs):
    """`_train_rl_in_process` for each argv of `runs`, in turn in these processes."""
    return [_train_rl_in_process(rank, world_size, argv, False) for argv in runs]


def _train_rl_logged(rank, world_size, runs):
    """Per argv of `runs` (in turn in these processes): train_rl's values per iteration with
    each step's grad norm (the log line rounds it) and greedy evaluation ("validation ...")."""
    from megatron_smp.post_training.rl_training import train_rl
    from megatron_smp.training.trainer import Trainer
    from pretrain_gpt import model_provider

    train_step, norms = Trainer.train_step, []

    def recording(self, *args, **kwargs):
        step = train_step(self, *args, **kwargs)
        norms.append(float(step.grad_norm))
        return step

    Trainer.train_step = recording
    out = []
    for argv in runs:
        norms.clear()
        result = train_rl(model_provider, argv=argv)
        out.append({iteration: {**values, "grad norm": norms[iteration - 1],
                                **{f"validation {key}": value for key, value in
                                   result.valid_rewards.get(iteration, {}).items()}}
                    for iteration, values in result.iterations.items()})
    return out


def test_train_rl_lora_packed_and_filtered(setup):
    from megatron_smp.post_training.rl_env import PromptSampler, load_env_config
    from megatron_smp.testing import run_distributed

    directory, flags = setup
    argv = flags[:flags.index("--langrl-env-config")] + flags[flags.index("--grpo-group-size"):]
    argv += ["--langrl-env-config", str(directory / "odd.yaml"), "--lora-rank", "4",
             "--grpo-filter-groups-with-same-reward", "--grpo-prompts-per-step", "3",
             "--global-batch-size", "12", "--eval-iters", "0", "--seq-length", "20"]
    argv[argv.index("--lr") + 1] = "3e-2"  # LoRA's B starts at 0: a visible first update
    runs = {}
    for name, extra, frozen_copy in (
            ("adapters-off, packed", ["--rl-use-sequence-packing", "--use-distributed-optimizer"],
             False), ("frozen copy, unpacked", [], True)):
        runs[name] = run_distributed(_train_rl_in_process, 2,
                                     args=(argv + extra, frozen_copy), timeout=180)[0]
    packed, unpacked = runs["adapters-off, packed"], runs["frozen copy, unpacked"]
    assert sorted(packed) == sorted(unpacked) == [1, 2, 3, 4]
    # The groups trained: those whose answer is odd (char_sum differs within each of them).
    sampler = PromptSampler(load_env_config(str(directory / "odd.yaml")), seed=5)
    for batch, odd_expected in enumerate((1, 2)):  # of 3 prompts (so the filter acts)
        odd = sum(int(p.answer) % 2 for p in sampler.sample(3))
        assert odd == odd_expected
        expected = 4 * odd if odd else 12  # all filtered: all trained, advantages 0
        for iteration in (2 * batch + 1, 2 * batch + 2):
            for values in (packed, unpacked):
                assert values[iteration]["rollouts_trained"] == expected, (iteration, values)
                assert values[iteration]["frac_reward_zero_std"] == pytest.approx(
                    1 - odd / 3)
    # Packed: fewer rows than rollouts (rows of 20, rollouts of 4-9 positions), the same
    # rewards, losses, KL and grad norms as one rollout per row. Before any update the two
    # agree to 1e-6. Packed rows and one rollout per row are products of different shapes,
    # so they sum in different orders; Adam at lr 3e-2 turns those last-bit differences of
    # near-zero gradients into whole steps, and after two updates the KL (a difference of
    # log-probs of ~1e-2) differs by up to 1e-4 relative on some CPUs. Attending across
    # rollouts would move these values by 1e-1 and more.
    assert packed[1]["rollout_rows"] < unpacked[1]["rollout_rows"]
    # The log line's "global batch size" is Megatron-LM's micro x dp x microbatches: the rows
    # the step ran (packed rows, padded to whole microbatches per data-parallel rank), not
    # the 12 rollouts of a step (main's RL logs its packed bins the same way).
    for values in (packed, unpacked):
        for iteration in values:
            rows = values[iteration]["rollout_rows"]
            assert values[iteration]["global batch size"] == -(-rows // 4) * 4, values
    assert unpacked[1]["global batch size"] == 4 and packed[1]["global batch size"] < 12
    assert packed[3]["kl"] > 0 and packed[1]["kl"] == pytest.approx(0.0, abs=1e-7)
    for iteration, values in unpacked.items():
        assert packed[iteration]["reward"] == values["reward"]
        rel = 1e-6 if iteration == 1 else 2e-3
        for key in ("rl loss", "kl", "entropy", "ratio_mean", "clip_fraction"):
            assert packed[iteration][key] == pytest.approx(values[key], rel=rel, abs=1e-6), (
                iteration, key)


def test_train_rl_expert_parallel_equals_one_process(setup):
    """A small MoE (4 experts, top-2) at EP=2 (two ranks), also under FSDP2, gives one
    process's rewards, losses and KL (grpo's per-sequence loss with an entropy bonus here)."""
    from megatron_smp.testing import run_distributed

    directory, flags = setup
    argv = flags + ["--num-experts", "4", "--moe-router-topk", "2", "--eval-iters", "0",
                    "--grpo-loss-type", "grpo", "--grpo-entropy-term-weight", "0.01",
                    "--train-iters", "2"]  # one rollout batch, two updates
    ep2 = argv + ["--expert-model-parallel-size", "2"]
    (single,) = run_distributed(_train_rl_in_process, 1, args=(argv, False), timeout=180)
    (expert_parallel, sharded), _ = run_distributed(
        _train_rl_runs, 2, args=([ep2, ep2 + ["--use-torch-fsdp2"]],), timeout=180)
    for run in (expert_parallel, sharded):  # sharded: rollouts on the gathered FSDP2 units
        assert sorted(single) == sorted(run) == [1, 2]
        for iteration, values in single.items():
            assert run[iteration]["reward"] == values["reward"], iteration
            for key in ("rl loss", "kl", "entropy", "ratio_mean"):
                assert run[iteration][key] == pytest.approx(
                    values[key], rel=1e-5, abs=1e-6), (iteration, key)


@pytest.mark.parametrize("extra,message", [
    (["--global-batch-size", "4"], "--global-batch-size (4) must equal"),
    (["--rl-max-completion-length", "20"], "more than --seq-length 12"),
    (["--inference-max-seq-length", "64"], "drop --inference-max-seq-length"),
])
def test_train_rl_refuses_flags(setup, extra, message):
    from megatron_smp.config import ConfigError
    from megatron_smp.post_training.rl_training import train_rl
    from pretrain_gpt import model_provider

    directory, flags = setup
    with pytest.raises(ConfigError, match=re.escape(message)):
        train_rl(model_provider, argv=flags + extra)
    without_env = [f for f in flags if f != str(directory / "env.yaml")]
    without_env.remove("--langrl-env-config")
    with pytest.raises(ConfigError, match="needs --langrl-env-config"):
        train_rl(model_provider, argv=without_env)


def _context_parallel_runs(rank, world_size, runs):
    """`_train_rl_logged`, then the rollouts' comparison over the CP group given rollouts that
    differ between the ranks: (logged values, the error it raised on this rank)."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from megatron_smp.post_training.rl_training import RLRun

    logged = _train_rl_logged(rank, world_size, runs)
    run = SimpleNamespace(state=SimpleNamespace(cp_size=2, cp_group=dist.group.WORLD,
                                                device="cpu"))
    rollouts = [SimpleNamespace(prompt_ids=[1, 2], completion_ids=[3, 4 + rank])]
    try:
        RLRun._check_same_over_context_parallel(run, rollouts, 7)
    except RuntimeError as error:
        return logged, str(error)
    return logged, None


def test_train_rl_context_parallel_equals_one_process(setup):
    """CP=2 (`--cp-comm-type all_gather`): each CP rank generates the rollouts on its own
    (the engine runs every step whole there), the training step splits each row over the
    two ranks. One rollout per row, packed rollouts (slots padded to 2 x CP) and gspo (its
    sequence ratios summed over the CP group) give one process's rewards exactly and its
    losses, KL, entropy and grad norms: the first update within 1e-6 (the CP split sums the
    same terms in another order), the second (after Adam has amplified those last bits) as
    the packed comparison above allows. Rollouts that differ between the CP ranks are an
    error on every rank."""
    from megatron_smp.testing import run_distributed

    directory, flags = setup
    argv = flags + ["--eval-iters", "0", "--train-iters", "2"]  # one batch, two updates
    # Rows of 24: two rollouts of 7-9 positions (12 with their slots padded to 4) per row.
    packed = argv + ["--rl-use-sequence-packing", "--seq-length", "24"]
    # The unpacked run also evaluates greedily after its second update.
    runs = [flags + ["--train-iters", "2"], packed, argv + ["--grpo-loss-type", "gspo"]]
    cp2 = ["--context-parallel-size", "2", "--cp-comm-type", "all_gather"]
    (single,) = run_distributed(_train_rl_logged, 1, args=(runs,), timeout=180)
    results = run_distributed(_context_parallel_runs, 2, args=([run + cp2 for run in runs],),
                              timeout=180)
    for _, error in results:
        assert "rollout batch 7 differs between the context-parallel ranks" in error
    for name, one, split in zip(("unpacked", "packed", "gspo"), single, results[0][0]):
        assert sorted(one) == sorted(split) == [1, 2], name
        for iteration, values in one.items():
            assert split[iteration]["reward"] == values["reward"], (name, iteration)
            assert ({k: v for k, v in split[iteration].items() if k.startswith("validation")}
                    == {k: v for k, v in values.items() if k.startswith("validation")})
            rel = 1e-6 if iteration == 1 else 1e-4
            for key in ("rl loss", "kl", "entropy", "ratio_mean", "grad norm"):
                assert split[iteration][key] == pytest.approx(values[key], rel=rel, abs=1e-6), (
                    name, iteration, key)
    assert single[1][1]["rollout_rows"] == results[0][0][1][1]["rollout_rows"] == 4
    assert "validation reward" in single[0][2]


def test_context_parallel_refusals(setup):
    """train_rl.py at CP > 1 needs --cp-comm-type all_gather (rollout rows are packed
    documents); the engine still refuses a CP layout for standalone inference
    (tools/generate.py, the server), and for recurrent layers even when replicated."""
    from types import SimpleNamespace

    from megatron_smp.config import ConfigError
    from megatron_smp.inference.kv_cache import check_inference_layout
    from megatron_smp.post_training.rl_config import RLConfig
    from megatron_smp.post_training.rl_training import check_rl_configs

    configs = SimpleNamespace(parallel=SimpleNamespace(context_parallel_size=2),
                              training=None, model=SimpleNamespace(cp_comm_type="p2p"))
    with pytest.raises(ConfigError, match="--context-parallel-size 2 needs --cp-comm-type "
                                          "all_gather"):
        check_rl_configs(configs, RLConfig(env_config=str(setup[0] / "env.yaml")))
    state = SimpleNamespace(cp_size=2)
    with pytest.raises(ConfigError, match="--context-parallel-size must be 1"):
        check_inference_layout(state)
    check_inference_layout(state, replicate_context_parallel=True)
    with pytest.raises(ConfigError, match="Mamba / Gated DeltaNet"):
        check_inference_layout(state, replicate_context_parallel=True, recurrent=True)
