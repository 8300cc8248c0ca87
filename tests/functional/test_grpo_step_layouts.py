"""GRPO steps through `Trainer.train_step` on fixed rollouts (DAPO-filtered, packed, split into
a number of micro-batches that changes from step to step) give the single-process update --
parameters and loss -- at TP=2 with sequence parallelism, PP=2, DP=2 with the distributed
optimizer, FSDP2, CP=2 and (an MoE model) EP=2, also under FSDP2; dapo's token-level and
grpo's per-sequence normalisation, a KL term against reference log-probs. Greedy rollouts
from the inference engine on the trainer's own model at TP=2, PP=2, DP=2 and EP=2 equal HF
`generate` on the same weights; with LoRA the adapters-off reference equals a frozen copy of
the base after a GRPO step.

Every model starts from the same small HF Llama (Mixtral for the MoE) loaded into the layout,
so a layout's result does not depend on how it initialises."""
import pytest
import torch

from megatron_smp.testing import run_distributed
from tests.unit.models.common import to_numpy, to_torch

LLAMA = ("--normalization RMSNorm --swiglu --position-embedding-type rope "
         "--untie-embeddings-and-output-weights --disable-bias-linear "
         "--group-query-attention --num-query-groups 2").split()
# Adam's first update is lr g / (|g| + eps): with the default eps 1e-8 a gradient of ~1e-8,
# whose last bits depend on the order of the sums, moves its parameter by up to lr times its
# relative rounding error; eps 1e-5 keeps that amplification below what is compared.
FLAGS = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --ffn-hidden-size 64 "
         "--seq-length 16 --max-position-embeddings 16 --micro-batch-size 2 "
         "--global-batch-size 4 --train-iters 4 --lr 1e-2 --adam-eps 1e-5 "
         "--lr-decay-style constant --tokenizer-type NullTokenizer --vocab-size 64 "
         "--hidden-dropout 0 --attention-dropout 0 --mock-data --seed 5").split() + LLAMA
MOE = "--num-experts 4 --moe-router-topk 2".split()
LAYOUTS = {  # name: (flags, MoE, the parallel sizes tp, cp, dp, pp, ep)
    "tp2+sp": ("--tensor-model-parallel-size 2 --sequence-parallel", False, (2, 1, 1, 1, 1)),
    "pp2": ("--pipeline-model-parallel-size 2", False, (1, 1, 1, 2, 1)),
    "dp2+distopt": ("--use-distributed-optimizer", False, (1, 1, 2, 1, 1)),
    "fsdp2": ("--use-torch-fsdp2", False, (1, 1, 2, 1, 1)),
    "ep2": ("--expert-model-parallel-size 2", True, (1, 1, 2, 1, 2)),
    "fsdp2+ep2": ("--use-torch-fsdp2 --expert-model-parallel-size 2", True, (1, 1, 2, 1, 2)),
    "cp2": ("--context-parallel-size 2 --cp-comm-type all_gather", False, (1, 2, 1, 1, 1)),
}
GENERATE_AT = ("tp2+sp", "pp2", "dp2+distopt", "ep2")  # the engine's layouts
# Two steps: DAPO's filter drops a group of the first (equal rewards), the second is smaller,
# so the steps run different numbers of micro-batches at every layout.
STEPS = [
    {"loss_type": "dapo", "groups": 8,
     "rewards": [1, 0, 0, 0, 1, 0.5, 0, 1, 1, 0, 0.5, 1, 0, 1, 1, 0.25]},
    {"loss_type": "grpo", "groups": 3, "rewards": [0, 1, 1, 0.25, 0, 0]},
]
GROUP_SIZE, KL_BETA = 2, 0.05
REPORTS = ("loss", "clip_fraction", "clip_ratio/low_mean", "clip_ratio/high_mean",
           "clip_ratio/region_mean", "ratio_mean", "kl")
PROMPTS = ["abcde", "hello", "xyz"]
NEW_TOKENS = 6


class Letters:
    """'a'..'z' <-> ids 3..28 (other ids decode to '?')."""

    def tokenize(self, text):
        return [3 + ord(c) - ord("a") for c in text]

    def detokenize(self, ids):
        return "".join(chr(ord("a") + i - 3) if 3 <= i < 29 else "?" for i in ids)


def _rollouts(step, seed):
    """Fixed prompt and completion ids (lengths 2-5 and 1-8) of one step's groups."""
    generator = torch.Generator().manual_seed(seed)
    prompts, completions = [], []
    for group in range(step["groups"]):
        prompt = torch.randint(3, 60, (2 + group % 4,), generator=generator).tolist()
        for member in range(GROUP_SIZE):
            length = 1 + (3 * group + 5 * member) % 8
            prompts.append(prompt)
            completions.append(torch.randint(3, 60, (length,), generator=generator).tolist())
    return prompts, completions


def _hf_model(configs, moe):
    """The small HF model whose weights every layout loads (same seed, same weights)."""
    import transformers

    from megatron_smp.models.hf import config_to_hf

    torch.manual_seed(11)
    hf_config = config_to_hf(configs.model, "mixtral" if moe else "llama")
    cls = transformers.MixtralForCausalLM if moe else transformers.LlamaForCausalLM
    return cls(hf_config).eval()


def _load_hf(trainer, hf, moe):
    """The HF weights into this layout's model (each rank's pieces of the global tensors)."""
    from megatron_smp.checkpointing.sharded_state import model_sharded_state_dict
    from megatron_smp.models.hf import get_adapter

    full = get_adapter("mixtral" if moe else "llama").from_hf(hf.state_dict(),
                                                              trainer.configs.model)
    views = model_sharded_state_dict(trainer.model, trainer.state,
                                     trainer.configs.model.vocab_size)
    with torch.no_grad():
        for key, view in views.items():
            for offsets, piece in view._chunks:
                if key in full:  # LoRA adapters are not in the base
                    piece.copy_(full[key][tuple(slice(o, o + n)
                                                for o, n in zip(offsets, piece.shape))])
    trainer.optimizer.reload_model_params()  # the optimizer's main copies


def _parameters(trainer):
    """{global name: (global shape, [(offsets, this rank's piece)])} of every parameter."""
    from megatron_smp.checkpointing.sharded_state import model_sharded_state_dict

    views = model_sharded_state_dict(trainer.model, trainer.state,
                                     trainer.configs.model.vocab_size)
    return {key: (tuple(view.shape), [(offsets, piece.detach().clone())
                                      for offsets, piece in view._chunks])
            for key, view in views.items()}


def _generate(trainer, seed):
    """Greedy rollouts of PROMPTS from the inference engine on the trainer's own model."""
    from megatron_smp.inference import InferenceEngine
    from megatron_smp.post_training.rl_config import RLConfig
    from megatron_smp.post_training.rl_env import Prompt
    from megatron_smp.post_training.rl_generation import generate_rollouts

    engine = InferenceEngine(trainer.model, max_tokens=256)
    config = RLConfig(group_size=GROUP_SIZE, prompts_per_step=len(PROMPTS), temperature=0.0,
                      max_completion_length=NEW_TOKENS)
    prompts = [Prompt("letters", text, None) for text in PROMPTS]
    rollouts = generate_rollouts(engine, Letters(), prompts, config, step=0, seed=seed)
    for chunk in trainer.model:
        chunk.train()
    return [(r.completion_ids, r.logprobs) for r in rollouts]


def _step_batches(trainer):
    """Each step's packed rollout batch with the initial model's log-probs as old policy
    (stale by one update in step 2, so the ratio is clipped) and, perturbed, as reference.
    Every rollout's slot is a multiple of 2 x CP, at every layout, so that CP=2 splits the
    same rows."""
    from megatron_smp.post_training.backend_api import compute_logprobs
    from megatron_smp.post_training.rollouts import build_rollout_batch, rollout_advantages

    batches = []
    for index, step in enumerate(STEPS):
        prompts, completions = _rollouts(step, seed=index)
        advantages, kept = rollout_advantages(step["rewards"], GROUP_SIZE,
                                              filter_groups_with_same_reward=True)
        batch = build_rollout_batch([prompts[i] for i in kept], [completions[i] for i in kept],
                                    advantages.tolist(), seq_length=16, pad_id=0,
                                    loss_type=step["loss_type"], pad_to_multiple=4)
        logps = compute_logprobs(trainer.model, batch, trainer.state,
                                 trainer.configs.model.vocab_size)["logprobs"].cpu()
        noise = torch.randn(logps.shape, generator=torch.Generator().manual_seed(20 + index))
        batch["old_logps"] = logps
        batch["ref_logps"] = logps + 0.1 * noise
        batches.append(batch)
    return batches


def _grpo_steps(trainer, batches, whole=False):
    """The GRPO steps; per step (micro-batches on this rank, {reported key: value}). `whole`:
    each step's batch as one micro-batch (one process, no pipeline: any row count runs)."""
    from megatron_smp.post_training.rl_config import RLConfig
    from megatron_smp.post_training.rollouts import grpo_loss_fn, rollout_microbatches

    state, results = trainer.state, []
    trainer.metric_keys = REPORTS
    for step, batch in zip(STEPS, batches):
        config = RLConfig(loss_type=step["loss_type"], clamp_eps_lower=0.2,
                          clamp_eps_upper=0.28, kl_beta=KL_BETA)
        micro = [batch] if whole else rollout_microbatches(
            batch, trainer.configs.training.micro_batch_size, state.dp_size, state.dp_rank)
        scale = len(micro) * state.dp_size * state.cp_size
        policy_loss = grpo_loss_fn(config, state.tp_group, trainer.configs.model.vocab_size,
                                   loss_scale=scale)

        def loss_fn(logits, batch, policy_loss=policy_loss, scale=scale):
            # The loss and metrics are weighted sums over the whole batch; the Trainer
            # reports each value's mean over micro-batches and data x context-parallel
            # ranks, so scaled like the loss that mean is the whole batch's value.
            loss, metrics = policy_loss(logits, batch)
            reports = {key: metrics[key] * scale for key in REPORTS[1:]}
            return loss, {"loss": loss.detach(), **reports}

        result = trainer.train_step(iter(micro), loss_fn=loss_fn, num_microbatches=len(micro))
        assert result.update_successful
        results.append((len(micro), {k: v.item() for k, v in result.losses.items()}))
    return results


def _run(layout_flags, moe, generate=False, whole=False):
    import pretrain_gpt
    from megatron_smp.training import Trainer, build_configs

    configs, _ = build_configs(FLAGS + layout_flags + (MOE if moe else []))
    trainer = Trainer.build(configs, pretrain_gpt.model_provider)
    _load_hf(trainer, _hf_model(configs, moe), moe)
    state = trainer.state
    out = {"sizes": (state.tp_size, state.cp_size, state.dp_size, state.pp_size,
                     state.expert_model_parallel_size),
           "rollouts": _generate(trainer, seed=0) if generate else None}
    out["steps"] = _grpo_steps(trainer, _step_batches(trainer), whole)
    out["params"] = _parameters(trainer)
    out["advanced"] = (trainer.progress.consumed_train_samples, trainer.scheduler.num_steps)
    return out


def _lora_reference(trainer_flags):
    """After a GRPO step with LoRA: the adapters-off log-probs (the reference) against a frozen
    copy of the base model, and against the adapters on."""
    import pretrain_gpt
    from megatron_smp.post_training.backend_api import compute_logprobs
    from megatron_smp.post_training.reference import build_reference_chunks, copy_base_weights
    from megatron_smp.tensor_parallel.lora import adapters_disabled
    from megatron_smp.training import Trainer, build_configs

    configs, _ = build_configs(FLAGS + trainer_flags + "--lora-rank 4 --lora-alpha 8".split())
    trainer = Trainer.build(configs, pretrain_gpt.model_provider)
    _load_hf(trainer, _hf_model(configs, False), False)
    frozen = build_reference_chunks(pretrain_gpt.model_provider, configs, trainer.state)
    copy_base_weights(frozen, trainer.model)
    batches = _step_batches(trainer)
    _grpo_steps(trainer, batches[:1])
    batch, vocab = batches[1], configs.model.vocab_size

    def logps(model):
        return compute_logprobs(model, batch, trainer.state, vocab)["logprobs"]

    with adapters_disabled(trainer.model):
        adapters_off = logps(trainer.model)
    mask = batch["loss_mask"].bool()
    return ((adapters_off - logps(frozen))[mask].abs().max().item(),
            (adapters_off - logps(trainer.model))[mask].abs().max().item())


def _errors():
    """Micro-batch counts that cannot work (at PP=2 with two virtual stages per rank): the
    error on every rank, before anything runs."""
    import torch.distributed as dist

    import pretrain_gpt
    from megatron_smp.training import Trainer, build_configs

    flags = ("--pipeline-model-parallel-size 2 --num-layers 4 "
             "--num-layers-per-virtual-pipeline-stage 1").split()
    trainer = Trainer.build(build_configs(FLAGS + flags)[0], pretrain_gpt.model_provider)
    messages = []
    for count in ([2, 3][dist.get_rank()], 0, 3):
        try:
            trainer.train_step(iter([]), loss_fn=lambda logits, batch: None,
                               num_microbatches=count)
        except ValueError as error:
            messages.append(str(error))
    return messages, trainer.iteration


def _reference(rank, world_size):
    """One process: the dense and MoE runs, the HF model's greedy generation and log-probs."""
    runs = {"dense": _run([], False, generate=True), "moe": _run([], True, generate=True),
            "whole": _run([], False, whole=True)}
    from megatron_smp.training import build_configs

    expected = {}
    for moe in (False, True):
        hf = _hf_model(build_configs(FLAGS + (MOE if moe else []))[0], moe)
        expected[moe] = []
        for text in PROMPTS:
            ids = torch.tensor([Letters().tokenize(text)])
            with torch.no_grad():
                out = hf.generate(ids, attention_mask=torch.ones_like(ids),
                                  max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                                  pad_token_id=0)[0]
                logits = hf(out[None]).logits[0, ids.shape[1] - 1:-1].float()
            completion = out[ids.shape[1]:]
            logprobs = torch.log_softmax(logits, -1).gather(1, completion[:, None])[:, 0]
            expected[moe].append((completion.tolist(), logprobs))
    return to_numpy((runs, expected))


def _layouts(rank, world_size):
    """Every layout at world size 2 in one spawn (each Trainer builds its own groups)."""
    results = {name: _run(flags.split(), moe, generate=name in GENERATE_AT)
               for name, (flags, moe, _) in LAYOUTS.items()}
    results["lora"] = _lora_reference("--tensor-model-parallel-size 2".split())
    results["errors"] = _errors()
    return to_numpy(results)


def _max_param_diff(ranks, reference):
    """Largest |layout - one process| over every parameter; every element covered."""
    def place(shape, pieces):
        whole, covered = torch.zeros(shape), torch.zeros(shape, dtype=torch.bool)
        for offsets, piece in pieces:
            index = tuple(slice(o, o + n) for o, n in zip(offsets, piece.shape))
            whole[index], covered[index] = piece, True
        return whole, covered

    worst = 0.0
    for key, (shape, pieces) in reference.items():
        expected, covered = place(shape, pieces)
        assert covered.all(), key
        covered = torch.zeros(shape, dtype=torch.bool)
        for params in ranks:
            got, mine = place(shape, params[key][1] if key in params else [])
            worst = max(worst, (got - expected)[mine].abs().max().item() if mine.any() else 0)
            covered |= mine
        assert covered.all(), key
    return worst


def _loss_diff(ranks, reference):
    """Largest |layout - reference| over every step's reported values, on every rank."""
    return max(abs(losses[key] - value) for run in ranks
               for (_, losses), (_, expected) in zip(run["steps"], reference["steps"])
               for key, value in expected.items())


@pytest.fixture(scope="module")
def reference():
    (result,) = run_distributed(_reference, 1, timeout=300)
    return to_torch(result)


def test_grpo_steps_at_every_layout_equal_one_process(reference):
    runs, expected_rollouts = reference
    # One process: the batch cut into micro-batches (as many as its rows need) updates the
    # model as the whole batch in one micro-batch does, and reports the same loss.
    dense, whole = runs["dense"], runs["whole"]
    counts = [count for count, _ in dense["steps"]]
    assert counts[0] != counts[1] and [c for c, _ in whole["steps"]] == [1, 1], counts
    table = {"1 process, whole batch": (counts, [1, 1], _loss_diff([dense], whole),
                                        _max_param_diff([dense["params"]], whole["params"]))}
    loss_diff, param_diff = table["1 process, whole batch"][2:]
    assert loss_diff < 1e-6 and param_diff < 1e-5, table
    # The second step's ratios were clipped and its KL is not zero (old / reference differ).
    step2 = dense["steps"][1][1]
    assert step2["clip_fraction"] > 0 and step2["kl"] > 0, step2

    results = to_torch(run_distributed(_layouts, 2, timeout=600))
    for name, (_, moe, sizes) in LAYOUTS.items():
        ref = runs["moe" if moe else "dense"]
        ranks = [result[name] for result in results]
        assert [run["sizes"] for run in ranks] == [sizes, sizes], name
        # Each step, whatever its rows, advanced the schedule by one --global-batch-size (4).
        assert [run["advanced"] for run in ranks] == [(8, 8), (8, 8)], name
        counts = [count for count, _ in ranks[0]["steps"]]
        assert counts[0] != counts[1], (name, counts)
        table[name] = (counts, [count for count, _ in ref["steps"]], _loss_diff(ranks, ref),
                       _max_param_diff([run["params"] for run in ranks], ref["params"]))
        loss_diff, param_diff = table[name][2:]
        assert loss_diff < 1e-5 and param_diff < 1e-5, (name, table[name])
    print("\nlayout: micro-batches per step (its reference's), max |loss diff|, "
          "max |param diff|")
    for name, row in table.items():
        print(f"  {name}: {row[0]} ({row[1]}), {row[2]:.1e}, {row[3]:.1e}")

    # Greedy rollouts in one process and at TP=2, PP=2, DP=2 and EP=2 equal HF generate.
    generated = [(False, dense["rollouts"]), (True, runs["moe"]["rollouts"])]
    generated += [(LAYOUTS[name][1], r[name]["rollouts"]) for r in results
                  for name in GENERATE_AT]
    worst = 0.0
    for moe, rollouts in generated:
        assert len(rollouts) == len(PROMPTS) * GROUP_SIZE
        for index, (completion, logprobs) in enumerate(rollouts):
            hf_completion, hf_logprobs = expected_rollouts[moe][index // GROUP_SIZE]
            assert completion == hf_completion, (moe, index, completion, hf_completion)
            worst = max(worst, (torch.tensor(logprobs) - hf_logprobs).abs().max().item())
    assert worst < 1e-5, worst
    print(f"  rollouts = HF generate; max |log-prob diff| {worst:.1e}")
    # LoRA: adapters off = the frozen base (the adapters did move).
    for result in results:
        frozen_diff, adapters_moved = result["lora"]
        assert frozen_diff < 1e-6 and adapters_moved > 1e-4, result["lora"]
    print(f"  lora tp2: |adapters-off - frozen| {frozen_diff:.1e}, "
          f"|adapters-off - on| {adapters_moved:.1e}")
    # Counts that cannot work: a clear error on every rank, and no step taken.
    for result in results:
        (differs, zero, interleaved), iteration = result["errors"]
        assert "num_microbatches differs over the ranks (2 to 3)" in differs
        assert "num_microbatches must be a positive integer, got 0" in zero
        assert "3 microbatches cannot run the interleaved virtual-pipeline" in interleaved
        assert iteration == 0
