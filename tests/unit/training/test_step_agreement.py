"""The step agreement: the NaN/Inf checks, the exit conditions, the token count and the logged
losses of a step in one all-reduce (see megatron_smp/training/step_agreement.py).

One launch at DP=2 checks the reduction's values on three layouts (DP=2, TP=2, PP=2: which
ranks contribute the losses, and that every rank gets them) and that float32 losses come out
as float32's own sum, bit for bit; then a whole pretrain_gpt run with every agreed value on
(the NaN check, --exit-signal-handler, --exit-duration-in-mins, --calculate-per-token-loss)
issues two all-reduces per iteration: the grads and the agreement.
"""
import contextlib
import importlib
import io

import torch

from megatron_smp.testing import run_distributed

ARGV = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--max-position-embeddings 16 --micro-batch-size 2 --global-batch-size 8 "
        "--train-iters 4 --mock-data --tokenizer-type NullTokenizer --vocab-size 127 "
        "--lr 1e-3 --log-interval 2 --eval-interval 100 --eval-iters 0 --seed 7").split()


def _reductions(rank):
    import torch.distributed as dist

    from megatron_smp.config import ParallelConfig
    from megatron_smp.parallel_state import build_parallel_state
    from megatron_smp.training.step_agreement import agree_on_step

    calls = []
    original = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        calls.append(tensor.dtype)
        return original(tensor, *args, **kwargs)

    dist.all_reduce = counting
    # Values whose float32 sum rounds: the result must be float32's a + b.
    loss = [torch.tensor([1.0 + 2**-23, 1.0]), torch.tensor([2**-24 + 2**-47, 1.0])][rank]
    out = {}
    try:
        for name, config in (("dp", ParallelConfig()),
                             ("tp", ParallelConfig(tensor_model_parallel_size=2)),
                             ("pp", ParallelConfig(pipeline_model_parallel_size=2))):
            state = build_parallel_state(config)
            # Under PP=2 only the last stage (rank 1) has reports.
            reports = [] if name == "pp" and rank == 0 else [{"lm loss": loss}]
            before = len(calls)
            host, losses = agree_on_step(
                state, reports, ["lm loss"],
                rank_counts={"checks": torch.tensor([float(rank), 0.0, 1.0, 0.0]),
                             "exit": torch.tensor([0.0, float(rank == 1)])},
                replica_sums={"tokens": torch.tensor([10.0 + rank])})
            out[name] = (host, losses["lm loss"].item(), len(calls) - before)
        # Without values for the host: one all-reduce, the losses stay on the device.
        state = build_parallel_state(ParallelConfig())
        host, losses = agree_on_step(state, [{"lm loss": loss}], ["lm loss"])
        out["losses_only"] = (host, losses["lm loss"].item(), losses["lm loss"].device.type)
    finally:
        dist.all_reduce = original
    return out


def _collectives_per_iteration(argv):
    """all_reduce calls per iteration of a pretrain_gpt run (from one train_step to the
    next), and its losses."""
    import torch.distributed as dist

    import pretrain_gpt

    pretrain_module = importlib.import_module("megatron_smp.training.pretrain")
    trainer_class = importlib.import_module("megatron_smp.training.trainer").Trainer
    calls, marks = [0], []
    original_reduce, original_step = dist.all_reduce, trainer_class.train_step

    def counting(*args, **kwargs):
        calls[0] += 1
        return original_reduce(*args, **kwargs)

    def step(*args, **kwargs):
        marks.append(calls[0])
        return original_step(*args, **kwargs)

    dist.all_reduce, trainer_class.train_step = counting, step
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            result = pretrain_module.pretrain(
                pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.model_provider,
                pretrain_gpt.forward_step, argv=argv)
    finally:
        dist.all_reduce, trainer_class.train_step = original_reduce, original_step
    per_iteration = [b - a for a, b in zip(marks, marks[1:])]
    return per_iteration, [result.train_losses[i]["lm loss"] for i in sorted(result.train_losses)]


def _body(rank, world_size):
    flags = ["--exit-signal-handler", "--exit-duration-in-mins", "60",
             "--calculate-per-token-loss"]
    return (_reductions(rank), _collectives_per_iteration(ARGV + flags),
            _collectives_per_iteration(ARGV + ["--no-check-for-nan-in-loss-and-grad"]))


def test_one_all_reduce_carries_checks_exits_tokens_and_losses():
    results = run_distributed(_body, 2, timeout=240)
    exact = (torch.tensor(1.0 + 2**-23) + torch.tensor(2**-24 + 2**-47)).item() / 2.0
    assert exact != (1.0 + 2**-23 + 2**-24 + 2**-47) / 2.0  # the float32 sum did round
    for rank, (reductions, (per_iteration, losses), (unchecked_calls, unchecked)) in \
            enumerate(results):
        for name in ("dp", "tp", "pp"):
            host, loss, calls = reductions[name]
            assert calls == 1, (name, calls)
            assert host["checks"] == [1.0, 0.0, 2.0, 0.0] and host["exit"] == [0.0, 1.0]
            if name == "dp":  # both ranks are replicas: both contribute
                assert host["tokens"] == [21.0] and loss == exact
            else:  # one replica: tp rank 0, or the last pipeline stage, contributes
                contributor = 0 if name == "tp" else 1
                assert host["tokens"] == [10.0 + contributor], (name, host)
                want = [1.0 + 2**-23, 2**-24 + 2**-47][contributor]
                assert loss == torch.tensor(want).item(), (name, loss)
        host, loss, device = reductions["losses_only"]
        assert host == {} and loss == exact and device == "cpu"
        # The grads' bucket and the agreement; the checks and exits cost no collective.
        assert per_iteration == [2, 2, 2], per_iteration
        assert unchecked_calls == [2, 2, 2], unchecked_calls
        assert len(losses) == 4 and losses[-1] < losses[0]
        assert losses == results[0][1][1]  # every rank logs the same losses
    assert results[0][2][1] == results[1][2][1]
