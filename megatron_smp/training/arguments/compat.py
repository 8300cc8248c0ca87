"""The Megatron-LM and SMP compatibility layer: flags whose meaning is more than one config
field (Megatron's spellings of one setting, Megatron-FSDP's strategies, Megatron-LM main's
flags, the hybrid pattern, the emerging optimizers) and the SMP v2 / v1 `--smp-config` keys,
turned into config fields, or into the ConfigError saying why not.

Each function reads the parsed namespace and edits the per-section field dicts that
`parse.parse_args` builds the typed configs from.
"""
from __future__ import annotations

import argparse
import warnings
from typing import Any, Dict, List, Sequence

import torch

from megatron_smp.config import ConfigError
from megatron_smp.training.arguments.flags import _MOE_FLAGS


# Flags that only mean something with Llama 3.x scaling or with YaRN.
_LLAMA3_ROPE_FLAGS = ("--rope-scaling-factor", "--rope-scaling-low-freq-factor",
                      "--rope-scaling-high-freq-factor",
                      "--rope-scaling-original-max-position-embeddings")
_YARN_FLAGS = ("--rotary-scaling-factor", "--yarn-original-max-position-embeddings",
               "--yarn-beta-fast", "--yarn-beta-slow", "--mscale", "--mscale-all-dim",
               "--yarn-correction-range-round-to-int", "--no-yarn-correction-range-round-to-int")


# --enable-gpt-oss: the values Megatron-LM main sets on the model config (from Hugging Face's
# gpt-oss configuration), whatever the position-embedding flags say.
GPT_OSS_YARN = {
    "position_embedding_type": "yarn",
    "yarn_rotary_scaling_factor": 32.0,
    "yarn_original_max_position_embeddings": 131072,
    "yarn_beta_fast": 32.0,
    "yarn_beta_slow": 1.0,
    "yarn_mscale": 1.0,
    "yarn_mscale_all_dim": 0.0,
    "yarn_correction_range_round_to_int": False,
}


def _check_rope_scaling_flags(argv: Sequence[str], model: Dict[str, Any],
                              enable_gpt_oss: bool = False) -> None:
    """Scaling flags without the RoPE they scale are an error, never silently unused;
    --enable-gpt-oss sets YaRN's values itself (Megatron-LM overwrites any given)."""
    given = {token.split("=", 1)[0] for token in argv}
    if enable_gpt_oss:
        overridden = sorted(given & set(_YARN_FLAGS))
        if overridden:
            raise ConfigError(f"--enable-gpt-oss sets YaRN's values itself (Megatron-LM "
                              f"overwrites {', '.join(overridden)}); drop them, or drop "
                              "--enable-gpt-oss and give --position-embedding-type yarn")
        model.update(GPT_OSS_YARN)
        return
    llama3 = sorted(given & set(_LLAMA3_ROPE_FLAGS))
    if llama3 and not model.get("use_rope_scaling"):
        raise ConfigError(f"{', '.join(llama3)} configure Llama 3.x RoPE scaling: add "
                          "--use-rope-scaling, or drop them")
    yarn = sorted(given & set(_YARN_FLAGS))
    if yarn and "yarn" not in (model.get("position_embedding_type"), model.get("mla_rope_type")):
        raise ConfigError(f"{', '.join(yarn)} configure YaRN: add --position-embedding-type "
                          "yarn (with --multi-latent-attention: drop --rope-type rope), or "
                          "drop them")


def _apply_megatron_fsdp(args: argparse.Namespace, sections: Dict[str, Dict[str, Any]]) -> None:
    """Megatron-FSDP's flags on the engines built here, where the strategy maps exactly:
    no_shard is DDP, optim shards the optimizer state (--use-distributed-optimizer),
    optim_grads_params shards params, grads and optimizer state (FSDP2, --use-torch-fsdp2);
    optim_grads (params replicated, grads sharded) is not built."""
    if args.outer_dp_sharding_strategy != "no_shard":
        raise ConfigError("--outer-dp-sharding-strategy optim shards the optimizer state over "
                          "HSDP's outer data-parallel group (several distributed-optimizer "
                          "instances), which is not built here; give no_shard or drop it")
    strategy = args.data_parallel_sharding_strategy
    flag = f"--data-parallel-sharding-strategy {strategy}"
    if not args.use_megatron_fsdp:
        if strategy != "no_shard":
            raise ConfigError(f"{flag} configures Megatron-FSDP: add --use-megatron-fsdp (or use "
                              "--use-distributed-optimizer / --use-torch-fsdp2 directly)")
        return
    parallel, optimizer = sections["parallel"], sections["optimizer"]
    if parallel.get("use_torch_fsdp2"):
        raise ConfigError("--use-megatron-fsdp and --use-torch-fsdp2 pick two FSDP engines; "
                          "give one")
    if strategy == "optim_grads":
        raise ConfigError(f"{flag} (ZeRO-2: params replicated, grads and optimizer state "
                          "sharded) is not built; use optim_grads_params (full sharding on "
                          "FSDP2) or optim (--use-distributed-optimizer)")
    if strategy == "optim_grads_params":
        parallel["use_torch_fsdp2"] = True
        # Megatron-FSDP's documented recipe passes these too; FSDP2 shards the optimizer state
        # and overlaps its all-gathers and reduce-scatters by itself.
        for name in ("use_distributed_optimizer", "overlap_grad_reduce", "overlap_param_gather"):
            optimizer[name] = False
    elif strategy == "optim":
        optimizer["use_distributed_optimizer"] = True


# --spec values of Megatron's hybrid scripts: the stack --hybrid-layer-pattern builds here.
HYBRID_SPECS = (("megatron.core.models.hybrid.hybrid_layer_specs", "hybrid_stack_spec"),
                ("megatron.core.models.mamba.mamba_layer_specs", "mamba_stack_spec"))


def hybrid_pattern_given(argv: Sequence[str]) -> bool:
    """Whether `argv` gives --hybrid-layer-pattern (or its deprecated spelling)."""
    return any(token.split("=", 1)[0] in ("--hybrid-layer-pattern", "--hybrid-override-pattern")
               for token in argv)


def _apply_hybrid_flags(args, model: Dict[str, Any]) -> None:
    """--hybrid-layer-pattern (or its deprecated --hybrid-override-pattern) sets --num-layers
    (Megatron warns and takes the pattern's count); --spec may only name the hybrid stack."""
    if args.hybrid_override_pattern is not None:
        if model.get("hybrid_layer_pattern") is not None:
            raise ConfigError("--hybrid-override-pattern and --hybrid-layer-pattern cannot both "
                              "be given (the first is the deprecated name of the second)")
        model["hybrid_layer_pattern"] = args.hybrid_override_pattern
    pattern = model.get("hybrid_layer_pattern")
    if args.spec is not None and (pattern is None or tuple(args.spec) not in HYBRID_SPECS):
        raise ConfigError(
            f"--spec {' '.join(args.spec)}: layer specs are not loaded from modules here; the "
            "hybrid stack specs (" + ", ".join(" ".join(spec) for spec in HYBRID_SPECS)
            + ") are accepted with --hybrid-layer-pattern, which builds that stack")
    if pattern is None:
        return
    from megatron_smp.config import HYBRID_MTP_SEPARATOR, HYBRID_STAGE_BREAK

    count = len(pattern.split(HYBRID_MTP_SEPARATOR)[0].replace(HYBRID_STAGE_BREAK, ""))
    given = model.get("num_layers")
    if given is not None and given != count:
        warnings.warn(f"--hybrid-layer-pattern is set; ignoring --num-layers ({given}) and "
                      f"using the layer count derived from the pattern ({count})")
    model["num_layers"] = count


def _apply_megatron_main_flags(args: argparse.Namespace,
                               sections: Dict[str, Dict[str, Any]]) -> None:
    """Megatron-LM 0.19 / main flags: what each does here, or the error saying why not."""
    training, data, parallel = sections["training"], sections["data"], sections["parallel"]
    if args.disable_bf16_reduced_precision_matmul:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    if args.dataloader_inter_document_masking:
        data["reset_attention_mask"] = True
    for flag, value, same, what in (
            ("--eval-micro-batch-size", args.eval_micro_batch_size,
             training.get("micro_batch_size", 1), "--micro-batch-size"),
            ("--eval-global-batch-size", args.eval_global_batch_size,
             training.get("global_batch_size"), "--global-batch-size")):
        if value is not None and value != same:
            raise ConfigError(f"{flag} {value}: evaluation here runs with the training batch "
                              f"({what} {same}); drop it or give the same value")
    if args.null_tokenizer_eod_id is not None:
        vocab = data.get("vocab_size")
        if args.null_tokenizer_eod_id != vocab:
            raise ConfigError(
                f"--null-tokenizer-eod-id {args.null_tokenizer_eod_id}: the NullTokenizer here "
                f"gives EOD the id after the text ids (--vocab-size, {vocab}); Megatron-LM "
                "main's default, vocab_size - 1, is one of the text ids; drop it")
    if args.exit_signal_handler_for_training:
        raise ConfigError("--exit-signal-handler-for-training (Megatron-LM main: exit quietly on "
                          "SIGINT/SIGTERM) is not built; --exit-signal-handler saves a "
                          "checkpoint and exits on --exit-signal")
    fsdp_dtypes = [(flag, value) for flag, value in (
        ("--megatron-fsdp-main-params-dtype", args.megatron_fsdp_main_params_dtype),
        ("--megatron-fsdp-main-grads-dtype", args.megatron_fsdp_main_grads_dtype),
        ("--megatron-fsdp-grad-comm-dtype", args.megatron_fsdp_grad_comm_dtype))
        if value is not None]
    if fsdp_dtypes and not args.use_megatron_fsdp:
        raise ConfigError(f"{', '.join(f for f, _ in fsdp_dtypes)} configure Megatron-FSDP: "
                          "add --use-megatron-fsdp, or drop them")
    for flag, value in fsdp_dtypes:
        # FSDP2 here keeps fp32 main params and fp32 grads (reduced in fp32, or bf16 with
        # --grad-reduce-in-bf16): those values, and auto for an fp32 model, are what it does.
        fp32_model = not (args.bf16 or args.fp16)
        if value == "fp32" or (value == "auto" and (fp32_model or "comm" in flag)):
            continue
        raise ConfigError(f"{flag} {value}: FSDP2 here keeps fp32 main params and grads; give "
                          "fp32 (or auto), or drop it")
    if args.num_virtual_stages_per_pipeline_rank is not None:
        given = parallel.get("virtual_pipeline_model_parallel_size")
        if given is not None and given != args.num_virtual_stages_per_pipeline_rank:
            raise ConfigError("--num-virtual-stages-per-pipeline-rank and "
                              "--virtual-pipeline-model-parallel-size are one setting; give one")
        parallel["virtual_pipeline_model_parallel_size"] = args.num_virtual_stages_per_pipeline_rank
    if args.cuda_graph_impl != "none" and not hasattr(args, "inference_max_tokens"):
        # (the inference tools and train_rl.py's rollouts capture decode steps: modes.py)
        raise ConfigError(f"--cuda-graph-impl {args.cuda_graph_impl} captures CUDA graphs of "
                          "training steps, which megatron_smp does not build; drop it (a "
                          "hardware-only switch). The inference tools take --cuda-graph-impl "
                          "local for their decode steps")
    if sections["checkpoint"].get("ckpt_format") == "torch_dcp":
        # Megatron-LM's torch_dcp (FSDP2 only) is plain DCP, as our torch_dist is.
        if not parallel.get("use_torch_fsdp2"):
            raise ConfigError("--ckpt-format torch_dcp is Megatron-LM's FSDP2 format: add "
                              "--use-torch-fsdp2, or use torch_dist")
        sections["checkpoint"]["ckpt_format"] = "torch_dist"


def _apply_optimizer_choice(args: argparse.Namespace, optimizer: Dict[str, Any],
                            argv: Sequence[str]) -> None:
    """Megatron-LM main's emerging optimizers: dist_muon is its deprecated spelling of muon
    with --use-distributed-optimizer; SOAP, adaptive Muon and the Triton SYRK kernel are not
    built here."""
    if optimizer.get("optimizer") == "dist_muon":
        optimizer["optimizer"] = "muon"
        optimizer["use_distributed_optimizer"] = True
    if optimizer.get("optimizer") in ("soap", "adaptive_muon"):
        raise ConfigError(f"--optimizer {optimizer['optimizer']} is not built here; use "
                          "--optimizer muon (or lion, adam, sgd)")
    if args.muon_use_syrk:
        raise ConfigError("--muon-use-syrk picks emerging_optimizers' Triton SYRK kernel "
                          "(CUDA, emerging_optimizers >= 0.4) for the Gram matrix; the "
                          "iteration here uses torch's matmul: drop it")
    given = {token.split("=", 1)[0] for token in argv}
    muon_flags = sorted(flag for flag in given if flag.startswith("--muon-"))
    if muon_flags and optimizer.get("optimizer") != "muon":
        raise ConfigError(f"{', '.join(muon_flags)} configure Muon: add --optimizer muon, or "
                          "drop them")
    lion_flags = sorted(flag for flag in given if flag.startswith("--lion-"))
    lion_used = optimizer.get("optimizer") == "lion" or (
        optimizer.get("optimizer") == "muon" and optimizer.get("muon_scalar_optimizer") == "lion")
    if lion_flags and not lion_used:
        raise ConfigError(f"{', '.join(lion_flags)} configure Lion: add --optimizer lion (or "
                          "--optimizer muon --muon-scalar-optimizer lion), or drop them")


# SMP v2 key -> (config section, field) it sets when the user gives it. Every other key is
# checked by smp's validator (and rejected there when its capability does not exist yet).
_SMP_TO_FLAGS = {
    "tensor_parallel_degree": ("parallel", "tensor_model_parallel_size"),
    "pipeline_parallel_degree": ("parallel", "pipeline_model_parallel_size"),
    "context_parallel_degree": ("parallel", "context_parallel_size"),
    "cp_comm_type": ("model", "cp_comm_type"),
    "expert_parallel_degree": ("parallel", "expert_model_parallel_size"),
    "hybrid_shard_degree": ("parallel", "hybrid_shard_degree"),
    "shard_optimizer_state": ("optimizer", "use_distributed_optimizer"),
    "random_seed": ("training", "seed"),
}


def _apply_smp_config(text: str, sections: Dict[str, Dict[str, Any]],
                      setting_names: Dict[str, str]) -> None:
    """Merge the keys of an SMP v2 JSON config over the parsed flags."""
    import json

    from megatron_smp.smp import read_smp_keys

    source: Any = text
    if text.lstrip().startswith("{"):
        try:
            source = json.loads(text)
        except json.JSONDecodeError as error:
            raise ConfigError(f"--smp-config is not valid JSON: {error}") from None
    given, values = read_smp_keys(source)
    from megatron_smp.smp import FSDP_SCRIPT_KEYS

    script_only = sorted(given & set(FSDP_SCRIPT_KEYS))
    if script_only:
        raise ConfigError(
            f"--smp-config keys {script_only} configure smp.fully_shard in a script of your own "
            "(see scripts/train_smp_fsdp.py); the training scripts do not read them: drop them"
        )
    for key in given & set(_SMP_TO_FLAGS):
        section, name = _SMP_TO_FLAGS[key]
        sections[section][name] = values[key]
        if section == "parallel":
            setting_names[name] = f"{key} (--smp-config)"
    if values["v1"]:
        _apply_smp_v1_settings(values["v1"], sections)


def _apply_smp_v1_settings(v1: Dict[str, Any], sections: Dict[str, Dict[str, Any]]) -> None:
    """SMP v1 keys of --smp-config (see megatron_smp.smp.v1_config) on the training scripts'
    settings: microbatches -> the global batch, pipeline -> --pipeline-schedule, optimize ->
    --sequence-parallel; ddp and placement_strategy are checked against the degrees."""
    import logging

    from megatron_smp.parallel_state import launcher_world_size
    from megatron_smp.smp.v1_config import check_v1_layout

    logger = logging.getLogger("megatron_smp.smp")
    parallel, training = sections["parallel"], sections["training"]
    tp = parallel.get("tensor_model_parallel_size", 1)
    pp = parallel.get("pipeline_model_parallel_size", 1)
    cp = parallel.get("context_parallel_size", 1)
    world = launcher_world_size()
    check_v1_layout(v1, {"T": tp, "P": pp, "D": max(1, world // (tp * pp))})
    if "microbatches" in v1:
        dp = max(1, world // (tp * pp * cp))
        micro = training.get("micro_batch_size", 1)
        global_batch = micro * dp * v1["microbatches"]
        given = training.get("global_batch_size")
        if given is not None and given != global_batch:
            raise ConfigError(
                f"--smp-config microbatches {v1['microbatches']} means --global-batch-size "
                f"{global_batch} (--micro-batch-size {micro} x {dp} data-parallel ranks x "
                f"{v1['microbatches']}), but --global-batch-size {given} was given: drop one"
            )
        training["global_batch_size"] = global_batch
        logger.warning("smp: v1 key microbatches=%d -> --global-batch-size %d (%d microbatches "
                       "of %d per data-parallel rank)", v1["microbatches"], global_batch,
                       v1["microbatches"], micro)
    if "pipeline" in v1:
        training["pipeline_schedule"] = v1["pipeline"]
        logger.warning("smp: v1 key pipeline=%r -> --pipeline-schedule %s", v1["pipeline"],
                       v1["pipeline"])
    if "sequence_parallel" in v1:
        sections["model"]["sequence_parallel"] = v1["sequence_parallel"] and tp > 1


def _position_fields(args: argparse.Namespace, model: Dict[str, Any]) -> None:
    """The position-embedding fields from Megatron's spellings of them."""
    if args.use_rotary_position_embeddings:
        model["position_embedding_type"] = "rope"
    if not args.add_position_embedding and model.get("position_embedding_type") != "rope":
        # Megatron (core_v0.16.1) accepts it only with RoPE, where it changes nothing.
        raise ConfigError("--no-position-embedding is Megatron's deprecated spelling, valid only "
                          "with --position-embedding-type rope; use --position-embedding-type "
                          "none (no position information) or rope")
    if args.rope_type == "yarn" and not model.get("multi_latent_attention"):
        raise ConfigError("--rope-type yarn applies to --multi-latent-attention (Megatron's "
                          "MLA RoPE); for other attention use --position-embedding-type yarn")
    if (model.get("multi_latent_attention") and args.rope_type != "rope"
            and model.get("position_embedding_type") == "rope"):
        model["position_embedding_type"] = "yarn"
    if model.get("multi_latent_attention") and model.get(
            "position_embedding_type", "learned_absolute") in ("learned_absolute", "none"):
        # Megatron's MLA rotates its positional channels with its own --rope-type (default
        # yarn) beside the learned absolute positions.
        model["mla_rope_type"] = args.rope_type or "yarn"


def _activation_fields(args: argparse.Namespace, argv: List[str],
                       model: Dict[str, Any]) -> None:
    """The MLP activation from --squared-relu / --swiglu / --openai-gelu / --quick-geglu /
    --geglu."""
    choices = (("--squared-relu", args.squared_relu), ("--openai-gelu", args.openai_gelu),
               ("--quick-geglu", args.quick_geglu), ("--geglu", args.geglu))
    if args.swiglu and "--swiglu" not in argv and any(given for _, given in choices):
        args.swiglu = False  # an entry script's default (pretrain_llama.py) gives way
    activations = [flag for flag, given in (("--swiglu", args.swiglu),) + choices if given]
    if len(activations) > 1:
        raise ConfigError(f"{' and '.join(activations)} each pick the MLP activation; give one")
    if args.squared_relu:
        model["activation"] = "squared_relu"
    if args.quick_geglu:  # Megatron: quick_gelu gated, ffn size as given (no 2/3 rule)
        model["gated_linear_unit"] = True
        model["activation"] = "quick_gelu"
    if args.swiglu:
        model["gated_linear_unit"] = True
        model["activation"] = "silu"
        if model.get("ffn_hidden_size") is None and model.get("hidden_size") is not None:
            # Megatron's SwiGLU default: 2/3 of 4h (same parameter count), rounded to 64.
            # (No --hidden-size: --use-checkpoint-args gives both.)
            model["ffn_hidden_size"] = int((4 * model["hidden_size"] * 2 / 3) / 64) * 64
    if args.openai_gelu:
        model["activation"] = "gelu_tanh"  # GPT-2's approximate GeLU ("gelu_new" in HF)
    if args.geglu:
        model["gated_linear_unit"] = True
        model["activation"] = "gelu_tanh"


def _model_fields(args: argparse.Namespace, argv: List[str],
                  sections: Dict[str, Dict[str, Any]]) -> None:
    """Bias, attention groups, MoE, precision and vocabulary fields from the flags."""
    model, training, data = sections["model"], sections["training"], sections["data"]
    if args.disable_bias_linear:
        model["add_bias_linear"] = False
    if args.group_query_attention:
        if args.num_query_groups is None:
            raise ConfigError("--group-query-attention needs --num-query-groups")
        model["num_query_groups"] = args.num_query_groups
    elif args.num_query_groups is not None:
        raise ConfigError("--num-query-groups is only used with --group-query-attention; add it")
    moe_given = sorted({t.split("=", 1)[0] for t in argv} & _MOE_FLAGS)
    if moe_given and model.get("num_moe_experts") is None:
        raise ConfigError(f"{', '.join(moe_given)} configure mixture-of-experts layers: add "
                          "--num-experts N, or drop them")
    if model.get("max_position_embeddings") is None:
        model["max_position_embeddings"] = training["seq_length"]
    if args.grad_reduce_in_bf16:
        if not args.bf16:
            raise ConfigError("--grad-reduce-in-bf16 applies to --bf16 models only (Megatron "
                              "ignores it otherwise); add --bf16 or drop it")
        sections["optimizer"]["accumulate_allreduce_grads_in_fp32"] = False
    if args.fp16 and args.bf16:
        raise ConfigError("--fp16 and --bf16 are mutually exclusive; pick one")
    precision = {"fp16": args.fp16, "bf16": args.bf16}
    model.update(precision)
    model["params_dtype"] = (
        torch.float16 if args.fp16 else torch.bfloat16 if args.bf16 else torch.float32
    )
    # The vocabulary is known only once the tokenizer is built; filled in by pretrain.
    model.setdefault("vocab_size", data.get("vocab_size") or 0)
