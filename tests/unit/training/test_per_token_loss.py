"""--calculate-per-token-loss at DP=2 with 2 microbatches per rank and unequal loss masks.

Megatron's semantics: the step's loss is sum(loss * mask) / sum(mask) over the whole global
batch (all microbatches, all data-parallel ranks), not the mean of the microbatches' means.
The test trains one step of a tiny GPT through our DDP, the no-pipelining schedule and
pretrain_gpt's loss function, and compares the reduced grads and the reported loss with
one plain-torch forward/backward of that formula over the whole batch (computed by hand).
The mean-of-means grads differ from them, so the check can fail.
"""
import pytest
import torch

from megatron_smp.testing import run_distributed

ARGV = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--max-position-embeddings 16 --micro-batch-size 2 --global-batch-size 8 "
        "--train-iters 1 --mock-data --vocab-size 64 --hidden-dropout 0 --attention-dropout 0 "
        "--calculate-per-token-loss").split()
GLOBAL_BATCH, MICRO_BATCH, SEQ, VOCAB = 8, 2, 16, 64


def global_batch():
    """Tokens, labels and masks [8, 16]; row r keeps 1 + 3r tokens (at most 16): the four
    microbatches hold 5, 17, 29 and 32 tokens, the two ranks 22 and 61."""
    generator = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=generator)
    mask = torch.zeros(GLOBAL_BATCH, SEQ)
    for row in range(GLOBAL_BATCH):
        mask[row, : min(SEQ, 1 + 3 * row)] = 1.0
    return tokens[:, :-1], tokens[:, 1:], mask


def _step(rank, world_size, per_token=True):
    from megatron_smp.distributed import DistributedDataParallel, finalize_model_grads
    from megatron_smp.models.gpt import GPTModel
    from megatron_smp.parallel_state import build_parallel_state
    from megatron_smp.pipeline_parallel.schedules import ScheduleHooks, get_forward_backward_func
    from megatron_smp.training.arguments import parse_args
    from megatron_smp.training.per_token_loss import (
        local_token_count,
        scale_grads_to_per_token_mean,
    )
    from megatron_smp.training.step_agreement import agree_on_step
    from pretrain_gpt import forward_step

    configs = parse_args(ARGV if per_token else
                         [a for a in ARGV if a != "--calculate-per-token-loss"])
    configs.model.vocab_size = VOCAB
    state = build_parallel_state(configs.parallel)
    models = []
    for _ in range(2):  # ours and the reference: the same seed gives the same weights
        torch.manual_seed(5)
        models.append(GPTModel(configs.model, state))
    model, reference = models
    ddp = DistributedDataParallel(model, configs.optimizer, state)

    tokens, labels, mask = global_batch()
    positions = torch.arange(SEQ).expand(GLOBAL_BATCH, SEQ)
    per_rank = GLOBAL_BATCH // world_size
    rows = range(rank * per_rank, (rank + 1) * per_rank, MICRO_BATCH)
    microbatches = iter([
        {"tokens": tokens[r:r + MICRO_BATCH], "labels": labels[r:r + MICRO_BATCH],
         "loss_mask": mask[r:r + MICRO_BATCH], "position_ids": positions[r:r + MICRO_BATCH]}
        for r in rows
    ])
    hooks = ScheduleHooks(no_sync_func=ddp.no_sync,
                          finalize_model_grads_func=lambda c: finalize_model_grads(c, state))
    reports = get_forward_backward_func(1)(
        forward_step_func=forward_step, data_iterator=microbatches, model=[ddp],
        num_microbatches=len(rows), seq_length=SEQ, micro_batch_size=MICRO_BATCH,
        forward_only=False, hooks=hooks)
    # The loop's agreement: the global token count and the logged loss in one all-reduce.
    agreed, losses = agree_on_step(state, reports, ["lm loss"], replica_sums={
        "tokens": local_token_count(reports, state.device)})
    assert agreed["tokens"] == [83.0]  # 22 + 61
    if per_token:
        scale_grads_to_per_token_mean([ddp], agreed["tokens"][0], state, len(rows))
    reported = float(losses["lm loss"])  # a device tensor

    # By hand: the per-token mean over the whole global batch, and the mean of the four
    # microbatch means (what the run would do without the flag).
    # (Two forwards: the vocab-parallel cross entropy's backward reuses its saved softmax.)
    losses = reference(tokens, position_ids=positions, labels=labels)  # [8, 16]
    per_token = (losses * mask).sum() / mask.sum()
    per_token_grads = torch.autograd.grad(per_token, list(reference.parameters()))
    losses = reference(tokens, position_ids=positions, labels=labels)
    micro_means = [(losses[r:r + 2] * mask[r:r + 2]).sum() / mask[r:r + 2].sum()
                   for r in range(0, GLOBAL_BATCH, MICRO_BATCH)]
    mean_of_means = torch.stack(micro_means).mean()
    mean_grads = torch.autograd.grad(mean_of_means, list(reference.parameters()))
    ours = [p.main_grad for p in model.parameters()]
    return {
        "ours": [g.flatten().tolist() for g in ours],
        "per_token": [g.flatten().tolist() for g in per_token_grads],
        "mean_of_means": [g.flatten().tolist() for g in mean_grads],
        "reported": reported, "per_token_loss": float(per_token.detach()),
        "mean_of_means_loss": float(mean_of_means.detach()),
        "local_tokens": float(mask[rank * per_rank:(rank + 1) * per_rank].sum()),
    }


def _max_relative(a, b):
    a = torch.cat([torch.tensor(x) for x in a])
    b = torch.cat([torch.tensor(x) for x in b])
    return float((a - b).abs().max() / b.abs().max())


def test_grads_and_loss_are_the_global_per_token_mean():
    results = run_distributed(_step, 2, timeout=180)
    assert [r["local_tokens"] for r in results] == [22.0, 61.0]
    for result in results:
        assert _max_relative(result["ours"], result["per_token"]) < 1e-5
        assert _max_relative(result["mean_of_means"], result["per_token"]) > 1e-2
        assert result["reported"] == pytest.approx(result["per_token_loss"], rel=1e-6)
        assert abs(result["mean_of_means_loss"] - result["per_token_loss"]) > 1e-3


def test_without_the_flag_grads_are_the_mean_of_means_and_the_log_is_token_weighted():
    """Megatron without --calculate-per-token-loss: each microbatch back-propagates its own
    per-token mean (grads: the mean of the microbatch means), but the logged lm loss is
    reduced from [sum, count] reports, i.e. the token-weighted mean of the global batch."""
    for result in run_distributed(_step, 2, args=(False,), timeout=180):
        assert _max_relative(result["ours"], result["mean_of_means"]) < 1e-5
        assert result["reported"] == pytest.approx(result["per_token_loss"], rel=1e-6)
        assert abs(result["mean_of_means_loss"] - result["per_token_loss"]) > 1e-3


def test_a_loss_without_a_count_is_a_clear_error():
    """Every contributing rank reports -1 tokens when its loss has no [sum, count]: the sum
    is negative on every rank, and each raises the same ConfigError."""
    from megatron_smp.config import ConfigError
    from megatron_smp.training.per_token_loss import (
        local_token_count,
        scale_grads_to_per_token_mean,
    )

    reports = [{"lm loss": torch.tensor(2.0)}, {"lm loss": torch.tensor(3.0)}]
    assert local_token_count(reports, torch.device("cpu")).tolist() == [-1.0]
    counted = [{"lm loss": torch.tensor([4.0, 2.0])}, {"lm loss": torch.tensor([1.0, 3.0])}]
    assert local_token_count(counted, torch.device("cpu")).tolist() == [5.0]
    assert local_token_count([], torch.device("cpu")).tolist() == [0.0]
    with pytest.raises(ConfigError, match="--calculate-per-token-loss needs the loss"):
        scale_grads_to_per_token_mean([], -2.0, None, 1)


def _train(rank, world_size, runs):
    from megatron_smp.training import pretrain
    from pretrain_gpt import forward_step, model_provider, train_valid_test_datasets_provider

    out = []
    for argv in runs:
        result = pretrain(train_valid_test_datasets_provider, model_provider, forward_step,
                          argv=argv)
        grad_norms = [float(line.split("grad norm:")[1].split("|")[0])
                      for line in result.log_lines if "grad norm:" in line]
        out.append(({i: v["lm loss"] for i, v in result.train_losses.items()}, grad_norms))
    return out


@pytest.mark.parametrize("layout", [[], ["--pipeline-model-parallel-size", "2"],
                                    ["--context-parallel-size", "2"], ["--use-torch-fsdp2"]],
                         ids=["dp2", "pp2", "cp2", "fsdp2"])
def test_pretrain_with_equal_token_counts_matches_the_microbatch_mean(layout):
    """Without masking every microbatch has the same tokens, so the per-token mean is the
    mean of means: pretrain's grad scaling and [sum, count] reporting must give the losses of
    a run without the flag (DP=2 with 2 microbatches; PP=2 with 4, where the first stage
    takes the token count from the last; CP=2, each rank counting its half of the tokens;
    3 iterations)."""
    from tests.functional.test_training_parity import COMMON

    argv = COMMON + ["--train-iters", "3", "--log-interval", "1"] + layout
    results = run_distributed(_train, 2, args=([argv, argv + ["--calculate-per-token-loss"]],),
                              timeout=300)
    for (plain, plain_norms), (per_token, per_token_norms) in results:
        assert sorted(plain) == [1, 2, 3]
        for iteration, loss in plain.items():
            assert per_token[iteration] == pytest.approx(loss, rel=1e-5)
        assert len({round(v, 6) for v in plain.values()}) == 3  # training moves the loss
        # Adam hides a constant factor in the grads from the losses; the norms show it.
        assert len(plain_norms) == 3
        assert per_token_norms == pytest.approx(plain_norms, abs=2e-3)
