"""DeepSeek-V3 routing under pretrain_gpt.py (sigmoid scores, group-limited top-k, scaling,
sequence-wise aux loss, aux-loss-free expert bias): EP=2 x DP=2 with the distributed optimizer
follows the single-process losses, every replica holds the single-process bias after each
step, each update is Megatron's formula on the counts summed over the replicas, and a resume
from a checkpoint continues exactly (the bias is saved with the model)."""
import pytest
import torch

from megatron_smp.testing import run_distributed
from tests.functional.test_moe_parity import MOE
from tests.functional.test_training_parity import COMMON, LLAMA

DEEPSEEK_ROUTER = (
    "--moe-router-score-function sigmoid --moe-router-enable-expert-bias "
    "--moe-router-bias-update-rate 0.01 --moe-router-num-groups 4 --moe-router-group-topk 2 "
    "--moe-router-topk-scaling-factor 1.5 --moe-router-load-balancing-type seq_aux_loss "
    "--moe-router-dtype fp32"
).split()
RATE = 0.01


def _argv(iters):
    argv = COMMON + LLAMA + MOE + DEEPSEEK_ROUTER + ["--lr-decay-iters", "6"]
    argv[argv.index("--train-iters") + 1] = str(iters)
    argv[argv.index("--num-experts") + 1] = "8"  # 4 groups of 2
    return argv


def _train(rank, world_size, argv):
    """(per-iteration lm loss, [(local counts, bias before, bias after)] per update)."""
    import pretrain_gpt
    from megatron_smp.training import pretrain
    from megatron_smp.transformer import moe
    from megatron_smp.transformer.moe.training import _routers

    updates = []
    original = moe.update_expert_bias

    def recording(chunks, config, state):
        routers = _routers(chunks)
        before = [(r.local_tokens_per_expert.clone(), r.expert_bias.clone()) for r in routers]
        original(chunks, config, state)
        updates.append([(c, b, r.expert_bias.clone()) for (c, b), r in zip(before, routers)])

    moe.update_expert_bias = recording
    try:
        result = pretrain(pretrain_gpt.train_valid_test_datasets_provider,
                          pretrain_gpt.model_provider, pretrain_gpt.forward_step, argv=argv)
    finally:
        moe.update_expert_bias = original
    # Lists, not tensors: tensors through the result queue need the sender alive.
    updates = [[tuple(t.tolist() for t in entry) for entry in step] for step in updates]
    return [result.train_losses[i]["lm loss"] for i in sorted(result.train_losses)], updates


def _tensors(results):
    return [(losses, [[tuple(torch.tensor(v) for v in entry) for entry in step]
                      for step in updates]) for losses, updates in results]


def test_expert_bias_ep2_dp2_distopt_matches_single_process_and_megatrons_update(tmp_path):
    argv = _argv(6) + ["--log-interval", "1"]
    (ref_losses, ref_updates), = _tensors(run_distributed(_train, 1, args=(argv,), timeout=300))
    layout = argv + "--expert-model-parallel-size 2 --use-distributed-optimizer".split()
    results = _tensors(run_distributed(_train, 2, args=(layout,), timeout=300))
    assert len(ref_losses) == 6 and ref_losses[-1] < ref_losses[0]
    final_bias = ref_updates[-1][0][2]
    assert final_bias.abs().max() > 0  # the bias moved
    for losses, updates in results:
        assert losses == pytest.approx(ref_losses, rel=1e-4)
        assert len(updates) == len(ref_updates) == 6
        for step, (got, want) in enumerate(zip(updates, ref_updates)):
            for (_, _, bias), (_, _, ref_bias) in zip(got, want):
                assert torch.equal(bias, ref_bias), step  # every replica, the same bias
    # Megatron's update on the counts summed over the data-parallel (here also EP) replicas.
    for step in range(6):
        for layer in range(len(ref_updates[step])):
            counts = sum(updates[step][layer][0] for _, updates in results)
            torch.testing.assert_close(counts, ref_updates[step][layer][0])
            before = results[0][1][step][layer][1]
            want = before + RATE * torch.sign(counts.mean() - counts)
            assert torch.equal(results[0][1][step][layer][2], want), step

    # Resume at step 3 from a checkpoint: the bias (and so the losses) continue exactly.
    save = ["--save", str(tmp_path), "--save-interval", "3"]
    first = _argv(3) + ["--log-interval", "1"] + save
    run_distributed(_train, 1, args=(first,), timeout=300)
    (resumed, resumed_updates), = _tensors(run_distributed(
        _train, 1, args=(argv + ["--load", str(tmp_path)],), timeout=300))
    assert resumed == pytest.approx(ref_losses[3:], rel=1e-6)
    assert torch.equal(resumed_updates[0][0][1], ref_updates[2][0][2])
    assert torch.equal(resumed_updates[-1][0][2], final_bias)
