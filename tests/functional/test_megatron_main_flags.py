"""Flags from Megatron-LM's current example scripts, each changing what it says:
--init-model-with-meta-device (the same model, built on meta and materialised),
--no-ckpt-fully-parallel-save (replicated tensors written by the lowest rank) and
--disable-gloo-process-groups (no gloo group besides the default backend's),
--save-retain-interval (the checkpoints kept and deleted, with --async-save, on resume).
(--step-batch-size-schedule is tested in tests/unit/training/test_rampup.py.)"""
import os

import pytest
import torch

from megatron_smp.testing import run_distributed
from tests.functional.test_training_parity import COMMON

ARGV = [a if a != "10" else "3" for a in COMMON]  # --train-iters 3
DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]


def _runs(rank, world_size, runs):
    """For each (argv, record_groups) a pretrain_gpt run: the lm losses, the devices the
    model provider was asked to build on, and (record_groups) the backends requested of
    dist.new_group."""
    import torch.distributed as dist

    from megatron_smp.training import pretrain
    from pretrain_gpt import forward_step, model_provider, train_valid_test_datasets_provider

    out = []
    for argv, record_groups in runs:
        devices, backends = [], []

        def provider(configs, state, **stage):
            devices.append(str(stage.get("device")))
            return model_provider(configs, state, **stage)

        new_group = dist.new_group

        def recording_new_group(*args, **kwargs):
            backends.append(kwargs.get("backend", "default"))
            return new_group(*args, **kwargs)

        if record_groups:
            dist.new_group = recording_new_group
        try:
            result = pretrain(train_valid_test_datasets_provider, provider, forward_step,
                              argv=argv)
        finally:
            dist.new_group = new_group
        out.append({"losses": {i: v["lm loss"] for i, v in result.train_losses.items()},
                    "devices": devices, "backends": backends})
    return out


def test_init_model_with_meta_device_builds_the_same_model_on_meta():
    """Bitwise the eager run's losses (with dropout) at TP=2 (tied embedding and output
    layer in one chunk) and PP=2 (one chunk per stage)."""
    runs = []
    for layout in (["--tensor-model-parallel-size", "2"],
                   ["--pipeline-model-parallel-size", "2"]):
        argv = ARGV + DROPOUT + layout
        runs += [(argv, False), (argv + ["--init-model-with-meta-device"], False)]
    for result in run_distributed(_runs, 2, args=(runs,)):
        for eager, meta in (result[0:2], result[2:4]):
            assert eager["devices"] == ["None"] and meta["devices"] == ["meta"]
            assert meta["losses"] == eager["losses"] and len(eager["losses"]) == 3


def test_init_model_with_meta_device_needs_a_provider_taking_device():
    from megatron_smp.config import ConfigError
    from megatron_smp.training.arguments import parse_args
    from megatron_smp.training.pretrain import build_model_chunks

    def eager_only(configs, state, pre_process=True, post_process=True):
        raise AssertionError("not called: the check comes first")

    configs = parse_args(ARGV + ["--init-model-with-meta-device"])
    with pytest.raises(ConfigError, match="--init-model-with-meta-device"):
        build_model_chunks(eager_only, configs, state=None)


def _file_bytes(checkpoint):
    return {name: os.path.getsize(os.path.join(checkpoint, name))
            for name in os.listdir(checkpoint) if name.endswith(".distcp")}


def test_no_ckpt_fully_parallel_save_and_disable_gloo_process_groups(tmp_path):
    """DP=2 with a replicated model and optimizer: by default DCP spreads the replicated
    tensors over both ranks' files (test_megatron_checkpoint's
    test_ckpt_fully_parallel_save_holds_both_replicas_write); with
    --no-ckpt-fully-parallel-save rank 0 writes them all (rank 1 only its own RNG states).
    With --disable-gloo-process-groups the --async-save writer group is asked of the default
    backend instead of gloo, and the checkpoint is published as usual."""
    save = str(tmp_path / "lowest")
    argv = ARGV + ["--train-iters", "2", "--save-interval", "2", "--save", save,
                   "--async-save", "--no-ckpt-fully-parallel-save",
                   "--disable-gloo-process-groups"]
    for (flagged,) in run_distributed(_runs, 2, args=([(argv, True)],)):
        assert flagged["backends"] and None in flagged["backends"]
        assert "gloo" not in flagged["backends"]
    assert sorted(os.listdir(save)) == ["iter_0000002", "latest_checkpointed_iteration.txt"]
    sizes = _file_bytes(os.path.join(save, "iter_0000002"))
    assert sorted(sizes) == ["__0_0.distcp", "__1_0.distcp"]
    assert sizes["__1_0.distcp"] < 0.03 * sizes["__0_0.distcp"]  # RNG states


def test_disable_gloo_process_groups_with_async_save_on_nccl_is_an_error():
    from megatron_smp.config import ConfigError
    from megatron_smp.training.arguments import parse_args, validate_configs

    argv = ARGV + ["--save", "ckpt", "--async-save", "--disable-gloo-process-groups",
                   "--distributed-backend", "nccl"]
    with pytest.raises(ConfigError, match="--disable-gloo-process-groups"):
        validate_configs(parse_args(argv), world_size=1)
    validate_configs(parse_args(argv[:-2]), world_size=1)  # a gloo job: fine
    validate_configs(parse_args([a for a in argv if a != "--async-save"]), world_size=1)


def test_save_retain_interval_through_pretrain_async_and_on_resume(tmp_path):
    """DP=2, --async-save, a save every iteration retaining multiples of 2: after 5
    iterations iter 2, 4 and the newest (5) remain; resumed from 5 to 7, publishing 6 deletes
    5 (the tracker's, loaded and done with) and 7 keeps 6; the resumed losses are the
    uninterrupted run's."""
    save = str(tmp_path / "ckpt")
    flags = ["--save", save, "--save-interval", "1", "--save-retain-interval", "2",
             "--async-save", "--lr-decay-iters", "7"]
    first = ARGV + ["--train-iters", "5"] + flags
    resumed = ARGV + ["--train-iters", "7", "--load", save] + flags
    whole = ARGV + ["--train-iters", "7", "--lr-decay-iters", "7"]
    results = run_distributed(_runs, 2, args=([(first, False), (resumed, False),
                                               (whole, False)],))
    assert sorted(os.listdir(save)) == ["iter_0000002", "iter_0000004", "iter_0000006",
                                        "iter_0000007", "latest_checkpointed_iteration.txt"]
    for first_run, resumed_run, whole_run in results:
        assert sorted(resumed_run["losses"]) == [6, 7]
        for iteration, loss in {**first_run["losses"], **resumed_run["losses"]}.items():
            assert loss == pytest.approx(whole_run["losses"][iteration], rel=1e-6)


def test_save_retain_interval_errors():
    from megatron_smp.config import ConfigError
    from megatron_smp.training.arguments import parse_args, validate_configs

    argv = ARGV + ["--save", "ckpt", "--save-interval", "2"]
    for retain, message in (("3", "multiple of --save-interval 2"), ("0", "must be positive")):
        with pytest.raises(ConfigError, match=f"--save-retain-interval.*{message}"):
            validate_configs(parse_args(argv + ["--save-retain-interval", retain]),
                             world_size=1)
    configs = parse_args(argv + ["--save-retain-interval", "4"])
    validate_configs(configs, world_size=1)
    assert configs.checkpoint.save_retain_interval == 4
