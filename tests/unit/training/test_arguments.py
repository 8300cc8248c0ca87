import math

import pytest
import torch

from megatron_smp.config import ConfigError, OptimizerConfig
from megatron_smp.training.arguments import parse_args, validate_configs
from megatron_smp.training.optimizer_param_scheduler import OptimizerParamScheduler

BASE = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--train-iters 10 --mock-data --micro-batch-size 2"
).split()


def parse(argv, **kwargs):
    """What pretrain does before the first collective: parse, take the tokenizer's
    vocabulary (here a stand-in), validate."""
    configs = parse_args(argv, **kwargs)
    configs.model.vocab_size = configs.model.vocab_size or 1000
    validate_configs(configs)
    return configs


def test_flags_fill_the_configs():
    configs = parse(
        BASE + "--swiglu --group-query-attention --num-query-groups 2 --bf16 "
        "--position-embedding-type rope --use-flash-attn --transformer-impl local "
        "--tensor-model-parallel-size 1 --lr 3e-4 --lr-warmup-fraction 0.2".split()
    )
    model = configs.model
    assert model.gated_linear_unit and model.activation == "silu"
    assert model.ffn_hidden_size == 128  # Megatron's 2/3 * 4h rounded to 64
    assert model.num_query_groups == 2 and model.position_embedding_type == "rope"
    assert model.bf16 and str(model.params_dtype) == "torch.bfloat16"
    assert not hasattr(configs.optimizer, "bf16")  # one home for precision: the model config
    # The scheduler turns the fraction into samples (test_scheduler.py checks its lengths).
    assert configs.optimizer.lr == 3e-4 and configs.optimizer.lr_warmup_fraction == 0.2
    assert configs.optimizer.lr_decay_iters is None and configs.training.train_iters == 10
    assert model.max_position_embeddings == 32


def test_openai_gelu_selects_gpt2_activation():
    assert parse(BASE + ["--openai-gelu"]).model.activation == "gelu_tanh"
    with pytest.raises(ConfigError, match="--openai-gelu"):
        parse(BASE + ["--openai-gelu", "--swiglu"])


def test_args_defaults_from_entry_script():
    configs = parse(BASE, args_defaults={"normalization": "RMSNorm", "swiglu": True})
    assert configs.model.normalization == "RMSNorm" and configs.model.gated_linear_unit


@pytest.mark.parametrize(
    "extra, message",
    [
        ("--num-attention-heads 3 --hidden-size 66", "--tensor-model-parallel-size"),
        ("--max-position-embeddings 16", "--max-position-embeddings (16)"),
        ("--global-batch-size 3", "--global-batch-size (3)"),
        ("--fp16 --bf16", "mutually exclusive"),
        ("--num-query-groups 2", "--group-query-attention"),
    ],
)
def test_bad_configurations_name_the_flag(extra, message, monkeypatch):
    argv = BASE + extra.split()
    if "3 --hidden-size" in extra:
        argv += ["--tensor-model-parallel-size", "2"]
        monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse(argv)


def test_save_interval_without_save_saves_nothing():
    """Accepted as Megatron-LM accepts it (in the docs' ignored-flags table): nothing to save
    to, so the run's checkpointing is off."""
    configs = parse(BASE + ["--save-interval", "5"])
    assert configs.checkpoint.save_interval == 5 and configs.checkpoint.save is None


def test_unknown_flag_value_exits(capsys):
    with pytest.raises(SystemExit) as info:
        parse(BASE + ["--lr-decay-style", "exponential"])
    assert info.value.code != 0
    assert "--lr-decay-style" in capsys.readouterr().err


def test_world_size_must_be_product_of_degrees(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match="world size 3"):
        parse(BASE + ["--tensor-model-parallel-size", "2"])


class _FakeOptimizer:
    def __init__(self):
        self.param_groups = [{"lr": 0.0}, {"lr": 0.0, "wd_mult": 0.0}]


@pytest.mark.parametrize("style", ["constant", "linear", "cosine"])
def test_lr_schedule(style):
    config = OptimizerConfig(lr=1.0, min_lr=0.1, lr_warmup_iters=2, lr_decay_iters=10,
                             lr_decay_style=style, weight_decay=0.5)
    opt = _FakeOptimizer()
    scheduler = OptimizerParamScheduler(opt, config, train_iters=10)
    lrs = []
    for _ in range(12):
        scheduler.step(1)
        lrs.append(opt.param_groups[0]["lr"])
    assert lrs[0] == pytest.approx(0.5) and lrs[1] == pytest.approx(1.0)
    if style == "constant":
        assert lrs[-1] == 1.0
    else:
        assert lrs[9] == pytest.approx(0.1) and lrs[-1] == pytest.approx(0.1)
        mid = 0.1 + 0.9 * (0.5 if style == "linear" else 0.5 * (math.cos(math.pi / 2) + 1))
        assert lrs[5] == pytest.approx(mid)
    assert opt.param_groups[1]["weight_decay"] == 0.0
    assert opt.param_groups[0]["weight_decay"] == 0.5


def test_smp_config_keys_override_flags(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    path = tmp_path / "smp.json"
    path.write_text('{"tensor_parallel_degree": 2, "shard_optimizer_state": true, '
                    '"random_seed": 99}')
    configs = parse(BASE + ["--smp-config", str(path), "--global-batch-size", "4"])
    assert configs.parallel.tensor_model_parallel_size == 2
    assert configs.optimizer.use_distributed_optimizer and configs.training.seed == 99
    with pytest.raises(ConfigError, match="tensor_parallel_degree"):
        parse(BASE + ["--smp-config", '{"tensor_parallel_degree": "two"}'])
    with pytest.raises(ConfigError, match="unknown config key"):
        parse(BASE + ["--smp-config", '{"tensor_parallel": 2}'])


# No silent no-ops ------------------------------------------------------------------------------

NOT_YET = [
    ("--hierarchical-context-parallel-sizes 2 2", "--hierarchical-context-parallel-sizes"),
]


@pytest.mark.parametrize("extra, name", NOT_YET)
def test_flags_of_missing_capabilities_are_errors(extra, name, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")  # so a degree of 2 is not rejected for the world size
    with pytest.raises(ConfigError, match=f"{name}.*not supported yet"):
        parse(BASE + extra.split() + ["--global-batch-size", "8"])


def test_degree_one_of_missing_capabilities_is_fine():
    configs = parse(BASE + "--expert-model-parallel-size 1 --context-parallel-size 1".split())
    assert configs.parallel.context_parallel_size == 1


FSDP_SCRIPT_KEYS = [
    {"sm_activation_offloading": True}, {"activation_loading_horizon": 3},
    {"fsdp_cache_flush_warnings": False}, {"allow_empty_shards": True},
]


@pytest.mark.parametrize("keys", FSDP_SCRIPT_KEYS)
def test_smp_fsdp_script_keys_are_read_by_init_not_by_training_scripts(keys, monkeypatch):
    import json

    from megatron_smp.smp import parse_smp_config

    _, values, _ = parse_smp_config(keys, 4)  # what smp.init runs before any collective
    assert all(values[k] == v for k, v in keys.items())
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ConfigError, match=f"{next(iter(keys))}.*smp.fully_shard"):
        parse(BASE + ["--smp-config", json.dumps(keys), "--global-batch-size", "8"])


def test_smp_defaults_and_shard_degrees_are_accepted():
    from megatron_smp.smp import parse_smp_config

    for keys in ({}, {"hybrid_shard_degree": 0}, {"hybrid_shard_degree": 1},
                 {"hybrid_shard_degree": 2}, {"sm_activation_offloading": False}):
        _, values, parallel = parse_smp_config(keys, 4)
        assert values["sm_activation_offloading"] is keys.get("sm_activation_offloading", True)
        assert values["activation_loading_horizon"] == 2
        assert parallel.hybrid_shard_degree == keys.get("hybrid_shard_degree", 0)
    with pytest.raises(ConfigError, match=r"hybrid_shard_degree \(3\) must .* divide"):
        parse_smp_config({"hybrid_shard_degree": 3}, 4)
    with pytest.raises(ConfigError, match="activation_loading_horizon must be a positive"):
        parse_smp_config({"activation_loading_horizon": 0}, 4)


FSDP_CONFLICTS = [
    ("--use-distributed-optimizer", "--use-distributed-optimizer"),
    ("--pipeline-model-parallel-size 2", "--pipeline-model-parallel-size > 1"),
    ("--overlap-grad-reduce", "--overlap-grad-reduce"),
    ("--ckpt-format torch", "--ckpt-format torch"),
]


@pytest.mark.parametrize("extra, name", FSDP_CONFLICTS)
def test_use_torch_fsdp2_conflicts_are_errors(extra, name, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ConfigError, match=f"--use-torch-fsdp2 does not combine with {name}"):
        parse(BASE + ["--use-torch-fsdp2", "--global-batch-size", "8"] + extra.split())


def test_hybrid_shard_degree_in_training_scripts_needs_use_torch_fsdp2(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ConfigError, match="hybrid_shard_degree.* = 2 .* add --use-torch-fsdp2"):
        parse(BASE + ["--smp-config", '{"hybrid_shard_degree": 2}', "--global-batch-size", "8"])
    configs = parse(BASE + ["--smp-config", '{"hybrid_shard_degree": 2}',
                            "--global-batch-size", "8", "--use-torch-fsdp2"])
    assert configs.parallel.use_torch_fsdp2 and configs.parallel.hybrid_shard_degree == 2


def test_smp_degrees_are_named_by_their_keys(monkeypatch):
    from megatron_smp.smp import parse_smp_config

    with pytest.raises(ConfigError, match=r"world size 3 is not divisible by "
                                          r"tensor_parallel_degree \(2\)"):
        parse_smp_config({"tensor_parallel_degree": 2}, 3)
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match=r"tensor_parallel_degree \(--smp-config\) \(2\)"):
        parse(BASE + ["--smp-config", '{"tensor_parallel_degree": 2}'])


def _library_sources():
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[3]
    sources = {}
    for path in list((root / "megatron_smp").rglob("*.py")) + [root / "pretrain_gpt.py"]:
        sources[str(path.relative_to(root))] = path.read_text()
    return root, sources


def test_every_accepted_flag_is_consumed_or_documented_as_ignored():
    """Walk the parser's whole table: each flag fills a config field that code outside the
    flag layer reads, or is post-processed in parse_args, or is on the documented ignore list
    (docs/flags.md's table, generated from IGNORED_FLAGS)."""
    import re

    from megatron_smp.training.arguments import (
        _FLAGS,
        IGNORED_FLAGS,
        IGNORED_WITHOUT,
        build_parser,
    )

    root, sources = _library_sources()
    arguments_source = "\n".join(sources.pop(path) for path in sorted(sources)
                                 if path.startswith("megatron_smp/training/arguments/"))
    config_source = "\n".join(sources.pop(path) for path in sorted(sources)
                              if path.startswith("megatron_smp/config/"))
    # Fields read only by a config/ method or function that the library calls.
    read_in_config = {"make_vocab_size_divisible_by": "padded_vocab_size",
                      "global_batch_size": "num_microbatches",
                      "moe_layer_freq": "moe_layer_pattern",
                      "expert_tensor_parallel_size": "validate",
                      "recompute_modules": "recompute_modules",
                      "window_attn_skip_freq": "layer_window_size",
                      "experimental_attention_variant": "validate",
                      "mup_base_hidden_size": "mup_width_mult",
                      "mup_output_mult": "mup_logit_mult",
                      "mup_base_head_dim": "attention_softmax_scale",
                      "mup_attn_scale_power": "attention_softmax_scale",
                      "fault_tolerance_lighthouse": "lighthouse",
                      "embedding_init_method_std": "embedding_init_std"}
    everything_else = "\n".join(sources.values())
    unused = []
    for spec in _FLAGS:
        if spec.section is None:  # post-processed: parse_args must read args.<dest>
            if not re.search(rf"\bargs\.{spec.field}\b", arguments_source):
                unused.append(spec.flag)
        elif spec.field in read_in_config:
            method = read_in_config[spec.field]
            assert f"def {method}" in config_source
            assert re.search(rf"[.\s(]{method}\b", everything_else), method
        elif not re.search(rf'\.{spec.field}\b|getattr\([^)]*"{spec.field}"', everything_else):
            unused.append(spec.flag)
    assert unused == [], f"flags parsed but never read: {unused}"

    accepted = {a for action in build_parser()._actions for a in action.option_strings}
    table = {spec.flag for spec in _FLAGS} | set(IGNORED_FLAGS) | {"-h", "--help"}
    assert accepted == table
    readme = (root / "docs" / "flags.md").read_text()
    table_start = readme.index("| flag | why it changes nothing here |")
    ignored_table = readme[table_start:readme.index("\n\n", table_start)]
    documented = set(re.findall(r"^\| `(--[\w-]+)` \|", ignored_table, flags=re.M))
    assert documented == set(IGNORED_FLAGS), (documented ^ set(IGNORED_FLAGS))
    # Flags that change nothing without another: "| `--flag` without `--other` | reason |".
    without = {flag: (other, reason) for flag, other, reason in re.findall(
        r"^\| `(--[\w-]+)` without `(--[\w-]+)` \| (.*) \|$", ignored_table, flags=re.M)}
    assert without == IGNORED_WITHOUT


def test_hidden_size_not_divisible_by_heads_needs_kv_channels():
    argv = BASE + ["--hidden-size", "100", "--num-attention-heads", "8"]
    with pytest.raises(ConfigError, match=r"--hidden-size \(100\).*--num-attention-heads \(8\)"
                                          r".*--kv-channels"):
        parse(argv)
    model = parse(argv + ["--kv-channels", "16"]).model
    assert model.kv_channels == 16


def test_scheduler_override_flags_contradict():
    with pytest.raises(ConfigError, match="--override-opt_param-scheduler.*"
                                          "--use-checkpoint-opt_param-scheduler"):
        parse(BASE + ["--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"])


def test_validation_is_pure():
    import copy

    configs = parse_args(BASE + ["--vocab-size", "100", "--tensor-model-parallel-size", "1"])
    before = copy.deepcopy(configs.to_dict())
    validate_configs(configs, world_size=1)
    assert configs.to_dict() == before


@pytest.mark.parametrize("extra", ["--decoder-first-pipeline-num-layers 1",
                                   "--num-layers-per-virtual-pipeline-stage 1",
                                   "--pipeline-timeline /tmp/trace"])
def test_pipeline_only_flags_need_pipeline_stages(extra):
    with pytest.raises(ConfigError, match=f"{extra.split()[0]} only apply with "
                                          r"--pipeline-model-parallel-size > 1"):
        parse(BASE + extra.split())


def test_pipeline_layout_is_validated_before_any_process_group(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"--num-layers \(3\)"):
        parse(BASE + "--pipeline-model-parallel-size 2 --num-layers 3".split())
    with pytest.raises(ConfigError, match="gpipe does not take virtual stages"):
        parse(BASE + "--pipeline-model-parallel-size 2 --num-layers 4 --pipeline-schedule gpipe "
                     "--virtual-pipeline-model-parallel-size 2 --global-batch-size 4".split())
    configs = parse(BASE + "--pipeline-model-parallel-size 2 --pipeline-schedule 1f1b".split())
    assert configs.training.pipeline_schedule == "1f1b"


def test_tensorboard_queue_size_reaches_the_writer(tmp_path):
    from megatron_smp.training.logging import TrainingLogger

    configs = parse(BASE + ["--tensorboard-dir", str(tmp_path), "--tensorboard-queue-size", "7"])
    logger = TrainingLogger(True, configs.training, torch.device("cpu"))
    event_writer = logger.writer._get_file_writer().event_writer
    assert event_writer._async_writer._byte_queue.maxsize == 7
    logger.close()


# Mixture of experts -----------------------------------------------------------------------------

MOE = "--num-experts 4 --moe-router-topk 2".split()


def test_moe_flags_fill_the_transformer_config(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    configs = parse(BASE + MOE + [
        "--expert-model-parallel-size", "2", "--moe-ffn-hidden-size", "48",
        "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff=0.01",
        "--moe-z-loss-coeff", "0.001", "--moe-token-dispatcher-type", "alltoall",
        "--moe-expert-capacity-factor", "1.5", "--moe-pad-expert-input-to-capacity",
        "--moe-token-drop-policy", "position", "--moe-grouped-gemm",
        "--moe-shared-expert-intermediate-size", "32", "--moe-shared-expert-gate",
        "--moe-router-pre-softmax", "--moe-input-jitter-eps", "0.01",
        "--moe-layer-freq", "([1]*1+[0]*1)*1", "--global-batch-size", "8",
    ])
    model = configs.model
    assert (model.num_moe_experts, model.moe_router_topk, model.moe_ffn_hidden_size) == (4, 2, 48)
    assert model.moe_router_load_balancing_type == "seq_aux_loss"
    assert (model.moe_aux_loss_coeff, model.moe_z_loss_coeff) == (0.01, 0.001)
    assert model.moe_token_dispatcher_type == "alltoall" and model.moe_grouped_gemm
    assert (model.moe_expert_capacity_factor, model.moe_token_drop_policy) == (1.5, "position")
    assert model.moe_pad_expert_input_to_capacity and model.moe_router_pre_softmax
    assert model.moe_shared_expert_intermediate_size == 32 and model.moe_shared_expert_gate
    assert model.moe_input_jitter_eps == 0.01
    assert configs.parallel.expert_model_parallel_size == 2
    validate_configs(configs, world_size=4)
    assert model.moe_layer_pattern() == [1, 0]


MOE_ERRORS = [
    ("--num-experts 6 --expert-model-parallel-size 4".split(), 4,
     r"--num-experts \(6\) must be divisible by --expert-model-parallel-size \(4\)"),
    ("--num-experts 4 --moe-router-topk 5".split(), 1,
     r"--moe-router-topk \(5\) must be between 1 and --num-experts \(4\)"),
    (["--expert-model-parallel-size", "2"], 2,
     r"--expert-model-parallel-size 2 needs a mixture-of-experts model"),
    (MOE + ["--expert-model-parallel-size", "4"], 2,
     r"--expert-model-parallel-size \(4\) must divide data-parallel x context-parallel "
     r"size \(2 x 1\)"),
    (MOE + ["--tensor-model-parallel-size", "2"], 2, r"need --sequence-parallel"),
    (MOE + ["--tensor-model-parallel-size", "2", "--sequence-parallel",
            "--expert-tensor-parallel-size", "4"], 4,
     r"--expert-tensor-parallel-size 4: experts split over more ranks than the dense"),
    (MOE + ["--tensor-model-parallel-size", "2", "--sequence-parallel",
            "--expert-tensor-parallel-size", "1", "--expert-model-parallel-size", "4"], 2,
     r"--expert-tensor-parallel-size \(1\) x --expert-model-parallel-size \(4\) must divide"),
    (["--moe-router-topk", "2"], 1, r"--moe-router-topk configure mixture-of-experts layers"),
    (MOE + ["--moe-layer-freq", "[1]*3"], 1, r"one 0 or 1 per layer \(--num-layers 2\)"),
    (MOE + ["--moe-layer-freq", "__import__('os')"], 1, r"--moe-layer-freq"),
    (MOE + ["--moe-pad-expert-input-to-capacity"], 1, r"needs --moe-expert-capacity-factor"),
    (MOE + ["--moe-router-load-balancing-type", "sinkhorn", "--moe-aux-loss-coeff", "0.1"], 1,
     r"sinkhorn balances without an auxiliary loss"),
]


@pytest.mark.parametrize("extra, world, message", MOE_ERRORS)
def test_bad_moe_settings_are_clear_errors(extra, world, message, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(ConfigError, match=message):
        parse(BASE + extra + ["--global-batch-size", "8"])


def test_global_aux_loss_parses_and_megatron_list_form_is_a_clear_error(capsys):
    model = parse(BASE + MOE + ["--moe-router-load-balancing-type", "global_aux_loss",
                                "--moe-aux-loss-coeff", "0.01"]).model
    assert (model.moe_router_load_balancing_type, model.moe_aux_loss_coeff) == (
        "global_aux_loss", 0.01)
    for extra in (["--moe-router-load-balancing-type", "aux_loss", "global_aux_loss"],
                  ["--moe-aux-loss-coeff", "0.01", "0.001"]):
        with pytest.raises(SystemExit):
            parse(BASE + MOE + extra)
        err = capsys.readouterr().err
        assert extra[0] in err and "combining load-balancing losses" in err


def test_torch_compile_with_fsdp2_is_refused_before_any_process_group():
    configs = parse_args(BASE + ["--torch-compile", "--use-torch-fsdp2"])
    configs.model.vocab_size = 1000
    with pytest.raises(ConfigError, match="--torch-compile is not supported with "
                                          "--use-torch-fsdp2"):
        validate_configs(configs, world_size=2)


def test_mode_sections_are_parsed_once_with_their_flags():
    """A mode's flags (added by its entry script) become its typed section in the one parse;
    pretraining has none of them."""
    from megatron_smp.config.inference import InferenceConfig
    from megatron_smp.config.post_training import DPOConfig, RLConfig
    from megatron_smp.training.arguments.modes import (
        add_dpo_args, add_inference_args, add_rl_args,
    )

    plain = parse(BASE)
    assert (plain.dpo, plain.rl, plain.inference) == (None, None, None)
    dpo = parse(BASE + "--sft --dpo-beta 0.3 --lora-rank 4".split(),
                extra_args_provider=add_dpo_args)
    assert dpo.dpo == DPOConfig(beta=0.3, reference="adapters-off")
    rl = parse_args(BASE + "--grpo-group-size 4 --grpo-prompts-per-step 2 "
                    "--inference-max-requests 8".split(),
                    extra_args_provider=lambda p: add_inference_args(add_rl_args(p)))
    assert rl.rl == RLConfig(group_size=4, prompts_per_step=2)
    assert rl.training.global_batch_size == 8  # one rollout per sequence
    assert rl.inference == InferenceConfig(max_requests=8)
    with pytest.raises(ConfigError, match="--dpo-reference adapters-off needs LoRA"):
        parse(BASE + "--sft --dpo-reference adapters-off".split(),
              extra_args_provider=add_dpo_args)
    with pytest.raises(ConfigError, match="--inference-max-tokens must be >= 1"):
        parse(BASE + "--inference-max-tokens 0".split(), extra_args_provider=add_inference_args)


def test_library_code_never_reads_the_flag_namespace():
    """Only the flag layer (training/arguments/, where the namespace becomes `Configs`) reads
    `Configs.args`; everything else, validation included, reads the typed sections."""
    import re

    _, sources = _library_sources()
    readers = sorted(path for path, text in sources.items()
                     if (not path.startswith("megatron_smp/training/arguments/")
                         or path.endswith("/validation.py"))
                     and re.search(r"configs\.args\b|\.args\.[a-z]", text))
    assert readers == [], readers


def test_microbatch_group_size_reaches_the_config_and_is_checked_against_the_batch():
    virtual = BASE + ["--pipeline-model-parallel-size", "2",
                      "--virtual-pipeline-model-parallel-size", "2", "--num-layers", "4",
                      "--global-batch-size", "8"]
    flag = "--microbatch-group-size-per-virtual-pipeline-stage"
    # 4 microbatches of 2 at world 2 (pp 2): a group of 4 runs; 3 leaves a last group of 1.

    def validated(group):
        configs = parse_args(virtual + [flag, group, "--vocab-size", "1000"])
        validate_configs(configs, world_size=2)
        return configs

    assert validated("4").training.microbatch_group_size_per_vp_stage == 4
    with pytest.raises(ConfigError, match=r"last group holds 1 microbatches \(4 % "
                                          rf"{flag} 3\)"):
        validated("3")
    with pytest.raises(ConfigError, match=rf"{flag} \(9\) must lie between"):
        validated("9")


def test_distributed_optimizer_instances_are_checked_against_the_layout():
    flag = ["--num-distributed-optimizer-instances", "2", "--vocab-size", "1000"]

    def validated(extra, world_size):
        configs = parse_args(BASE + flag + extra)
        validate_configs(configs, world_size=world_size)
        return configs

    assert validated(["--use-distributed-optimizer"], 4) \
        .optimizer.num_distributed_optimizer_instances == 2
    with pytest.raises(ConfigError, match="needs --use-distributed-optimizer"):
        validated([], 4)
    with pytest.raises(ConfigError, match=r"must divide the data-parallel x context-parallel "
                                          r"size \(3\)"):
        validated(["--use-distributed-optimizer"], 3)
    with pytest.raises(ConfigError, match=r"must divide the expert-data-parallel size \(1\)"):
        validated(["--use-distributed-optimizer", "--num-experts", "4",
                   "--expert-model-parallel-size", "4"], 4)
