"""Megatron's command-line flags, mapped onto the typed config dataclasses.

Each flag is declared once in `_FLAGS` with the config section and field it fills, so the
argparse layer and the dataclasses cannot drift apart. Flag names are Megatron-LM's, so
users' existing pretraining shell scripts run unchanged. Every accepted flag does what it
says, with two exceptions listed in `IGNORED_FLAGS` (and the README): flags that only pick a
Megatron implementation detail with no effect on results or memory. Flags of capabilities
that do not exist yet (`NOT_SUPPORTED_YET_FLAGS`, every `--moe-*` flag not in
`_FLAGS`) are a ConfigError.
"""
from __future__ import annotations

import argparse
import dataclasses
import re
import signal
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from megatron_smp.config import (
    CP_COMM_TYPES,
    LR_DECAY_STYLES,
    LR_WSD_DECAY_STYLES,
    CheckpointConfig,
    ConfigError,
    DataConfig,
    OptimizerConfig,
    ParallelConfig,
    ResilienceConfig,
    TrainingConfig,
    TransformerConfig,
    not_supported,
)
from megatron_smp.checkpointing.loop import (
    STRICTNESS_CHOICES,
    check_checkpoint_flags,
    checkpoint_model_fields,
)

_SECTIONS = {
    "model": TransformerConfig,
    "parallel": ParallelConfig,
    "optimizer": OptimizerConfig,
    "training": TrainingConfig,
    "data": DataConfig,
    "checkpoint": CheckpointConfig,
    "resilience": ResilienceConfig,
}


@dataclass
class _Flag:
    flag: str
    section: Optional[str]  # None: an argument that is not a config field (post-processed)
    field: Optional[str]
    kwargs: Dict[str, Any]


def _f(flag: str, section: Optional[str], field: Optional[str] = None, **kwargs) -> _Flag:
    if field is None and section is not None:
        field = flag.lstrip("-").replace("-", "_")
    return _Flag(flag, section, field, kwargs)


class _OneOfList(argparse.Action):
    """Megatron-LM main takes a list for --moe-router-load-balancing-type and
    --moe-aux-loss-coeff (several balancing losses at once, one coefficient each); this
    project runs one of them: a single value is stored as is, several are a clear error."""

    def __call__(self, parser, namespace, values, option_string=None):
        if len(values) != 1:
            parser.error(
                f"{option_string}: one value, got {len(values)} ({' '.join(map(str, values))}); "
                "combining load-balancing losses (Megatron-LM's list form of "
                "--moe-router-load-balancing-type / --moe-aux-loss-coeff) is not supported: "
                "pick one of aux_loss, seq_aux_loss, global_aux_loss with one coefficient")
        setattr(namespace, self.dest, values[0])


def _int_pair(text: str):
    """'4095,0' or '(4095, 0)' -> (4095, 0), Megatron's --window-size syntax."""
    parts = text.strip().strip("()").split(",")
    try:
        if len(parts) != 2:
            raise ValueError
        return tuple(int(part) for part in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected two integers LEFT,RIGHT, got {text!r}")


_CHOICES_POSITION = ["learned_absolute", "rope", "yarn", "alibi", "none"]

_FLAGS: List[_Flag] = [
    # Model shape.
    _f("--num-layers", "model", type=int, required=True),
    _f("--hidden-size", "model", type=int, required=True),
    _f("--ffn-hidden-size", "model", type=int),
    _f("--num-attention-heads", "model", type=int, required=True),
    _f("--kv-channels", "model", type=int),
    _f("--group-query-attention", None, "group_query_attention", action="store_true"),
    _f("--num-query-groups", None, "num_query_groups", type=int),
    _f("--max-position-embeddings", "model", type=int),
    _f("--make-vocab-size-divisible-by", "model", type=int, default=128),
    _f("--normalization", "model", choices=["LayerNorm", "RMSNorm"], default="LayerNorm"),
    _f("--norm-epsilon", "model", "layernorm_epsilon", type=float, default=1e-5),
    _f("--swiglu", None, "swiglu", action="store_true"),
    _f("--openai-gelu", None, "openai_gelu", action="store_true"),
    _f("--position-embedding-type", "model", choices=_CHOICES_POSITION,
       default="learned_absolute"),
    _f("--use-rotary-position-embeddings", None, "use_rotary_position_embeddings",
       action="store_true"),
    _f("--rotary-base", "model", type=float, default=10000.0),
    _f("--rotary-percent", "model", type=float, default=1.0),
    # Llama 3.x's RoPE scaling (Megatron's flags; the last three are fixed in Megatron).
    _f("--use-rope-scaling", "model", action="store_true"),
    _f("--rope-scaling-factor", "model", type=float),
    _f("--rope-scaling-low-freq-factor", "model", type=float,
       help="--use-rope-scaling: wavelengths above original context / this are divided by "
       "the factor (default 1, Llama 3.1's)"),
    _f("--rope-scaling-high-freq-factor", "model", type=float,
       help="--use-rope-scaling: wavelengths below original context / this are kept "
       "(default 4)"),
    _f("--rope-scaling-original-max-position-embeddings", "model", type=int,
       help="--use-rope-scaling: the pretraining context (default 8192)"),
    # YaRN, with --position-embedding-type yarn (Megatron's flags and defaults).
    _f("--rotary-scaling-factor", "model", "yarn_rotary_scaling_factor", type=float),
    _f("--yarn-original-max-position-embeddings", "model", type=int),
    _f("--yarn-beta-fast", "model", type=float),
    _f("--yarn-beta-slow", "model", type=float),
    _f("--mscale", "model", "yarn_mscale", type=float),
    _f("--mscale-all-dim", "model", "yarn_mscale_all_dim", type=float),
    _f("--yarn-correction-range-round-to-int", "model", action="store_true", default=None),
    _f("--no-yarn-correction-range-round-to-int", "model",
       "yarn_correction_range_round_to_int", action="store_false", default=None),
    # Post-processed: YaRN with gpt-oss's values (Megatron-LM main's ModelOpt builder).
    _f("--enable-gpt-oss", None, "enable_gpt_oss", action="store_true",
       help="RoPE scaled by YaRN with gpt-oss's values (factor 32, original length 131072, "
       "beta fast 32, slow 1, mscale 1, mscale-all-dim 0, unrounded correction range), over "
       "the --position-embedding-type given"),
    # Model numerics (Megatron's semantics; see README "Model numerics flags").
    _f("--rotary-interleaved", "model", action="store_true"),
    _f("--no-position-embedding", None, "add_position_embedding", action="store_false",
       help="Megatron's deprecated spelling: only with --position-embedding-type rope"),
    _f("--apply-layernorm-1p", "model", "layernorm_zero_centered_gamma", action="store_true",
       help="norm weights stored zero-centred: y = norm(x) * (1 + w)"),
    _f("--qk-layernorm", "model", action="store_true"),
    _f("--squared-relu", None, "squared_relu", action="store_true"),
    _f("--use-parallel-residual", "model", "parallel_residual", action="store_true"),
    _f("--window-size", "model", type=_int_pair, metavar="LEFT,RIGHT",
       help="sliding-window attention: query i sees keys i-LEFT..i+RIGHT (Mistral's "
       "sliding_window W is W-1,0)"),
    _f("--window-attn-skip-freq", "model", metavar="N|PATTERN",
       help="which layers use --window-size: every N-th layer attends fully, or a 0/1 list "
       "per layer (1 = window) such as \"[1,0]*2\" (gpt-oss: 2)"),
    _f("--softmax-type", "model", choices=["vanilla", "off-by-one", "learnable"],
       default="vanilla",
       help="learnable: a learned logit per head in every attention softmax (gpt-oss's sinks)"),
    _f("--quick-geglu", None, "quick_geglu", action="store_true",
       help="gated MLP with x * sigmoid(1.702 x) (gpt-oss's experts)"),
    _f("--glu-linear-offset", "model", type=float, default=0.0,
       help="gated unit act(gate) * (up + OFFSET) (gpt-oss: 1)"),
    _f("--activation-func-clamp-value", "model", type=float,
       help="clamp the gate from above and up on both sides before the gated unit "
       "(gpt-oss's swiglu_limit, 7)"),
    # Gemma 3 (README "Gemma 3"): Megatron-LM main's --rotary-seq-len-interpolation-factor;
    # Megatron-LM has no flags for the rest, named here after Megatron-Bridge's Gemma fields.
    _f("--rotary-seq-len-interpolation-factor", "model", type=float,
       help="linear RoPE scaling: positions / F (HF rope_type linear; Gemma 3's global "
       "layers: 8)"),
    _f("--local-rotary-base", "model", type=float,
       help="RoPE base of the sliding-window layers, unscaled (Gemma 3's "
       "rope_local_base_freq, 10000); the full-attention layers keep --rotary-base"),
    _f("--sandwich-norm", "model", action="store_true",
       help="normalise the attention's and the MLP's outputs before each residual add "
       "(Gemma 2/3's post norms)"),
    _f("--apply-embedding-scaling", "model", action="store_true",
       help="multiply the word embeddings by sqrt(hidden size) (Gemma)"),
    _f("--softmax-scale", "model", type=float,
       help="attention scores q.k times this (default 1/sqrt(kv channels); Gemma 3's "
       "query_pre_attn_scalar S: S**-0.5)"),
    _f("--final-logit-softcapping", "model", type=float,
       help="logits = C * tanh(logits / C) (Gemma 2)"),
    _f("--geglu", None, "geglu", action="store_true",
       help="gated MLP gelu_tanh(gate) * up (Gemma's GeGLU), ffn size as given"),
    _f("--untie-embeddings-and-output-weights", "model", action="store_true"),
    _f("--hidden-dropout", "model", type=float, default=0.1),
    _f("--no-gradient-accumulation-fusion", "model", "gradient_accumulation_fusion",
       action="store_false",
       help="linear layers return their weight grads to autograd, which the DDP hook then "
            "adds to the fp32 main grads, instead of adding them there themselves"),
    _f("--attention-dropout", "model", type=float, default=0.1),
    _f("--disable-bias-linear", None, "disable_bias_linear", action="store_true"),
    _f("--add-qkv-bias", "model", action="store_true"),
    _f("--init-method-std", "model", type=float, default=0.02),
    _f("--recompute-granularity", "model", choices=["full", "selective"]),
    _f("--recompute-activations", None, "recompute_activations", action="store_true",
       help="Megatron's shorthand for --recompute-granularity selective"),
    _f("--recompute-method", "model", choices=["uniform", "block"]),
    _f("--recompute-num-layers", "model", type=int),
    # Space- or comma-separated; Megatron's test configs also write "[layernorm mlp]".
    _f("--recompute-modules", "model", nargs="+"),
    # Multi-latent attention (Megatron's flags; see README "Multi-latent attention").
    _f("--multi-latent-attention", "model", action="store_true"),
    # Megatron: multi-latent attention takes YaRN by default (--rotary-scaling-factor, default
    # 1.0, where it equals plain RoPE), --rope-type rope opts out; other attention takes rope.
    _f("--rope-type", None, "rope_type", choices=["rope", "yarn"]),
    _f("--q-lora-rank", "model", type=int),
    _f("--kv-lora-rank", "model", type=int, default=32),
    _f("--qk-head-dim", "model", type=int, default=128),
    _f("--qk-pos-emb-head-dim", "model", type=int, default=64),
    _f("--v-head-dim", "model", type=int, default=128),
    # Multi-token prediction (Megatron's flags; see README "Multi-token prediction").
    _f("--mtp-num-layers", "model", type=int),
    _f("--mtp-loss-scaling-factor", "model", type=float, default=0.1),
    # Hybrid models (Megatron-LM main's flags; see README "Hybrid models").
    _f("--hybrid-layer-pattern", "model",
       help="one symbol per layer: M Mamba-2, G Gated DeltaNet, * attention, - MLP, E MoE; "
       "| between pipeline stages; decides --num-layers"),
    _f("--hybrid-override-pattern", None, "hybrid_override_pattern",
       help="Megatron's deprecated spelling of --hybrid-layer-pattern"),
    _f("--spec", None, "spec", nargs="*",
       help="Megatron's layer-spec module and function: only the hybrid stack specs, which "
       "--hybrid-layer-pattern builds here"),
    _f("--linear-attention-freq", "model", metavar="N|PATTERN",
       help="with --experimental-attention-variant gated_delta_net: N-1 Gated DeltaNet layers "
       "per full attention layer, or a 0/1 list per layer (1 = linear)"),
    _f("--experimental-attention-variant", "model", choices=["gated_delta_net", "gdn"]),
    _f("--attention-output-gate", "model", action="store_true"),
    _f("--mamba-state-dim", "model", type=int, default=128),
    _f("--mamba-head-dim", "model", type=int, default=64),
    _f("--mamba-num-groups", "model", type=int, default=8),
    _f("--mamba-num-heads", "model", type=int),
    _f("--linear-conv-kernel-dim", "model", type=int, default=4),
    _f("--linear-key-head-dim", "model", type=int, default=128),
    _f("--linear-value-head-dim", "model", type=int, default=128),
    _f("--linear-num-key-heads", "model", type=int, default=16),
    _f("--linear-num-value-heads", "model", type=int, default=32),
    # Mixture of experts (Megatron's flags; see README "Mixture of experts").
    _f("--num-experts", "model", "num_moe_experts", type=int),
    _f("--moe-layer-freq", "model", metavar="N|PATTERN",
       help="every N-th layer is MoE, or a 0/1 list per layer such as \"([1]*3+[0]*1)*2\""),
    _f("--moe-ffn-hidden-size", "model", type=int),
    _f("--moe-router-topk", "model", type=int, default=2),
    _f("--moe-router-pre-softmax", "model", action="store_true"),
    _f("--moe-router-score-function", "model", choices=["softmax", "sigmoid", "sqrtsoftplus"],
       default="softmax"),
    _f("--moe-router-enable-expert-bias", "model", action="store_true"),
    _f("--moe-router-bias-update-rate", "model", type=float, default=1e-3),
    _f("--moe-router-num-groups", "model", type=int),
    _f("--moe-router-group-topk", "model", type=int),
    _f("--moe-router-topk-scaling-factor", "model", type=float),
    _f("--moe-router-dtype", "model", choices=["fp32", "fp64"]),
    _f("--moe-router-load-balancing-type", "model", nargs="+", action=_OneOfList,
       choices=["aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"],
       default="aux_loss"),
    _f("--moe-aux-loss-coeff", "model", type=float, nargs="+", action=_OneOfList,
       default=0.0),
    _f("--moe-z-loss-coeff", "model", type=float),
    _f("--moe-input-jitter-eps", "model", type=float),
    _f("--moe-token-dispatcher-type", "model", choices=["allgather", "alltoall"],
       default="allgather"),
    _f("--moe-expert-capacity-factor", "model", type=float),
    _f("--moe-pad-expert-input-to-capacity", "model", action="store_true"),
    _f("--moe-token-drop-policy", "model", choices=["probs", "position"], default="probs"),
    _f("--moe-grouped-gemm", "model", action="store_true"),
    _f("--moe-shared-expert-intermediate-size", "model", type=int),
    _f("--moe-shared-expert-gate", "model", action="store_true"),
    _f("--moe-latent-size", "model", type=int,
       help="routed experts work in this width between projections from and back to the "
       "hidden size (Nemotron 3's latent MoE)"),
    _f("--moe-per-layer-logging", "training", action="store_true",
       help="also write each MoE layer's load_balancing_loss / z_loss to TensorBoard and "
       "W&B (moe/<name>_layer_<i>)"),
    _f("--expert-tensor-parallel-size", "parallel", type=int),
    # Parallelism.
    _f("--tensor-model-parallel-size", "parallel", type=int, default=1),
    _f("--pipeline-model-parallel-size", "parallel", type=int, default=1),
    _f("--context-parallel-size", "parallel", type=int, default=1),
    _f("--cp-comm-type", "model", choices=list(CP_COMM_TYPES), default="p2p",
       help="context parallelism's attention: p2p ring, all_gather of K/V, a2a (Ulysses)"),
    _f("--expert-model-parallel-size", "parallel", type=int, default=1),
    _f("--virtual-pipeline-model-parallel-size", "parallel", type=int),
    _f("--num-layers-per-virtual-pipeline-stage", "parallel", type=int),
    _f("--decoder-first-pipeline-num-layers", "parallel", type=int),
    _f("--decoder-last-pipeline-num-layers", "parallel", type=int),
    _f("--sequence-parallel", "model", action="store_true"),
    _f("--pipeline-schedule", "training",
       choices=["simple", "interleaved", "gpipe", "1f1b", "interleaved_1f1b"],
       default="interleaved",
       help="SMP's simple (= gpipe) or interleaved (= 1f1b, or interleaved_1f1b with virtual "
       "stages), or the internal names"),
    _f("--pipeline-timeline", "parallel", metavar="PATH",
       help="Chrome trace of the pipeline schedule, PATH.rank<r>.json per rank"),
    _f("--use-distributed-optimizer", "optimizer", action="store_true"),
    _f("--use-megatron-fsdp", None, "use_megatron_fsdp", action="store_true",
       help="Megatron-FSDP's flag, run on the engine its --data-parallel-sharding-strategy "
       "maps to"),
    _f("--data-parallel-sharding-strategy", None, "data_parallel_sharding_strategy",
       choices=["no_shard", "optim", "optim_grads", "optim_grads_params"], default="no_shard",
       help="with --use-megatron-fsdp: no_shard = DDP, optim = --use-distributed-optimizer, "
       "optim_grads_params = FSDP2 full sharding (--use-torch-fsdp2)"),
    _f("--use-torch-fsdp2", "parallel", action="store_true",
       help="shard params, grads and optimizer state with PyTorch FSDP2 (over groups of "
       "hybrid_shard_degree ranks with --smp-config, default all data-parallel ranks)"),
    _f("--no-torch-fsdp2-reshard-after-forward", "parallel",
       "torch_fsdp2_reshard_after_forward", action="store_false",
       help="FSDP2: keep each layer's gathered params from forward to backward"),
    _f("--overlap-grad-reduce", "optimizer", action="store_true"),
    _f("--overlap-param-gather", "optimizer", action="store_true"),
    _f("--ddp-bucket-size", "optimizer", type=int),
    _f("--ddp-average-in-collective", "optimizer", action="store_true"),
    _f("--accumulate-allreduce-grads-in-fp32", "optimizer", action="store_true", default=True,
       help="always on here: fp16/bf16 models reduce fp32 grads"),
    _f("--grad-reduce-in-bf16", None, "grad_reduce_in_bf16", action="store_true",
       help="--bf16 models accumulate and reduce grads in bf16 (DDP buffers, FSDP2 "
       "reduce-scatter)"),
    _f("--distributed-backend", "parallel", choices=["nccl", "gloo"]),
    _f("--distributed-timeout-minutes", "parallel", type=int, default=10),
    _f("--disable-gloo-process-groups", "parallel", "use_gloo_process_groups",
       action="store_false",
       help="create no gloo group besides the default backend's (--async-save's writer "
       "group then uses the default backend: gloo jobs only)"),
    _f("--init-model-with-meta-device", "parallel", action="store_true",
       help="build the model on the meta device and materialise it part by part on the "
       "device (the model provider must take device=)"),
    _f("--smp-config", None, "smp_config", metavar="JSON",
       help="SMP v2 configuration (a JSON file or inline JSON object); its keys override "
       "the matching flags"),
    # Batch.
    _f("--micro-batch-size", "training", type=int, default=1),
    _f("--global-batch-size", "training", type=int),
    _f("--rampup-batch-size", "training", type=int, nargs=3,
       metavar=("START", "INCREMENT", "SAMPLES"),
       help="grow the global batch from START by INCREMENT over SAMPLES consumed samples "
       "(needs --train-samples)"),
    _f("--step-batch-size-schedule", "training", metavar="'THRESHOLD:BS ...'",
       help="Megatron-LM main's step-wise global batch: BS from THRESHOLD consumed tokens on "
       "(suffixes K M B T; the first threshold is 0; needs --train-samples)"),
    _f("--seq-length", "training", type=int, required=True),
    # Optimisation.
    _f("--optimizer", "optimizer", choices=["adam", "sgd", "muon", "dist_muon", "lion", "soap",
                                            "adaptive_muon"], default="adam",
       help="muon and lion: optimizer/muon.py; dist_muon is Megatron's deprecated spelling of "
       "--optimizer muon --use-distributed-optimizer; soap and adaptive_muon are an error"),
    # Muon and Lion (Megatron-LM 0.19 / main's flags and defaults).
    _f("--muon-momentum", "optimizer", type=float, default=0.9),
    _f("--muon-nesterov", "optimizer", action="store_true"),
    _f("--muon-no-split-qkv", "optimizer", "muon_split_qkv", action="store_false", default=True,
       help="orthogonalise the fused QKV weight whole, not q, k and v each"),
    _f("--muon-scale-mode", "optimizer", choices=["spectral", "unit_rms_norm", "shape_scaling"],
       default="spectral"),
    _f("--muon-fp32-matmul-prec", "optimizer", choices=["low", "medium", "high"],
       default="medium", help="medium: the Newton-Schulz iteration in bf16; low, high: fp32"),
    _f("--muon-coefficient-type", "optimizer", default="quintic"),
    _f("--muon-num-ns-steps", "optimizer", type=int, default=5),
    _f("--muon-tp-mode", "optimizer", choices=["blockwise", "duplicated", "distributed"],
       default="duplicated"),
    _f("--muon-extra-scale-factor", "optimizer", type=float, default=1.0),
    _f("--muon-scalar-optimizer", "optimizer", choices=["adam", "lion"], default="adam"),
    _f("--muon-use-syrk", None, "muon_use_syrk", action="store_true"),
    _f("--lion-beta1", "optimizer", type=float, default=0.95),
    _f("--lion-beta2", "optimizer", type=float, default=0.98),
    _f("--no-use-layer-wise-param-layout", "optimizer", "use_layer_wise_param_layout",
       action="store_false",
       help="layer-wise distributed optimizer: keep every param whole in one rank's shard, "
       "the scalar optimizer's too (Megatron-LM main's legacy layout)"),
    # Megatron-LM 0.19 / main flags of launch scripts written in 2026 (see
    # _apply_megatron_main_flags for what each does or why it is refused).
    _f("--disable-bf16-reduced-precision-matmul", None,
       "disable_bf16_reduced_precision_matmul", action="store_true",
       help="CUDA: bf16 matmuls accumulate in full precision "
       "(torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False)"),
    _f("--dataloader-inter-document-masking", None, "dataloader_inter_document_masking",
       action="store_true", help="attention stays inside each document (--reset-attention-mask)"),
    _f("--eval-micro-batch-size", None, "eval_micro_batch_size", type=int),
    _f("--eval-global-batch-size", None, "eval_global_batch_size", type=int),
    _f("--null-tokenizer-eod-id", None, "null_tokenizer_eod_id", type=int),
    _f("--exit-signal-handler-for-training", None, "exit_signal_handler_for_training",
       action="store_true"),
    _f("--megatron-fsdp-main-params-dtype", None, "megatron_fsdp_main_params_dtype",
       choices=["fp32", "bf16", "fp16", "auto"]),
    _f("--megatron-fsdp-main-grads-dtype", None, "megatron_fsdp_main_grads_dtype",
       choices=["fp32", "bf16", "fp16", "auto"]),
    _f("--megatron-fsdp-grad-comm-dtype", None, "megatron_fsdp_grad_comm_dtype",
       choices=["fp32", "bf16", "fp16", "auto"]),
    _f("--num-virtual-stages-per-pipeline-rank", None, "num_virtual_stages_per_pipeline_rank",
       type=int, help="Megatron-LM main's name of --virtual-pipeline-model-parallel-size"),
    _f("--num-distributed-optimizer-instances", None, "num_distributed_optimizer_instances",
       type=int, default=1),
    _f("--cuda-graph-impl", None, "cuda_graph_impl",
       choices=["none", "local", "transformer_engine"], default="none"),
    _f("--lr", "optimizer", type=float, default=1e-4),
    _f("--min-lr", "optimizer", type=float, default=0.0),
    _f("--lr-decay-style", "optimizer", choices=list(LR_DECAY_STYLES), default="linear"),
    _f("--lr-warmup-iters", "optimizer", type=int, default=0),
    _f("--lr-warmup-samples", "optimizer", type=int, default=0),
    _f("--lr-warmup-fraction", "optimizer", type=float),
    _f("--lr-warmup-init", "optimizer", type=float, default=0.0),
    _f("--lr-decay-iters", "optimizer", type=int),
    _f("--lr-decay-samples", "optimizer", type=int),
    _f("--lr-wsd-decay-style", "optimizer", choices=list(LR_WSD_DECAY_STYLES),
       default="exponential"),
    _f("--lr-wsd-decay-iters", "optimizer", type=int),
    _f("--lr-wsd-decay-samples", "optimizer", type=int),
    _f("--decoupled-lr", "optimizer", type=float,
       help="own learning rate for the word embedding and output layer weights"),
    _f("--decoupled-min-lr", "optimizer", type=float),
    _f("--apply-wd-to-qk-layernorm", "optimizer", action="store_true",
       help="weight decay on the --qk-layernorm weights (other 1-D params stay undecayed)"),
    _f("--calculate-per-token-loss", "optimizer", action="store_true",
       help="the loss is summed over tokens and divided by the unmasked tokens of the whole "
       "global batch"),
    _f("--weight-decay", "optimizer", type=float, default=0.01),
    _f("--clip-grad", "optimizer", type=float, default=1.0),
    _f("--adam-beta1", "optimizer", type=float, default=0.9),
    _f("--adam-beta2", "optimizer", type=float, default=0.999),
    _f("--adam-eps", "optimizer", type=float, default=1e-8),
    _f("--sgd-momentum", "optimizer", type=float, default=0.9),
    # Precision.
    _f("--fp16", None, "fp16", action="store_true"),
    _f("--bf16", None, "bf16", action="store_true"),
    _f("--loss-scale", "optimizer", type=float),
    _f("--initial-loss-scale", "optimizer", type=float, default=2.0**32),
    _f("--min-loss-scale", "optimizer", type=float, default=1.0),
    _f("--loss-scale-window", "optimizer", type=int, default=1000),
    _f("--hysteresis", "optimizer", type=int, default=2),
    # Run.
    _f("--train-iters", "training", type=int),
    _f("--train-samples", "training", type=int),
    _f("--seed", "training", type=int, default=1234),
    _f("--lora-rank", "training", type=int, default=0),
    _f("--lora-alpha", "training", type=float, default=32.0),
    _f("--lora-dropout", "training", type=float, default=0.0),
    _f("--lora-target-modules", "training", nargs="+",
       default=["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]),
    _f("--log-interval", "training", type=int, default=100),
    _f("--eval-interval", "training", type=int, default=1000),
    _f("--eval-iters", "training", type=int, default=100),
    _f("--tensorboard-dir", "training"),
    _f("--tensorboard-log-interval", "training", type=int, default=1),
    _f("--tensorboard-queue-size", "training", type=int, default=1000),
    _f("--log-throughput", "training", action="store_true"),
    _f("--log-timers-to-tensorboard", "training", action="store_true"),
    _f("--log-validation-ppl-to-tensorboard", "training", action="store_true"),
    _f("--log-memory-to-tensorboard", "training", action="store_true"),
    _f("--report-memory", "training", action="store_true",
       help="rank 0 prints the memory planner's per-rank table (params, grads, optimizer "
       "state, activations) before the model is built"),
    _f("--log-num-zeros-in-grad", "optimizer", action="store_true"),
    _f("--manual-gc", "training", action="store_true"),
    _f("--manual-gc-interval", "training", type=int, default=0),
    _f("--no-manual-gc-eval", "training", "manual_gc_eval", action="store_false"),
    _f("--empty-unused-memory-level", "training", type=int, choices=[0, 1, 2], default=0,
       help="CUDA: empty the allocator's cache after each step (1), and after the optimizer "
       "step too (2)"),
    _f("--exit-interval", "training", type=int),
    _f("--exit-duration-in-mins", "training", type=int),
    _f("--exit-signal-handler", "training", action="store_true",
       help="on --exit-signal (SIGTERM) to any rank: save (with --save) and exit with code 0"),
    _f("--exit-signal", "training", choices=[s.name for s in signal.Signals], default="SIGTERM"),
    _f("--skip-train", "training", action="store_true"),
    _f("--deterministic-mode", "training", action="store_true"),
    _f("--check-weight-hash-across-dp-replicas-interval", "training", type=int),
    _f("--torch-compile", "training", nargs="?", const="inductor", metavar="BACKEND",
       help="torch.compile each transformer layer (default backend inductor)"),
    _f("--log-params-norm", "training", action="store_true"),
    _f("--log-progress", "training", action="store_true"),
    _f("--no-log-loss-scale-to-tensorboard", "training", "log_loss_scale_to_tensorboard",
       action="store_false"),
    _f("--log-world-size-to-tensorboard", "training", action="store_true"),
    _f("--logging-level", "training", type=int,
       help="Python logging's root level (10 DEBUG, 20 INFO, ...); default: the "
       "MEGATRON_LOGGING_LEVEL environment variable, if set"),
    _f("--no-check-for-nan-in-loss-and-grad", "training", "check_for_nan_in_loss_and_grad",
       action="store_false", default=True),
    _f("--rerun-mode", "training", choices=["disabled", "validate_results", "report_stats"],
       default="validate_results"),
    # Resilience (megatron_smp/resilience): hang detection, fault injection, stragglers.
    _f("--enable-ft-package", "resilience", action="store_true",
       help="a progress watchdog per rank: a rank with no progress past its section's timeout "
       "is named with its Python stack and the job exits with code 75 (torchrun "
       "--max-restarts restarts it from the last checkpoint)"),
    _f("--calc-ft-timeouts", "resilience", action="store_true",
       help="learn the section timeouts from the run (5 x the longest seen, at least 30 s), "
       "kept in <--save>/ft_state.json"),
    _f("--ft-num-warmup-iters", "resilience", type=int, default=5,
       help="iterations before each step is timed by the step timeout"),
    _f("--ft-rank-section-timeouts", "resilience", metavar="SECTION:SECONDS,...",
       default="setup:600,step:180,checkpointing:420",
       help="the longest a rank may stay in each section (setup, step, checkpointing)"),
    _f("--ft-rank-out-of-section-timeout", "resilience", type=float, default=300.0,
       help="the longest a rank may stay between sections (warm-up steps, evaluation, logs)"),
    _f("--ft-rank-heartbeat-timeout", "resilience", type=float, default=60.0,
       help="a rank whose monitor thread sends no heartbeat this long is frozen or cut off"),
    _f("--ft-heartbeat-interval", "resilience", type=float, default=1.0),
    _f("--fault-injector-ranks", "resilience", metavar="R[,R...]",
       help="the ranks that get the injected fault"),
    _f("--fault-injector-num-ranks", "resilience", type=int,
       help="instead of --fault-injector-ranks: this many ranks drawn from 1..world-1"),
    _f("--fault-injector-fault-types", "resilience", metavar="hang|crash|slow[,...]",
       help="the fault, drawn from these: hang (the process SIGSTOPs itself), crash (SIGKILL), "
       "slow (each later step --fault-injector-slow-factor times as long); only the first "
       "restart attempt injects"),
    _f("--fault-injector-fault-probabilities", "resilience", metavar="P[,P...]",
       help="weights of --fault-injector-fault-types (default: equal)"),
    _f("--fault-injector-fault-delay", "resilience", type=float,
       help="seconds from the start of training (or --fault-injector-delay-start-iteration) "
       "to the fault"),
    _f("--fault-injector-delay-start-iteration", "resilience", type=int,
       help="the delay starts after this iteration completes"),
    _f("--fault-injector-mtti-seconds", "resilience", type=float,
       help="instead of --fault-injector-fault-delay: an exponential delay of this mean"),
    _f("--fault-injector-offset-seconds", "resilience", type=float,
       help="added to the delay drawn with --fault-injector-mtti-seconds"),
    _f("--fault-injector-seed", "resilience", type=int,
       help="seed of the plan (ranks, fault, delay), drawn on rank 0"),
    _f("--fault-injector-slow-factor", "resilience", type=float, default=2.0,
       help="a 'slow' fault makes each later step of the rank take this many times as long"),
    _f("--log-straggler", "resilience", action="store_true",
       help="every log interval, the slowest and fastest ranks by forward-backward time, "
       "with their throughput relative to the median; ranks below 0.7x named as stragglers"),
    _f("--straggler-minmax-count", "resilience", type=int, default=1,
       help="how many slowest and fastest ranks the straggler report names"),
    _f("--disable-straggler-on-startup", "resilience", action="store_true",
       help="the straggler report starts off (toggle it on --straggler-ctrlr-port)"),
    _f("--straggler-ctrlr-port", "resilience", type=int, default=65535,
       help="rank 0 toggles the straggler report on each GET to 127.0.0.1:PORT"),
    _f("--profile", "training", action="store_true"),
    _f("--use-pytorch-profiler", "training", action="store_true"),
    _f("--profile-step-start", "training", type=int, default=10),
    _f("--profile-step-end", "training", type=int, default=12),
    _f("--profile-ranks", "training", type=int, nargs="+", default=[0]),
    _f("--record-memory-history", "training", action="store_true"),
    _f("--memory-snapshot-path", "training", default="snapshot.pickle"),
    _f("--wandb-project", "training"),
    _f("--wandb-exp-name", "training"),
    _f("--wandb-save-dir", "training"),
    _f("--wandb-entity", "training"),
    # Data.
    _f("--data-path", "data", nargs="*", default=[]),
    # None when not given (DataConfig's default, Megatron's '969, 30, 1', applies), so that
    # validate_configs can refuse it beside per-split data paths as Megatron does.
    _f("--split", "data"),
    _f("--mock-data", "data", action="store_true"),
    _f("--train-data-path", "data", nargs="*"),
    _f("--valid-data-path", "data", nargs="*"),
    _f("--test-data-path", "data", nargs="*"),
    _f("--data-args-path", "data"),
    _f("--per-split-data-args-path", "data"),
    _f("--mid-level-dataset-surplus", "data", type=float, default=0.005),
    # Megatron has only --no-mmap-bin-files; --mmap-bin-files states the default.
    _f("--mmap-bin-files", "data", "mmap_bin_files", action="store_true", default=None),
    _f("--no-mmap-bin-files", "data", "mmap_bin_files", action="store_false", default=None),
    _f("--legacy-tokenizer", "data", action="store_true"),
    _f("--tokenizer-hf-include-special-tokens", "data", action="store_true"),
    _f("--tokenizer-type", "data", default=None,
       choices=["NullTokenizer", "SentencePieceTokenizer", "GPTSentencePieceTokenizer",
                "Llama2Tokenizer", "HuggingFaceTokenizer", "GPT2BPETokenizer",
                "TikTokenizer"]),
    _f("--tiktoken-pattern", "data", choices=["v1", "v2"]),
    _f("--tiktoken-num-special-tokens", "data", type=int),
    _f("--tiktoken-special-tokens", "data", "tokenizer_special_tokens", nargs="+"),
    _f("--tokenizer-model", "data"),
    _f("--vocab-file", "data"),
    _f("--merge-file", "data"),
    _f("--vocab-size", "data", type=int),
    _f("--reset-position-ids", "data", action="store_true"),
    _f("--reset-attention-mask", "data", action="store_true"),
    _f("--eod-mask-loss", "data", action="store_true"),
    _f("--sft", "data", action="store_true"),
    _f("--num-workers", "data", type=int, default=0),
    _f("--data-cache-path", "data"),
    _f("--dataloader-fast-cache-load", "data", action="store_true"),
    _f("--dataloader-defer-npy-index-mmap", "data", action="store_true"),
    _f("--per-dataset-sequences-path", "data"),
    # Checkpoints.
    _f("--save", "checkpoint"),
    _f("--load", "checkpoint"),
    _f("--save-interval", "checkpoint", type=int),
    _f("--save-retain-interval", "checkpoint", type=int,
       help="keep only the checkpoints of multiples of this iteration count, and the newest"),
    _f("--no-load-optim", "checkpoint", action="store_true"),
    _f("--no-load-rng", "checkpoint", action="store_true"),
    _f("--no-save-optim", "checkpoint", action="store_true"),
    _f("--no-save-rng", "checkpoint", action="store_true"),
    _f("--finetune", "checkpoint", action="store_true"),
    _f("--pretrained-checkpoint", "checkpoint",
       help="the base checkpoint of a --lora-rank run: loaded before the --load adapters (or "
       "alone when --load holds none); overrides the base a LoRA checkpoint records"),
    _f("--ckpt-format", "checkpoint", choices=["torch_dist", "torch", "fsdp_dtensor", "torch_dcp"],
       default="torch_dist",
       help="fsdp_dtensor (Megatron-FSDP's DCP format) is accepted with FSDP2 runs and writes "
       "torch_dist: DCP with global names and shapes, loadable at any layout"),
    _f("--async-save", "checkpoint", action="store_true"),
    _f("--override-opt_param-scheduler", "checkpoint", "override_opt_param_scheduler",
       action="store_true"),
    _f("--use-checkpoint-opt_param-scheduler", "checkpoint",
       "use_checkpoint_opt_param_scheduler", action="store_true"),
    _f("--dist-ckpt-strictness", "checkpoint", choices=list(STRICTNESS_CHOICES)),
    _f("--auto-detect-ckpt-format", "checkpoint", action="store_true"),
    _f("--dist-ckpt-optim-fully-reshardable", "checkpoint", action="store_true"),
    _f("--no-ckpt-fully-parallel-save", "checkpoint", "ckpt_fully_parallel_save",
       action="store_false",
       help="replicated tensors are written by their lowest rank, not spread over the ranks"),
    # Post-processed: the model flags are replaced by the --load checkpoint's.
    _f("--use-checkpoint-args", None, "use_checkpoint_args", action="store_true"),
]

# Megatron-LM flags accepted and ignored, each with the reason it changes neither results nor
# memory here (the README lists the same table; a test keeps the two equal).
IGNORED_FLAGS: Dict[str, str] = {
    "--use-flash-attn": "attention always runs through torch SDPA, which picks flash kernels "
                        "itself where the device has them",
    "--attention-backend": "SDPA picks its kernel (flash, efficient, math) itself",
    "--transformer-impl": "one transformer implementation (the Megatron 'local' layout)",
    "--use-mcore-models": "one model implementation",
    "--use-legacy-models": "one model implementation (Megatron-LM main removed the flag)",
    "--DDP-impl": "one DDP implementation (Megatron's local DDP: contiguous buffers)",
    "--use-contiguous-buffers-in-local-ddp": "buffers are always contiguous",
    "--no-masked-softmax-fusion": "kernel fusion choice",
    "--no-bias-gelu-fusion": "kernel fusion choice",
    "--no-bias-swiglu-fusion": "kernel fusion choice",
    "--no-bias-dropout-fusion": "kernel fusion choice",
    "--no-rope-fusion": "kernel fusion choice",
    "--no-persist-layer-norm": "kernel choice of Apex's layer norm",
    "--no-async-tensor-model-parallel-allreduce": "communication overlap choice",
    "--use-cpu-initialization": "master weights are always drawn on the CPU (so they do not "
                                "depend on the layout), then moved to the device",
    "--attention-softmax-in-fp32": "SDPA accumulates the softmax in fp32",
    "--apply-query-key-layer-scaling": "a numerics guard of Megatron's unfused fp16 softmax; "
                                       "the scaled product is the same with SDPA",
    "--no-query-key-layer-scaling": "see --apply-query-key-layer-scaling",
    "--no-create-attention-mask-in-dataloader": "no [s, s] mask is ever built: causal "
                                                "masking is inside the attention kernel, and "
                                                "--reset-attention-mask / --sft pass document "
                                                "ids",
    "--timing-log-level": "log verbosity of Megatron's per-phase timers (the log line's "
                          "iteration time is always printed)",
    "--timing-log-option": "which ranks' values of Megatron's per-phase timers are printed "
                           "(max, minmax, all); those timers are not printed here",
    "--exit-signal-handler-for-dataloader": "Megatron-LM core_v0.16.1 declares it and reads it "
                                            "nowhere; with --exit-signal-handler the data "
                                            "loader workers get the handler, as there",
    "--cross-entropy-loss-fusion": "kernel fusion choice: Megatron's fused vocab-parallel "
                                   "cross entropy computes the same loss as the unfused one",
    "--cross-entropy-fusion-impl": "which fused cross-entropy kernel (native or Transformer "
                                   "Engine), see --cross-entropy-loss-fusion",
    "--ckpt-fully-parallel-save": "Megatron-LM core_v0.16.1 itself ignores it (deprecated: "
                                  "parallel saving is its default); here too DCP's planner "
                                  "spreads the writes of replicated tensors over their ranks "
                                  "unless --no-ckpt-fully-parallel-save is given",
    "--ckpt-fully-parallel-load": "how data-parallel replicas share reading: here each rank "
                                  "reads only its own chunks straight from the files, which "
                                  "gives the same tensors and memory with or without it",
    "--use-persistent-ckpt-worker": "Megatron-LM main: whether its async-save worker outlives "
                                    "one save; the bytes written are the same",
    "--async-strategy": "Megatron-LM main: which of its async-save engines (nvrx, mcore) "
                        "writes; here --async-save has one",
    "--async-ckpt-use-cpu-shm": "Megatron-LM main: how the nvrx async worker receives GPU "
                                "tensors (CPU shared memory instead of CUDA IPC)",
    "--ckpt-assume-constant-structure": "Megatron-LM main: caches its save plan between saves "
                                        "of the same structure; the files are the same",
    "--dist-ckpt-workers": "Megatron-LM main: how many processes write an async save; the "
                           "files are the same",
    "--verify-integrity": "Megatron-LM main: hash the files on save, check them on load; here "
                          "every checkpoint file always carries CRC-32 sidecars checked on load",
    "--no-save-tokenizer-assets": "Megatron-LM main saves tokenizer files into checkpoints by "
                                  "default; checkpoints here never hold them (what this flag "
                                  "asks)",
    "--moe-permute-fusion": "kernel fusion choice (Transformer Engine's fused token "
                            "permutation: the same tokens reach the same experts)",
    "--moe-router-fusion": "kernel fusion choice (Transformer Engine's fused router top-k and "
                           "scores: the same routing)",
    "--overlap-moe-expert-parallel-comm": "communication overlap choice (Megatron-LM main "
                                          "overlaps the expert all-to-all with another "
                                          "microbatch's compute; the same result)",
    "--defer-embedding-wgrad-compute": "when the output layer's weight grad is computed "
                                       "(Megatron defers it to overlap the pipeline's last "
                                       "backward); the same grad",
    "--use-transformer-engine-op-fuser": "kernel fusion choice (Megatron-LM main: Transformer "
                                         "Engine's operation fuser builds fused kernels for the "
                                         "same ops)",
    "--export-force-local-attention": "Megatron-LM main (ModelOpt's model builder): its local "
                                      "DotProductAttention instead of Transformer Engine's; "
                                      "the same attention, here always SDPA",
    "--use-tp-pp-dp-mapping": "the order ranks are laid out in (tp-pp-dp instead of "
                              "tp-cp-ep-dp-pp): which ranks form each group, not what is "
                              "computed",
}
# Megatron-LM flags accepted and changing nothing in the absence of another flag, as in
# Megatron-LM: {flag: (the flag it needs to act, the reason)} (the docs table lists them too,
# as "`--flag` without `--other`").
IGNORED_WITHOUT: Dict[str, tuple] = {
    "--apply-wd-to-qk-layernorm": ("--qk-layernorm", "there are no q/k norm weights to decay "
                                   "(Megatron-LM accepts it there too); every other 1-D param "
                                   "and bias stays undecayed"),
}
# Which of them take a value.
_IGNORED_WITH_VALUE = {"--attention-backend", "--transformer-impl", "--DDP-impl",
                       "--timing-log-level", "--cross-entropy-fusion-impl",
                       "--timing-log-option", "--async-strategy", "--dist-ckpt-workers"}

# Megatron-LM flags of capabilities megatron_smp does not have yet: giving one is an error, never
# a silent no-op. Every other --moe-* flag is treated the same way.
NOT_SUPPORTED_YET_FLAGS: Dict[str, str] = {
    "--hierarchical-context-parallel-sizes": "hierarchical (a2a+p2p) context parallelism",
    # Megatron-LM 0.19 / main.
    "--use-mup": "Maximal Update Parametrisation (muP: width-scaled init, learning rates and "
                 "attention scale)",
    "--mup-base-hidden-size": "Maximal Update Parametrisation (--use-mup)",
    "--mup-base-head-dim": "Maximal Update Parametrisation (--use-mup)",
    "--multiple-validation-sets": "separate validation losses per validation dataset",
    "--validation-set-names": "separate validation losses per validation dataset "
                              "(--multiple-validation-sets)",
    "--start-eval-at-iter": "a first evaluation iteration other than --eval-interval's",
    "--freeze-all-layers": "freezing the whole model (LoRA, --lora-rank, freezes the base)",
    "--chat-template": "a custom jinja chat template (--sft uses the tokenizer's)",
    "--override-ckpt-iteration": "loading a checkpoint under another iteration number",
    "--moe-extended-tp": "extended expert tensor parallelism (Megatron-LM main removed it: use "
                         "--expert-tensor-parallel-size)",
    "--qk-clip": "Kimi's QK-clip (rescaling the query and key weights whose attention logits "
                 "exceed a threshold)",
    "--qk-clip-alpha": "Kimi's QK-clip (--qk-clip)",
    "--qk-clip-threshold": "Kimi's QK-clip (--qk-clip)",
}
# Values Megatron-LM main added to existing flags that are not built here.
_NOT_SUPPORTED_YET_VALUES = {
    ("--moe-router-load-balancing-type", "quantile_balancing"): "quantile balancing (a "
                                                                 "per-expert bias by dual "
                                                                 "coordinate descent)",
}


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
    if yarn and model.get("position_embedding_type") != "yarn":
        raise ConfigError(f"{', '.join(yarn)} configure YaRN: add --position-embedding-type "
                          "yarn (with --multi-latent-attention: drop --rope-type rope), or "
                          "drop them")


# The --moe-* flags that exist; any other is an error (never silently ignored).
_MOE_FLAGS = {spec.flag for spec in _FLAGS if spec.flag.startswith("--moe-")}


# FP8 / FP4 training needs NVIDIA Transformer Engine on a Hopper or Blackwell GPU: every such
# flag of Megatron-LM core_v0.16.1 is an error here, never silently ignored.
_LOW_PRECISION_FLAG_PREFIXES = ("--fp8-", "--fp4-")
_LOW_PRECISION_FLAGS = {"--no-fp8-wgrad", "--disable-fp8-wgrad", "--keep-fp8-transpose-cache",
                        "--reuse-grad-buf-for-mxfp8-param-ag", "--first-last-layers-bf16",
                        "--num-layers-at-start-in-bf16", "--num-layers-at-end-in-bf16",
                        "--te-precision-config-file"}


def _low_precision_error(flag: str) -> ConfigError:
    """The error for an FP8/FP4 flag: the hardware and library it needs."""
    try:
        import transformer_engine  # noqa: F401

        have = "Transformer Engine imports here, but megatron_smp has no FP8/FP4 path built"
    except Exception:  # ImportError, or a build without its CUDA libraries
        have = "Transformer Engine is not installed here, and megatron_smp has no FP8/FP4 path"
    return ConfigError(
        f"{flag} asks for FP8/FP4 training, which needs NVIDIA Transformer Engine on a "
        f"Hopper (H100/H200) or Blackwell GPU; {have}. Drop the --fp8-*/--fp4-* flags and "
        "train in --bf16 (the hardware-only change Megatron's FP8 example scripts allow)"
    )


def _apply_megatron_fsdp(args: argparse.Namespace, sections: Dict[str, Dict[str, Any]]) -> None:
    """Megatron-FSDP's flags on the engines built here, where the strategy maps exactly:
    no_shard is DDP, optim shards the optimizer state (--use-distributed-optimizer),
    optim_grads_params shards params, grads and optimizer state (FSDP2, --use-torch-fsdp2);
    optim_grads (params replicated, grads sharded) is not built."""
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
    if args.num_distributed_optimizer_instances != 1:
        raise ConfigError(f"--num-distributed-optimizer-instances "
                          f"{args.num_distributed_optimizer_instances}: the distributed optimizer "
                          "here shards over the whole data-parallel group (one instance); drop it")
    if args.cuda_graph_impl != "none":
        raise ConfigError(f"--cuda-graph-impl {args.cuda_graph_impl} captures CUDA graphs, which "
                          "megatron_smp does not build; drop it (a hardware-only switch)")
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


def _reject_not_supported_yet(argv: Sequence[str]) -> None:
    """ConfigError for the first flag in `argv` whose capability does not exist yet (FP8/FP4
    flags included)."""
    for token, value in zip(argv, list(argv[1:]) + [""]):
        flag, _, inline = token.partition("=")
        what = _NOT_SUPPORTED_YET_VALUES.get((flag, inline or value))
        if what:
            raise not_supported(f"{flag} {inline or value}", what)
    for token in argv:
        flag = token.split("=", 1)[0]
        if flag.startswith(_LOW_PRECISION_FLAG_PREFIXES) or flag in _LOW_PRECISION_FLAGS:
            raise _low_precision_error(flag)
        if flag in NOT_SUPPORTED_YET_FLAGS:
            raise not_supported(flag, NOT_SUPPORTED_YET_FLAGS[flag])
        if flag.startswith("--moe-") and flag not in _MOE_FLAGS and flag not in IGNORED_FLAGS:
            raise not_supported(flag, "this mixture-of-experts option")


def build_parser(extra_args_provider: Optional[Callable] = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="megatron_smp pretraining (Megatron-LM compatible flags)",
        allow_abbrev=False,
    )
    for spec in _FLAGS:
        dest = spec.field if spec.section is None else f"{spec.section}__{spec.field}"
        parser.add_argument(spec.flag, dest=dest, **spec.kwargs)
    for flag in IGNORED_FLAGS:
        if flag in _IGNORED_WITH_VALUE:
            parser.add_argument(flag, dest=f"ignored__{flag}", help=argparse.SUPPRESS)
        else:
            parser.add_argument(flag, dest=f"ignored__{flag}", action="store_true",
                                help=argparse.SUPPRESS)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser) or parser
    return parser


@dataclass
class Configs:
    """Everything one run needs, typed. `args` keeps the raw namespace for the flags an entry
    script adds with `extra_args_provider` (Megatron's convention)."""

    model: TransformerConfig
    parallel: ParallelConfig
    optimizer: OptimizerConfig
    training: TrainingConfig
    data: DataConfig
    checkpoint: CheckpointConfig
    args: argparse.Namespace
    # How validation names ParallelConfig fields the user set through --smp-config keys.
    setting_names: Dict[str, str] = dataclasses.field(default_factory=dict)
    resilience: ResilienceConfig = dataclasses.field(default_factory=ResilienceConfig)

    def to_dict(self) -> Dict[str, Any]:
        """Plain-data view (for checkpoint metadata and logs)."""
        out = {}
        for name in _SECTIONS:
            section = dataclasses.asdict(getattr(self, name))
            out[name] = {k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in section.items()}
        return out


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


def _parse_namespace(argv: List[str], extra_args_provider: Optional[Callable],
                     args_defaults: Optional[Dict[str, Any]]) -> argparse.Namespace:
    """The argparse namespace of `argv`, with the entry script's defaults."""
    _reject_not_supported_yet(argv)
    parser = build_parser(extra_args_provider)
    if args_defaults:
        by_field = {}
        for spec in _FLAGS:
            key = spec.flag.lstrip("-").replace("-", "_")
            by_field[key] = spec.field if spec.section is None else f"{spec.section}__{spec.field}"
        parser.set_defaults(**{by_field.get(k, k): v for k, v in args_defaults.items()})
    if hybrid_pattern_given(argv):  # the pattern gives the layer count, as in Megatron
        parser._option_string_actions["--num-layers"].required = False
    if "--use-checkpoint-args" in argv:
        # As in Megatron, the model's shape may come from the --load checkpoint alone.
        for action in parser._actions:
            if action.dest.startswith("model__"):
                action.required = False
    return parser.parse_args(argv)


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


def parse_args(
    argv: Optional[Sequence[str]] = None,
    extra_args_provider: Optional[Callable] = None,
    args_defaults: Optional[Dict[str, Any]] = None,
) -> Configs:
    """Parse Megatron flags into `Configs`; `validate_configs` checks them (once the tokenizer
    has given the vocabulary size). Raises ConfigError for flags that contradict each other
    or name a capability that does not exist yet; argparse exits for malformed values.

    `args_defaults` maps flag destinations without dashes (e.g. "tokenizer_type") to defaults
    an entry script wants (Megatron's convention).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parse_namespace(argv, extra_args_provider, args_defaults)
    sections: Dict[str, Dict[str, Any]] = {name: {} for name in _SECTIONS}
    for spec in _FLAGS:
        if spec.section is None:
            continue
        value = getattr(args, f"{spec.section}__{spec.field}")
        if value is not None:
            sections[spec.section][spec.field] = value

    model = sections["model"]
    training = sections["training"]
    _apply_hybrid_flags(args, model)
    _position_fields(args, model)
    _check_rope_scaling_flags(argv, model, args.enable_gpt_oss)
    _activation_fields(args, argv, model)
    _model_fields(args, argv, sections)
    _apply_optimizer_choice(args, sections["optimizer"], argv)
    _apply_megatron_fsdp(args, sections)
    _apply_megatron_main_flags(args, sections)
    if sections["checkpoint"].get("ckpt_format") == "fsdp_dtensor":
        # Megatron-FSDP's format is DCP over the sharded DTensors; ours (torch_dist) is DCP
        # with global tensor names and shapes, which FSDP2 runs write and read already.
        if not sections["parallel"].get("use_torch_fsdp2"):
            raise ConfigError("--ckpt-format fsdp_dtensor is Megatron-FSDP's format: add "
                              "--use-megatron-fsdp --data-parallel-sharding-strategy "
                              "optim_grads_params (or --use-torch-fsdp2), or use torch_dist")
        sections["checkpoint"]["ckpt_format"] = "torch_dist"
    setting_names: Dict[str, str] = {}
    if args.smp_config:
        _apply_smp_config(args.smp_config, sections, setting_names)

    # Given by --train-samples instead: pretrain derives it (see NumMicrobatchesCalculator).
    training.setdefault("train_iters", None)
    if model.get("recompute_modules") is not None:
        model["recompute_modules"] = [
            name for token in model["recompute_modules"]
            for name in re.split(r"[\s,\[\]]+", token) if name]
    if args.recompute_activations:
        if model.get("recompute_granularity", "selective") != "selective":
            raise ConfigError("--recompute-activations is --recompute-granularity selective; "
                              f"drop one (--recompute-granularity is "
                              f"{model['recompute_granularity']})")
        model["recompute_granularity"] = "selective"

    if args.use_checkpoint_args:
        model.update(checkpoint_model_fields(sections["checkpoint"].get("load"),
                                             sections["checkpoint"].get("pretrained_checkpoint")))
        missing = [f"--{name.replace('_', '-')}" for name in
                   ("num_layers", "hidden_size", "num_attention_heads") if model.get(name) is None]
        if missing:
            raise ConfigError(f"--use-checkpoint-args: the --load checkpoint gives no "
                              f"{', '.join(missing)}; pass {'it' if len(missing) == 1 else 'them'}")
    if training.get("skip_train"):
        # Megatron's --skip-train only evaluates: the optimizer state is never needed.
        sections["checkpoint"]["no_load_optim"] = True
    built = {name: cls(**sections[name]) for name, cls in _SECTIONS.items()}
    return Configs(args=args, setting_names=setting_names, **built)


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
            check_virtual_microbatches(count, parallel.pipeline_model_parallel_size)


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
    configs.resilience.validate(configs.checkpoint.save, world_size)


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
    if per_split_paths and getattr(configs.args, "data__split", None) is not None:
        raise ConfigError(f"--split cuts --data-path; {'/'.join(per_split_paths)} are used "
                          "whole (Megatron refuses both too): drop --split")
    if data.mid_level_dataset_surplus < 0:
        raise ConfigError(f"--mid-level-dataset-surplus must be >= 0, got "
                          f"{data.mid_level_dataset_surplus}")


def _validate_checkpoint_flags(configs: Configs) -> None:
    """--save-interval, the run-control flags, the LR-schedule choice on load, the format."""
    checkpoint = configs.checkpoint
    if checkpoint.save_interval is not None and not checkpoint.save:
        raise ConfigError("--save-interval needs --save DIR")
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
        use_flash_attn=bool(getattr(configs.args, "ignored__--use-flash-attn", False)),
        uses_nccl=backend == "nccl" or (backend is None and cuda),
        sharded_params=configs.parallel.use_torch_fsdp2,
    )
    validate_profiling(configs.training, cuda)
    validate_result_flags(configs.training)
    if configs.training.torch_compile and "layernorm" in (configs.model.recompute_modules or ()):
        raise ConfigError("--recompute-modules layernorm frees and refills tensor storage "
                          "between forward and backward, which --torch-compile's graphs do "
                          "not allow: drop one of them")
    validate_wandb(configs.training, configs.checkpoint.save)
    if configs.training.log_progress and not configs.checkpoint.save:
        raise ConfigError("--log-progress writes <--save>/progress.txt: add --save DIR")


__all__ = [
    "Configs", "IGNORED_FLAGS", "IGNORED_WITHOUT", "NOT_SUPPORTED_YET_FLAGS", "build_parser",
    "parse_args", "validate_configs",
]
