"""MoE training runs: every expert-parallel layout follows the single-process trajectory
(fp32, dropless, 4 experts, top-2, with the load-balancing and z losses in backward)."""
import pytest

from megatron_smp.testing import run_distributed
from tests.functional.test_training_parity import COMMON, LLAMA

MOE = (
    "--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 48 --moe-aux-loss-coeff 0.01 "
    "--moe-z-loss-coeff 0.001"
).split()
DISPATCHERS = ("allgather", "alltoall")


def _train(rank, world_size, argv):
    """Per-iteration (lm loss, load_balancing_loss, z_loss) of pretrain_gpt.py."""
    import pretrain_gpt
    from megatron_smp.training import pretrain

    result = pretrain(pretrain_gpt.train_valid_test_datasets_provider,
                      pretrain_gpt.model_provider, pretrain_gpt.forward_step, argv=argv)
    keys = ("lm loss", "load_balancing_loss", "z_loss")
    return [[result.train_losses[i][k] for k in keys] for i in sorted(result.train_losses)]


_BASELINES = {}


def baseline(dispatcher):
    if dispatcher not in _BASELINES:
        argv = COMMON + LLAMA + MOE + ["--moe-token-dispatcher-type", dispatcher]
        _BASELINES[dispatcher] = run_distributed(_train, 1, args=(argv,), timeout=300)[0]
    return _BASELINES[dispatcher]


LAYOUTS = {
    "ep2": (2, "--expert-model-parallel-size 2"),
    "ep4": (4, "--expert-model-parallel-size 4"),
    "ep2_tp2_sp": (4, "--expert-model-parallel-size 2 --tensor-model-parallel-size 2 "
                      "--sequence-parallel"),
    "ep2_pp2": (4, "--expert-model-parallel-size 2 --pipeline-model-parallel-size 2"),
    "ep2_dp2_distopt": (4, "--expert-model-parallel-size 2 --use-distributed-optimizer"),
}


@pytest.mark.parametrize("dispatcher", DISPATCHERS)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_expert_parallel_layout_matches_single_process(layout, dispatcher):
    world_size, flags = LAYOUTS[layout]
    reference = baseline(dispatcher)
    argv = COMMON + LLAMA + MOE + ["--moe-token-dispatcher-type", dispatcher] + flags.split()
    results = run_distributed(_train, world_size, args=(argv,), timeout=300)
    assert len(reference) == 10 and reference[-1][0] < reference[0][0]
    for per_rank in results:
        for step, (got, want) in enumerate(zip(per_rank, reference)):
            assert got == pytest.approx(want, rel=1e-4), (layout, step, got, want)


def test_expert_parallel_with_virtual_pipeline_stages():
    """EP=2 x PP=2 with two virtual stages per rank (4 layers), alltoall dispatch."""
    argv = COMMON + LLAMA + MOE + ["--moe-token-dispatcher-type", "alltoall"]
    argv[argv.index("--num-layers") + 1] = "4"
    reference = run_distributed(_train, 1, args=(argv,), timeout=300)[0]
    flags = ("--expert-model-parallel-size 2 --pipeline-model-parallel-size 2 "
             "--num-layers-per-virtual-pipeline-stage 1").split()
    for per_rank in run_distributed(_train, 4, args=(argv + flags,), timeout=300):
        for step, (got, want) in enumerate(zip(per_rank, reference)):
            assert got == pytest.approx(want, rel=1e-4), (step, got, want)


def _train_each(rank, world_size, argvs):
    return [_train(rank, world_size, argv) for argv in argvs]


@pytest.mark.parametrize("world_size,flags", [
    (2, "--expert-model-parallel-size 2"),
    (4, "--expert-model-parallel-size 2 --tensor-model-parallel-size 2 --sequence-parallel"),
])
def test_flex_dispatcher_routes_and_trains_as_alltoall(world_size, flags):
    """--moe-token-dispatcher-type flex (one all-to-all over the TP x EP group), with each
    backend name (a kernel choice): at EP=2 the same routing and losses as alltoall bit for
    bit (the same exchange); at TP=2 x EP=2 the experts get the same rows and only the sums
    over TP and over a token's experts swap order."""
    base = COMMON + LLAMA + MOE + flags.split()
    backends = ("deepep", "hybridep") if world_size == 2 else ("hybridep",)
    argvs = [base + ["--moe-token-dispatcher-type", "alltoall"]] + [
        base + ["--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend", name]
        for name in backends]
    for alltoall, *flex_runs in run_distributed(_train_each, world_size, args=(argvs,),
                                                timeout=300):
        assert len(alltoall) == 10 and alltoall[-1][0] < alltoall[0][0]
        for flex in flex_runs:
            if world_size == 2:
                assert flex == alltoall
            else:
                for got, want in zip(flex, alltoall):
                    assert got == pytest.approx(want, rel=1e-6)


def test_experts_on_fewer_tensor_parallel_ranks_match_single_process(tmp_path):
    """--expert-tensor-parallel-size 1 below --tensor-model-parallel-size 2 (Megatron's expert
    grid: the 4 ranks split etp x ep x expert-dp, each expert whole on one rank) follows the
    single-process trajectory with each dispatcher: EP=4 over all ranks (alltoall), EP=2 with
    two expert-data-parallel replicas and the distributed optimizer (allgather). The
    allgather run saves at iteration 5 and stops, and an ETP = TP = 2 run resumes from it: the
    experts' slices land where they belong whichever layout wrote them."""
    tp = "--tensor-model-parallel-size 2 --sequence-parallel".split()
    etp1 = ["--expert-tensor-parallel-size", "1"]
    save = ["--save", str(tmp_path / "ckpt"), "--save-interval", "5", "--exit-interval", "5"]
    argvs = [
        COMMON + LLAMA + MOE + tp + etp1 + ["--expert-model-parallel-size", "4",
                                            "--moe-token-dispatcher-type", "alltoall"],
        COMMON + LLAMA + MOE + tp + etp1 + ["--expert-model-parallel-size", "2",
                                            "--use-distributed-optimizer",
                                            "--moe-token-dispatcher-type", "allgather"] + save,
        COMMON + LLAMA + MOE + tp + ["--expert-model-parallel-size", "2",
                                     "--use-distributed-optimizer",
                                     "--moe-token-dispatcher-type", "alltoall",
                                     "--load", str(tmp_path / "ckpt")],
    ]
    reference = {name: baseline(name) for name in DISPATCHERS}
    for alltoall, allgather, resumed in run_distributed(_train_each, 4, args=(argvs,),
                                                        timeout=300):
        for got_run, want_run in ((alltoall, reference["alltoall"]),
                                  (allgather, reference["allgather"][:5]),
                                  (resumed, reference["allgather"][5:])):
            assert len(got_run) == len(want_run)
            for step, (got, want) in enumerate(zip(got_run, want_run)):
                assert got == pytest.approx(want, rel=1e-4), (step, got, want)


def test_two_distributed_optimizer_instances_match_single_process(tmp_path):
    """--num-distributed-optimizer-instances 2 at DP=4 with EP=2 (Megatron's partial
    distributed optimizer): dense params sharded over 2 ranks and all-reduced across the 2
    instances, experts (expert-DP 2) sharded over 1 and all-reduced across 2; with overlapped
    grad reduction and param gather the losses are the single-process ones, and a save at
    iteration 5 resumes to them."""
    ckpt = str(tmp_path / "ckpt")
    flags = (COMMON + LLAMA + MOE
             + "--moe-token-dispatcher-type alltoall --expert-model-parallel-size 2 "
               "--use-distributed-optimizer --num-distributed-optimizer-instances 2 "
               "--overlap-grad-reduce --overlap-param-gather".split())
    argvs = [flags + ["--save", ckpt, "--save-interval", "5", "--exit-interval", "5"],
             flags + ["--load", ckpt]]
    reference = baseline("alltoall")
    for first, resumed in run_distributed(_train_each, 4, args=(argvs,), timeout=300):
        for got_run, want_run in ((first, reference[:5]), (resumed, reference[5:])):
            assert len(got_run) == len(want_run)
            for step, (got, want) in enumerate(zip(got_run, want_run)):
                assert got == pytest.approx(want, rel=1e-4), (step, got, want)
