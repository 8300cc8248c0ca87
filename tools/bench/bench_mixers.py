"""Forward + backward of one Mamba-2 mixer and one Gated DeltaNet mixer against Hugging
Face's torch implementations of the same layers (NemotronHMamba2Mixer, Qwen3NextGatedDeltaNet,
their reference PyTorch kernels), same size and weights, in one process, interleaved.

    python tools/bench/bench_mixers.py [--hidden 512 --seq 1024 --batch 2 --threads 1]

Ours gets HF's weights through the HF adapters' layer conversions, and the outputs are
compared first (max abs difference printed). Calls alternate between the two so machine noise
hits both alike; prints the median CPU milliseconds (this process's CPU time, which a loaded
machine's waiting does not inflate) per forward+backward and ours / HF.
"""
from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers as tf

    from megatron_smp.config import ParallelConfig
    from megatron_smp.models.hf import nemotron_h, qwen3_next
    from megatron_smp.parallel_state import build_parallel_state
    from megatron_smp.transformer.ssm.gated_delta_net import GatedDeltaNet
    from megatron_smp.transformer.ssm.mamba_mixer import MambaMixer

    h = args.hidden
    torch.manual_seed(0)
    state = build_parallel_state(ParallelConfig())
    nemotron = tf.NemotronHConfig(hidden_size=h, layers_block_type=["mamba"],
                                  mamba_num_heads=2 * h // 64, mamba_head_dim=64, n_groups=2,
                                  ssm_state_size=64, chunk_size=128, num_attention_heads=4,
                                  vocab_size=128)
    qwen = tf.Qwen3NextConfig(hidden_size=h, num_hidden_layers=1,
                              layer_types=["linear_attention"], linear_num_key_heads=4,
                              linear_num_value_heads=8, linear_key_head_dim=64,
                              linear_value_head_dim=64, num_attention_heads=4,
                              num_key_value_heads=2, vocab_size=128)
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    results = {}
    for name, hf_layer, adapter in (
            ("mamba2", NemotronHMamba2Mixer(nemotron, layer_idx=0), nemotron_h),
            ("gated_delta_net", Qwen3NextGatedDeltaNet(qwen, layer_idx=0), qwen3_next)):
        config = adapter.config_from_hf(nemotron if name == "mamba2" else qwen)
        config = config.replace(hidden_dropout=0.0)
        ours = (MambaMixer if name == "mamba2" else GatedDeltaNet)(config, state)
        hf_sd = hf_layer.state_dict()
        if name == "mamba2":
            converted = nemotron_h._mamba_from_hf(hf_sd, "", "", config)
        else:
            converted = qwen3_next._gdn_from_hf(hf_sd, "", "", config, split_projections=False)
        ours.load_state_dict(converted)
        hf_layer.train()
        ours.train()
        x = torch.randn(args.batch, args.seq, h, requires_grad=True)
        x_ours = x.detach().transpose(0, 1).contiguous().requires_grad_()
        with torch.no_grad():
            difference = (ours(x_ours).transpose(0, 1) - hf_layer(x)).abs().max().item()

        def step_ours():
            ours(x_ours).sum().backward()

        def step_hf():
            hf_layer(x).sum().backward()

        times = {"ours": [], "hf": []}
        for _ in range(args.warmup):
            step_ours(), step_hf()
        for _ in range(args.repeats):
            for key, step in (("ours", step_ours), ("hf", step_hf)):
                start = time.process_time()
                step()
                times[key].append(time.process_time() - start)
        ours_ms = 1e3 * statistics.median(times["ours"])
        hf_ms = 1e3 * statistics.median(times["hf"])
        results[name] = {"ours_ms": ours_ms, "hf_ms": hf_ms, "max_abs_diff": difference}
        print(f"{name:16s} hidden {h} seq {args.seq} batch {args.batch}: ours {ours_ms:8.1f} ms"
              f"  HF {hf_ms:8.1f} ms  ours/HF {ours_ms / hf_ms:5.2f}  max |diff| {difference:.2e}")
    return results


if __name__ == "__main__":
    main()
