"""Pipeline stages that hold no MoE layer (`--moe-layer-freq [1,1,0,0]`, DeepSeek's dense
first layers `[0,0,1,1]`) train with the single-process trajectory and never hang.

A collective whose issue depends on what a rank holds (expert grads in the grad norm, the
zeros count, the params norm, weight-hash checks, result checks, MoE loss logging,
checkpoint agreement) hangs the job when the stages disagree on the number of calls. The
walk below records, on every rank, each collective our code issues with the group's global
ranks, and asserts that every member of every group issued the same sequence on it: the
condition whose violation is a hang.
"""
import pytest

from megatron_smp.testing import run_distributed
from tests.functional.test_moe_parity import MOE
from tests.functional.test_training_parity import COMMON, LLAMA

_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
                "broadcast", "all_to_all_single", "barrier")
FEATURES = ("--log-interval 1 --log-num-zeros-in-grad --log-params-norm "
            "--check-weight-hash-across-dp-replicas-interval 2 --train-iters 4 "
            # the aux-loss-free expert-bias update reduces token counts after each step
            "--moe-router-score-function sigmoid --moe-router-enable-expert-bias "
            "--moe-router-bias-update-rate 0.01").split()


def _argv(pattern):
    argv = COMMON + LLAMA + MOE + FEATURES + ["--moe-layer-freq", pattern]
    argv[argv.index("--num-layers") + 1] = "4"
    return argv


def _train_and_walk(rank, world_size, argv):
    """Per-iteration (lm loss, grad norm, num zeros, params norm) and this rank's
    collectives [(op, group's global ranks)] in issue order."""
    import torch.distributed as dist

    import pretrain_gpt
    from megatron_smp.training import logging as training_logging
    from megatron_smp.training import pretrain

    walk = []

    def recording(name, original):
        def call(*args, **kwargs):
            group = kwargs.get("group")
            if group is None:  # positional group: all_reduce(t, op, group), broadcast(t, src, group)
                group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
            ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(
                range(dist.get_world_size()))
            walk.append((name, ranks))
            return original(*args, **kwargs)
        return call

    for name in _COLLECTIVES:
        setattr(dist, name, recording(name, getattr(dist, name)))
    scalars = {}
    original_scalars = training_logging.TrainingLogger.iteration_scalars

    def record_scalars(self, iteration, lr, batch, losses, loss_scale, grad_norm, zeros,
                       params_norm, *args, **kwargs):
        # The loop hands device tensors over (read here, the test's own host sync).
        scalars[iteration] = (float(losses["lm loss"]), grad_norm, zeros, params_norm)
        return original_scalars(self, iteration, lr, batch, losses, loss_scale, grad_norm,
                                zeros, params_norm, *args, **kwargs)

    training_logging.TrainingLogger.iteration_scalars = record_scalars
    pretrain(pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.model_provider,
             pretrain_gpt.forward_step, argv=argv)
    return [scalars[i] for i in sorted(scalars)], walk


def _assert_groups_agree(walks):
    """Every member of every group issued the same sequence of collectives on it."""
    per_group = {}
    for rank, walk in enumerate(walks):
        for op, ranks in walk:
            per_group.setdefault(ranks, {}).setdefault(rank, []).append(op)
    assert per_group
    for ranks, by_rank in per_group.items():
        if len(ranks) == 1:
            continue
        sequences = [by_rank.get(member, []) for member in ranks]
        for member, sequence in zip(ranks, sequences):
            assert sequence == sequences[0], (
                f"group {ranks}: rank {member} issued {len(sequence)} collectives "
                f"{sequence[:6]}..., rank {ranks[0]} {len(sequences[0])}")


_BASELINES = {}


def _baseline(pattern):
    if pattern not in _BASELINES:
        _BASELINES[pattern] = run_distributed(_train_and_walk, 1, args=(_argv(pattern),),
                                              timeout=300)[0][0]
    return _BASELINES[pattern]


CASES = {
    # stage 1 holds no MoE layer
    "moe_first_pp2": (2, "[1,1,0,0]", "--pipeline-model-parallel-size 2"),
    # DeepSeek-style dense first layers: stage 0 holds none; EP=2 and sharded optimizer, with
    # the checkpoint's and the exit signal's agreements walked too
    "dense_first_pp2_ep2_distopt": (4, "[0,0,1,1]", "--pipeline-model-parallel-size 2 "
                                    "--expert-model-parallel-size 2 --use-distributed-optimizer "
                                    "--exit-signal-handler --save-interval 2 --save {save}"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_stage_without_moe_layers_trains_like_one_process(case, tmp_path):
    world_size, pattern, flags = CASES[case]
    flags = flags.format(save=tmp_path / "checkpoints")
    reference = _baseline(pattern)
    results = run_distributed(_train_and_walk, world_size, args=(_argv(pattern) + flags.split(),),
                              timeout=300, collective_timeout=60)
    _assert_groups_agree([walk for _, walk in results])
    assert len(reference) == 4 and reference[-1][0] < reference[0][0]
    for rank, (scalars, _) in enumerate(results):
        for step, (got, want) in enumerate(zip(scalars, reference)):
            loss, grad_norm, zeros, params_norm = got
            assert loss == pytest.approx(want[0], rel=1e-5), (rank, step)
            assert grad_norm == pytest.approx(want[1], rel=1e-4), (rank, step)
            assert zeros == want[2], (rank, step)
            assert params_norm == pytest.approx(want[3], rel=1e-5), (rank, step)
    if "--save" in flags:
        assert (tmp_path / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == "4"


def test_walk_catches_a_collective_only_some_ranks_issue():
    """The check itself: one rank issuing an extra all-reduce on a shared group fails it."""
    agreeing = [[("all_reduce", (0, 1))], [("all_reduce", (0, 1))]]
    _assert_groups_agree(agreeing)
    with pytest.raises(AssertionError, match="group \\(0, 1\\)"):
        _assert_groups_agree([agreeing[0] + [("all_reduce", (0, 1))], agreeing[1]])
