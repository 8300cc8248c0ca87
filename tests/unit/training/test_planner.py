"""The step-time planner (training/planner.py, tools/plan.py): its FLOP count is Megatron-LM's
(and Narayanan et al.'s with recompute), its figures follow from the predicted step, each
mechanism moves the part of the breakdown it should by the amount the model says, the memory
is the memory planner's, and the tool's flags do what they say or name what would work."""
import dataclasses
import json
import math
import os

import pytest

from megatron_smp.config import ConfigError, TransformerConfig

GPT = ["--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "16",
       "--seq-length", "2048", "--max-position-embeddings", "2048", "--vocab-size", "32000",
       "--micro-batch-size", "1", "--global-batch-size", "64", "--bf16"]


def _configs(flags, entry="gpt", hf_config=None):
    from tools.plan import build_parser, load_configs

    argv = ["--num-gpus", "1", "--entry", entry] + (
        ["--hf-config", hf_config] if hf_config else [])
    ours, rest = build_parser().parse_known_args(argv + flags)
    return load_configs(ours, rest)


def _predict(flags, num_gpus=16, gpu="h100-sxm", memory=False, **options):
    from megatron_smp.training import planner

    configs, provider = _configs(flags)
    cluster = planner.Cluster(planner.GPUS[gpu], num_gpus)
    return planner.predict(configs, cluster, provider, planner.PlanOptions(**options),
                           memory=memory)


def test_model_flops_megatron_and_narayanan():
    """Causal: training.logging's count (Megatron-LM's); full attention adds the other half of
    the scores; with recompute it is Narayanan et al.'s 96 B s l h^2 (1 + s/6h + V/16lh)."""
    from megatron_smp.training.logging import flops_per_iteration
    from megatron_smp.training.planner import model_flops

    h, layers, s, vocab, batch = 1024, 12, 2048, 51200, 8
    config = TransformerConfig(num_layers=layers, hidden_size=h, num_attention_heads=16,
                               vocab_size=vocab, max_position_embeddings=s,
                               ffn_hidden_size=4 * h)
    causal = model_flops(config, s, batch)
    assert causal == flops_per_iteration(config, s, batch, vocab)
    full = model_flops(config, s, batch, attention="full")
    assert full == pytest.approx(causal + 6 * h * s * layers * batch * s, rel=1e-12)
    # Megatron's pre-2025 formula: 72 B s l h^2 (1 + s/6h + V/12lh)... written as 12 x (...)
    assert full == pytest.approx(
        12 * batch * s * layers * h * h * (1 + 1 + s / h + 4 + vocab / (2 * layers * h)),
        rel=1e-12)
    narayanan = model_flops(config, s, batch, attention="full", recompute=True)
    assert narayanan == pytest.approx(
        96 * batch * s * layers * h * h * (1 + s / (6 * h) + vocab / (16 * layers * h)),
        rel=1e-12)
    with pytest.raises(ConfigError, match="causal or full"):
        model_flops(config, s, batch, attention="half")


def test_figures_follow_from_the_step():
    """tokens/s, TFLOP/s and MFU are the step's; the breakdown adds up to it."""
    from megatron_smp.training.planner import GPUS, model_flops

    p = _predict(GPT + ["--tensor-model-parallel-size", "2", "--sequence-parallel"])
    assert sum(p.breakdown.values()) == pytest.approx(p.step_time, rel=1e-12)
    assert p.tokens_per_second_per_gpu == pytest.approx(64 * 2048 / p.step_time / 16)
    configs, _ = _configs(GPT)
    flops = model_flops(configs.model, 2048, 64)
    assert p.model_tflops_per_gpu == pytest.approx(flops / p.step_time / 16 / 1e12)
    assert p.mfu == pytest.approx(flops / p.step_time / 16 / GPUS["h100-sxm"].bf16_flops)
    assert p.breakdown["tp"] > 0 and p.breakdown["pp_bubble"] == 0 and p.breakdown["ep"] == 0


def test_collective_bandwidths():
    """A group inside a node runs at NVLink; across nodes at the NIC per GPU times the group's
    members per node (NCCL's rings cross each node once per channel), never above NVLink."""
    from megatron_smp.training.planner import GPUS, Cluster

    cluster = Cluster(GPUS["h100-sxm"], 64)
    assert cluster.link(1, 8) == (450e9, 3e-6)
    assert cluster.link(8, 8) == (50e9, 8e-6)  # one member per node
    assert cluster.link(2, 8) == (200e9, 8e-6)  # four members per node
    assert cluster.link(1, 64) == (400e9, 8e-6)
    slow = Cluster(GPUS["h100-sxm"], 64, inter_node_bandwidth=10e9, gpus_per_node=4)
    assert slow.link(1, 8) == (40e9, 8e-6) and slow.link(1, 4)[0] == 450e9


def test_mechanisms_move_their_part():
    """Recompute full adds one forward of the layers; --overlap-grad-reduce hides DP time;
    virtual stages shrink the bubble; FP8 speeds up the linear layers only; TP comm overlap
    exposes the fitted share of TP time; an MoE imbalance slows the experts and all-to-alls."""
    base = _predict(GPT)
    full = _predict(GPT + ["--recompute-granularity", "full", "--recompute-method", "uniform",
                           "--recompute-num-layers", "1"])
    assert full.breakdown["recompute"] > 0 and base.breakdown["recompute"] == 0
    assert full.breakdown["compute"] == pytest.approx(base.breakdown["compute"])
    # One more forward of the layers (not of the output layer): under a third of forward +
    # backward (backward ~ 2 x forward, attention's 2.5 x).
    assert 0.2 < full.breakdown["recompute"] / full.breakdown["compute"] < 1 / 3

    ddp = _predict(GPT + ["--use-distributed-optimizer"])
    overlapped = _predict(GPT + ["--use-distributed-optimizer", "--overlap-grad-reduce",
                                 "--overlap-param-gather"])
    assert overlapped.breakdown["dp"] < ddp.breakdown["dp"]

    pp = GPT + ["--pipeline-model-parallel-size", "4", "--global-batch-size", "32"]
    one = _predict(pp, num_gpus=8)
    two = _predict(pp + ["--virtual-pipeline-model-parallel-size", "2"], num_gpus=8)
    assert two.breakdown["pp_bubble"] == pytest.approx(one.breakdown["pp_bubble"] / 2, rel=0.05)
    assert one.breakdown["pp_bubble"] > 0

    fp8 = _predict(GPT, precision="fp8")
    assert fp8.precision == "fp8" and fp8.breakdown["compute"] < base.breakdown["compute"]
    assert fp8.breakdown["compute"] > base.breakdown["compute"] / 2  # attention stays bf16
    with pytest.raises(ConfigError, match="--fp8-format"):
        _predict(GPT, gpu="a100-80gb", precision="fp8")

    tp = GPT + ["--tensor-model-parallel-size", "8", "--sequence-parallel"]
    plain, overlap = _predict(tp), _predict(tp, tp_comm_overlap=True)
    from megatron_smp.training.planner import GPU_EFFICIENCY

    assert overlap.breakdown["tp"] == pytest.approx(
        plain.breakdown["tp"] * GPU_EFFICIENCY.tp_overlap_exposed)

    moe = GPT + ["--num-experts", "8", "--moe-router-topk", "2", "--expert-model-parallel-size",
                 "4", "--moe-token-dispatcher-type", "alltoall"]
    balanced, skewed = _predict(moe), _predict(moe, moe_imbalance=1.5)
    assert balanced.breakdown["ep"] > 0
    # 1.5 x the bytes; the latencies stay.
    assert 1.3 < skewed.breakdown["ep"] / balanced.breakdown["ep"] <= 1.5
    assert skewed.breakdown["compute"] > balanced.breakdown["compute"]

    # Unfused elementwise ops (eager PyTorch): eager_passes more hidden-sized passes per layer
    # forward, twice that backward; the op policy's recompute adds the forward's passes.
    from megatron_smp.training.planner import GPUS, eager_passes

    llama = ["--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "16",
             "--group-query-attention", "--num-query-groups", "4", "--ffn-hidden-size", "3584",
             "--seq-length", "2048", "--max-position-embeddings", "2048", "--vocab-size",
             "32000", "--micro-batch-size", "1", "--global-batch-size", "64", "--bf16",
             "--swiglu", "--position-embedding-type", "rope", "--normalization", "RMSNorm"]
    fused, eager = _predict(llama), _predict(llama, fused_elementwise=False)
    configs, _ = _configs(llama)
    assert eager_passes(configs.model) == pytest.approx(32 + 8 * 1.25 + 2 * 1.25 + 2 + 7)
    per_pass = 2048 * 1024 * 2 / (GPUS["h100-sxm"].hbm_bandwidth * GPU_EFFICIENCY.memory)
    assert eager.breakdown["compute"] - fused.breakdown["compute"] == pytest.approx(
        4 * 8 * 3 * eager_passes(configs.model) * per_pass, rel=1e-9)
    recomputed = _predict(llama, recompute_elementwise=True)
    assert recomputed.breakdown["compute"] == pytest.approx(fused.breakdown["compute"])
    assert recomputed.breakdown["recompute"] > fused.breakdown["recompute"] == 0


def test_memory_is_the_memory_planners():
    """The plan's memory is estimate_memory's largest rank; fits compares it with HBM x the
    usable fraction."""
    from megatron_smp.training.memory_planner import GIB, estimate_memory

    flags = GPT + ["--pipeline-model-parallel-size", "2", "--use-distributed-optimizer"]
    p = _predict(flags, num_gpus=8, memory=True)
    configs, provider = _configs(flags)
    expected = estimate_memory(configs, 8, provider, "cuda").largest.total / GIB
    assert p.memory_gib == pytest.approx(expected, rel=1e-12)
    assert p.fits and p.memory_limit_gib == pytest.approx(80e9 * 0.95 / GIB)
    tight = _predict(flags, num_gpus=8, memory=True, memory_fraction=p.memory_gib * GIB / 80e9
                     * 0.99)
    assert tight.fits is False


def test_plan_tool(tmp_path, capsys):
    """tools/plan.py: the breakdown for a layout, --json, --hf-config's shape, and clear
    errors naming the flag."""
    from tools.plan import main

    assert main(["--gpu", "h100-sxm", "--num-gpus", "16", "--tensor-model-parallel-size", "2",
                 "--sequence-parallel", "--json"] + GPT) == 0
    out = json.loads(capsys.readouterr().out)
    plan = out["plans"][0]
    assert plan["layout"]["tp"] == 2 and plan["layout"]["dp"] == 8
    assert plan["fits"] is True and plan["memory_gib"] > 0
    assert set(plan["breakdown_s"]) >= {"compute", "tp", "cp", "ep", "pp_bubble", "dp",
                                        "optimizer"}
    assert main(["--gpu", "h100-sxm", "--num-gpus", "16"] + GPT) == 0
    text = capsys.readouterr().out
    assert "tokens/s/GPU" in text and "MFU" in text and "fits" in text

    # The network flags reach the collectives: DP over two nodes at a fifth of the NIC
    # bandwidth; the same 16 GPUs in one node run the DP traffic on NVLink.
    def dp_seconds(*flags):
        assert main(["--num-gpus", "16", "--json", *flags] + GPT) == 0
        return json.loads(capsys.readouterr().out)["plans"][0]["breakdown_s"]["dp"]

    default = dp_seconds()
    assert dp_seconds("--inter-node-bandwidth", "10") > 2 * default
    assert dp_seconds("--gpus-per-node", "16") < default
    assert dp_seconds("--inter-node-latency", "1000") > default

    assert main(["--gpu", "a100-80gb", "--num-gpus", "16", "--fp8-format", "e4m3"] + GPT) == 2
    assert "--fp8-format" in capsys.readouterr().err
    assert main(["--gpu", "cpu", "--num-gpus", "2"] + GPT) == 2
    assert "--efficiency" in capsys.readouterr().err
    assert main(["--num-gpus", "16", "--moe-imbalance", "0.5"] + GPT) == 2
    assert "--moe-imbalance" in capsys.readouterr().err
    assert main(["--num-gpus", "12", "--tensor-model-parallel-size", "8"] + GPT) == 2
    capsys.readouterr()

    from transformers import LlamaConfig

    LlamaConfig(hidden_size=512, intermediate_size=1536, num_hidden_layers=6,
                num_attention_heads=8, num_key_value_heads=2, vocab_size=1000,
                max_position_embeddings=4096).save_pretrained(tmp_path)
    flags = ["--seq-length", "1024", "--max-position-embeddings", "4096",
             "--global-batch-size", "16", "--bf16"]
    configs, _ = _configs(flags, entry="llama", hf_config=str(tmp_path))
    assert (configs.model.num_layers, configs.model.num_query_groups,
            configs.model.ffn_hidden_size, configs.model.gated_linear_unit) == (6, 2, 1536, True)
    assert configs.model.bf16
    assert main(["--num-gpus", "8", "--hf-config", str(tmp_path), "--json"] + flags) == 0
    assert json.loads(capsys.readouterr().out)["plans"][0]["layout"]["seq_length"] == 1024
    assert main(["--num-gpus", "8", "--hf-config", str(tmp_path), "--num-layers", "2"]
                + flags) == 2
    assert "--num-layers" in capsys.readouterr().err
    assert main(["--num-gpus", "8", "--hf-config", str(tmp_path / "none")] + flags) == 2
    assert "config.json" in capsys.readouterr().err


def test_hybrid_layers_have_their_parts():
    """--hybrid-layer-pattern layers hold one part each: "*-*-" costs what two GPT layers do
    (the same GEMMs, attention, norms and TP collectives) but for the two more layers' host
    overhead; a Mamba-2 or Gated DeltaNet mixer adds its projections and its chunked scan
    (`mixer_scan_flops` at the attention efficiency, backward 2.5 x); --linear-attention-freq
    GPT layers swap their attention for the Gated DeltaNet. MFU counts Megatron's hybrid
    FLOPs."""
    from megatron_smp.training.planner import (GPU_EFFICIENCY, GPUS, mixer_gemms,
                                               mixer_scan_flops, model_flops)

    base = ["--hidden-size", "1024", "--num-attention-heads", "16", "--seq-length", "2048",
            "--max-position-embeddings", "2048", "--vocab-size", "32000",
            "--micro-batch-size", "1", "--global-batch-size", "32", "--bf16",
            "--tensor-model-parallel-size", "2", "--sequence-parallel"]
    gpt = _predict(base + ["--num-layers", "2"])
    attention_mlp = _predict(base + ["--hybrid-layer-pattern", "*-*-"])
    assert attention_mlp.breakdown["tp"] == pytest.approx(gpt.breakdown["tp"], rel=1e-9)
    micro_batches = 32 // 8
    assert attention_mlp.breakdown["compute"] - gpt.breakdown["compute"] == pytest.approx(
        micro_batches * 2 * 3 * GPU_EFFICIENCY.layer_overhead, rel=1e-6)

    mamba = _predict(base + ["--hybrid-layer-pattern", "M-M-"])
    configs, _ = _configs(base + ["--hybrid-layer-pattern", "M-M-"])
    assert mamba.mfu == pytest.approx(model_flops(configs.model, 2048, 32) / mamba.step_time
                                      / 16 / GPUS["h100-sxm"].bf16_flops)
    scan = mixer_scan_flops(configs.model, "M", 2048, 2048, 2)
    assert scan > 0 and len(mixer_gemms(configs.model, "M", 2048, 2)) == 2
    assert mamba.breakdown["compute"] != attention_mlp.breakdown["compute"]
    gdn = _predict(base + ["--hybrid-layer-pattern", "G-G-"])
    linear = _predict(base + ["--num-layers", "2", "--linear-attention-freq", "2"])
    assert gdn.breakdown["compute"] > 0 and linear.breakdown["compute"] > 0
    assert linear.breakdown["compute"] != gpt.breakdown["compute"]
