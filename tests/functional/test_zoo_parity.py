"""A small Qwen3-MoE-style model (q/k norms, head dim 24 != 64 / 4 heads, GQA, one MoE and one
dense layer, renormalised top-2 of 4 experts with the load-balancing and z losses, YaRN RoPE
whose original context, 16, is half the sequence) trains 10 iterations under pretrain_gpt.py
with the single-process losses (fp32, 1e-4) at TP=2+SP, EP=2, PP=2, CP=2 (with the distributed
optimizer), CP=2 x EP=2 (the experts' groups take in the context-parallel ranks) and DP=2 with
the distributed optimizer. All layouts run one after the other in one spawned pair of
processes."""
import pytest

from megatron_smp.testing import run_distributed
from tests.functional.test_moe_parity import _train
from tests.functional.test_training_parity import COMMON

QWEN3_MOE = (
    "--normalization RMSNorm --swiglu --disable-bias-linear --untie-embeddings-and-output-weights "
    "--group-query-attention --num-query-groups 2 --kv-channels 24 --qk-layernorm "
    "--position-embedding-type yarn --rotary-scaling-factor 4 "
    "--yarn-original-max-position-embeddings 16 --yarn-beta-slow 0.25 "
    "--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 32 --moe-layer-freq [1,0] "
    "--moe-aux-loss-coeff 0.01 --moe-z-loss-coeff 0.001 --moe-token-dispatcher-type alltoall"
).split()
LAYOUTS = {
    "tp2_sp": "--tensor-model-parallel-size 2 --sequence-parallel",
    "ep2": "--expert-model-parallel-size 2",
    "pp2": "--pipeline-model-parallel-size 2",
    # Expert grads and optimizer state sharded over the CP ranks (expert-data-parallel group).
    "cp2_distopt": "--context-parallel-size 2 --use-distributed-optimizer",
    "cp2_ep2": "--context-parallel-size 2 --expert-model-parallel-size 2 --cp-comm-type a2a",
    "dp2_distopt": "--use-distributed-optimizer",
}


def _train_layouts(rank, world_size, argvs):
    return {name: _train(rank, world_size, argv) for name, argv in argvs.items()}


def test_qwen3_moe_style_layouts_match_single_process(tmp_path):
    """... and bf16 at CP=2 x EP=2 follows the bf16 single-process run to bf16's resolution;
    CP=2 x EP=2 saved with --ckpt-format torch writes Megatron's legacy file of each EP rank
    (the second EP rank is the second CP rank)."""
    import os

    import torch

    from megatron_smp.checkpointing.megatron_lm import safe_load
    single = {"fp32": COMMON + QWEN3_MOE, "bf16": COMMON + QWEN3_MOE + ["--bf16"]}
    references = run_distributed(_train_layouts, 1, args=(single,), timeout=300)[0]
    reference = references["fp32"]
    assert len(reference) == 10 and reference[-1][0] < reference[0][0]
    assert reference[0][1] > 0 and reference[0][2] > 0  # both router losses are there
    argvs = {name: COMMON + QWEN3_MOE + flags.split() for name, flags in LAYOUTS.items()}
    argvs["cp2_ep2_bf16"] = argvs["cp2_ep2"] + ["--bf16"]
    save = str(tmp_path / "cp2_ep2")
    argvs["cp2_ep2"] += ["--save", save, "--ckpt-format", "torch"]
    for per_rank in run_distributed(_train_layouts, 2, args=(argvs,), timeout=600):
        for layout, losses in per_rank.items():
            bf16 = layout.endswith("bf16")
            want_all = references["bf16"] if bf16 else reference
            for step, (got, want) in enumerate(zip(losses, want_all)):
                # (lm loss, load_balancing_loss, z_loss)
                assert got == pytest.approx(want, rel=2e-2 if bf16 else 1e-4), (
                    layout, step, got, want)
    experts = []
    for ep_rank in range(2):
        path = os.path.join(save, "iter_0000010", f"mp_rank_00_{ep_rank:03d}",
                            "model_optim_rng.pt")
        model = safe_load(path)["model"]
        experts.append(model["decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"])
    assert not torch.equal(experts[0], experts[1])  # each EP rank's own experts


def _train_losses(rank, world_size, argv):
    import pretrain_gpt
    from megatron_smp.training import pretrain

    result = pretrain(pretrain_gpt.train_valid_test_datasets_provider,
                      pretrain_gpt.model_provider, pretrain_gpt.forward_step, argv=argv)
    return result.train_losses


def test_moe_per_layer_logging_writes_each_moe_layer(tmp_path):
    """--moe-per-layer-logging: moe/<loss>_layer_<i> TensorBoard scalars for MoE layers 0 and 2
    (layer 1 dense), whose mean is the logged loss; a clear error without a scalar sink."""
    from megatron_smp.config import ConfigError
    from megatron_smp.training.arguments import parse_args, validate_configs
    from tests.functional.test_logging_flags import _scalars

    argv = COMMON + QWEN3_MOE
    argv[argv.index("--num-layers") + 1] = "3"
    argv[argv.index("--train-iters") + 1] = "2"
    argv[argv.index("--moe-layer-freq") + 1] = "[1,0,1]"
    board = str(tmp_path / "tb")
    flags = ["--moe-per-layer-logging", "--tensorboard-dir", board]
    losses = run_distributed(_train_losses, 1, args=(argv + flags,), timeout=120)[0]
    scalars = _scalars(board)
    for name in ("load_balancing_loss", "z_loss"):
        per_layer = [dict(scalars[f"moe/{name}_layer_{i}"]) for i in (0, 2)]
        assert f"moe/{name}_layer_1" not in scalars
        for step in (1, 2):
            assert per_layer[0][step] != per_layer[1][step]
            mean = (per_layer[0][step] + per_layer[1][step]) / 2
            assert mean == pytest.approx(losses[step][name], rel=1e-5)
        assert not any(key.startswith("moe/") for key in losses[1])  # not on the log line
    with pytest.raises(ConfigError, match="--moe-per-layer-logging.*--tensorboard-dir"):
        validate_configs(parse_args(argv + ["--moe-per-layer-logging"]), 1)
