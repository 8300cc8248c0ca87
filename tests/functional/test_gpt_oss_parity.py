"""A small gpt-oss-style model (attention sinks, a sliding and a full layer, YaRN, q/k/v/o,
expert and router biases, clamped quick-GeGLU experts with the +1 offset, top-2 of 4 experts)
trains under pretrain_gpt.py with the single-process losses (fp32) at TP=2+SP, EP=2, PP=2,
CP=2 and DP=2 with the distributed optimizer: several layouts per spawned group."""
import pytest

from megatron_smp.testing import run_distributed
from tests.functional.test_moe_parity import MOE
from tests.functional.test_training_parity import COMMON

GPT_OSS = (
    "--normalization RMSNorm --quick-geglu --glu-linear-offset 1.0 "
    "--activation-func-clamp-value 0.5 --softmax-type learnable --window-size 7,0 "
    "--window-attn-skip-freq 2 --position-embedding-type yarn --rotary-scaling-factor 4 "
    "--yarn-original-max-position-embeddings 16 --rotary-base 150000 "
    "--untie-embeddings-and-output-weights --group-query-attention --num-query-groups 2 "
    "--init-method-std 0.2"
).split() + MOE
LAYOUTS = (
    "--tensor-model-parallel-size 2 --sequence-parallel",
    "--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall",
    "--pipeline-model-parallel-size 2",
    "--context-parallel-size 2 --cp-comm-type p2p",
    "--use-distributed-optimizer",
)


def _train_layouts(rank, world_size, argvs):
    """Per argv: per-iteration (lm loss, load_balancing_loss, z_loss) of pretrain_gpt.py."""
    import pretrain_gpt
    from megatron_smp.training import pretrain

    keys = ("lm loss", "load_balancing_loss", "z_loss")
    runs = []
    for argv in argvs:
        result = pretrain(pretrain_gpt.train_valid_test_datasets_provider,
                          pretrain_gpt.model_provider, pretrain_gpt.forward_step, argv=argv)
        runs.append([[result.train_losses[i].get(k) for k in keys]
                     for i in sorted(result.train_losses)])
    return runs


# The model of tests/unit/models/test_hf_gpt_oss.build_gpt_oss, as flags (NullTokenizer adds
# its EOD to --vocab-size: 1003 tokens).
HF_SHAPE = (
    "--num-layers 2 --hidden-size 64 --ffn-hidden-size 40 --num-attention-heads 4 "
    "--kv-channels 12 --group-query-attention --num-query-groups 2 --seq-length 32 "
    "--max-position-embeddings 32 --vocab-size 1002 --normalization RMSNorm "
    "--untie-embeddings-and-output-weights --softmax-type learnable --window-size 4,0 "
    "--window-attn-skip-freq 2 --position-embedding-type yarn --rotary-base 150000 "
    "--rotary-scaling-factor 4 --yarn-original-max-position-embeddings 8 "
    "--no-yarn-correction-range-round-to-int --quick-geglu --glu-linear-offset 1 "
    "--activation-func-clamp-value 0.3 --num-experts 4 --moe-router-topk 2 "
    "--moe-ffn-hidden-size 40 --moe-aux-loss-coeff 0.01 --micro-batch-size 2 "
    "--global-batch-size 8 --train-iters 3 --mock-data --tokenizer-type NullTokenizer "
    "--lr 1e-4 --eval-iters 0 --finetune --expert-model-parallel-size 2"
).split()


def layouts_match_and_converted_finetunes(tmp_path, model_type, flags, layouts, hf_shape):
    """`COMMON + flags` in one process (10 iterations, the loss falls), then each layout and a
    fine-tune of the HF model saved in `tmp_path / "hf"` (converted by convert.py, trained
    with `hf_shape --load`) in one spawned group of 2: every layout's per-iteration losses
    equal the single process's (rel 1e-4). Returns each rank's fine-tune lm losses."""
    from tests.unit.tools.test_convert import _convert_ok

    _convert_ok(model_type, "hf", "megatron_smp", tmp_path / "hf", tmp_path / "converted")
    reference = run_distributed(_train_layouts, 1, args=([COMMON + flags],), timeout=300)[0][0]
    assert len(reference) == 10 and reference[-1][0] < reference[0][0]
    argvs = [COMMON + flags + layout.split() for layout in layouts]
    argvs.append(hf_shape + ["--load", str(tmp_path / "converted")])
    finetunes = []
    for per_rank in run_distributed(_train_layouts, 2, args=(argvs,), timeout=400):
        for layout, losses in zip(layouts, per_rank):
            for step, (got, want) in enumerate(zip(losses, reference)):
                given = [value for value in got if value is not None]
                assert given == pytest.approx([value for value in want if value is not None],
                                              rel=1e-4), (layout, step, got, want)
        finetunes.append([loss[0] for loss in per_rank[-1]])
    return finetunes


def test_gpt_oss_layouts_match_single_process(tmp_path):
    """The layouts, and (in the same spawned group) an HF gpt-oss converted by convert.py
    fine-tuned under the gpt-oss flags at EP=2: the flags and the checkpoint agree."""
    from tests.unit.models.test_hf_gpt_oss import build_gpt_oss

    build_gpt_oss().save_pretrained(tmp_path / "hf")
    for finetuned in layouts_match_and_converted_finetunes(tmp_path, "gpt_oss", GPT_OSS,
                                                           LAYOUTS, HF_SHAPE):
        # Converted random weights (std 0.05) predict roughly uniformly over 1003 tokens.
        assert len(finetuned) == 3 and abs(finetuned[0] - 6.91) < 0.5, finetuned


def test_gpt_oss_20b_script_is_the_published_shape(tmp_path):
    """scripts/pretrain_gpt_oss_20b.sh parses into openai/gpt-oss-20b's model (20.9B
    parameters, the published count) and validates at its default layout (EP=8 of 8)."""
    from megatron_smp.models.hf import config_to_hf
    from megatron_smp.training.arguments import parse_args
    from tests.unit.training.test_launch_scripts import _command_line

    argv = _command_line("pretrain_gpt_oss_20b.sh", tmp_path)
    configs = parse_args(argv[argv.index("pretrain_gpt.py") + 1:])
    model = configs.model.replace(vocab_size=201088)
    model.validate(configs.parallel, configs.training.seq_length)
    configs.parallel.validate(8)
    assert configs.parallel.expert_model_parallel_size == 8
    hf = config_to_hf(model, "gpt_oss")  # it is a gpt-oss, as HF spells it
    assert (hf.num_hidden_layers, hf.num_local_experts, hf.sliding_window) == (24, 32, 128)
    assert hf.layer_types[:2] == ["sliding_attention", "full_attention"]
    assert hf.rope_parameters["factor"] == 32 and hf.rope_parameters["truncate"] is False
    h, heads, groups, d, f, e = 2880, 64, 8, 64, 2880, 32
    layer = (h * (heads + 2 * groups) * d + (heads + 2 * groups) * d  # qkv
             + heads * d * h + h + heads  # proj, sinks
             + e * (h * 2 * f + 2 * f + f * h + h) + e * h + e  # experts, router
             + 2 * h)  # norms
    total = 24 * layer + 2 * 201088 * h + h
    assert round(total / 1e9, 1) == 20.9


def small_script_losses(script: str, iterations: int = 6):
    """Per-iteration lm loss of scripts/small/`script` run as written (its 2 processes) for
    `iterations` iterations."""
    import os
    import re
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHON=sys.executable, PYTHONPATH=root, OMP_NUM_THREADS="1")
    proc = subprocess.run(["bash", f"scripts/small/{script}", "--train-iters", str(iterations),
                           "--log-interval", "1", "--eval-iters", "0"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return [float(x) for x in re.findall(r"\| lm loss: (\S+) \|", proc.stdout)]


def test_gpt_oss_small_script_trains(tmp_path):
    """scripts/small/pretrain_gpt_oss_small.sh runs as written (EP=2 on 2 processes); its
    loss falls."""
    losses = small_script_losses("pretrain_gpt_oss_small.sh")
    assert len(losses) == 6 and losses[-1] < losses[0], losses
