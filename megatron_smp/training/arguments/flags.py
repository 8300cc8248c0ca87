"""The flag table: every Megatron-LM flag accepted here, declared once with the config section
and field it fills, so the argparse layer and the dataclasses cannot drift apart.

Flag names are Megatron-LM's, so users' existing pretraining shell scripts run unchanged.
Every accepted flag does what it says, with the exceptions listed in `IGNORED_FLAGS` (and the
docs): flags that only pick a Megatron implementation detail with no effect on results or
memory. Flags of capabilities that do not exist yet (`NOT_SUPPORTED_YET_FLAGS`, every `--moe-*`
flag not in `_FLAGS`) are a ConfigError. How flags become configs: parse.py (with compat.py's
Megatron-LM / SMP translations); how configs are checked: validation.py.
"""
from __future__ import annotations

import argparse
import signal
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

from megatron_smp.checkpointing.loop import STRICTNESS_CHOICES
from megatron_smp.training.arguments import megatron_lm
from megatron_smp.config import (
    CP_COMM_TYPES,
    LR_DECAY_STYLES,
    LR_WSD_DECAY_STYLES,
    ConfigError,
    not_supported,
)


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
    _f("--group-query-attention", None, "group_query_attention", action="store_true",
       help="grouped-query attention with --num-query-groups key/value heads"),
    _f("--num-query-groups", None, "num_query_groups", type=int,
       help="key/value heads under --group-query-attention (without it an error)"),
    _f("--max-position-embeddings", "model", type=int),
    _f("--make-vocab-size-divisible-by", "model", type=int, default=128),
    _f("--normalization", "model", choices=["LayerNorm", "RMSNorm"], default="LayerNorm"),
    _f("--norm-epsilon", "model", "layernorm_epsilon", type=float, default=1e-5),
    _f("--swiglu", None, "swiglu", action="store_true",
       help="gated MLP silu(gate) * up; without --ffn-hidden-size the width is 2/3 of 4h, "
       "rounded down to a multiple of 64 (Megatron's rule)"),
    _f("--openai-gelu", None, "openai_gelu", action="store_true",
       help="MLP activation: the tanh approximation of GeLU (GPT-2's, HF gelu_new)"),
    _f("--position-embedding-type", "model", choices=_CHOICES_POSITION,
       default="learned_absolute"),
    _f("--use-rotary-position-embeddings", None, "use_rotary_position_embeddings",
       action="store_true", help="Megatron's older spelling of --position-embedding-type rope"),
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
    # Model numerics (Megatron's semantics; see docs/models.md "Model numerics").
    _f("--rotary-interleaved", "model", action="store_true"),
    _f("--no-position-embedding", None, "add_position_embedding", action="store_false",
       help="Megatron's deprecated spelling: only with --position-embedding-type rope"),
    _f("--apply-layernorm-1p", "model", "layernorm_zero_centered_gamma", action="store_true",
       help="norm weights stored zero-centred: y = norm(x) * (1 + w)"),
    _f("--qk-layernorm", "model", action="store_true"),
    _f("--test-mode", "model", action="store_true",
       help="Megatron-LM's real-time test: each attention forward checks that the data- and "
            "tensor-parallel replicas of its --qk-layernorm weights are equal, and stops the "
            "run on every rank of a group that disagrees"),
    _f("--squared-relu", None, "squared_relu", action="store_true",
       help="MLP activation relu(x)^2"),
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
    # Gemma 3 (docs/models.md "gpt-oss and Gemma 3"): Megatron-LM main's
    # --rotary-seq-len-interpolation-factor; Megatron-LM has no flags for the rest, named here
    # after Megatron-Bridge's Gemma fields.
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
    # Megatron-LM main's muP (TransformerConfig.use_mup and its mup_* fields).
    _f("--use-mup", "model", action="store_true",
       help="Maximal Update Parametrisation: width-scaled init, per-group learning rates and "
       "Adam eps, muP attention and output scaling"),
    _f("--mup-base-hidden-size", "model", type=int,
       help="the proxy model's hidden size (width multiplier = hidden size / this)"),
    _f("--mup-embedding-mult", "model", type=float, default=1.0),
    _f("--mup-output-mult", "model", type=float, default=1.0,
       help="logit multiplier; 1.0 means 1 / width multiplier"),
    _f("--mup-base-head-dim", "model", type=float),
    _f("--mup-attn-scale-power", "model", type=float, default=1.0),
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
    _f("--disable-bias-linear", None, "disable_bias_linear", action="store_true",
       help="no biases in the linear layers (--add-qkv-bias adds q/k/v ones back)"),
    _f("--add-qkv-bias", "model", action="store_true"),
    _f("--init-method-std", "model", type=float, default=0.02),
    _f("--recompute-granularity", "model", choices=["full", "selective"]),
    _f("--recompute-activations", None, "recompute_activations", action="store_true",
       help="Megatron's shorthand for --recompute-granularity selective"),
    _f("--recompute-method", "model", choices=["uniform", "block"]),
    _f("--recompute-num-layers", "model", type=int),
    # Space- or comma-separated; Megatron's test configs also write "[layernorm mlp]".
    _f("--recompute-modules", "model", nargs="+"),
    # Multi-latent attention (Megatron's flags; see docs/models.md "Multi-latent attention").
    _f("--multi-latent-attention", "model", action="store_true"),
    # Megatron: multi-latent attention takes YaRN by default (--rotary-scaling-factor, default
    # 1.0, where it equals plain RoPE), --rope-type rope opts out; other attention takes rope.
    _f("--rope-type", None, "rope_type", choices=["rope", "yarn"],
       help="with --multi-latent-attention: rope opts out of its default YaRN; yarn is only "
       "for it (other attention: --position-embedding-type yarn)"),
    _f("--q-lora-rank", "model", type=int),
    _f("--kv-lora-rank", "model", type=int, default=32),
    _f("--qk-head-dim", "model", type=int, default=128),
    _f("--qk-pos-emb-head-dim", "model", type=int, default=64),
    _f("--v-head-dim", "model", type=int, default=128),
    # Multi-token prediction (Megatron's flags; see docs/models.md "Multi-token prediction").
    _f("--mtp-num-layers", "model", type=int),
    _f("--mtp-loss-scaling-factor", "model", type=float, default=0.1),
    # Hybrid models (Megatron-LM main's flags; see docs/models.md "Hybrid models").
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
    # Mixture of experts (Megatron's flags; see docs/models.md "Mixture of experts").
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
    _f("--moe-token-dispatcher-type", "model", choices=["allgather", "alltoall", "flex"],
       default="allgather"),
    _f("--moe-flex-dispatcher-backend", "model", choices=["deepep", "hybridep", "ncclep"],
       default="deepep",
       help="the fused kernel Megatron-LM runs the flex dispatcher's exchange with; here "
       "torch.distributed's all-to-all, the same routing"),
    # Post-processed: Megatron-LM main's deprecated spelling of the deepep backend.
    _f("--moe-enable-deepep", None, "moe_enable_deepep", action="store_true"),
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
    _f("--expert-tensor-parallel-size", "parallel", type=int,
       help="ranks each expert is split over (default --tensor-model-parallel-size; at most "
            "that): each pipeline stage's ranks form Megatron's expert grid etp x ep x "
            "expert-data-parallel"),
    # Parallelism.
    _f("--tensor-model-parallel-size", "parallel", type=int, default=1),
    _f("--pipeline-model-parallel-size", "parallel", type=int, default=1),
    _f("--context-parallel-size", "parallel", type=int, default=1),
    _f("--cp-comm-type", "model", choices=list(CP_COMM_TYPES), default="p2p",
       help="context parallelism's attention: p2p ring, all_gather of K/V, a2a (Ulysses)"),
    _f("--expert-model-parallel-size", "parallel", type=int, default=1),
    _f("--virtual-pipeline-model-parallel-size", "parallel", type=int),
    _f("--num-layers-per-virtual-pipeline-stage", "parallel", type=int),
    _f("--pipeline-model-parallel-layout", "parallel",
       help="Megatron's layout string: |-separated virtual stages (stage k on rank k mod pp) of "
            "E (embedding), t (transformer layer), m (MTP), L (loss), with (..)*n and x*n "
            "repeats, e.g. \"Et*3|(tt|)*6tmL\""),
    _f("--account-for-embedding-in-pipeline-split", "parallel", action="store_true",
       help="the layer split over pipeline stages counts the embedding as a layer: the first "
            "stage's first chunk holds one transformer layer fewer"),
    _f("--account-for-loss-in-pipeline-split", "parallel", action="store_true",
       help="the layer split counts the loss as a layer: the last stage's last chunk holds "
            "one transformer layer fewer"),
    _f("--microbatch-group-size-per-virtual-pipeline-stage", "training",
       "microbatch_group_size_per_vp_stage", type=int,
       help="the interleaved schedule runs each model chunk on this many microbatches in turn "
            "(default: the pipeline size; between it and the number of microbatches)"),
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
    # Megatron-FSDP's sharding over the outer data-parallel group of HSDP (several
    # distributed-optimizer instances): no_shard, its default, is replication (all there is
    # with one instance); optim is not built.
    _f("--outer-dp-sharding-strategy", None, "outer_dp_sharding_strategy",
       choices=["no_shard", "optim"], default="no_shard"),
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
    _f("--muon-use-syrk", None, "muon_use_syrk", action="store_true",
       help="refused: a Triton kernel choice for the Gram matrix; the iteration here uses "
       "torch's matmul"),
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
    _f("--eval-micro-batch-size", None, "eval_micro_batch_size", type=int,
       help="accepted when equal to --micro-batch-size: evaluation runs with the training batch"),
    _f("--eval-global-batch-size", None, "eval_global_batch_size", type=int,
       help="accepted when equal to --global-batch-size: evaluation runs with the training "
       "batch"),
    _f("--null-tokenizer-eod-id", None, "null_tokenizer_eod_id", type=int,
       help="accepted when equal to --vocab-size: the NullTokenizer's EOD is the id after the "
       "text ids"),
    _f("--exit-signal-handler-for-training", None, "exit_signal_handler_for_training",
       action="store_true",
       help="refused: Megatron-LM main's quiet exit on SIGINT/SIGTERM is not built "
       "(--exit-signal-handler saves and exits)"),
    _f("--megatron-fsdp-main-params-dtype", None, "megatron_fsdp_main_params_dtype",
       choices=["fp32", "bf16", "fp16", "auto"],
       help="with --use-megatron-fsdp: fp32 (auto for an fp32 model), what FSDP2 here keeps; "
       "other values are an error"),
    _f("--megatron-fsdp-main-grads-dtype", None, "megatron_fsdp_main_grads_dtype",
       choices=["fp32", "bf16", "fp16", "auto"],
       help="with --use-megatron-fsdp: fp32 (auto for an fp32 model), what FSDP2 here keeps; "
       "other values are an error"),
    _f("--megatron-fsdp-grad-comm-dtype", None, "megatron_fsdp_grad_comm_dtype",
       choices=["fp32", "bf16", "fp16", "auto"],
       help="with --use-megatron-fsdp: fp32 or auto; other values are an error"),
    _f("--num-virtual-stages-per-pipeline-rank", None, "num_virtual_stages_per_pipeline_rank",
       type=int, help="Megatron-LM main's name of --virtual-pipeline-model-parallel-size"),
    _f("--num-distributed-optimizer-instances", "optimizer", type=int, default=1,
       help="split the data-parallel ranks into N consecutive instances: the distributed "
            "optimizer shards within each, and the instances all-reduce each shard's grads"),
    _f("--cuda-graph-impl", None, "cuda_graph_impl",
       choices=["none", "local", "transformer_engine"], default="none",
       help="local: the inference tools' (and train_rl.py's rollouts') decode steps "
       "captured as CUDA graphs, one per padded batch size and key width (a CUDA device); "
       "training: none only"),
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
    _f("--fp16", None, "fp16", action="store_true",
       help="fp16 params with fp32 main params and dynamic loss scaling"),
    _f("--bf16", None, "bf16", action="store_true",
       help="bf16 params with fp32 main params (grads reduced in fp32 unless "
       "--grad-reduce-in-bf16)"),
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
    _f("--error-injection-rate", "training", type=int, default=0,
       help="with --rerun-mode validate_results: reject each check with probability 1/N per "
            "rank (Megatron's error injector, to rehearse the reruns); 0: never"),
    _f("--error-injection-type", "training",
       choices=["correct_result", "transient_error", "persistent_error"],
       default="transient_error",
       help="what the injected error looks like to the reruns: not reproduced in place "
            "(transient), or reproduced in place and then not (persistent) or again "
            "(correct) on the resumed job's rerun elsewhere"),
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
    _f("--fault-injector-fault-types", "resilience", metavar="hang|crash|slow|exception[,...]",
       help="the fault, drawn from these: hang (the process SIGSTOPs itself), crash (SIGKILL), "
       "slow (each later step --fault-injector-slow-factor times as long), exception (the "
       "rank's next step raises); only the first restart attempt injects"),
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
    _f("--inprocess-restart", "resilience", action="store_true",
       help="a failed training run (an exception on a rank; with --enable-ft-package a rank "
       "stuck without its process freezing) is restarted inside the same processes: every "
       "rank aborts its collectives, forms new process groups and resumes from the last "
       "checkpoint (--save = --load; under torchrun). A frozen or dead rank still ends the "
       "job with code 75 for torchrun / SLURM to relaunch"),
    _f("--inprocess-max-iterations", "resilience", type=int,
       help="the most in-process restarts; the next failure ends the process (default: no "
       "limit)"),
    _f("--inprocess-empty-cuda-cache", "resilience", action="store_true",
       help="return the CUDA caching allocator's unused memory at each in-process restart"),
    _f("--log-straggler", "resilience", action="store_true",
       help="every log interval, the slowest and fastest ranks by their fastest "
       "forward-backward in the interval, "
       "with their throughput relative to the median; ranks below 0.7x in two reports running "
       "named as stragglers"),
    _f("--straggler-minmax-count", "resilience", type=int, default=1,
       help="how many slowest and fastest ranks the straggler report names"),
    _f("--disable-straggler-on-startup", "resilience", action="store_true",
       help="the straggler report starts off (toggle it on --straggler-ctrlr-port)"),
    _f("--straggler-ctrlr-port", "resilience", type=int, default=65535,
       help="rank 0 toggles the straggler report on each GET to 127.0.0.1:PORT"),
    # Replica groups (torchft), torchtitan's --fault_tolerance.* options.
    _f("--fault-tolerance", "resilience", action="store_true",
       help="this job is one replica group of several (torchft): the groups average their "
       "gradients over the groups alive at each step; a group that fails leaves the quorum "
       "and the others go on, a restarted group fetches the weights and optimizer state from "
       "a live one and rejoins"),
    _f("--fault-tolerance-replica-id", "resilience", type=int, default=0,
       help="this replica group's index (its data shard), 0..group-size-1"),
    _f("--fault-tolerance-group-size", "resilience", type=int, default=0,
       help="how many replica groups the job has (each reads 1/N of the data)"),
    _f("--fault-tolerance-min-replica-size", "resilience", type=int, default=1,
       help="the fewest replica groups a step may update with (fewer: the step is skipped)"),
    _f("--fault-tolerance-lighthouse", "resilience", metavar="http://HOST:PORT",
       help="the torchft lighthouse (default: the TORCHFT_LIGHTHOUSE variable)"),
    _f("--fault-tolerance-process-group-timeout-ms", "resilience", type=int, default=10000,
       help="the longest a gradient all-reduce across replica groups may take before the "
       "step is given up (and the quorum re-formed)"),
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
    # Fill-in-the-middle samples (Megatron-LM's GPTFIMDataset: data/fim.py).
    _f("--fim-data", "data", action="store_true",
       help="turn samples into fill-in-the-middle ones (prefix / suffix / middle by characters, "
            "PSM or SPM), as Megatron-LM's GPT FIM dataset"),
    _f("--fim-rate", "data", type=float, default=0.5,
       help="--fim-data: probability that a piece (between EODs) is made FIM"),
    _f("--fim-spm-rate", "data", type=float, default=0.5,
       help="--fim-data: probability that a FIM piece uses SPM order rather than PSM"),
    _f("--fim-split-sample", "data",
       help="--fim-data: a token at which pieces are split into fragments, each made FIM "
            "with --fim-fragment-rate"),
    _f("--fim-fragment-rate", "data", type=float,
       help="--fim-data --fim-split-sample: probability that a fragment is made FIM"),
    _f("--fim-no-prefix", "data",
       help="--fim-data: pieces whose text starts with this are left as they are"),
    *[_f(f"--fim-{name}-token", "data", default=default,
         help=f"--fim-data: the vocabulary's {name} token")
      for name, default in (("prefix", "<fim_prefix>"), ("middle", "<fim_middle>"),
                            ("suffix", "<fim_suffix>"), ("pad", "<fim_pad>"),
                            ("eod", "<|endoftext|>"))],
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
    _f("--use-checkpoint-args", None, "use_checkpoint_args", action="store_true",
       help="the model flags come from the --load checkpoint (the shape flags may be left out)"),
]

# Megatron-LM main's flags with a meaning of their own here (megatron_lm.py).
_FLAGS += [_f(flag, section, field, **kwargs)
           for flag, section, field, kwargs in megatron_lm.IMPLEMENTED]
# Its other spellings of flags in the table: the same config field.
_FLAGS += [_Flag(alias, spec.section, spec.field,
                 megatron_lm.alias_kwargs(spec.flag, spec.kwargs, negated))
           for spec in list(_FLAGS)
           for aliases, negated in ((megatron_lm.ALIASES, False),
                                    (megatron_lm.NEGATED_ALIASES, True))
           for alias, flag in aliases.items() if flag == spec.flag]

# Megatron-LM flags accepted and ignored, each with the reason it changes neither results nor
# memory here (docs/flags.md lists the same table, generated from this one).
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
    # The flex dispatcher's kernels (Megatron-LM main; see --moe-flex-dispatcher-backend).
    "--moe-flex-dispatcher-num-sms": "GPU streaming multiprocessors the flex dispatcher's "
                                     "kernels may use: how fast, not what they exchange",
    "--moe-deepep-num-sms": "deprecated spelling of --moe-flex-dispatcher-num-sms",
    "--moe-hybridep-num-sms": "deprecated spelling of --moe-flex-dispatcher-num-sms",
    "--moe-hybridep-num-sms-preprocessing": "GPU multiprocessors of HybridEP's preprocessing "
                                            "kernel",
    "--moe-hybridep-num-blocks-permute": "thread blocks of HybridEP's fused permute kernel",
    "--moe-hybridep-num-blocks-unpermute": "thread blocks of HybridEP's fused unpermute kernel",
    "--moe-permute-fusion-into-hybridep": "kernel fusion choice (token permutation inside "
                                          "HybridEP's dispatch kernel)",
    "--moe-hybridep-pad-uneven-dispatch-inputs": "HybridEP's kernels need equal inputs per "
                                                 "rank; the all-to-all here takes uneven "
                                                 "counts as they are",
    "--moe-ncclep-zero-copy": "NCCL-EP's symmetric-memory IO path: where the exchanged rows "
                              "are buffered, not which",
    "--mup-width-mult": "Megatron-LM main computes it (hidden size / --mup-base-hidden-size) "
                        "over any value given, and reads it only with --use-mup",
    "--overlap-param-gather-with-optimizer-step": "communication overlap choice (Megatron "
                                                  "gathers the first bucket's params during the "
                                                  "optimizer step); the same params",
    "--overlap-p2p-communication-warmup-flush": "communication overlap choice (the pipeline's "
                                                "warm-up and flush sends and receives "
                                                "overlapped); the same activations",
    "--wgrad-deferral-limit": "how many microbatches' output-layer weight grads Megatron defers "
                              "(see --defer-embedding-wgrad-compute); the same grad",
    "--delay-wgrad-compute": "when weight grads are computed (Megatron delays them to overlap "
                             "the expert all-to-all); the same grads",
    "--no-use-tokenizer-model-from-checkpoint-args": "Megatron-LM takes the tokenizer model "
                                                      "from a loaded checkpoint's args unless "
                                                      "given this; checkpoints here never "
                                                      "supply it (what this flag asks)",
    "--inference-logging-step-interval": "how often Megatron-LM's RL loop logs its inference "
                                         "engine's metrics",
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
    "--save-interval": ("--save", "there is nowhere to save to, so nothing is saved (Megatron-LM "
                                  "accepts it there too)"),
    **{flag: ("--use-mup", "Megatron-LM reads it only with --use-mup") for flag in (
        "--mup-base-hidden-size", "--mup-embedding-mult", "--mup-output-mult",
        "--mup-base-head-dim", "--mup-attn-scale-power")},
    "--apply-wd-to-qk-layernorm": ("--qk-layernorm", "there are no q/k norm weights to decay "
                                   "(Megatron-LM accepts it there too); every other 1-D param "
                                   "and bias stays undecayed"),
    "--test-mode": ("--qk-layernorm", "its one real-time test compares the replicas of the q/k "
                                      "norm weights (Megatron-LM returns from it there too)"),
}
# Which of them take a value.
_IGNORED_WITH_VALUE = {"--wgrad-deferral-limit", "--inference-logging-step-interval",
                       "--mup-width-mult", "--moe-flex-dispatcher-num-sms", "--moe-deepep-num-sms",
                       "--moe-hybridep-num-sms", "--moe-hybridep-num-sms-preprocessing",
                       "--moe-hybridep-num-blocks-permute", "--moe-hybridep-num-blocks-unpermute",
                       "--attention-backend", "--transformer-impl", "--DDP-impl",
                       "--timing-log-level", "--cross-entropy-fusion-impl",
                       "--timing-log-option", "--async-strategy", "--dist-ckpt-workers"}

# The rest of Megatron-LM main's parser (megatron_lm.py): its ignored flags join the table.
IGNORED_FLAGS.update(megatron_lm.IGNORED)
_IGNORED_NARGS = {flag: nargs for flag, nargs in megatron_lm.IGNORED_NARGS.items() if nargs}

# Megatron-LM flags of capabilities megatron_smp does not have yet: giving one is an error, never
# a silent no-op. Every other --moe-* flag is treated the same way.
NOT_SUPPORTED_YET_FLAGS: Dict[str, str] = {
    # Megatron-LM main's in-process restart runs nvidia-resiliency-ext's Wrapper: a monitor
    # process per rank, its own heartbeats and soft/hard progress timeouts, warm spare ranks.
    # --inprocess-restart here restarts on the --enable-ft-package watchdog's timeouts.
    **{f"--inprocess-{name}": f"--inprocess-{name} (nvidia-resiliency-ext's in-process "
       "monitor process, spare ranks and timeouts); --inprocess-restart takes its timeouts "
       "from --enable-ft-package (--ft-rank-section-timeouts, --ft-rank-heartbeat-timeout, "
       "--ft-heartbeat-interval)"
       for name in ("monitor-thread-interval", "monitor-process-interval",
                    "progress-watchdog-interval", "heartbeat-interval", "soft-timeout",
                    "hard-timeout", "heartbeat-timeout", "barrier-timeout",
                    "completion-timeout", "last-call-wait", "termination-grace-time",
                    "granularity", "active-world-size")},
    "--hierarchical-context-parallel-sizes": "hierarchical (a2a+p2p) context parallelism",
    # Megatron-LM 0.19 / main.
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
    # Megatron-LM main's functional-test configs.
    **{flag: "DeepSeek sparse attention (--experimental-attention-variant dsa)" for flag in (
        "--dsa-indexer-head-dim", "--dsa-indexer-loss-coeff", "--dsa-indexer-n-heads",
        "--dsa-indexer-topk")},
    # Megatron-LM's own RL loop (examples/rl): train_rl.py is the RL loop here and takes
    # --grpo-*, --langrl-env-config, --rl-use-sequence-packing and the --rl-default-* flags.
    **{flag: "this option of Megatron-LM's RL loop (train_rl.py is the RL loop here)"
       for flag in (
           "--perform-rl-step", "--rl-generation-lag", "--rl-partial-rollouts",
           "--rl-offload-optimizer-during-inference", "--rl-sequence-packing-algo",
           "--rl-consumption-granularity", "--rl-submission-granularity",
           "--rl-offload-inference-model-weights-when-idle", "--refit-method",
           "--rl-inference-tensor-model-parallel-size",
           "--rl-inference-pipeline-model-parallel-size",
           "--rl-inference-expert-model-parallel-size",
           "--rl-inference-expert-tensor-model-parallel-size",
           "--inference-max-seq-length", "--max-tokens-to-oom",
           "--inference-dynamic-batching-buffer-size-gb")},
}

NOT_SUPPORTED_YET_FLAGS.update(megatron_lm.NOT_BUILT)

# Megatron-LM flags that need NVIDIA hardware or libraries this path does not have, refused
# as Megatron-LM itself fails without them: {flag: what it needs}. Each only changes how the
# same computation runs on a GPU: dropping it is the hardware-only change.
NEEDS_NVIDIA_FLAGS: Dict[str, str] = {
    "--tp-comm-overlap": "Transformer Engine's userbuffers on CUDA GPUs",
    "--tp-comm-overlap-cfg": "Transformer Engine's userbuffers on CUDA GPUs (--tp-comm-overlap)",
    "--te-rng-tracker": "Transformer Engine's CUDA RNG tracker",
    **{flag: "CUDA graphs (a CUDA device)" for flag in (
        "--cuda-graph-modules", "--cuda-graph-warmup-steps", "--cuda-graph-scope",
        "--rl-training-cuda-graphs", "--inference-dynamic-batching-num-cuda-graphs",
        "--inference-dynamic-batching-cuda-graph-sizing-distribution",
        "--moe-pad-experts-for-cuda-graph-inference")},
    **{flag: "CUDA unified memory" for flag in (
        "--inference-dynamic-batching-unified-memory-level",
        "--rl-inference-model-unified-memory-level")},
    "--fine-grained-activation-offloading": "CUDA streams and pinned host memory (Megatron-LM's "
                                            "fine-grained offloading; SMP's "
                                            "sm_activation_offloading is the one built here)",
    "--offload-modules": "CUDA streams (--fine-grained-activation-offloading)",
    **{flag: "NVIDIA Model Optimizer (nvidia-modelopt), with which Megatron-LM's "
             "pretrain_gpt.py declares its --export-* flags" for flag in (
                 "--export-te-mcore-model", "--export-kd-teacher-load", "--export-kd-cfg")},
}
NEEDS_NVIDIA_FLAGS.update(megatron_lm.NEEDS_NVIDIA)
# Values Megatron-LM main added to existing flags that are not built here.
_NOT_SUPPORTED_YET_VALUES = {
    ("--experimental-attention-variant", "dsa"): "DeepSeek sparse attention",
    ("--moe-router-load-balancing-type", "quantile_balancing"): "quantile balancing (a "
                                                                 "per-expert bias by dual "
                                                                 "coordinate descent)",
}


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
        if flag in megatron_lm.MEGATRON_ERRORS:  # as Megatron-LM's validate_args refuses it
            raise ConfigError(megatron_lm.MEGATRON_ERRORS[flag])
        if flag in NEEDS_NVIDIA_FLAGS:
            raise ConfigError(
                f"{flag} needs {NEEDS_NVIDIA_FLAGS[flag]}, as in Megatron-LM, and megatron_smp "
                "has no such path: drop it (it changes how the same step runs on a GPU, not "
                "what it computes)")
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
        if flag in _IGNORED_NARGS:
            parser.add_argument(flag, dest=f"ignored__{flag}", help=argparse.SUPPRESS,
                                nargs=None if _IGNORED_NARGS[flag] == 1 else _IGNORED_NARGS[flag])
        elif flag in _IGNORED_WITH_VALUE:
            parser.add_argument(flag, dest=f"ignored__{flag}", help=argparse.SUPPRESS)
        else:
            parser.add_argument(flag, dest=f"ignored__{flag}", action="store_true",
                                help=argparse.SUPPRESS)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser) or parser
    return parser
