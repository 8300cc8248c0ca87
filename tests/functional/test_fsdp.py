"""pretrain with --use-torch-fsdp2: the single-process trajectory, checkpoints that resume under
DDP + the distributed optimizer at TP=2 (and the reverse), the HF export of an FSDP2
checkpoint, and MoE models (experts sharded over the expert-data-parallel ranks)."""
import contextlib
import io
import warnings

import pytest
import torch

from megatron_smp.testing import run_distributed
from tests.functional.test_checkpoint_resume import PROBE_SEED, _probe, _train
from tests.functional.test_moe_parity import MOE
from tests.functional.test_training_parity import COMMON, LLAMA, baseline

warnings.filterwarnings("ignore", message=".*")
FSDP2 = ["--use-torch-fsdp2"]
TP2_DISTOPT = "--tensor-model-parallel-size 2 --use-distributed-optimizer".split()


def _losses(result, iterations):
    return [result["losses"][i] for i in iterations]


@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_pretrain_fsdp2_matches_single_process(model):
    reference = baseline(model)
    argv = COMMON + (LLAMA if model == "llama" else []) + FSDP2
    results = run_distributed(_train, 2, args=(argv,), timeout=300)
    for result in results:
        assert _losses(result, range(1, 11)) == pytest.approx(reference, rel=1e-4)


def test_fsdp2_checkpoint_resumes_under_ddp_tp2_and_back_and_converts(tmp_path):
    import transformers

    from tests.unit.tools.test_convert import _convert_ok

    reference = baseline("llama")
    argv = COMMON + LLAMA
    first_half = ["--save-interval", "5", "--exit-interval", "5"]
    fsdp_dir, ddp_dir = str(tmp_path / "fsdp"), str(tmp_path / "ddp")

    saved = run_distributed(_train, 2, args=(argv + FSDP2 + first_half + ["--save", fsdp_dir],),
                            kwargs={"probe": True}, timeout=300)
    assert _losses(saved[0], range(1, 6)) == pytest.approx(reference[:5], rel=1e-4)
    resumed = run_distributed(_train, 2, args=(argv + TP2_DISTOPT + ["--load", fsdp_dir],),
                              timeout=300)
    assert _losses(resumed[0], range(6, 11)) == pytest.approx(reference[5:], rel=1e-4)

    run_distributed(_train, 2, args=(argv + TP2_DISTOPT + first_half + ["--save", ddp_dir],),
                    timeout=300)
    back = run_distributed(_train, 2, args=(argv + FSDP2 + ["--load", ddp_dir],), timeout=300)
    for result in back:
        assert _losses(result, range(6, 11)) == pytest.approx(reference[5:], rel=1e-4)

    # The FSDP2 checkpoint as a Hugging Face directory gives the logits the run had.
    _convert_ok("llama", "megatron_smp", "hf", fsdp_dir, tmp_path / "hf")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    expected = _probe(saved, ("save", 5))
    tokens = torch.randint(0, expected.shape[-1], tuple(expected.shape[:2]),
                           generator=torch.Generator().manual_seed(PROBE_SEED))
    with torch.no_grad(), contextlib.redirect_stdout(io.StringIO()):
        logits = hf_model(tokens).logits
    assert (logits - expected).abs().max().item() < 1e-4


# --clip-grad 0.5: every step is clipped (grad norms ~0.9), dense and expert shards alike.
MOE_ARGV = COMMON + LLAMA + MOE + ("--moe-token-dispatcher-type alltoall --log-interval 1 "
                                   "--train-iters 4 --clip-grad 0.5").split()


def _moe_train(rank, world_size, runs):
    """For each argv of `runs`, in turn in these processes: per-iteration (lm loss, grad norm,
    load_balancing_loss, z_loss) of pretrain_gpt.py."""
    import pretrain_gpt
    from megatron_smp.training import logging as training_logging
    from megatron_smp.training import pretrain

    norms = {}
    original = training_logging.TrainingLogger.iteration_scalars

    def record(self, iteration, lr, batch, losses, loss_scale, grad_norm, *args, **kwargs):
        norms[iteration] = grad_norm
        return original(self, iteration, lr, batch, losses, loss_scale, grad_norm, *args,
                        **kwargs)

    training_logging.TrainingLogger.iteration_scalars = record
    out = []
    for argv in runs:
        with contextlib.redirect_stdout(io.StringIO()):
            result = pretrain(pretrain_gpt.train_valid_test_datasets_provider,
                              pretrain_gpt.model_provider, pretrain_gpt.forward_step, argv=argv)
        losses = result.train_losses
        out.append({i: (losses[i]["lm loss"], norms[i], losses[i]["load_balancing_loss"],
                        losses[i]["z_loss"]) for i in sorted(losses)})
    return out


def _moe_runs_at_dp2(rank, world_size, save_dir, at_2):
    """The DP=2 runs in one spawn: EP=1, EP=2 saving, then EP=2 and EP=1 from its iteration 2."""
    from tests.functional.test_checkpoint_resume import _checkpoint_at

    ep2 = FSDP2 + ["--expert-model-parallel-size", "2"]
    out = _moe_train(rank, world_size, [
        MOE_ARGV + FSDP2, MOE_ARGV + ep2 + ["--save", save_dir, "--save-interval", "2"]])
    if rank == 0:
        _checkpoint_at(save_dir, 2, at_2)
    torch.distributed.barrier()  # the copy is there before either rank loads it
    return out + _moe_train(rank, world_size, [MOE_ARGV + ep2 + ["--load", at_2],
                                               MOE_ARGV + FSDP2 + ["--load", at_2]])


def test_fsdp2_moe_matches_single_process_and_resumes_exactly(tmp_path):
    """4 experts, top-2, alltoall: FSDP2 at DP=2 with EP=1 and EP=2 and at DP=4 with EP=2 (two
    ranks per expert shard group; with hybrid_shard_degree 2 one, replicated) give the
    single-process losses, grad norms (clipped on both meshes) and router losses; the EP=2
    run resumes bit-exactly from its iteration-2 checkpoint, which also loads at DP=2 with
    EP=1 (experts resharded over both ranks)."""
    reference = run_distributed(_moe_train, 1, args=([MOE_ARGV],), timeout=300)[0][0]
    assert len(reference) == 4
    ep2 = FSDP2 + ["--expert-model-parallel-size", "2"]
    save_dir, at_2 = str(tmp_path / "save"), str(tmp_path / "at_2")

    dp2 = run_distributed(_moe_runs_at_dp2, 2, args=(save_dir, at_2), timeout=300)
    # DP=4 x EP=2: expert shard groups of 2 ranks (a sum divided by 4); with
    # hybrid_shard_degree 2, one rank each, replicated over 2.
    hybrid = ["--smp-config", '{"hybrid_shard_degree": 2}']
    dp4 = run_distributed(_moe_train, 4, args=([MOE_ARGV + ep2, MOE_ARGV + ep2 + hybrid],),
                          timeout=300)
    runs = {"dp2": [r[0] for r in dp2], "dp2_ep2": [r[1] for r in dp2],
            "dp4_ep2": [r[0] for r in dp4], "dp4_ep2_hsdp2": [r[1] for r in dp4]}
    for layout, results in runs.items():
        for result in results:
            for iteration, want in reference.items():
                assert result[iteration] == pytest.approx(want, rel=1e-4), (layout, iteration)
    for _, uninterrupted, resumed, resharded in dp2:
        assert resumed == {i: uninterrupted[i] for i in (3, 4)}
        for iteration in (3, 4):
            assert resharded[iteration] == pytest.approx(reference[iteration], rel=1e-4)


def _runs(rank, world_size, argvs):
    return [_train(rank, world_size, argv) for argv in argvs]


def test_fsdp2_fp16_scales_the_loss_like_ddp():
    """--use-torch-fsdp2 --fp16: the layers compute in fp16 on the fp32 shards and the
    dynamic loss scaler unscales the grad shards (any rank's overflow skips the step on all):
    the same skipped steps, loss scales and losses as DDP's fp16 run at DP=2 (scale 2^20, then
    2^19 and 2^18 after two overflows)."""
    six_iterations = [a if a != "10" else "6" for a in COMMON]  # --train-iters 6
    # 2^20 overflows the fp16 grads: the first steps are skipped, halving it, then it trains.
    fp16 = six_iterations + ["--fp16", "--initial-loss-scale", str(2 ** 20), "--hysteresis",
                             "1", "--log-interval", "1"]
    ddp, fsdp = run_distributed(_runs, 2, args=([fp16, fp16 + FSDP2],), timeout=300)[0]
    scales = [[line.split("loss scale:")[1].split("|")[0].strip() for line in run["log_lines"]
               if "loss scale:" in line] for run in (ddp, fsdp)]
    assert scales[0] == scales[1] and len(set(scales[0])) > 1, scales  # backed off, same steps
    assert sorted(fsdp["losses"]) == sorted(ddp["losses"])
    assert fsdp["losses"][6] < fsdp["losses"][1] - 0.03  # the steps after the skips train
    for iteration, want in ddp["losses"].items():  # measured: 1.2e-6 apart at most
        assert fsdp["losses"][iteration] == pytest.approx(want, rel=1e-4), iteration
