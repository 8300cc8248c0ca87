"""OptimizerConfig: the optimizer, its LR schedule, loss scaling and grad reduction."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_smp.config.errors import _require


LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
LR_WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")


# The values of Megatron-LM's --muon-* choices (optimizer/muon.py implements each).
MUON_SCALE_MODES = ("spectral", "unit_rms_norm", "shape_scaling")
MUON_TP_MODES = ("blockwise", "duplicated", "distributed")
MUON_MATMUL_PRECISIONS = ("low", "medium", "high")
MUON_COEFFICIENT_TYPES = ("simple", "quintic", "polar_express", "cans", "aol", "deepseekv4")


@dataclass
class OptimizerConfig:
    optimizer: str = "adam"  # "adam" | "sgd"
    lr: float = 1e-4
    min_lr: float = 0.0
    weight_decay: float = 0.01
    # Megatron's weight-decay schedule: constant (--weight-decay throughout), or linear /
    # cosine from start to end over the run (--train-iters x global batch, or --train-samples).
    weight_decay_incr_style: str = "constant"
    start_weight_decay: Optional[float] = None
    end_weight_decay: Optional[float] = None
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.9
    clip_grad: float = 1.0
    # "constant" | "linear" | "cosine" | "inverse-square-root" | "WSD"
    lr_decay_style: str = "linear"
    lr_warmup_iters: int = 0
    lr_decay_iters: Optional[int] = None
    # Megatron's sample-based schedule (with --train-samples) and the rest of its LR flags;
    # the scheduler counts samples either way (optimizer_param_scheduler.schedule_lengths).
    lr_warmup_samples: int = 0
    lr_decay_samples: Optional[int] = None
    lr_warmup_fraction: Optional[float] = None  # of the decay length, instead of the warm-up
    lr_warmup_init: float = 0.0  # the LR warm-up starts from
    lr_wsd_decay_style: str = "exponential"  # WSD's annealing: exponential|linear|cosine|minus_sqrt
    lr_wsd_decay_iters: Optional[int] = None
    lr_wsd_decay_samples: Optional[int] = None
    # Own LR schedule bounds for the word embedding and output layer weights (None: --lr /
    # --min-lr).
    decoupled_lr: Optional[float] = None
    decoupled_min_lr: Optional[float] = None
    # Megatron's --calculate-per-token-loss: the step's loss is the global batch's per-token
    # mean (training/per_token_loss.py), not the mean of per-microbatch means.
    calculate_per_token_loss: bool = False
    # Megatron's --apply-wd-to-qk-layernorm: the --qk-layernorm weights are decayed although
    # they are 1-D (optimizer.get_param_groups).
    apply_wd_to_qk_layernorm: bool = False
    use_distributed_optimizer: bool = False
    # Megatron's --num-distributed-optimizer-instances: the data-parallel ranks split into
    # this many consecutive instances; each shards the optimizer over its own ranks
    # (reduce-scatter and all-gather within it) and the instances all-reduce each shard.
    num_distributed_optimizer_instances: int = 1
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    # fp16 loss scaling: None = dynamic.
    loss_scale: Optional[float] = None
    initial_loss_scale: float = 2.0**32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2
    ddp_bucket_size: Optional[int] = None
    ddp_average_in_collective: bool = False
    accumulate_allreduce_grads_in_fp32: bool = True
    # Count zero grad elements each step (returned by optimizer.step()).
    log_num_zeros_in_grad: bool = False
    # Muon and Lion (Megatron-LM 0.19 / main's flags and defaults; optimizer/muon.py). With
    # --use-distributed-optimizer they shard whole matrices over data-parallel ranks (the
    # layer-wise distributed optimizer, `use_layer_wise_distributed_optimizer`).
    muon_momentum: float = 0.9
    muon_nesterov: bool = False
    muon_split_qkv: bool = True
    muon_scale_mode: str = "spectral"  # spectral | unit_rms_norm | shape_scaling
    muon_fp32_matmul_prec: str = "medium"  # medium: the NS iteration in bf16; high/low: fp32
    muon_coefficient_type: str = "quintic"
    muon_num_ns_steps: int = 5
    muon_tp_mode: str = "duplicated"  # blockwise | duplicated | distributed
    muon_extra_scale_factor: float = 1.0
    muon_scalar_optimizer: str = "adam"  # adam | lion: embeddings, output layer, norms, biases
    lion_beta1: float = 0.95
    lion_beta2: float = 0.98
    # Megatron-LM main's --no-use-layer-wise-param-layout clears it: with the layer-wise
    # distributed optimizer every param, the scalar optimizer's too, lies whole in one rank's
    # shard (main's legacy layout) instead of those being byte-sharded like the distributed
    # optimizer's (main's default). The same update either way; a different placement.
    use_layer_wise_param_layout: bool = True

    @property
    def use_layer_wise_distributed_optimizer(self) -> bool:
        """Muon and Lion shard whole params over DP ranks (Megatron's layer-wise optimizer)."""
        return self.use_distributed_optimizer and self.optimizer in ("muon", "lion")

    def validate(self) -> None:
        """Check the optimizer settings. Pure; run once where the configs are built
        (`validate_configs`); a config built by hand is checked by calling this before
        `get_megatron_optimizer`, which does not."""
        ends = (self.start_weight_decay, self.end_weight_decay)
        _require(self.weight_decay_incr_style in ("constant", "linear", "cosine"),
                 f"--weight-decay-incr-style must be constant, linear or cosine, got "
                 f"{self.weight_decay_incr_style!r}")
        if self.weight_decay_incr_style == "constant":
            _require(ends == (None, None),
                     "--start-weight-decay / --end-weight-decay need --weight-decay-incr-style "
                     "linear or cosine (constant uses --weight-decay throughout)")
        else:
            _require(None not in ends,
                     f"--weight-decay-incr-style {self.weight_decay_incr_style} needs "
                     "--start-weight-decay and --end-weight-decay")
            _require(0.0 <= ends[0] <= ends[1],
                     f"--start-weight-decay ({ends[0]}) must be >= 0 and at most "
                     f"--end-weight-decay ({ends[1]}), as in Megatron-LM")
        _require(
            self.optimizer in ("adam", "sgd", "muon", "lion"),
            f"--optimizer must be adam, sgd, muon or lion, got {self.optimizer!r}",
        )
        for flag, value, allowed in (
                ("--muon-scale-mode", self.muon_scale_mode, MUON_SCALE_MODES),
                ("--muon-fp32-matmul-prec", self.muon_fp32_matmul_prec, MUON_MATMUL_PRECISIONS),
                ("--muon-coefficient-type", self.muon_coefficient_type, MUON_COEFFICIENT_TYPES),
                ("--muon-tp-mode", self.muon_tp_mode, MUON_TP_MODES),
                ("--muon-scalar-optimizer", self.muon_scalar_optimizer, ("adam", "lion"))):
            _require(value in allowed,
                     f"{flag} must be one of {', '.join(allowed)}, got {value!r}")
        _require(self.muon_num_ns_steps >= 1,
                 f"--muon-num-ns-steps must be at least 1, got {self.muon_num_ns_steps}")
        for flag, beta in (("--lion-beta1", self.lion_beta1), ("--lion-beta2", self.lion_beta2)):
            _require(0.0 <= beta < 1.0, f"{flag} must be in [0, 1), got {beta}")
        _require(
            self.lr_decay_style in LR_DECAY_STYLES,
            f"--lr-decay-style must be one of {', '.join(LR_DECAY_STYLES)}, got "
            f"{self.lr_decay_style!r}",
        )
        _require(
            self.lr_wsd_decay_style in LR_WSD_DECAY_STYLES,
            f"--lr-wsd-decay-style must be one of {', '.join(LR_WSD_DECAY_STYLES)}, got "
            f"{self.lr_wsd_decay_style!r}",
        )
        wsd_given = [flag for flag, value in (
            ("--lr-wsd-decay-iters", self.lr_wsd_decay_iters),
            ("--lr-wsd-decay-samples", self.lr_wsd_decay_samples)) if value is not None]
        _require(
            not wsd_given or self.lr_decay_style == "WSD",
            f"{', '.join(wsd_given)} set the annealing phase of --lr-decay-style WSD; add it "
            f"(the decay style is {self.lr_decay_style!r})",
        )
        _require(
            self.decoupled_min_lr is None or self.decoupled_lr is not None,
            "--decoupled-min-lr bounds the schedule of --decoupled-lr: add --decoupled-lr LR",
        )
        _require(
            not self.overlap_param_gather or self.use_distributed_optimizer,
            "--overlap-param-gather needs --use-distributed-optimizer",
        )
        instances = self.num_distributed_optimizer_instances
        _require(instances >= 1, f"--num-distributed-optimizer-instances must be >= 1, got "
                                 f"{instances}")
        _require(instances == 1 or self.use_distributed_optimizer,
                 "--num-distributed-optimizer-instances > 1 needs --use-distributed-optimizer "
                 "(as in Megatron-LM: partial sharding of the distributed optimizer)")
        _require(
            self.use_layer_wise_param_layout or self.use_layer_wise_distributed_optimizer,
            "--no-use-layer-wise-param-layout chooses how the layer-wise distributed optimizer "
            "places params: add --optimizer muon (or lion) --use-distributed-optimizer, or "
            "drop it",
        )
