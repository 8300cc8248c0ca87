"""Hybrid models under the entry scripts: one stack holding every part of Megatron's
--hybrid-layer-pattern (Mamba-2, Gated DeltaNet, attention, MLP, MoE, a `/` multi-token-
prediction depth), and a Qwen3-Next-shaped
GPT (--linear-attention-freq), train 10 iterations with the single-process losses at TP=2 +
SP, PP=2 (the pattern's | break), DP=2 with the distributed optimizer and EP=2, and both
mixers (with attention and an MLP) at FSDP2 and CP=2 under pretrain_hybrid.py; Megatron's
hybrid flag set (examples/mamba/train.sh, shrunk) runs through pretrain_hybrid.py as written."""
import pytest

from megatron_smp.testing import run_distributed
from tests.functional.test_training_parity import _train

COMMON = (
    "--hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
    "--micro-batch-size 2 --global-batch-size 8 --train-iters 10 --mock-data "
    "--tokenizer-type NullTokenizer --vocab-size 1000 --hidden-dropout 0 --attention-dropout 0 "
    "--lr 1e-3 --lr-warmup-iters 2 --log-interval 5 --eval-interval 100 --eval-iters 1 --seed 7 "
    "--normalization RMSNorm --disable-bias-linear --untie-embeddings-and-output-weights "
    "--group-query-attention --num-query-groups 2"
).split()
# Every symbol; the | puts 2 layers on the first of two pipeline stages (ignored with one);
# the / part is one multi-token-prediction depth (a Gated DeltaNet and an MLP, last stage).
HYBRID = (
    "--hybrid-layer-pattern MG|*-E/G- --position-embedding-type none --squared-relu "
    "--mamba-state-dim 16 --mamba-head-dim 16 --mamba-num-groups 2 "
    "--linear-num-key-heads 2 --linear-num-value-heads 4 --linear-key-head-dim 16 "
    "--linear-value-head-dim 16 --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 64"
).split()
QWEN3_NEXT = (
    "--num-layers 2 --experimental-attention-variant gated_delta_net --linear-attention-freq 2 "
    "--attention-output-gate --qk-layernorm --apply-layernorm-1p --swiglu "
    "--position-embedding-type rope --rotary-percent 0.5 --kv-channels 24 "
    "--linear-num-key-heads 2 --linear-num-value-heads 4 --linear-key-head-dim 16 "
    "--linear-value-head-dim 16"
).split()
# Both mixers with attention, an MLP and MoE, in one pipeline stage and without the
# multi-token-prediction depth (FSDP2 and CP=2 take neither).
HYBRID_ONE_STAGE = [a if a != "MG|*-E/G-" else "MG*-E" for a in HYBRID]
MODELS = {"hybrid": HYBRID, "qwen3_next": QWEN3_NEXT, "hybrid_one_stage": HYBRID_ONE_STAGE}


_BASELINES = {}


def baseline(model):
    if model not in _BASELINES:
        script = SCRIPTS.get(model, "pretrain_gpt")
        _BASELINES[model] = run_distributed(_train, 1, args=(COMMON + MODELS[model], script))[0]
    return _BASELINES[model]


LAYOUTS = {
    ("hybrid", "tp2_sp"): "--tensor-model-parallel-size 2 --sequence-parallel",
    ("hybrid", "pp2"): "--pipeline-model-parallel-size 2",
    ("hybrid", "dp2_distopt"): "--use-distributed-optimizer",
    ("hybrid", "ep2"): "--expert-model-parallel-size 2",
    ("qwen3_next", "tp2_sp"): "--tensor-model-parallel-size 2 --sequence-parallel",
    # Built on the meta device, each layer materialised (the mixers replay their init), then
    # sharded, the MoE layer's experts over the expert-data-parallel ranks (here EP=2: one
    # rank each): the single-process trajectory under pretrain_hybrid.py.
    ("hybrid_one_stage", "fsdp2_ep2"): "--use-torch-fsdp2 --expert-model-parallel-size 2",
    # Each CP rank scans the whole sequence for half the Mamba groups / key heads (all-to-all,
    # as the attention's a2a: 6 s here against 21 s with the default p2p ring on gloo; packed
    # rows: tests/unit/transformer/test_hybrid.py).
    ("hybrid_one_stage", "cp2"): "--context-parallel-size 2 --cp-comm-type a2a",
}
SCRIPTS = {"hybrid_one_stage": "pretrain_hybrid"}


@pytest.mark.parametrize("model,layout", sorted(LAYOUTS))
def test_layout_matches_single_process(model, layout):
    reference = baseline(model)
    assert len(reference) == 10 and reference[-1] < reference[0]
    argv = COMMON + MODELS[model] + LAYOUTS[(model, layout)].split()
    script = SCRIPTS.get(model, "pretrain_gpt")
    for losses in run_distributed(_train, 2, args=(argv, script), timeout=300):
        assert losses == pytest.approx(reference, rel=1e-4), (layout, losses, reference)


# examples/mamba/train.sh @ Megatron-LM main (800M): its `options`, verbatim but for the
# shrink (pattern, hidden size, sequence, batch, samples, eval iterations, log interval), the
# data swap (--mock-data, NullTokenizer) and the CPU's changes: gloo for nccl, and fp32 for
# --bf16 (bf16 matmuls are ~30x slower than fp32 on this CPU).
MAMBA_TRAIN_SH = [
    "--tensor-model-parallel-size", "1", "--sequence-parallel",
    "--pipeline-model-parallel-size", "1", "--use-distributed-optimizer",
    "--overlap-param-gather", "--overlap-grad-reduce", "--untie-embeddings-and-output-weights",
    "--init-method-std", "0.02", "--position-embedding-type", "none",
    "--hybrid-layer-pattern", "M-M*-", "--hidden-size", "256", "--num-attention-heads", "16",
    "--group-query-attention", "--num-query-groups", "8", "--seq-length", "64",
    "--max-position-embeddings", "64", "--train-samples", "80", "--lr-warmup-samples", "16",
    "--lr-decay-samples", "64", "--save", "$CHECKPOINT_DIR", "--load", "$CHECKPOINT_DIR",
    "--mock-data", "--data-cache-path", "$DATACACHE_DIR", "--split", "99,1,0",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000",
    "--distributed-backend", "gloo", "--micro-batch-size", "2", "--global-batch-size", "8",
    "--lr", "2.5e-4", "--min-lr", "2.5e-5", "--lr-decay-style", "cosine",
    "--weight-decay", "0.1", "--clip-grad", "1.0", "--attention-dropout", "0.0",
    "--hidden-dropout", "0.0", "--disable-bias-linear", "--normalization", "RMSNorm",
    "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--log-interval", "1",
    "--save-interval", "2000", "--eval-interval", "2000", "--eval-iters", "1",
    "--use-mcore-models", "--spec", "megatron.core.models.hybrid.hybrid_layer_specs",
    "hybrid_stack_spec", "--no-create-attention-mask-in-dataloader",
    "--tensorboard-dir", "$TENSORBOARD_DIR",
]


def test_megatron_mamba_train_sh_runs_as_written(tmp_path):
    paths = {"$CHECKPOINT_DIR": tmp_path / "ckpt", "$DATACACHE_DIR": tmp_path / "cache",
             "$TENSORBOARD_DIR": tmp_path / "tb"}
    one, two = ([str(paths.get(a, a)).replace("ckpt", f"ckpt{n}") for a in MAMBA_TRAIN_SH]
                for n in (1, 2))
    single = run_distributed(_train, 1, args=(one, "pretrain_hybrid"), timeout=300)[0]
    results = run_distributed(_train, 2, args=(two, "pretrain_hybrid"), timeout=300)
    assert len(single) == 10 and single[-1] < single[0]
    for losses in results:  # DP=2, distributed optimizer with overlapped reductions
        assert losses == pytest.approx(single, rel=1e-4), (losses, single)
    assert (tmp_path / "ckpt2" / "latest_checkpointed_iteration.txt").read_text().strip() == "10"
