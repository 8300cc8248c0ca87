"""validate_configs: every check that needs more than one config section, run once before any
process group exists (each section's own checks live beside it in megatron_smp.config)."""
from __future__ import annotations

from typing import Optional

import torch

from megatron_smp.checkpointing.loop import check_checkpoint_flags
from megatron_smp.config import ConfigError
from megatron_smp.config.sections import Configs


def _validate_training_length(configs: Configs, data_parallel_size: int) -> None:
    """Megatron's rules for iteration- and sample-based runs: each counts its length, warm-up
    and decay in its own unit, never mixed; --rampup-batch-size needs samples."""
    from megatron_smp.training.num_microbatches import NumMicrobatchesCalculator

    training, optimizer = configs.training, configs.optimizer
    if (training.train_iters is None) == (training.train_samples is None):
        raise ConfigError("give the run's length as one of --train-iters N or --train-samples N"
                          + ("" if training.train_iters is None else ", not both"))
    unit, other = ("iters", "samples") if training.train_iters is not None else ("samples",
                                                                                   "iters")
    mixed = [f"--lr-{name}-{other}" for name in ("warmup", "decay", "wsd-decay")
             if getattr(optimizer, f"lr_{name.replace('-', '_')}_{other}")]
    if mixed:
        raise ConfigError(f"{', '.join(mixed)} count {other}, but the run is given in {unit} "
                          f"(--train-{unit}); use the --lr-*-{unit} flags")
    if optimizer.lr_warmup_fraction is not None and getattr(optimizer, f"lr_warmup_{unit}"):
        raise ConfigError(f"give one of --lr-warmup-fraction and --lr-warmup-{unit}")
    calculator = NumMicrobatchesCalculator(training, data_parallel_size)
    for flag, value in (("--train-iters", training.train_iters),
                        ("--train-samples", training.train_samples)):
        if value is not None and calculator.train_iters(
                training.train_iters, training.train_samples) < 1:
            raise ConfigError(f"{flag} {value} is less than one iteration (global batch "
                              f"{calculator.global_batch_size_at(0)})")
    parallel = configs.parallel
    if (parallel.pipeline_model_parallel_size > 1
            and (training.rampup_batch_size or training.step_batch_size_schedule)
            and (parallel.virtual_pipeline_model_parallel_size
                 or parallel.num_layers_per_virtual_pipeline_stage)):
        from megatron_smp.pipeline_parallel.schedules import check_virtual_microbatches

        for count in calculator.microbatch_counts():
            check_virtual_microbatches(count, parallel.pipeline_model_parallel_size,
                                       training.microbatch_group_size_per_vp_stage)


def validate_configs(configs: Configs, world_size: Optional[int] = None) -> None:
    """Check everything that can be checked before a process group exists. Pure (changes
    nothing); `pretrain` runs it once, after the tokenizer has set the vocabulary size.

    Runs identically on every rank, so a bad configuration fails everywhere at once.
    """
    from megatron_smp.parallel_state import launcher_world_size

    world_size = world_size or launcher_world_size()
    parallel = configs.parallel
    parallel.check_supported(configs.setting_names)
    parallel.validate(world_size, names=configs.setting_names)
    configs.model.validate(parallel, configs.training.seq_length, names=configs.setting_names)
    configs.optimizer.validate()
    training = configs.training
    if training.micro_batch_size < 1:
        raise ConfigError("--micro-batch-size must be >= 1")
    data_parallel_size = parallel.data_parallel_size_for(world_size)
    _validate_training_length(configs, data_parallel_size)
    _validate_optimizer_instances(configs, data_parallel_size)
    backend = parallel.distributed_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if (configs.checkpoint.async_save and not parallel.use_gloo_process_groups
            and backend != "gloo"):
        raise ConfigError(
            "--async-save writes from a background thread over a gloo process group of its "
            f"own, which --disable-gloo-process-groups rules out on a {backend} job: drop one "
            "of the two flags"
        )
    from megatron_smp.data.dataset_builder import check_cache_flags

    check_cache_flags(configs.data)
    from megatron_smp.distributed.fsdp import validate_fsdp_configs

    validate_fsdp_configs(configs)
    if parallel.pipeline_model_parallel_size > 1:
        from megatron_smp.pipeline_parallel.stages import validate_pipeline_configs

        validate_pipeline_configs(configs, parallel.pipeline_model_parallel_size,
                                  data_parallel_size)
    _validate_logging_flags(configs)
    _validate_feature_combinations(configs)
    _validate_data_flags(configs)
    _validate_checkpoint_flags(configs)
    configs.resilience.validate(configs.checkpoint.save, world_size,
                                load=configs.checkpoint.load)
    _validate_replica_groups(configs)
    _validate_inprocess_restart(configs)
    _validate_modes(configs)


def _validate_optimizer_instances(configs: Configs, data_parallel_size: int) -> None:
    """--num-distributed-optimizer-instances against the layout (as Megatron-LM asserts)."""
    instances = configs.optimizer.num_distributed_optimizer_instances
    if instances == 1:
        return
    parallel = configs.parallel
    dp_cp = data_parallel_size * parallel.context_parallel_size
    if dp_cp % instances:
        raise ConfigError(f"--num-distributed-optimizer-instances ({instances}) must divide the "
                          f"data-parallel x context-parallel size ({dp_cp})")
    if configs.model.num_moe_experts is not None:
        etp = parallel.expert_tensor_parallel_size or parallel.tensor_model_parallel_size
        expert_dp = (dp_cp * parallel.tensor_model_parallel_size
                     // (etp * parallel.expert_model_parallel_size))
        if expert_dp % instances:
            raise ConfigError(f"--num-distributed-optimizer-instances ({instances}) must divide "
                              f"the expert-data-parallel size ({expert_dp})")
    if parallel.use_torch_fsdp2:
        raise ConfigError("--num-distributed-optimizer-instances shards Megatron's distributed "
                          "optimizer; with --use-torch-fsdp2 shard in groups with "
                          "hybrid_shard_degree instead")


def _validate_replica_groups(configs: Configs) -> None:
    """--fault-tolerance against the rest of the run."""
    if not configs.resilience.fault_tolerance:
        return
    for flag, on in (("--use-torch-fsdp2", configs.parallel.use_torch_fsdp2),
                     ("train_dpo.py", configs.dpo is not None),
                     ("train_rl.py", configs.rl is not None)):
        if on:
            raise ConfigError(f"--fault-tolerance does not apply to {flag}: replica groups run "
                              "the pretraining / SFT scripts over our DDP (with tensor, "
                              "pipeline and data parallelism inside each group)")


def _validate_inprocess_restart(configs: Configs) -> None:
    """--inprocess-restart restarts pretrain()'s run (pretraining, SFT, DPO)."""
    if not configs.resilience.inprocess_restart:
        return
    if configs.rl is not None:
        raise ConfigError("--inprocess-restart restarts the pretraining, SFT and DPO runs; "
                          "train_rl.py is not restarted in process: use --enable-ft-package "
                          "with torchrun --max-restarts")
    if configs.resilience.fault_tolerance:
        raise ConfigError("--inprocess-restart and --fault-tolerance recover the same faults "
                          "two ways (a restart of every rank / the other replica groups going "
                          "on): give one")


def _validate_logging_flags(configs: Configs) -> None:
    """Log intervals, --manual-gc's companions, TensorBoard-only logging."""
    training = configs.training
    for flag, value in (("--log-interval", training.log_interval),
                        ("--tensorboard-log-interval", training.tensorboard_log_interval),
                        ("--tensorboard-queue-size", training.tensorboard_queue_size)):
        if value < 1:
            raise ConfigError(f"{flag} must be >= 1, got {value}")
    if training.manual_gc_interval < 0:
        raise ConfigError(f"--manual-gc-interval must be >= 0, got {training.manual_gc_interval}")
    if (training.manual_gc_interval or not training.manual_gc_eval) and not training.manual_gc:
        raise ConfigError("--manual-gc-interval / --no-manual-gc-eval need --manual-gc")
    logging_to_tensorboard = [
        flag for flag, on in (
            ("--log-timers-to-tensorboard", training.log_timers_to_tensorboard),
            ("--log-validation-ppl-to-tensorboard", training.log_validation_ppl_to_tensorboard),
            ("--log-memory-to-tensorboard", training.log_memory_to_tensorboard),
        ) if on
    ]
    if logging_to_tensorboard and not training.tensorboard_dir:
        raise ConfigError(f"{', '.join(logging_to_tensorboard)} need --tensorboard-dir DIR")
    if training.moe_per_layer_logging:
        if not (training.tensorboard_dir or training.wandb_project):
            raise ConfigError("--moe-per-layer-logging writes TensorBoard / W&B scalars: add "
                              "--tensorboard-dir DIR or --wandb-project NAME")
        if configs.model.num_moe_experts is None:
            raise ConfigError("--moe-per-layer-logging needs a mixture-of-experts model "
                              "(--num-experts)")


def _validate_feature_combinations(configs: Configs) -> None:
    """LoRA's and multi-token prediction's flags and what they do not combine with."""
    training, parallel = configs.training, configs.parallel
    if training.lora_rank:
        from megatron_smp.tensor_parallel.lora import check_lora_flags

        check_lora_flags(training.lora_rank, training.lora_alpha, training.lora_dropout,
                         training.lora_target_modules)
        if parallel.use_torch_fsdp2:
            raise ConfigError("--lora-rank is not supported with --use-torch-fsdp2 yet; use "
                              "DDP or --use-distributed-optimizer")
    elif configs.checkpoint.pretrained_checkpoint:
        raise ConfigError("--pretrained-checkpoint names the base model of a --lora-rank run; "
                          "for full fine-tuning use --load DIR --finetune")
    etp = parallel.expert_tensor_parallel_size
    split_experts = (configs.model.num_moe_experts is not None and etp is not None
                     and etp != parallel.tensor_model_parallel_size)
    if split_experts and training.lora_rank:
        raise ConfigError(f"--expert-tensor-parallel-size {etp} (below "
                          "--tensor-model-parallel-size) with --lora-rank is not supported "
                          "yet; drop one of the two")
    if split_experts and configs.checkpoint.ckpt_format == "torch" and configs.checkpoint.save:
        raise ConfigError(f"--expert-tensor-parallel-size {etp} (below "
                          "--tensor-model-parallel-size) with --ckpt-format torch is not "
                          "supported yet (its files are per TP x PP x EP rank); use "
                          "--ckpt-format torch_dist")
    if configs.model.mtp_num_layers is not None:
        unsupported = [flag for flag, on in (
            ("--calculate-per-token-loss", configs.optimizer.calculate_per_token_loss),
            ("--use-torch-fsdp2", parallel.use_torch_fsdp2),
            # MTP's one-token shifts would carry tokens across packed documents.
            ("--sft", configs.data.sft),
            ("--reset-attention-mask", configs.data.reset_attention_mask),
        ) if on]
        if unsupported:
            raise ConfigError(f"--mtp-num-layers with {', '.join(unsupported)} is not "
                              "supported yet; drop one of them (MTP trains with the mean loss "
                              "on unpacked sequences, with DDP or --use-distributed-optimizer)")


def _validate_data_flags(configs: Configs) -> None:
    """SFT packing, packed documents under context parallelism, the dataset paths."""
    data, parallel = configs.data, configs.parallel
    if data.fim_data:
        if data.mock_data:
            raise ConfigError("--fim-data rearranges real text: it does not take --mock-data "
                              "(as in Megatron-LM); give --data-path")
        for flag, rate in (("--fim-rate", data.fim_rate), ("--fim-spm-rate", data.fim_spm_rate),
                           ("--fim-fragment-rate", data.fim_fragment_rate)):
            if rate is not None and not 0.0 <= rate <= 1.0:
                raise ConfigError(f"{flag} is a probability: between 0 and 1, got {rate}")
        if (data.fim_split_sample is None) != (data.fim_fragment_rate is None):
            raise ConfigError("--fim-split-sample and --fim-fragment-rate go together")
    if data.sft:
        # Packing is computed in memory from the conversation lengths; these flags shape
        # pretraining samples only, and the loss mask comes from the data.
        ignored = [flag for flag, on in (
            ("--eod-mask-loss", data.eod_mask_loss),
            ("--data-cache-path", data.data_cache_path),
            ("--per-dataset-sequences-path", data.per_dataset_sequences_path),
            ("--dataloader-fast-cache-load", data.dataloader_fast_cache_load),
            ("--dataloader-defer-npy-index-mmap", data.dataloader_defer_npy_index_mmap),
        ) if on]
        if ignored:
            raise ConfigError(
                f"--sft with {', '.join(ignored)}: SFT packs conversations in memory and trains "
                "on the loss mask tools/preprocess_sft_data.py wrote; drop "
                f"{'it' if len(ignored) == 1 else 'them'}")
    packed_by = "--sft" if data.sft else "--reset-attention-mask"
    if ((data.sft or data.reset_attention_mask) and parallel.context_parallel_size > 1
            and configs.model.cp_comm_type != "all_gather"):
        raise ConfigError(
            f"{packed_by} with --context-parallel-size {parallel.context_parallel_size} needs "
            "--cp-comm-type all_gather (packed documents attend to their keys gathered over "
            "the CP ranks; p2p and a2a attend with causal masks only)"
        )
    per_split_paths = [flag for flag, paths in (
        ("--train-data-path", data.train_data_path), ("--valid-data-path", data.valid_data_path),
        ("--test-data-path", data.test_data_path),
        ("--per-split-data-args-path", data.per_split_data_args_path)) if paths]
    whole_paths = [flag for flag, paths in (("--data-path", data.data_path),
                                            ("--data-args-path", data.data_args_path)) if paths]
    if not data.mock_data and not whole_paths and not per_split_paths:
        raise ConfigError("give --data-path PREFIX [...] (a preprocessed dataset), "
                          "--train-data-path/--valid-data-path/--test-data-path, or --mock-data")
    if len(whole_paths) > 1 or (whole_paths and per_split_paths):
        raise ConfigError(f"{' and '.join(whole_paths + per_split_paths)} are exclusive "
                          "(Megatron's rule): give one dataset cut by --split, or one dataset "
                          "per split")
    # Whether --split was given at all (the field has Megatron's default).
    if per_split_paths and "--split" in configs.given_flags:
        raise ConfigError(f"--split cuts --data-path; {'/'.join(per_split_paths)} are used "
                          "whole (Megatron refuses both too): drop --split")
    if data.mid_level_dataset_surplus < 0:
        raise ConfigError(f"--mid-level-dataset-surplus must be >= 0, got "
                          f"{data.mid_level_dataset_surplus}")


def _validate_checkpoint_flags(configs: Configs) -> None:
    """--save-interval, the run-control flags, the LR-schedule choice on load, the format."""
    checkpoint = configs.checkpoint
    _validate_run_flags(configs)
    if checkpoint.override_opt_param_scheduler and checkpoint.use_checkpoint_opt_param_scheduler:
        raise ConfigError(
            "--override-opt_param-scheduler (the command line's LR schedule wins) and "
            "--use-checkpoint-opt_param-scheduler (the checkpoint's wins) contradict each "
            "other; give one"
        )
    check_checkpoint_flags(checkpoint)


def _validate_run_flags(configs: Configs) -> None:
    """Run control, profiling and wandb flags (their modules own the checks)."""
    from megatron_smp.training.profiling import validate_profiling
    from megatron_smp.training.result_validation import validate_result_flags
    from megatron_smp.training.run_control import validate_run_control
    from megatron_smp.training.wandb_logger import validate_wandb

    backend = configs.parallel.distributed_backend
    cuda = torch.cuda.is_available()
    validate_run_control(
        configs.training,
        # An ignored flag (no config field): only whether it was given.
        use_flash_attn="--use-flash-attn" in configs.given_flags,
        uses_nccl=backend == "nccl" or (backend is None and cuda),
        sharded_params=configs.parallel.use_torch_fsdp2,
    )
    validate_profiling(configs.training, cuda)
    validate_result_flags(configs.training)
    if configs.training.torch_compile and configs.parallel.use_torch_fsdp2:
        raise ConfigError("--torch-compile is not supported with --use-torch-fsdp2 yet; "
                          "drop one of them")
    if configs.training.torch_compile and "layernorm" in (configs.model.recompute_modules or ()):
        raise ConfigError("--recompute-modules layernorm frees and refills tensor storage "
                          "between forward and backward, which --torch-compile's graphs do "
                          "not allow: drop one of them")
    validate_wandb(configs.training, configs.checkpoint.save)
    if configs.training.log_progress and not configs.checkpoint.save:
        raise ConfigError("--log-progress writes <--save>/progress.txt: add --save DIR")


def _validate_modes(configs: Configs) -> None:
    """The sections of the modes beside pretraining (present when their flags were added):
    DPO, RL and the inference engine, each against the rest of the run."""
    if configs.dpo is not None:
        check_dpo_configs(configs)
    if configs.rl is not None:
        check_rl_configs(configs, configs.rl)
    if configs.inference is not None:
        _validate_inference(configs)


def check_dpo_configs(configs: Configs) -> None:
    """What a DPO run (train_dpo.py) cannot do, naming the flag."""
    configs.dpo.validate(bool(configs.training.lora_rank))
    if configs.optimizer.calculate_per_token_loss:
        raise ConfigError("--calculate-per-token-loss does not apply to DPO (its loss is a mean "
                          "over pairs); drop it")
    if not configs.data.sft:
        raise ConfigError("train_dpo.py reads packed preference pairs: keep --sft (its default "
                          "here)")


def check_rl_configs(configs, config) -> None:
    """ConfigErrors naming the flag for what a RL run cannot do (on every rank, before any
    collective); `config`: its RLConfig (validated on construction)."""
    parallel, training = configs.parallel, configs.training
    if config.env_config is None:
        raise ConfigError("train_rl.py needs --langrl-env-config (a YAML list of environments: "
                          "prompts and reward functions; see "
                          "megatron_smp/post_training/envs/addition.yaml)")
    if parallel.context_parallel_size > 1 and configs.model.cp_comm_type != "all_gather":
        raise ConfigError(f"train_rl.py with --context-parallel-size "
                          f"{parallel.context_parallel_size} needs --cp-comm-type all_gather "
                          f"(each rollout attends only to itself: its row's documents attend "
                          f"to their keys gathered over the CP ranks; p2p and a2a attend with "
                          f"causal masks only)")
    if parallel.virtual_pipeline_model_parallel_size not in (None, 1):
        raise ConfigError("train_rl.py: virtual pipeline stages are not supported by the "
                          "inference engine; drop --num-layers-per-virtual-pipeline-stage")
    if training.rampup_batch_size:
        raise ConfigError("train_rl.py: --rampup-batch-size does not apply (a step's batch is "
                          "--grpo-group-size x --grpo-prompts-per-step rollouts)")
    if configs.optimizer.calculate_per_token_loss:
        raise ConfigError("train_rl.py: --calculate-per-token-loss does not apply (the GRPO "
                          "loss normalises over the rollout batch itself; --grpo-loss-type "
                          "dapo is the per-token mean)")
    inference = getattr(configs, "inference", None)
    if inference is not None and inference.max_seq_length is not None:
        raise ConfigError("train_rl.py: a rollout fills one sequence of --seq-length; drop "
                          "--inference-max-seq-length (the engine's limit follows it)")
    if training.global_batch_size != config.rollouts_per_step:
        raise ConfigError(f"train_rl.py: --global-batch-size ({training.global_batch_size}) "
                          f"must equal --grpo-group-size x --grpo-prompts-per-step "
                          f"({config.rollouts_per_step}): one rollout per sequence; leave "
                          f"--global-batch-size out to get it")


def _validate_inference(configs: Configs) -> None:
    """The --inference-* and speculative-decoding flags."""
    from megatron_smp.inference.engine import check_step_budget
    from megatron_smp.inference.speculative import speculative_config_of

    inference = configs.inference
    inference.validate()
    check_step_budget(inference.max_step_tokens, inference.chunked_prefill)
    speculative = speculative_config_of(inference)
    if speculative is not None and speculative.method == "mtp" \
            and not configs.model.mtp_num_layers:
        raise ConfigError("--num-speculative-tokens / speculative method 'mtp' drafts with the "
                          "model's MTP layers: the model has none (--mtp-num-layers); use "
                          "--speculative-config with method ngram or draft_model")
    if not inference.prefix_caching and inference.prefix_caching_eviction_policy is not None:
        raise ConfigError("--inference-dynamic-batching-prefix-caching-eviction-policy "
                          "needs --inference-dynamic-batching-prefix-caching")

