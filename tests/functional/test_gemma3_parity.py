"""A small Gemma 3-style model (sliding/full layers with their own RoPE bases, linear RoPE
scaling on the full layers, sandwich and (1 + w) norms, q/k norms, scaled embeddings, a
softmax scale other than 1/sqrt(d), GeGLU, final logit soft-capping, tied embeddings) trains
under pretrain_gpt.py with the single-process losses (fp32, 1e-4) at TP=2+SP, PP=2, CP=2 and
DP=2 with the distributed optimizer (and full activation recompute); a Gemma3ForCausalLM
converted by convert.py fine-tunes under the same flags at its own shape (TP=2 + SP)."""
from tests.functional.test_gpt_oss_parity import (
    layouts_match_and_converted_finetunes,
    small_script_losses,
)

GEMMA3 = (
    "--num-layers 4 --normalization RMSNorm --norm-epsilon 1e-6 --apply-layernorm-1p "
    "--qk-layernorm --sandwich-norm --apply-embedding-scaling --geglu --ffn-hidden-size 96 "
    "--disable-bias-linear --kv-channels 20 --group-query-attention --num-query-groups 2 "
    "--position-embedding-type rope --rotary-base 100000 --rotary-seq-len-interpolation-factor 8 "
    "--local-rotary-base 1000 --window-size 7,0 --window-attn-skip-freq 3 --softmax-scale 0.2 "
    "--final-logit-softcapping 10 --init-method-std 0.1"
).split()
LAYOUTS = (
    "--tensor-model-parallel-size 2 --sequence-parallel",
    "--pipeline-model-parallel-size 2",
    "--context-parallel-size 2 --cp-comm-type p2p",
    "--use-distributed-optimizer --recompute-granularity full --recompute-method uniform "
    "--recompute-num-layers 1",
)
# tests/unit/models/test_hf_gemma3.build_gemma3 as flags (NullTokenizer adds its EOD to
# --vocab-size: 1003 tokens; --softmax-scale is 24 ** -0.5, its query_pre_attn_scalar).
HF_SHAPE = (
    "--num-layers 7 --hidden-size 48 --ffn-hidden-size 40 --num-attention-heads 4 "
    "--kv-channels 20 --group-query-attention --num-query-groups 2 --seq-length 32 "
    "--max-position-embeddings 64 --vocab-size 1002 --normalization RMSNorm "
    "--norm-epsilon 1e-6 --apply-layernorm-1p --qk-layernorm --sandwich-norm "
    "--apply-embedding-scaling --geglu --disable-bias-linear --position-embedding-type rope "
    "--rotary-base 100000 --rotary-seq-len-interpolation-factor 8 --local-rotary-base 1000 "
    f"--window-size 4,0 --window-attn-skip-freq 6 --softmax-scale {24 ** -0.5!r} "
    "--final-logit-softcapping 6 --hidden-dropout 0 --attention-dropout 0 "
    "--micro-batch-size 2 --global-batch-size 8 --train-iters 3 --mock-data "
    "--tokenizer-type NullTokenizer --lr 1e-4 --eval-iters 0 --finetune "
    "--tensor-model-parallel-size 2 --sequence-parallel"
).split()


def test_gemma3_layouts_match_single_process(tmp_path):
    from tests.unit.models.test_hf_gemma3 import build_gemma3

    build_gemma3().save_pretrained(tmp_path / "hf")
    for finetuned in layouts_match_and_converted_finetunes(tmp_path, "gemma3", GEMMA3, LAYOUTS,
                                                           HF_SHAPE):
        # Converted random weights predict roughly uniformly over 1003 tokens.
        assert len(finetuned) == 3 and abs(finetuned[0] - 6.91) < 0.5, finetuned


def test_gemma3_1b_script_is_the_published_shape(tmp_path):
    """scripts/pretrain_gemma3_1b.sh parses into google/gemma-3-1b-pt's model (999,885,952
    parameters, the published count) and validates at its default layout (DP=8)."""
    from megatron_smp.models.hf import config_to_hf
    from megatron_smp.training.arguments import parse_args
    from tests.unit.training.test_launch_scripts import _command_line

    argv = _command_line("pretrain_gemma3_1b.sh", tmp_path)
    configs = parse_args(argv[argv.index("pretrain_gpt.py") + 1:])
    model = configs.model.replace(vocab_size=262144)
    model.validate(configs.parallel, configs.training.seq_length)
    configs.parallel.validate(8)
    hf = config_to_hf(model, "gemma3_text")  # it is a Gemma 3, as HF spells it
    assert (hf.num_hidden_layers, hf.sliding_window, hf.query_pre_attn_scalar) == (26, 512, 256)
    assert hf.layer_types[4:7] == ["sliding_attention", "full_attention", "sliding_attention"]
    assert hf.rope_parameters == {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                  "sliding_attention": {"rope_type": "default",
                                                        "rope_theta": 1e4}}
    h, heads, groups, d, f, v = 1152, 4, 1, 256, 6912, 262144
    layer = h * (heads + 2 * groups) * d + heads * d * h + 3 * h * f + 4 * h + 2 * d
    assert 26 * layer + v * h + h == 999_885_952

    # The memory planner at the script's layout (8 GPUs, seq 8192, bf16, selective recompute):
    # 45.7 GiB a GPU, 12 GiB of it the transient logits of the 262k vocabulary.
    from megatron_smp.training.memory_planner import GIB, report_from_argv
    from tools.estimate_memory import entry_script

    argv = argv[argv.index("pretrain_gpt.py") + 1:]
    for flag in ("--data-path", "--tokenizer-type", "--tokenizer-model"):
        at = argv.index(flag)
        del argv[at:at + 2]
    argv += ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "262144"]
    provider, defaults = entry_script("gpt")
    report = report_from_argv(argv, 8, provider, defaults, "cuda")
    assert 40 * GIB < report.largest.total < 80e9, report.table()


def test_gemma3_small_script_trains():
    """scripts/small/pretrain_gemma3_small.sh runs as written (TP=2 + SP on 2 processes); its
    loss falls."""
    losses = small_script_losses("pretrain_gemma3_small.sh")
    assert len(losses) == 6 and losses[-1] < losses[0], losses
