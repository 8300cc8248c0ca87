"""Whole runs that save and resume: exact resume, resharding across layouts, clear errors.

One 8-process run (TP=2 x PP=2 x DP=2, distributed optimizer, async saves) trains 15 of 20
iterations and saves at 10 and 15; the other runs load its iteration-10 checkpoint.
"""
import contextlib
import io
import os
import shutil
import time

import pytest
import torch

from megatron_smp.testing import run_distributed
from tests.functional.test_training_parity import COMMON

TRAIN = COMMON + ["--train-iters", "20", "--exit-interval", "15"]
TP2_PP2_DP2 = ("--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 "
               "--use-distributed-optimizer").split()
PROBE_SEED = 11


def _logits(run):
    """Full logits [b, s, vocab] of a fixed batch through all stages (None off the last)."""
    from megatron_smp.models.gpt import gather_full_logits
    from megatron_smp.pipeline_parallel.schedules import get_forward_backward_func, schedule_name

    state, training = run.state, run.configs.training
    shape = (training.micro_batch_size, training.seq_length)
    generator = torch.Generator().manual_seed(PROBE_SEED)
    tokens = torch.randint(0, run.configs.model.vocab_size, shape, generator=generator)
    captured = []

    def forward_step(data_iterator, model):
        output = model(tokens.to(state.device))

        def loss_func(logits):
            captured.append(gather_full_logits(logits, state, run.configs.model.vocab_size))
            return logits.sum() * 0.0, {}

        return output, loss_func

    forward = get_forward_backward_func(
        state.pp_size, schedule_name(training.pipeline_schedule, len(run.model)))
    for chunk in run.model:
        chunk.eval()
    forward(forward_step_func=forward_step, data_iterator=None, model=run.model,
            num_microbatches=1, seq_length=training.seq_length,
            micro_batch_size=training.micro_batch_size, forward_only=True)
    for chunk in run.model:
        chunk.train()
    # numpy pickles by value (a tensor would travel by a file descriptor of the exiting child)
    return captured[0].float().cpu().numpy() if captured else None


def _train(rank, world_size, argv, probe=False):
    """Run pretrain; returns losses by iteration, logits probed after each save / load (with
    `probe`) by iteration, and the save / load times."""
    from megatron_smp.checkpointing import loop as checkpointing
    from megatron_smp.training import pretrain
    from pretrain_gpt import forward_step, model_provider, train_valid_test_datasets_provider

    out = {"logits": {}, "save_s": [], "load_s": []}

    def timed(name, fn):
        def wrapper(run, *args):
            start = time.perf_counter()
            fn(run, *args)
            out[f"{name}_s"].append(time.perf_counter() - start)
            if probe:
                out["logits"][(name, run.iteration)] = _logits(run)
        return wrapper

    original = checkpointing.save, checkpointing.load
    checkpointing.save = timed("save", checkpointing.save)
    checkpointing.load = timed("load", checkpointing.load)
    stdout = io.StringIO()
    try:
        with contextlib.redirect_stdout(stdout):
            result = pretrain(train_valid_test_datasets_provider, model_provider, forward_step,
                              argv=argv)
    finally:
        checkpointing.save, checkpointing.load = original
    out["stdout"] = stdout.getvalue()
    out["losses"] = {i: v["lm loss"] for i, v in result.train_losses.items()}
    out["log_lines"] = result.log_lines
    return out


def _checkpoint_at(save_dir, iteration, target):
    """A --load directory whose tracker names `iteration` of `save_dir`."""
    name = f"iter_{iteration:07d}"
    os.makedirs(target, exist_ok=True)
    shutil.copytree(os.path.join(save_dir, name), os.path.join(target, name))
    with open(os.path.join(target, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(f"{iteration}\n")
    return str(target)


def _probe(results, key):
    found = [r["logits"][key] for r in results if r["logits"].get(key) is not None]
    assert found, key
    return torch.from_numpy(found[0])


TIMINGS = {}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The TP=2 x PP=2 x DP=2 run: 15 iterations, async saves at 10 and 15."""
    root = tmp_path_factory.mktemp("ckpt")
    save_dir = str(root / "tp2pp2dp2")
    argv = TRAIN + TP2_PP2_DP2 + ["--save", save_dir, "--save-interval", "10", "--async-save"]
    results = run_distributed(_train, 8, args=(argv,), kwargs={"probe": True}, timeout=300)
    TIMINGS["save tp2pp2dp2 (async, blocked)"] = max(max(r["save_s"]) for r in results)
    return {
        "losses": results[0]["losses"],
        "logits10": _probe(results, ("save", 10)),
        "load10": _checkpoint_at(save_dir, 10, root / "load10"),
        "save_dir": save_dir,
    }


def test_async_saves_published(saved):
    with open(os.path.join(saved["save_dir"], "latest_checkpointed_iteration.txt")) as f:
        assert f.read().strip() == "15"
    assert sorted(os.listdir(saved["save_dir"])) == [
        "iter_0000010", "iter_0000015", "latest_checkpointed_iteration.txt"]
    assert sorted(saved["losses"]) == list(range(1, 16))


def test_resume_is_exact_tp2_pp2_dp2(saved):
    argv = TRAIN + TP2_PP2_DP2 + ["--load", saved["load10"]]
    results = run_distributed(_train, 8, args=(argv,), timeout=300)
    TIMINGS["load tp2pp2dp2 -> tp2pp2dp2"] = max(r["load_s"][0] for r in results)
    for result in results:
        assert sorted(result["losses"]) == list(range(11, 16))
        for iteration, loss in result["losses"].items():
            assert loss == saved["losses"][iteration], (iteration, loss)


RESHARD = {
    "tp1_pp1_dp4_distopt": (4, "--use-distributed-optimizer"),
    "tp4_pp1_dp1": (4, "--tensor-model-parallel-size 4"),
    "tp4_pp1_dp2_distopt": (8, "--tensor-model-parallel-size 4 --use-distributed-optimizer"),
}


@pytest.mark.parametrize("layout", list(RESHARD))
def test_reshard_keeps_logits_and_losses(saved, layout):
    world_size, flags = RESHARD[layout]
    argv = TRAIN + flags.split() + ["--load", saved["load10"]]
    results = run_distributed(_train, world_size, args=(argv,), kwargs={"probe": True},
                              timeout=300)
    TIMINGS[f"load tp2pp2dp2 -> {layout}"] = max(r["load_s"][0] for r in results)
    logits = _probe(results, ("load", 10))
    difference = (logits - saved["logits10"]).abs().max().item()
    TIMINGS[f"logits max diff {layout}"] = difference
    assert logits.shape == saved["logits10"].shape and logits.shape[:2] == (2, 32)
    assert difference < 1e-5, difference
    expected = [saved["losses"][i] for i in range(11, 16)]
    for result in results:
        assert sorted(result["losses"]) == list(range(11, 16))
        losses = [result["losses"][i] for i in range(11, 16)]
        TIMINGS[f"loss max rel diff {layout}"] = max(
            abs(a - b) / abs(b) for a, b in zip(losses, expected))
        assert losses == pytest.approx(expected, rel=1e-4)


def _model_only_checkpoint_then_load(rank, world_size, source, target, argv):
    """Write `source`'s model, as full tensors, the way a converter does (no optimizer, no
    progress, no RNG); then load it without and with --finetune."""
    from megatron_smp.checkpointing import CheckpointError, save_checkpoint
    from megatron_smp.config import ParallelConfig
    from megatron_smp.checkpointing import engine as dcp
    from megatron_smp.parallel_state import build_parallel_state

    metadata = dcp.read_checkpoint_metadata(source)
    model = {key[len("model."):]: torch.zeros(tuple(md.size), dtype=md.properties.dtype)
             for key, md in metadata.state_dict_metadata.items() if key.startswith("model.")}
    dcp.load({"model": model}, checkpoint_id=source)
    save_checkpoint(0, {"model": model}, target, build_parallel_state(ParallelConfig()),
                    save_rng=False)
    try:
        _train(rank, world_size, argv + ["--load", target])
        message = None
    except CheckpointError as error:
        message = str(error)
    finetuned = _train(rank, world_size, argv + ["--load", target, "--finetune"], probe=True)
    return message, finetuned


def test_model_only_checkpoint_needs_no_load_optim_or_finetune(saved, tmp_path):
    argv = COMMON + ["--train-iters", "2"]
    message, finetuned = run_distributed(
        _model_only_checkpoint_then_load, 1,
        args=(os.path.join(saved["load10"], "iter_0000010"), str(tmp_path / "hf"), argv))[0]
    assert message is not None and "holds no optimizer state" in message
    assert "--no-load-optim" in message and "--finetune" in message
    logits = torch.from_numpy(finetuned["logits"][("load", 0)])
    assert (logits - saved["logits10"]).abs().max().item() < 1e-5
    assert sorted(finetuned["losses"]) == [1, 2]  # --finetune restarts at iteration 0


def test_mismatched_model_is_a_clear_error_on_every_rank(saved):
    argv = TRAIN + ["--ffn-hidden-size", "128", "--load", saved["load10"]]
    errors = run_distributed(_train, 2, args=(argv,), allow_errors=True, timeout=120)
    for error in errors:
        assert "CheckpointError" in error, error[-2000:]
        assert ("model.decoder.layers.0.mlp.linear_fc1.weight: checkpoint shape [256, 64] vs "
                "model shape [128, 64]") in error, error[-2000:]


def test_dp2_distributed_optimizer_torch_format_resume(tmp_path):
    """Also: an --async-save whose (slowed) copy to CPU memory runs in the background during
    the next forward and backward, with --overlap-param-gather, holds exactly the state of
    its iteration -- train_step waits for the copy before optimizer.step()."""
    from megatron_smp.checkpointing.engine.storage import TEST_STAGING_DELAY_ENV

    save_dir = str(tmp_path / "dp2")
    short = COMMON + ["--train-iters", "6", "--use-distributed-optimizer",
                      "--overlap-param-gather", "--ckpt-format", "torch"]
    straight = run_distributed(
        _train, 2, args=(short + ["--save", save_dir, "--save-interval", "3", "--async-save"],),
        env={TEST_STAGING_DELAY_ENV: "0.01"})  # seconds per tensor copied
    load_dir = _checkpoint_at(save_dir, 3, tmp_path / "load3")
    resumed = run_distributed(_train, 2, args=(short + ["--load", load_dir],))
    TIMINGS["save dp2 torch format"] = max(max(r["save_s"]) for r in straight)
    TIMINGS["load dp2 torch format"] = max(r["load_s"][0] for r in resumed)
    for result in resumed:
        assert result["losses"] == {i: straight[0]["losses"][i] for i in (4, 5, 6)}
    # A "torch" checkpoint does not reshard: another layout is an error naming both.
    errors = run_distributed(_train, 1, args=(short + ["--load", load_dir],),
                             allow_errors=True)
    assert "'torch' format" in errors[0] and "'world_size': 2" in errors[0], errors[0][-2000:]


FP16 = COMMON + ["--train-iters", "6", "--fp16", "--initial-loss-scale", "4096",
                 "--loss-scale-window", "2"]


def test_fp16_resume_restores_main_params_and_loss_scale(tmp_path):
    """Float16 optimizer (fp32 main params) and a growing dynamic loss scale, at DP=2;
    the same checkpoint also loads into the distributed optimizer."""
    save_dir = str(tmp_path / "fp16")
    straight = run_distributed(
        _train, 2, args=(FP16 + ["--save", save_dir, "--save-interval", "3"],))
    load_dir = _checkpoint_at(save_dir, 3, tmp_path / "load3")
    resumed = run_distributed(_train, 2, args=(FP16 + ["--load", load_dir],))
    TIMINGS["save dp2 fp16 torch_dist (sync)"] = max(max(r["save_s"]) for r in straight)
    TIMINGS["load dp2 fp16 torch_dist"] = max(r["load_s"][0] for r in resumed)
    expected = {i: straight[0]["losses"][i] for i in (4, 5, 6)}
    for result in resumed:
        assert result["losses"] == expected
    scale = [line.split("loss scale:")[1].split("|")[0] for line in straight[0]["log_lines"]
             if "loss scale:" in line]  # not the evaluation lines
    resumed_scale = [line.split("loss scale:")[1].split("|")[0]
                     for line in resumed[0]["log_lines"] if "loss scale:" in line]
    assert scale[-1] == resumed_scale[-1] and float(scale[-1]) > 4096
    distributed = run_distributed(
        _train, 2, args=(FP16 + ["--load", load_dir, "--use-distributed-optimizer"],))
    for result in distributed:
        assert [result["losses"][i] for i in (4, 5, 6)] == pytest.approx(
            [expected[i] for i in (4, 5, 6)], rel=1e-4)


def test_missing_load_dir_starts_from_scratch(tmp_path):
    argv = COMMON + ["--train-iters", "2", "--load", str(tmp_path / "nowhere")]
    result = run_distributed(_train, 1, args=(argv,))[0]
    assert sorted(result["losses"]) == [1, 2]
    assert "does not exist; training starts from scratch" in result["stdout"]


def test_report_timings():
    """The figures the tests above measured (printed for the closing note): every save and load
    finished in seconds, and resharded logits stayed at fp32 rounding."""
    if not TIMINGS:
        pytest.skip("run with the checkpoint tests above: they measure the figures")
    print("\ncheckpoint timings / figures:", TIMINGS)
    for name, value in TIMINGS.items():
        if name.startswith(("save", "load")):
            assert 0.0 < value < 60.0, (name, value)
        elif name.startswith("logits max diff"):
            assert value < 1e-4, (name, value)


@pytest.mark.parametrize("dim,stride,row_limit", [(0, 2, None), (1, 1, None), (0, 1, 13)])
def test_flat_ranges_tile_the_global_tensor(dim, stride, row_limit):
    """Distributed-optimizer ranges of TP shards (strided fused weights, trimmed vocab rows)
    land exactly on the TP=1 tensor."""
    from megatron_smp.checkpointing.sharded_state import ParamLayout, describe
    from megatron_smp.models.sharding import split_tensor

    tp_size, full = 2, torch.arange(16 * 6, dtype=torch.float32).view(16, 6)
    global_shape = (row_limit or 16, 6)
    rebuilt = torch.full(global_shape, -1.0)
    for tp_rank in range(tp_size):
        local = split_tensor(full, dim, stride, tp_size, tp_rank)
        layout = ParamLayout("w", local.shape, global_shape, dim, stride, tp_rank, tp_size,
                             row_limit, tied_copy=False)
        flat = local.reshape(-1)
        for start, end in ((0, 7), (7, 30), (30, flat.numel())):  # uneven "DP" ranges
            view = describe(layout, flat[start:end], start)
            for offsets, chunk in view.chunks if view is not None else []:
                index = tuple(slice(o, o + n) for o, n in zip(offsets, chunk.shape))
                assert (rebuilt[index] == -1).all()  # every element written once
                rebuilt[index] = chunk
    assert torch.equal(rebuilt, full[: global_shape[0]])
