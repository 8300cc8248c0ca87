"""Megatron-LM 0.19 / main flags of 2026 launch scripts: each does what it says here, or is a
ConfigError naming it. (Muon's flags change the step as tests/unit/optimizer/test_muon.py
shows; the layouts are in tests/functional/test_muon_training.py.)"""
import math

import pytest
import torch

from megatron_smp.config import ConfigError
from megatron_smp.training.arguments import parse_args

BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 16 "
        "--train-iters 2 --mock-data --vocab-size 100 --micro-batch-size 2").split()


def parse(flags: str):
    return parse_args(BASE + flags.split())


def test_muon_flags_fill_the_optimizer_config():
    optimizer = parse(
        "--optimizer muon --muon-momentum 0.95 --muon-nesterov --muon-no-split-qkv "
        "--muon-scale-mode unit_rms_norm --muon-fp32-matmul-prec high "
        "--muon-coefficient-type polar_express --muon-num-ns-steps 8 --muon-tp-mode blockwise "
        "--muon-extra-scale-factor 0.2 --muon-scalar-optimizer lion --lion-beta1 0.9 "
        "--lion-beta2 0.99").optimizer
    assert (optimizer.optimizer, optimizer.muon_momentum, optimizer.muon_nesterov,
            optimizer.muon_split_qkv, optimizer.muon_scale_mode, optimizer.muon_fp32_matmul_prec,
            optimizer.muon_coefficient_type, optimizer.muon_num_ns_steps, optimizer.muon_tp_mode,
            optimizer.muon_extra_scale_factor, optimizer.muon_scalar_optimizer,
            optimizer.lion_beta1, optimizer.lion_beta2) == (
        "muon", 0.95, True, False, "unit_rms_norm", "high", "polar_express", 8, "blockwise",
        0.2, "lion", 0.9, 0.99)
    defaults = parse("--optimizer muon").optimizer
    assert (defaults.muon_momentum, defaults.muon_nesterov, defaults.muon_split_qkv,
            defaults.muon_scale_mode, defaults.muon_fp32_matmul_prec,
            defaults.muon_coefficient_type, defaults.muon_num_ns_steps, defaults.muon_tp_mode,
            defaults.lion_beta1, defaults.lion_beta2) == (
        0.9, False, True, "spectral", "medium", "quintic", 5, "duplicated", 0.95, 0.98)
    assert not defaults.use_layer_wise_distributed_optimizer


def test_dist_muon_is_muon_with_the_layer_wise_distributed_optimizer():
    optimizer = parse("--optimizer dist_muon").optimizer
    assert optimizer.optimizer == "muon" and optimizer.use_layer_wise_distributed_optimizer
    assert parse("--optimizer muon --use-distributed-optimizer").optimizer \
        .use_layer_wise_distributed_optimizer


@pytest.mark.parametrize("flags,named", [
    ("--muon-momentum 0.9", "--muon-momentum"),
    ("--optimizer adam --muon-tp-mode blockwise", "--muon-tp-mode"),
    ("--lion-beta1 0.9", "--lion-beta1"),
    ("--optimizer muon --lion-beta2 0.9", "--lion-beta2"),
    ("--optimizer soap", "--optimizer soap"),
    ("--optimizer adaptive_muon", "--optimizer adaptive_muon"),
    ("--optimizer muon --muon-use-syrk", "--muon-use-syrk"),
    ("--optimizer muon --muon-coefficient-type cubic", "--muon-coefficient-type"),
    ("--optimizer muon --muon-num-ns-steps 0", "--muon-num-ns-steps"),
    ("--multiple-validation-sets", "--multiple-validation-sets"),
    ("--validation-set-names a b", "--validation-set-names"),
    ("--start-eval-at-iter 5", "--start-eval-at-iter"),
    ("--freeze-all-layers", "--freeze-all-layers"),
    ("--chat-template x", "--chat-template"),
    ("--no-use-layer-wise-param-layout", "--no-use-layer-wise-param-layout"),
    ("--optimizer muon --no-use-layer-wise-param-layout", "--use-distributed-optimizer"),
    ("--enable-gpt-oss --rotary-scaling-factor 8", "--enable-gpt-oss"),
    ("--override-ckpt-iteration 3", "--override-ckpt-iteration"),
    ("--moe-extended-tp", "--moe-extended-tp"),
    ("--optimizer muon --qk-clip", "--qk-clip"),
    ("--qk-clip-threshold 100", "--qk-clip-threshold"),
    ("--num-experts 2 --moe-router-load-balancing-type quantile_balancing", "quantile_balancing"),
    ("--exit-signal-handler-for-training", "--exit-signal-handler-for-training"),
    ("--eval-micro-batch-size 4", "--eval-micro-batch-size"),
    ("--global-batch-size 4 --eval-global-batch-size 8", "--eval-global-batch-size"),
    ("--null-tokenizer-eod-id 99", "--null-tokenizer-eod-id"),
    ("--megatron-fsdp-main-params-dtype fp32", "--megatron-fsdp-main-params-dtype"),
    ("--use-megatron-fsdp --megatron-fsdp-main-grads-dtype bf16",
     "--megatron-fsdp-main-grads-dtype"),
    ("--ckpt-format torch_dcp", "--ckpt-format torch_dcp"),
    ("--num-distributed-optimizer-instances 2", "--num-distributed-optimizer-instances"),
    ("--cuda-graph-impl local", "--cuda-graph-impl"),
    ("--virtual-pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 4",
     "--num-virtual-stages-per-pipeline-rank"),
])
def test_clear_errors_name_the_flag(flags, named):
    with pytest.raises(ConfigError, match=named.replace("-", r"\-")):
        parse(flags).optimizer.validate()  # (validated when the optimizer is built)


def test_flags_that_work():
    assert parse("--dataloader-inter-document-masking").data.reset_attention_mask
    assert not parse("").data.reset_attention_mask
    same = parse("--global-batch-size 4 --eval-micro-batch-size 2 --eval-global-batch-size 4")
    assert same.training.global_batch_size == 4
    assert parse("--null-tokenizer-eod-id 100").data.vocab_size == 100
    fsdp = parse("--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params "
                 "--megatron-fsdp-main-params-dtype fp32 --megatron-fsdp-main-grads-dtype auto "
                 "--megatron-fsdp-grad-comm-dtype fp32 --ckpt-format torch_dcp")
    assert fsdp.parallel.use_torch_fsdp2 and fsdp.checkpoint.ckpt_format == "torch_dist"
    previous = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    try:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
        parse("--disable-bf16-reduced-precision-matmul")
        assert torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction is False
    finally:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = previous


def test_implementation_choice_flags_are_accepted():
    parse("--use-persistent-ckpt-worker --async-strategy nvrx --async-ckpt-use-cpu-shm "
          "--ckpt-assume-constant-structure --dist-ckpt-workers 2 --verify-integrity "
          "--no-save-tokenizer-assets --use-legacy-models --use-tp-pp-dp-mapping "
          "--defer-embedding-wgrad-compute --overlap-moe-expert-parallel-comm "
          "--num-distributed-optimizer-instances 1 --cuda-graph-impl none "
          "--use-transformer-engine-op-fuser --export-force-local-attention")
    parse("--num-experts 4 --moe-permute-fusion --moe-router-fusion")
    virtual = parse("--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2")
    assert virtual.parallel.virtual_pipeline_model_parallel_size == 2


def test_sqrtsoftplus_router_and_pre_softmax_with_sigmoid():
    """Megatron-LM main's sqrtsoftplus scores: sqrt(softplus(x)) per expert, the chosen ones
    renormalised; --moe-router-pre-softmax with per-expert scores is accepted as Megatron does
    (they are taken before top-k already)."""
    from megatron_smp.transformer.moe.moe_utils import topk_routing

    model = parse("--num-experts 4 --moe-router-score-function sqrtsoftplus "
                  "--moe-router-enable-expert-bias --moe-router-pre-softmax").model
    assert model.moe_router_score_function == "sqrtsoftplus"
    parse("--num-experts 4 --moe-router-score-function sigmoid --moe-router-pre-softmax")
    torch.manual_seed(0)
    logits = torch.randn(5, 4)
    probs, routing_map = topk_routing(logits, 2, False, "sqrtsoftplus")
    scores = torch.nn.functional.softplus(logits).sqrt()
    top, index = scores.topk(2, dim=-1)
    expected = torch.zeros(5, 4).scatter(1, index, top / top.sum(-1, keepdim=True))
    assert torch.allclose(probs, expected, atol=1e-6)
    assert torch.equal(routing_map, expected > 0)


def test_interleaved_schedule_checks_the_step_schedule_batches():
    """Megatron checks the virtual schedule's microbatches against the batch sizes the
    --step-batch-size-schedule reaches, not the default --global-batch-size (micro-batch x DP,
    here 1: never used)."""
    from megatron_smp.training.arguments import validate_configs

    base = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 16 "
            "--mock-data --vocab-size 100 --micro-batch-size 1 --train-samples 40 "
            "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1").split()
    validate_configs(parse_args(base + ["--step-batch-size-schedule", "0:4 0.256K:8"]),
                     world_size=2)
    with pytest.raises(ConfigError, match="multiple of --pipeline-model-parallel-size"):
        validate_configs(parse_args(base + ["--step-batch-size-schedule", "0:4 0.256K:5"]),
                         world_size=2)


def test_enable_gpt_oss_is_yarn_with_gpt_oss_values():
    """Megatron-LM main's --enable-gpt-oss sets these on the model config over the RoPE
    flags given (examples/gptoss passes --position-embedding-type rope with it): the same
    config as spelling YaRN out, and rotary frequencies other than plain RoPE's."""
    from megatron_smp.transformer.rope import rope_frequencies, rope_scaling_of

    gpt_oss = parse("--position-embedding-type rope --enable-gpt-oss").model
    spelled = parse("--position-embedding-type yarn --rotary-scaling-factor 32 "
                    "--yarn-original-max-position-embeddings 131072 --yarn-beta-fast 32 "
                    "--yarn-beta-slow 1 --mscale 1 --mscale-all-dim 0 "
                    "--no-yarn-correction-range-round-to-int").model
    plain = parse("--position-embedding-type rope").model
    assert gpt_oss == spelled and gpt_oss != plain
    assert (gpt_oss.position_embedding_type, gpt_oss.yarn_rotary_scaling_factor,
            gpt_oss.yarn_original_max_position_embeddings,
            gpt_oss.yarn_correction_range_round_to_int) == ("yarn", 32.0, 131072, False)
    yarn, scale = rope_frequencies(16, 10000.0, rope_scaling_of(gpt_oss))
    rope, _ = rope_frequencies(16, 10000.0, rope_scaling_of(plain))
    # 0.1 ln(32) + 1; with original length 131072 every frequency of a 16-dim head at base
    # 1e4 has more than beta_slow rotations, the slowest fewer than beta_fast: a ramp.
    assert scale == pytest.approx(0.1 * math.log(32) + 1)
    assert torch.equal(yarn[:2], rope[:2]) and not torch.equal(yarn, rope)


@pytest.mark.parametrize("flags,named", [
    ("--moe-token-dispatcher-type flex", "needs tensor x expert parallelism > 1"),
    ("--moe-flex-dispatcher-backend ncclep", "ncclep requires --moe-token-dispatcher-type flex"),
    ("--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend hybridep "
     "--moe-expert-capacity-factor 1 --moe-pad-expert-input-to-capacity", None),
    ("--moe-token-dispatcher-type flex --expert-model-parallel-size 2 "
     "--moe-expert-capacity-factor 1 --moe-pad-expert-input-to-capacity",
     "deepep backend does not support --moe-pad-expert-input-to-capacity"),
])
def test_flex_dispatcher_refusals_are_megatron_lm_s(flags, named):
    """Megatron-LM main's own checks on the flex dispatcher (DeepEP needs TP x EP > 1, ...);
    HybridEP has none of them."""
    from megatron_smp.training.arguments import validate_configs

    configs = parse("--num-experts 4 " + flags)
    world_size = 2 if "--expert-model-parallel-size 2" in flags else 1
    if named is None:
        validate_configs(configs, world_size=world_size)
        return
    with pytest.raises(ConfigError, match=named):
        validate_configs(configs, world_size=world_size)


def test_moe_enable_deepep_is_the_deepep_backend():
    model = parse("--num-experts 4 --moe-token-dispatcher-type flex --moe-enable-deepep "
                  "--moe-flex-dispatcher-backend deepep").model
    assert model.moe_flex_dispatcher_backend == "deepep"
    for flags, message in (("--moe-enable-deepep", "only supported with"),
                           ("--moe-token-dispatcher-type flex --moe-enable-deepep "
                            "--moe-flex-dispatcher-backend hybridep", "give one backend")):
        with pytest.raises(ConfigError, match=message):
            parse("--num-experts 4 " + flags)
