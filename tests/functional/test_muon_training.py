"""Muon through the entry script: every layout follows the single-process trajectory (with
the TP-invariant --muon-tp-modes), blockwise does not, the layer-wise distributed optimizer
holds ~1/DP of the state per rank, and checkpoints resume exactly and reshard."""
import pytest

from megatron_smp.testing import run_distributed
from tests.functional.test_checkpoint_resume import _checkpoint_at
from tests.functional.test_training_parity import COMMON, LLAMA

# fp32 Newton-Schulz (--muon-fp32-matmul-prec high): layouts compared at 1e-4.
MUON = COMMON + LLAMA + "--optimizer muon --muon-fp32-matmul-prec high --lr 2e-3".split()
MOE = "--num-experts 4 --moe-router-topk 2".split()


def _train(rank, world_size, argv, numels=False):
    """Per-iteration lm loss, and the bytes of this rank's optimizer state after the run
    (`numels`: and the sizes of its params' state, one per param, sorted)."""
    import megatron_smp.optimizer as optimizer_module
    import pretrain_gpt
    from megatron_smp.training import pretrain

    built = []
    original = optimizer_module.get_megatron_optimizer

    def capture(*args, **kwargs):
        built.append(original(*args, **kwargs))
        return built[-1]

    optimizer_module.get_megatron_optimizer = capture
    try:
        result = pretrain(pretrain_gpt.train_valid_test_datasets_provider,
                          pretrain_gpt.model_provider, pretrain_gpt.forward_step, argv=argv)
    finally:
        optimizer_module.get_megatron_optimizer = original
    from megatron_smp.distributed.fsdp import local_tensor

    state_bytes = sum(local_tensor(tensor).numel() * tensor.element_size()
                      for state in built[0].optimizer.state.values()
                      for key, tensor in state.items() if key != "step")
    losses = {i: v["lm loss"] for i, v in result.train_losses.items()}
    if numels:
        return losses, state_bytes, sorted(
            min(local_tensor(tensor).numel() for key, tensor in state.items() if key != "step")
            for state in built[0].optimizer.state.values())
    return losses, state_bytes


_BASELINES = {}


def baseline(extra=()):
    key = tuple(extra)
    if key not in _BASELINES:
        _BASELINES[key] = run_distributed(_train, 1, args=(MUON + list(extra),))[0]
    return _BASELINES[key]


LAYOUTS = {
    "tp2_sp_duplicated": (2, "--tensor-model-parallel-size 2 --sequence-parallel", ()),
    "tp2_distributed": (2, "--tensor-model-parallel-size 2 --muon-tp-mode distributed", ()),
    "dp2_layer_wise": (2, "--use-distributed-optimizer --overlap-grad-reduce "
                          "--overlap-param-gather --ddp-bucket-size 20000", ()),
    "pp2": (2, "--pipeline-model-parallel-size 2", ()),
    "fsdp2": (2, "--use-torch-fsdp2", ()),
    "ep2_layer_wise": (2, "--expert-model-parallel-size 2 --use-distributed-optimizer", MOE),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_process(layout):
    world_size, flags, extra = LAYOUTS[layout]
    reference, _ = baseline(extra)
    results = run_distributed(_train, world_size, args=(MUON + list(extra) + flags.split(),),
                              timeout=300)
    expected = [reference[i] for i in sorted(reference)]
    assert len(expected) == 10 and expected[-1] < expected[0]
    for losses, _ in results:
        assert [losses[i] for i in sorted(losses)] == pytest.approx(expected, rel=1e-4), layout


def test_lion_distributed_optimizer_matches_single_process():
    """--optimizer lion: every param by Lion; with --use-distributed-optimizer byte-sharded."""
    lion = COMMON + LLAMA + "--optimizer lion --lr 2e-4 --lion-beta1 0.9".split()
    reference, whole = run_distributed(_train, 1, args=(lion,))[0]
    results = run_distributed(_train, 2, args=(lion + ["--use-distributed-optimizer"],),
                              timeout=300)
    muon_reference, _ = baseline()
    assert abs(reference[10] - muon_reference[10]) > 1e-3  # not Muon's trajectory
    for losses, state_bytes in results:
        assert losses == pytest.approx(reference, rel=1e-4)
        assert state_bytes == whole // 2


def test_blockwise_depends_on_the_layout():
    """--muon-tp-mode blockwise orthogonalises each TP shard alone: not the TP=1 run."""
    reference, _ = baseline()
    results = run_distributed(
        _train, 2, args=(MUON + "--tensor-model-parallel-size 2 --muon-tp-mode blockwise".split(),),
        timeout=300)
    losses = results[0][0]
    assert losses[1] == pytest.approx(reference[1], rel=1e-6)  # same model, no step yet
    assert max(abs(losses[i] - reference[i]) for i in range(2, 11)) > 1e-3


def test_layer_wise_state_is_split_over_dp():
    """Each of the DP=2 ranks holds the state of its whole matrices: ~1/2 of the total."""
    _, whole = baseline()
    results = run_distributed(_train, 2, args=(MUON + ["--use-distributed-optimizer"],),
                              timeout=300)
    per_rank = [state_bytes for _, state_bytes in results]
    assert sum(per_rank) == whole
    # Measured: 673024 bytes on each rank of 1346048 (Muon's matrices whole, balanced by
    # size; the scalar optimizer's params byte-sharded).
    assert max(per_rank) / (whole / 2) < 1.01, (per_rank, whole)


def test_resume_exact_and_reshard_tp2_dp2_to_tp1_dp4(tmp_path):
    tp2_dp2 = "--tensor-model-parallel-size 2 --use-distributed-optimizer".split()
    save_dir = str(tmp_path / "save")
    saved = run_distributed(_train, 4, args=(MUON + tp2_dp2 + [
        "--save", save_dir, "--save-interval", "5"],), timeout=300)[0][0]
    load = _checkpoint_at(save_dir, 5, tmp_path / "load")
    resumed = run_distributed(_train, 4, args=(MUON + tp2_dp2 + ["--load", load],),
                              timeout=300)
    for losses, _ in resumed:
        assert losses == {i: saved[i] for i in range(6, 11)}  # bit-exact
    resharded = run_distributed(
        _train, 4, args=(MUON + ["--use-distributed-optimizer", "--load", load],), timeout=300)
    for losses, _ in resharded:
        assert sorted(losses) == list(range(6, 11))
        assert [losses[i] for i in range(6, 11)] == pytest.approx(
            [saved[i] for i in range(6, 11)], rel=1e-4)


def test_no_use_layer_wise_param_layout_keeps_every_param_whole():
    """Megatron-LM main's --no-use-layer-wise-param-layout: the scalar optimizer's params
    (embeddings, norms) lie whole in one rank's shard like Muon's matrices, instead of
    byte-sharded. Per rank, every param's state is then a whole param's (together: exactly the
    single process's), which the default layout is not; the losses are the same."""
    argv = MUON + ["--use-distributed-optimizer"]
    whole_run = run_distributed(_train, 1, args=(argv[:-1], True))[0]
    default = run_distributed(_train, 2, args=(argv, True), timeout=300)
    legacy = run_distributed(_train, 2, args=(argv + ["--no-use-layer-wise-param-layout"],
                                               True), timeout=300)
    whole_numels = whole_run[2]
    assert sorted(legacy[0][2] + legacy[1][2]) == whole_numels
    assert sorted(default[0][2] + default[1][2]) != whole_numels
    assert sum(bytes_ for _, bytes_, _ in legacy) == whole_run[1]
    for (losses, _, _), (reference, _, _) in zip(legacy, default):
        assert losses == pytest.approx(reference, rel=1e-6)
