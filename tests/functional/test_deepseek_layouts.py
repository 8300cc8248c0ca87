"""A small DeepSeek-V3-style model (multi-latent attention with a q latent, latent norms and
interleaved YaRN RoPE on the positional channels, positions beyond the original context, a dense
first layer, then sigmoid-routed experts with expert bias, group-limited top-k, scaling, the
sequence-wise aux loss and a shared expert, and two
multi-token-prediction layers) trains 10 iterations under pretrain_gpt.py with the
single-process losses (lm loss and each MTP depth's loss; fp32, 1e-4) at TP=2+SP, EP=2, PP=2
(MTP on the last stage only), CP=2 (p2p, all_gather and a2a: MLA and the MTP shifts under
context parallelism) and DP=2 with the distributed optimizer. After 10 steps every layout holds
the single-process expert bias exactly (the MTP layers' routers too); each EP=2 update is
Megatron's formula on the token counts summed over the replicas; a run resumed from a
checkpoint (DP=2, distributed optimizer) continues exactly, bias included.

One spawned group per world size runs all its layouts one after the other."""
import pytest
import torch

from megatron_smp.testing import run_distributed
from tests.functional.test_moe_parity import MOE
from tests.functional.test_training_parity import COMMON, LLAMA

DEEPSEEK_ROUTER = (
    "--moe-router-score-function sigmoid --moe-router-enable-expert-bias "
    "--moe-router-bias-update-rate 0.003 --moe-router-num-groups 4 --moe-router-group-topk 2 "
    "--moe-router-topk-scaling-factor 1.5 --moe-router-load-balancing-type seq_aux_loss "
    "--moe-router-dtype fp32"
).split()
RATE = 0.003
MLA = ("--multi-latent-attention --qk-layernorm --q-lora-rank 24 --kv-lora-rank 20 "
       "--qk-head-dim 12 --qk-pos-emb-head-dim 8 --v-head-dim 10 --rotary-interleaved").split()
# Megatron's MLA YaRN flags; the original context (16) is half the sequence.
YARN = ("--rotary-scaling-factor 4 --mscale 0.9 --mscale-all-dim 0.7 "
        "--yarn-original-max-position-embeddings 16").split()
LAYOUTS = {
    # Recompute changes no number: MLA's up-projections and core attention run again.
    "tp2_sp": "--tensor-model-parallel-size 2 --sequence-parallel --recompute-granularity "
              "selective --recompute-modules mla_up_proj core_attn",
    "ep2": "--expert-model-parallel-size 2",
    "pp2": "--pipeline-model-parallel-size 2",
    "cp2_p2p": "--context-parallel-size 2 --cp-comm-type p2p",
    "cp2_all_gather": "--context-parallel-size 2 --cp-comm-type all_gather",
    "cp2_a2a": "--context-parallel-size 2 --cp-comm-type a2a",
    "dp2_distopt": "--use-distributed-optimizer",
}


def deepseek_argv(extra=()):
    """pretrain_gpt.py flags of the small DeepSeek-V3-style model (2 layers: dense, MoE)."""
    argv = [a for a in COMMON + LLAMA if a != "--group-query-attention"]
    del argv[argv.index("--num-query-groups"):argv.index("--num-query-groups") + 2]
    argv += MOE + DEEPSEEK_ROUTER + MLA + YARN + [
        "--moe-layer-freq", "[0,1]", "--moe-shared-expert-intermediate-size", "32",
        "--mtp-num-layers", "2", "--mtp-loss-scaling-factor", "0.3", "--log-interval", "1"]
    argv[argv.index("--num-experts") + 1] = "8"  # 4 groups of 2
    return argv + list(extra)


LOSSES = ("lm loss", "mtp_1 loss", "mtp_2 loss")


def _run(argv, record_updates=False):
    """(per-iteration [lm loss, mtp_1 loss, mtp_2 loss], {global layer: expert bias}, [per
    update: [(local counts, bias before, bias after)] per router] when `record_updates`,
    whether this rank holds the MTP layers)."""
    from megatron_smp.models.multi_token_prediction import MultiTokenPredictionBlock

    import pretrain_gpt
    from megatron_smp.training import pretrain
    from megatron_smp.transformer import moe
    from megatron_smp.transformer.moe.training import _routers

    updates, models = [], []
    original = moe.update_expert_bias

    def recording(chunks, config, state):
        routers = _routers(chunks)
        models[:] = [chunks]
        before = [(r.local_tokens_per_expert.clone(), r.expert_bias.clone()) for r in routers]
        original(chunks, config, state)
        if record_updates:
            updates.append([(c.tolist(), b.tolist(), r.expert_bias.tolist())
                            for (c, b), r in zip(before, routers)])

    moe.update_expert_bias = recording
    try:
        result = pretrain(pretrain_gpt.train_valid_test_datasets_provider,
                          pretrain_gpt.model_provider, pretrain_gpt.forward_step, argv=argv)
    finally:
        moe.update_expert_bias = original
    # Lists, not tensors: tensors through the result queue need the sender alive.
    bias = {r.layer_number: r.expert_bias.tolist() for r in _routers(models[0])}
    losses = [[result.train_losses[i][k] for k in LOSSES] for i in sorted(result.train_losses)]
    has_mtp = any(isinstance(m, MultiTokenPredictionBlock) for c in models[0] for m in c.modules())
    return losses, bias, updates, has_mtp


def _single(rank, world_size, argv):
    return _run(argv)


def _layouts(rank, world_size, checkpoint_dir):
    out = {name: _run(deepseek_argv(flags.split()), record_updates=name == "ep2")
           for name, flags in LAYOUTS.items()}
    # Resume: 5 iterations saved at DP=2 with the distributed optimizer, then 6-10 loaded.
    resume = deepseek_argv(LAYOUTS["dp2_distopt"].split()) + ["--save", checkpoint_dir]
    _run(resume + ["--exit-interval", "5"])
    out["resumed"] = _run(resume + ["--load", checkpoint_dir])
    return out


def test_deepseek_style_model_layouts_match_one_process(tmp_path):
    reference, ref_bias, _, _ = run_distributed(_single, 1, args=(deepseek_argv(),),
                                                timeout=300)[0]
    assert len(reference) == 10 and all(a > b for a, b in zip(reference[0], reference[-1]))
    assert sorted(ref_bias) == [2, 3, 4]  # the MoE layer and the two MTP layers' routers
    assert all(max(abs(v) for v in ref_bias[layer]) > 0 for layer in ref_bias)  # it moved
    results = run_distributed(_layouts, 2, args=(str(tmp_path),), timeout=600)
    print(f"\nsingle process: losses (lm, mtp_1, mtp_2) {reference[0]} .. {reference[-1]}")
    for name in list(LAYOUTS) + ["resumed"]:
        want = reference[5:] if name == "resumed" else reference
        bias, error = {}, 0.0
        for rank_results in results:
            losses, rank_bias, _, _ = rank_results[name]
            for got_row, want_row in zip(losses, want, strict=True):
                assert got_row == pytest.approx(want_row, rel=1e-4), (name, losses, want)
                error = max([error] + [abs(a - b) / abs(b) for a, b in zip(got_row, want_row)])
            for layer, value in rank_bias.items():  # every replica, the same bias
                assert bias.setdefault(layer, value) == value, (name, layer)
        assert bias == ref_bias, name  # bit-identical to the single process's
        print(f"{name}: max relative loss error (lm, mtp_1, mtp_2) {error:.1e}, expert bias "
              "identical")
    assert [r["pp2"][3] for r in results] == [False, True]  # MTP on the last stage only

    for rank_results in results:  # the resumed run is the uninterrupted one, bit for bit
        assert rank_results["resumed"][0] == rank_results["dp2_distopt"][0][5:]

    # EP=2: each update is Megatron's on the counts summed over the replicas.
    updates = [r["ep2"][2] for r in results]
    assert len(updates[0][0]) == 3  # routers: the MoE layer's and the MTP layers'
    assert len(updates[0]) == 10
    for step in range(10):
        for router in range(3):
            counts = sum(torch.tensor(u[step][router][0]) for u in updates)
            before = torch.tensor(updates[0][step][router][1])
            want = before + RATE * torch.sign(counts.mean() - counts)
            assert torch.equal(torch.tensor(updates[0][step][router][2]), want), (step, router)
