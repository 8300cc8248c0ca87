"""Typed configuration for every part of megatron_smp.

These dataclasses are the single source of truth; `training/arguments.py` maps
Megatron's command-line flags onto them and `smp.init` maps the SMP v2 JSON keys
onto them. This module imports nothing of ours.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import List, Optional, Tuple, Union

import torch


class ConfigError(ValueError):
    """A configuration that cannot work. The message names the flag and what would work."""


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


# What each not-yet-built capability is called in errors, so the user knows it is missing and
# not misconfigured.
NOT_SUPPORTED_YET = "is not supported yet (megatron_smp has no {what} yet); remove it"


def not_supported(setting: str, what: str) -> ConfigError:
    """The error for a setting whose capability does not exist yet (never silently ignored)."""
    return ConfigError(f"{setting} {NOT_SUPPORTED_YET.format(what=what)}")


# -- validated once ---------------------------------------------------------------------------
# Each config is validated where it is built (training.arguments.validate_configs, smp.init);
# the library entry points that take a config (build_parallel_state, GPTModel,
# get_megatron_optimizer) call `validate` too, for callers that build configs by hand. A
# config remembers the contents and layout it was validated with, so those repeated calls
# return at once; a config changed since (or a copy, dataclasses.replace) is checked again.


def _fingerprint(config, skip: Tuple[str, ...] = ()) -> str:
    """A config's contents (every dataclass field but `skip`), as text."""
    return repr([(f.name, getattr(config, f.name)) for f in dataclasses.fields(config)
                 if f.name not in skip])


def _validated(config, key) -> bool:
    return key in config.__dict__.get("_validated_keys", ())


def _remember_validated(config, key) -> None:
    config.__dict__.setdefault("_validated_keys", set()).add(key)



# How validation messages name ParallelConfig fields: Megatron's flags by default; `smp.init`
# passes the SMP v2 keys instead so each user sees the name they wrote.
FLAG_NAMES = {
    "tensor_model_parallel_size": "--tensor-model-parallel-size",
    "pipeline_model_parallel_size": "--pipeline-model-parallel-size",
    "context_parallel_size": "--context-parallel-size",
    "expert_model_parallel_size": "--expert-model-parallel-size",
    "virtual_pipeline_model_parallel_size": "--virtual-pipeline-model-parallel-size",
    "hybrid_shard_degree": "hybrid_shard_degree (--smp-config)",
}


@dataclass
class ParallelConfig:
    """Degrees of every parallelism and the pipeline layout. World size = tp * cp * dp * pp
    (ep divides dp)."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    # None: derived from the world size at init.
    data_parallel_size: Optional[int] = None
    virtual_pipeline_model_parallel_size: Optional[int] = None
    # Alternative to the virtual size: layers per virtual stage (Megatron's flag).
    num_layers_per_virtual_pipeline_stage: Optional[int] = None
    # Uneven pipeline split: layers on the first / last stage, the rest split evenly.
    decoder_first_pipeline_num_layers: Optional[int] = None
    decoder_last_pipeline_num_layers: Optional[int] = None
    # Chrome trace of the pipeline schedule, one file per rank (PATH.rank<r>.json).
    pipeline_timeline: Optional[str] = None
    # SMP v2 sharded data parallelism (FSDP2, `distributed.fsdp`): parameters, grads and
    # optimizer state are sharded over groups of `hybrid_shard_degree` data x context-parallel
    # ranks and replicated across the groups. 0: one group of all dp x cp ranks (full
    # sharding); 1: no sharding (replicas, like plain data parallelism).
    hybrid_shard_degree: int = 0
    # Megatron's --use-torch-fsdp2: the training loop wraps the model in FSDP2 instead of our
    # DDP (sharded over the `hybrid_shard_degree` groups above).
    use_torch_fsdp2: bool = False
    # Megatron's --no-torch-fsdp2-reshard-after-forward clears it: keep each layer's gathered
    # params from forward to backward (ZeRO-2 like: less communication, more memory).
    torch_fsdp2_reshard_after_forward: bool = True
    distributed_backend: Optional[str] = None  # None: nccl with CUDA, else gloo
    distributed_timeout_minutes: int = 10
    # Megatron's --disable-gloo-process-groups clears it: no gloo group besides the default
    # backend's (the only one we would add is the --async-save writer's).
    use_gloo_process_groups: bool = True
    # Megatron's --init-model-with-meta-device: every model chunk is built on the meta device
    # and materialised part by part on its device (with FSDP2: unit by unit while sharding).
    init_model_with_meta_device: bool = False
    # Megatron's --expert-tensor-parallel-size; None: the experts use the dense layers' TP
    # (the only layout built: experts split like the dense MLP over the TP group).
    expert_tensor_parallel_size: Optional[int] = None

    def data_parallel_size_for(self, world_size: int) -> int:
        return world_size // (
            self.tensor_model_parallel_size
            * self.context_parallel_size
            * self.pipeline_model_parallel_size
        )

    def check_supported(self, names: Optional[dict] = None) -> None:
        """ConfigError for degrees whose capability does not exist yet (none at present;
        kept as the one place such checks go)."""

    def fsdp_shard_size(self, world_size: int) -> int:
        """Ranks of one FSDP shard group (dp x cp ranks holding different shards) for
        `hybrid_shard_degree`: 0 -> all dp x cp ranks, 1 -> 1 (no sharding), N -> N."""
        dp_cp = self.data_parallel_size_for(world_size) * self.context_parallel_size
        return dp_cp if self.hybrid_shard_degree == 0 else self.hybrid_shard_degree

    def validate(self, world_size: int, names: Optional[dict] = None) -> None:
        """Check the degrees against `world_size`. Pure: reads the config, never changes it
        (once per contents and world size: see `_fingerprint`).

        `names` maps field names to how the user spelled them (default: Megatron's flags).
        """
        key = (_fingerprint(self), world_size)
        if not _validated(self, key):
            self._check(world_size, names)
            _remember_validated(self, key)

    def _check(self, world_size: int, names: Optional[dict]) -> None:
        name = dict(FLAG_NAMES, **(names or {}))
        for field_name in (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "context_parallel_size",
            "expert_model_parallel_size",
        ):
            value = getattr(self, field_name)
            _require(
                isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                f"{name[field_name]} must be a positive integer, got {value!r}",
            )
        _require(
            self.hybrid_shard_degree >= 0,
            f"{name['hybrid_shard_degree']} must be >= 0, got {self.hybrid_shard_degree}",
        )
        tp, cp, pp = (self.tensor_model_parallel_size, self.context_parallel_size,
                      self.pipeline_model_parallel_size)
        model_parallel = tp * cp * pp
        _require(
            world_size % model_parallel == 0,
            f"world size {world_size} is not divisible by {name['tensor_model_parallel_size']} "
            f"({tp}) x {name['context_parallel_size']} ({cp}) x "
            f"{name['pipeline_model_parallel_size']} ({pp}) = {model_parallel}; launch a "
            f"multiple of {model_parallel} processes or change the degrees",
        )
        data_parallel = world_size // model_parallel
        shard = self.hybrid_shard_degree
        if shard >= 2:
            # Shard groups are whole context-parallel groups times consecutive dp ranks.
            _require(
                shard % cp == 0 and (data_parallel * cp) % shard == 0,
                f"{name['hybrid_shard_degree']} ({shard}) must be a multiple of "
                f"{name['context_parallel_size']} ({cp}) and divide the data x context-parallel "
                f"size ({data_parallel * cp} = world size {world_size} / (tp {tp} x pp {pp})); "
                "use 0 to shard over all of them or 1 not to shard",
            )
        if self.data_parallel_size is not None:
            _require(
                self.data_parallel_size == data_parallel,
                f"world size {world_size} is not tp x cp x pp x dp: with tp={tp}, cp={cp}, "
                f"pp={pp} the data-parallel size must be {data_parallel}, not "
                f"{self.data_parallel_size}",
            )
        _require(
            (data_parallel * cp) % self.expert_model_parallel_size == 0,
            f"{name['expert_model_parallel_size']} ({self.expert_model_parallel_size}) must "
            f"divide data-parallel x context-parallel size ({data_parallel} x {cp})",
        )
        if pp == 1:
            pipeline_only = {
                name["virtual_pipeline_model_parallel_size"]:
                    self.virtual_pipeline_model_parallel_size,
                "--num-layers-per-virtual-pipeline-stage":
                    self.num_layers_per_virtual_pipeline_stage,
                "--decoder-first-pipeline-num-layers": self.decoder_first_pipeline_num_layers,
                "--decoder-last-pipeline-num-layers": self.decoder_last_pipeline_num_layers,
                "--pipeline-timeline": self.pipeline_timeline,
            }
            given = [flag for flag, value in pipeline_only.items() if value is not None]
            _require(
                not given,
                f"{', '.join(given)} only apply with {name['pipeline_model_parallel_size']} "
                "> 1; drop them or add pipeline stages",
            )
        _require(
            self.distributed_backend in (None, "nccl", "gloo"),
            f"--distributed-backend must be nccl or gloo, got {self.distributed_backend!r}",
        )


# Context parallelism's attentions (Megatron's --cp-comm-type values).
CP_COMM_TYPES = ("p2p", "all_gather", "a2a")
# Attention over packed sequences (`transformer.packed`).
PACKED_ATTENTION_BACKENDS = ("auto", "varlen", "flex", "segments", "mask")


def name_of(names: Optional[dict]) -> dict:
    """FLAG_NAMES with the caller's spellings (e.g. SMP keys) over them."""
    return dict(FLAG_NAMES, **(names or {}))


# TransformerConfig fields that change the function a model computes without changing any
# tensor shape: weights trained under other values would load without error and be wrong.
FUNCTION_FIELDS = (
    "normalization", "layernorm_epsilon", "activation", "gated_linear_unit",
    "position_embedding_type", "rotary_base", "rotary_percent", "parallel_residual",
    "window_size", "moe_router_topk", "moe_router_pre_softmax", "moe_router_score_function",
    "moe_router_enable_expert_bias", "moe_router_num_groups", "moe_router_group_topk",
    "moe_router_topk_scaling_factor",
    "layernorm_zero_centered_gamma", "rotary_interleaved", "parallel_residual_shared_norm",
    "add_attention_bias", "add_output_layer_bias", "multi_latent_attention",
    "window_attn_skip_freq", "softmax_type", "glu_linear_offset", "activation_func_clamp_value",
    "use_rope_scaling", "rope_scaling_factor", "rope_scaling_low_freq_factor",
    "rope_scaling_high_freq_factor", "rope_scaling_original_max_position_embeddings",
    "yarn_rotary_scaling_factor", "yarn_original_max_position_embeddings", "yarn_beta_fast",
    "yarn_beta_slow", "yarn_mscale", "yarn_mscale_all_dim",
    "yarn_correction_range_round_to_int",
    "hybrid_layer_pattern", "linear_attention_freq", "attention_output_gate", "mamba_dt_min",
    # Gemma 3's numerics (see TransformerConfig).
    "sandwich_norm", "apply_embedding_scaling", "softmax_scale", "final_logit_softcapping",
    "local_rotary_base", "rotary_seq_len_interpolation_factor",
)

# --hybrid-layer-pattern's symbols (Megatron's): Mamba, Gated DeltaNet, attention, MLP, MoE.
HYBRID_SYMBOLS = "MG*-E"
HYBRID_STAGE_BREAK = "|"
HYBRID_MTP_SEPARATOR = "/"

# Megatron's --softmax-type: "vanilla" softmax, "off-by-one" (a zero logit in every
# denominator) or "learnable" (a learned logit per head: gpt-oss's attention sinks).
SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")


# Megatron's --recompute-modules choices.
RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe",
                     "shared_experts")


def recompute_modules(config) -> tuple:
    """What selective recompute covers ("core_attn" alone by default); () otherwise."""
    if getattr(config, "recompute_granularity", None) != "selective":
        return ()
    modules = getattr(config, "recompute_modules", None)
    return tuple(modules) if modules is not None else ("core_attn",)


@dataclass
class TransformerConfig:
    """Shape and numerics of a decoder-only transformer (GPT, Llama, Mistral, Mixtral).

    `vocab_size` is the tokenizer's true vocabulary; the embedding is padded to a multiple of
    `make_vocab_size_divisible_by * tensor_model_parallel_size` and the padded rows never
    take part in the loss or in returned logits.
    """

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int
    max_position_embeddings: int
    ffn_hidden_size: Optional[int] = None
    num_query_groups: Optional[int] = None  # None: multi-head attention (= num_attention_heads)
    # Head dim; None: hidden_size // num_attention_heads, which must then divide evenly. Set it
    # for models whose heads x head dim differs from hidden_size (Mistral-style head_dim).
    kv_channels: Optional[int] = None
    # Multi-latent attention (DeepSeek-V2/V3, transformer/mla.py): q (optionally through a
    # q_lora_rank latent) and k/v through a kv_lora_rank latent; each head's query/key is
    # qk_head_dim channels without position plus qk_pos_emb_head_dim with RoPE (the positional
    # key shared by all heads); values are v_head_dim wide.
    multi_latent_attention: bool = False
    q_lora_rank: Optional[int] = None  # None: a plain q projection
    kv_lora_rank: int = 32
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    make_vocab_size_divisible_by: int = 128

    normalization: str = "LayerNorm"  # "LayerNorm" | "RMSNorm"
    layernorm_epsilon: float = 1e-5
    # Megatron's --apply-layernorm-1p: every norm's scale is stored zero-centred,
    # y = norm(x) * (1 + w), so where norms are decayed (--apply-wd-to-qk-layernorm) the
    # decay pulls the scale towards 1 instead of 0.
    layernorm_zero_centered_gamma: bool = False
    # Megatron's --qk-layernorm: `normalization` over each head's query and key (head dim),
    # after the QKV projection and before RoPE.
    qk_layernorm: bool = False
    # "gelu" | "gelu_tanh" | "silu" (with gated_linear_unit: SwiGLU) | "squared_relu" (relu(x)^2)
    # | "quick_gelu" (x * sigmoid(1.702 x); gated: Megatron's --quick-geglu, gpt-oss's GLU)
    activation: str = "gelu"
    gated_linear_unit: bool = False
    # Megatron's --glu-linear-offset: the gated unit is act(gate) * (up + offset) (gpt-oss: 1).
    glu_linear_offset: float = 0.0
    # Megatron's --activation-func-clamp-value C: before the gated unit, gate <= C and
    # -C <= up <= C (gpt-oss's swiglu_limit).
    activation_func_clamp_value: Optional[float] = None
    # "learned_absolute" | "rope" | "yarn" (RoPE with YaRN's scaling) | "alibi" | "none"
    position_embedding_type: str = "learned_absolute"
    rotary_base: float = 10000.0
    rotary_percent: float = 1.0
    # Llama 3.x's RoPE frequency scaling (Megatron's --use-rope-scaling, --rope-scaling-factor;
    # the other three are fixed at these values in Megatron and read from HF configs here).
    use_rope_scaling: bool = False
    rope_scaling_factor: float = 8.0
    rope_scaling_low_freq_factor: float = 1.0
    rope_scaling_high_freq_factor: float = 4.0
    rope_scaling_original_max_position_embeddings: int = 8192
    # YaRN, with position_embedding_type "yarn" (Megatron's config names; flags
    # --rotary-scaling-factor, --yarn-original-max-position-embeddings, --yarn-beta-fast,
    # --yarn-beta-slow, --mscale, --mscale-all-dim, --[no-]yarn-correction-range-round-to-int).
    yarn_rotary_scaling_factor: float = 1.0
    yarn_original_max_position_embeddings: int = 4096
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float = 1.0
    yarn_mscale_all_dim: float = 0.0
    yarn_correction_range_round_to_int: bool = True
    # Megatron's --rotary-interleaved: RoPE rotates channel pairs (2i, 2i + 1) (RoFormer, Meta's
    # Llama) instead of (i, i + d/2) (GPT-NeoX, Hugging Face's Llama).
    rotary_interleaved: bool = False
    # GPT-NeoX: attention and MLP read the same input and add into one residual.
    parallel_residual: bool = False
    # GPT-J (with parallel_residual): both branches read one norm's output; the layer has no
    # pre_mlp_layernorm. No Megatron flag: set by the GPT-J adapter, kept in checkpoints.
    parallel_residual_shared_norm: bool = False
    # Sliding-window attention (Mistral), flash-attention's convention: query i attends to
    # keys i - left .. i + right; left -1 = unbounded. A decoder needs right == 0. Mistral's
    # `sliding_window` W is (W - 1, 0). None: full causal attention.
    window_size: Optional[Tuple[int, int]] = None
    # Megatron's --window-attn-skip-freq: which layers use `window_size`. An int N: every N-th
    # layer attends fully, the others through the window (gpt-oss: 2, sliding first); a 0/1
    # list per layer (1 = window), or its pattern text "([1]*3+[0]*1)*2". None: every layer.
    window_attn_skip_freq: Optional[Union[int, List[int], str]] = None
    # Megatron's --softmax-type (SOFTMAX_TYPES): "learnable" adds one learned logit per head
    # to every softmax denominator (attention sinks; `core_attention.softmax_offset`).
    softmax_type: str = "vanilla"
    # Context parallelism's attention (Megatron's --cp-comm-type): "p2p" ring attention,
    # "all_gather" of keys/values, or "a2a" (all-to-all of heads and sequence, Ulysses).
    cp_comm_type: str = "p2p"
    # How attention over packed sequences (--sft, --reset-attention-mask: several documents
    # in one row) runs, `transformer.packed.PACKED_ATTENTION_BACKENDS`: "auto" takes the
    # varlen flash kernel where it fits, else "segments"; "flex", "mask" by name. No flag.
    packed_attention: str = "auto"
    add_bias_linear: bool = True
    add_qkv_bias: bool = False  # Only used when add_bias_linear is False.
    # False: the attention's QKV and output projections have no bias, whatever add_bias_linear
    # says (GPT-J: biased MLP, unbiased attention). No Megatron flag, as below.
    add_attention_bias: bool = True
    # A bias on the output layer (the LM head), vocab-parallel like its weight (GPT-J).
    add_output_layer_bias: bool = False
    untie_embeddings_and_output_weights: bool = False
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    # Linear layers add their weight grad straight into the DDP's fp32 main grad (Megatron's
    # gradient-accumulation fusion, torch-native: `main_grad.addmm_`), no weight-sized
    # temporary and no separate accumulation pass. Only where the weight has a main grad.
    gradient_accumulation_fusion: bool = True
    init_method_std: float = 0.02
    # Megatron scales the init of output projections by 1/sqrt(2 * num_layers).
    use_scaled_init_method: bool = True

    params_dtype: torch.dtype = torch.float32
    fp16: bool = False
    bf16: bool = False
    sequence_parallel: bool = False

    # Memory.
    recompute_granularity: Optional[str] = None  # None | "full" | "selective"
    recompute_method: Optional[str] = None  # "uniform" | "block"
    recompute_num_layers: Optional[int] = None
    # What "selective" recomputes (Megatron's --recompute-modules; None: ["core_attn"]):
    # "core_attn", "mlp" (dense MLPs), "layernorm" (both norms, outputs discarded until
    # backward). See recompute_modules().
    recompute_modules: Optional[list] = None

    # Mixture of experts (Megatron's names; None experts: a dense model).
    num_moe_experts: Optional[int] = None
    # Which layers are MoE: every `freq`-th layer (int, 1 = all), or a 0/1 list per layer
    # (the flag also takes Megatron's pattern text "([1]*3+[0]*1)*2", see parse_moe_layer_freq).
    moe_layer_freq: Union[int, List[int], str] = 1
    moe_ffn_hidden_size: Optional[int] = None  # None: ffn_hidden_size
    moe_router_topk: int = 2
    moe_router_pre_softmax: bool = False  # softmax over all experts, then top-k (Qwen-MoE)
    # softmax | sigmoid (DeepSeek-V3: sigmoid scores, the chosen ones renormalised).
    moe_router_score_function: str = "softmax"
    # Aux-loss-free balancing (DeepSeek-V3): a per-expert bias added to the scores for the
    # choice only, moved by +-rate after each step towards equal token counts.
    moe_router_enable_expert_bias: bool = False
    moe_router_bias_update_rate: float = 1e-3
    # Group-limited routing: experts in num_groups groups, each token picks group_topk groups.
    moe_router_num_groups: Optional[int] = None
    moe_router_group_topk: Optional[int] = None
    moe_router_topk_scaling_factor: Optional[float] = None  # routed_scaling_factor
    moe_router_dtype: Optional[str] = None  # None (params dtype) | fp32 | fp64: router logits
    moe_router_load_balancing_type: str = "aux_loss"  # aux_loss|seq_aux_loss|global_aux_loss|sinkhorn|none
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: Optional[float] = None
    moe_input_jitter_eps: Optional[float] = None
    moe_token_dispatcher_type: str = "allgather"  # allgather | alltoall
    moe_expert_capacity_factor: Optional[float] = None  # None: dropless
    moe_pad_expert_input_to_capacity: bool = False
    moe_token_drop_policy: str = "probs"  # probs | position
    moe_grouped_gemm: bool = False
    moe_shared_expert_intermediate_size: Optional[int] = None
    moe_shared_expert_gate: bool = False  # Qwen-MoE: sigmoid(x w) scales the shared expert
    # Latent experts (Nemotron 3; Megatron's --moe-latent-size): routed experts work in this
    # width between replicated projections h -> latent (fc1_latent_proj) and back (fc2_...).
    moe_latent_size: Optional[int] = None
    # Multi-token prediction (DeepSeek-V3; transformer/multi_token_prediction.py): D extra
    # layers on the last pipeline stage, layer k predicting the token k + 1 places ahead;
    # their mean loss enters backward scaled by mtp_loss_scaling_factor (Megatron's flags).
    mtp_num_layers: Optional[int] = None
    mtp_loss_scaling_factor: float = 0.1
    # Hybrid models (transformer/hybrid.py, transformer/ssm/): Megatron's --hybrid-layer-pattern,
    # one symbol per layer: M Mamba-2, G Gated DeltaNet, * attention, - MLP, E MoE; | cuts the
    # pattern into pipeline stages. A layer is then norm -> that one part -> residual. None: the
    # GPT layer (attention + MLP) everywhere.
    hybrid_layer_pattern: Optional[str] = None
    # Megatron's --linear-attention-freq with --experimental-attention-variant gated_delta_net
    # (Qwen3-Next / Qwen3.5): in GPT layers the attention is a Gated DeltaNet on the layers
    # the pattern marks 1; an int N is N-1 linear layers then one full attention layer.
    linear_attention_freq: Optional[Union[int, List[int], str]] = None
    experimental_attention_variant: Optional[str] = None  # "gated_delta_net" (alias "gdn")
    # Megatron's --attention-output-gate: the query projection also gives a gate per channel,
    # the attention output is multiplied by sigmoid(gate) before the output projection.
    attention_output_gate: bool = False
    # Mamba-2 mixer (Megatron's flags); heads None: 2 * hidden / head dim.
    mamba_state_dim: int = 128
    mamba_head_dim: int = 64
    mamba_num_groups: int = 8
    mamba_num_heads: Optional[int] = None
    mamba_chunk_size: int = 128  # the scan's chunk (no effect on results)
    mamba_conv_kernel_dim: int = 4  # Megatron's d_conv (HF conv_kernel); no flag
    # Lower clamp of the Mamba time step after softplus (HF Nemotron-H: time_step_min;
    # Megatron: 0). No flag: set by the HF adapter.
    mamba_dt_min: float = 0.0
    # Gated DeltaNet mixer (Megatron's flags).
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_chunk_size: int = 64  # the delta rule's chunk (no effect on results)

    # Gemma 2/3 numerics (models/hf/gemma3.py). Megatron-LM has no flags for the first two
    # and the last but one; ours are named after Megatron-Bridge's Gemma fields.
    # --sandwich-norm: the attention's and the MLP's outputs are normalised once more before
    # they join the residual (`post_self_attn_layernorm`, `post_mlp_layernorm`).
    sandwich_norm: bool = False
    # --apply-embedding-scaling: the word embeddings are multiplied by sqrt(hidden_size)
    # (in the activation dtype, as Gemma does).
    apply_embedding_scaling: bool = False
    # Megatron core's softmax_scale (--softmax-scale): scores q.k * scale; None:
    # 1/sqrt(kv_channels). Gemma's query_pre_attn_scalar S is S**-0.5.
    softmax_scale: Optional[float] = None
    # --final-logit-softcapping C: logits = C * tanh(logits / C) (Gemma 2; Gemma 3 has None).
    final_logit_softcapping: Optional[float] = None
    # --local-rotary-base B: the sliding-window layers' RoPE uses base B, unscaled (Gemma 3's
    # rope_local_base_freq); the full-attention layers keep --rotary-base and its scaling.
    local_rotary_base: Optional[float] = None
    # Megatron's --rotary-seq-len-interpolation-factor F: linear RoPE scaling, positions / F
    # (HF rope_type "linear"; Gemma 3's full-attention layers: 8).
    rotary_seq_len_interpolation_factor: Optional[float] = None

    def __post_init__(self) -> None:
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if (self.kv_channels is None and self.num_attention_heads
                and self.hidden_size % self.num_attention_heads == 0):
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if self.window_size is not None:  # JSON (common.json, --smp-config) gives a list
            self.window_size = tuple(int(v) for v in self.window_size)
        if isinstance(self.window_attn_skip_freq, str):  # the flag's text: one stored form
            self.window_attn_skip_freq = parse_moe_layer_freq(self.window_attn_skip_freq,
                                                              "--window-attn-skip-freq")
        if isinstance(self.linear_attention_freq, str):  # the flag's text: one stored form
            self.linear_attention_freq = parse_moe_layer_freq(self.linear_attention_freq,
                                                              "--linear-attention-freq")
        if self.num_moe_experts is not None and self.moe_ffn_hidden_size is None:
            self.moe_ffn_hidden_size = self.ffn_hidden_size
        depths = self.hybrid_mtp_depths()
        if depths and self.mtp_num_layers is None:  # the pattern's `/` parts are the depths
            self.mtp_num_layers = depths

    def sequence_parallel_at(self, tp_size: int) -> bool:
        """Whether sequence parallelism is on at tensor-parallel size `tp_size` (--sequence-
        parallel means nothing without tensor parallelism): the one place it is derived."""
        return bool(self.sequence_parallel) and tp_size > 1

    def validate(self, parallel: ParallelConfig, seq_length: Optional[int] = None,
                 names: Optional[dict] = None) -> None:
        """Check the model against the parallel layout (and sequence length). Pure; once per
        contents and layout (a check with a sequence length covers one without)."""
        # The data-parallel size is derived (ParallelState's copy has it, the flags' not);
        # the model's checks never read it.
        layout = (_fingerprint(self), _fingerprint(parallel, ("data_parallel_size",)))
        if _validated(self, layout + (seq_length,)) or (
                seq_length is None and any(key[:2] == layout for key in
                                           self.__dict__.get("_validated_keys", ()))):
            return
        self._check(parallel, seq_length, names)
        _remember_validated(self, layout + (seq_length,))

    def _check(self, parallel: ParallelConfig, seq_length: Optional[int],
               names: Optional[dict]) -> None:
        parallel.check_supported(names)
        tp = parallel.tensor_model_parallel_size
        _require(self.num_layers >= 1, f"--num-layers must be >= 1, got {self.num_layers}")
        _require(
            self.num_attention_heads >= 1,
            f"--num-attention-heads must be >= 1, got {self.num_attention_heads}",
        )
        _require(
            self.vocab_size >= 1,
            f"the vocabulary size must be >= 1, got {self.vocab_size} (it comes from the "
            "tokenizer; with --tokenizer-type NullTokenizer give --vocab-size)",
        )
        _require(
            self.kv_channels is None or self.kv_channels >= 1,
            f"--kv-channels must be >= 1, got {self.kv_channels}",
        )
        _require(
            self.hidden_size % self.num_attention_heads == 0 or self.kv_channels is not None,
            f"--hidden-size ({self.hidden_size}) must be divisible by --num-attention-heads "
            f"({self.num_attention_heads}), or set --kv-channels",
        )
        _require(
            self.num_attention_heads % tp == 0,
            f"--num-attention-heads ({self.num_attention_heads}) must be divisible by "
            f"--tensor-model-parallel-size ({tp})",
        )
        _require(
            self.packed_attention in PACKED_ATTENTION_BACKENDS,
            f"packed_attention must be one of {', '.join(PACKED_ATTENTION_BACKENDS)}, got "
            f"{self.packed_attention!r}",
        )
        _require(
            self.num_attention_heads % self.num_query_groups == 0,
            f"--num-attention-heads ({self.num_attention_heads}) must be divisible by "
            f"--num-query-groups ({self.num_query_groups})",
        )
        _require(
            self.num_query_groups % tp == 0,
            f"--num-query-groups ({self.num_query_groups}) must be divisible by "
            f"--tensor-model-parallel-size ({tp})",
        )
        _require(
            self.ffn_hidden_size % tp == 0,
            f"--ffn-hidden-size ({self.ffn_hidden_size}) must be divisible by "
            f"--tensor-model-parallel-size ({tp})",
        )
        _require(
            self.normalization in ("LayerNorm", "RMSNorm"),
            f"--normalization must be LayerNorm or RMSNorm, got {self.normalization!r}",
        )
        _require(
            self.position_embedding_type in ("learned_absolute", "rope", "yarn", "alibi", "none"),
            "--position-embedding-type must be one of learned_absolute, rope, yarn, alibi, none;"
            f" got {self.position_embedding_type!r}",
        )
        self._validate_rope_scaling()
        _require(
            not (self.fp16 and self.bf16), "--fp16 and --bf16 are mutually exclusive; pick one"
        )
        _require(
            not self.rotary_interleaved or self.uses_rotary_embedding(),
            "--rotary-interleaved only applies to rotary embeddings: add --position-embedding-type"
            f" rope, or drop it (got --position-embedding-type {self.position_embedding_type})",
        )
        _require(
            not self.parallel_residual_shared_norm or self.parallel_residual,
            "parallel_residual_shared_norm (one norm for attention and MLP, GPT-J) needs "
            "--use-parallel-residual",
        )
        _require(
            self.add_attention_bias or not self.add_qkv_bias,
            "--add-qkv-bias asks for a QKV bias but add_attention_bias=False removes the "
            "attention's biases; drop one of them",
        )
        self._validate_recompute_modules()
        self._validate_moe(parallel, dict(FLAG_NAMES, **(names or {})))
        self._validate_gpt_oss_numerics()
        self._validate_gemma_numerics()
        if self.multi_latent_attention:
            self._validate_mla(parallel)
        if self.mtp_num_layers is not None:
            self._validate_mtp(parallel)
        self._validate_hybrid(parallel)
        if self.window_size is not None:
            left, right = self.window_size
            _require(
                right == 0 and (left >= 0 or left == -1),
                f"--window-size {left},{right}: a decoder attends only to the past, so it must "
                "be LEFT,0 with LEFT >= 0 (or -1 for an unbounded window)",
            )
        if seq_length is not None:
            _require(
                self.position_embedding_type != "learned_absolute"
                or seq_length <= self.max_position_embeddings,
                f"--seq-length ({seq_length}) must not exceed --max-position-embeddings "
                f"({self.max_position_embeddings})",
            )
        cp = parallel.context_parallel_size
        if cp > 1:
            self._validate_context_parallel(tp, cp, seq_length, name_of(names))
        if self.sequence_parallel and seq_length is not None:
            _require(
                seq_length % (tp * parallel.context_parallel_size) == 0,
                f"--seq-length ({seq_length}) must be divisible by tensor-model-parallel-size"
                f" x context-parallel-size ({tp * parallel.context_parallel_size}) with "
                "--sequence-parallel",
            )

    def uses_rotary_embedding(self) -> bool:
        """RoPE, plain or scaled (position_embedding_type "rope" or "yarn")."""
        return self.position_embedding_type in ("rope", "yarn")

    def _validate_rope_scaling(self) -> None:
        if self.use_rope_scaling:
            _require(
                self.position_embedding_type == "rope",
                "--use-rope-scaling (Llama 3.x) scales RoPE: it needs --position-embedding-type "
                f"rope (got {self.position_embedding_type}; yarn has its own scaling)",
            )
            _require(
                self.rope_scaling_factor >= 1.0
                and 0 < self.rope_scaling_low_freq_factor < self.rope_scaling_high_freq_factor
                and self.rope_scaling_original_max_position_embeddings >= 1,
                f"--rope-scaling-factor ({self.rope_scaling_factor}) must be >= 1 and the "
                f"low/high frequency factors ({self.rope_scaling_low_freq_factor}, "
                f"{self.rope_scaling_high_freq_factor}) positive and increasing",
            )
        if self.position_embedding_type == "yarn":
            _require(
                self.yarn_rotary_scaling_factor > 0
                and self.yarn_original_max_position_embeddings >= 1
                and self.yarn_beta_fast > 0 and self.yarn_beta_slow > 0,
                "--position-embedding-type yarn needs --rotary-scaling-factor > 0, "
                "--yarn-original-max-position-embeddings >= 1 and positive --yarn-beta-fast / "
                f"--yarn-beta-slow (got {self.yarn_rotary_scaling_factor}, "
                f"{self.yarn_original_max_position_embeddings}, {self.yarn_beta_fast}, "
                f"{self.yarn_beta_slow})",
            )

    def _validate_context_parallel(self, tp: int, cp: int, seq_length: Optional[int],
                                   name: dict) -> None:
        cp_flag = name["context_parallel_size"]
        _require(
            self.cp_comm_type in CP_COMM_TYPES,
            f"--cp-comm-type must be one of {', '.join(CP_COMM_TYPES)}, got "
            f"{self.cp_comm_type!r}",
        )
        if seq_length is not None:
            _require(
                seq_length % (2 * cp) == 0,
                f"--seq-length ({seq_length}) must be divisible by 2 x {cp_flag} ({2 * cp}): "
                f"context parallelism cuts each sequence into {2 * cp} chunks",
            )
        if self.cp_comm_type == "a2a":
            _require(
                self.num_query_groups % (tp * cp) == 0,
                f"--cp-comm-type a2a shares the heads out over {cp_flag} ({cp}): "
                f"--num-query-groups ({self.num_query_groups}) must be divisible by "
                f"tensor-model-parallel-size x context-parallel-size ({tp * cp}); use "
                "--cp-comm-type p2p or all_gather",
            )

    def _validate_gpt_oss_numerics(self) -> None:
        _require(self.softmax_type in SOFTMAX_TYPES,
                 f"--softmax-type must be one of {', '.join(SOFTMAX_TYPES)}, got "
                 f"{self.softmax_type!r}")
        gated_only = [flag for flag, given in (
            ("--glu-linear-offset", self.glu_linear_offset != 0.0),
            ("--activation-func-clamp-value", self.activation_func_clamp_value is not None))
            if given]
        _require(not gated_only or self.gated_linear_unit,
                 f"{', '.join(gated_only)} shape the gated linear unit: add --swiglu or "
                 "--quick-geglu, or drop them")
        clamp = self.activation_func_clamp_value
        _require(clamp is None or (math.isfinite(clamp) and clamp > 0),
                 f"--activation-func-clamp-value must be finite and > 0, got {clamp}")
        if self.window_attn_skip_freq is not None:
            _require(self.window_size is not None,
                     "--window-attn-skip-freq chooses the layers that use --window-size: add "
                     "--window-size LEFT,0, or drop it")
            self.window_layer_pattern()  # raises for a malformed or wrong-length pattern

    def _validate_gemma_numerics(self) -> None:
        """--sandwich-norm, --softmax-scale, --final-logit-softcapping, --local-rotary-base,
        --rotary-seq-len-interpolation-factor."""
        _require(not (self.sandwich_norm and self.parallel_residual),
                 "--sandwich-norm normalises each branch's output before its residual add, "
                 "which --use-parallel-residual does not have; drop one of them")
        for flag, value in (("--softmax-scale", self.softmax_scale),
                            ("--final-logit-softcapping", self.final_logit_softcapping),
                            ("--local-rotary-base", self.local_rotary_base),
                            ("--rotary-seq-len-interpolation-factor",
                             self.rotary_seq_len_interpolation_factor)):
            _require(value is None or (math.isfinite(value) and value > 0),
                     f"{flag} must be finite and > 0, got {value}")
        _require(self.softmax_scale is None or not self.multi_latent_attention,
                 "--softmax-scale: multi-latent attention derives its own scale (YaRN's "
                 "mscale); drop --softmax-scale")
        if self.local_rotary_base is not None:
            _require(self.uses_rotary_embedding() and not self.multi_latent_attention,
                     "--local-rotary-base is the RoPE base of the sliding-window layers: it "
                     "needs --position-embedding-type rope (or yarn) without "
                     "--multi-latent-attention")
            _require(any(self.window_layer_pattern()),
                     "--local-rotary-base applies to the sliding-window layers, and this model "
                     "has none: add --window-size LEFT,0 (and --window-attn-skip-freq), or "
                     "drop it")
        if self.rotary_seq_len_interpolation_factor is not None:
            _require(self.position_embedding_type == "rope" and not self.use_rope_scaling,
                     "--rotary-seq-len-interpolation-factor scales plain RoPE linearly: it "
                     "needs --position-embedding-type rope and no other scaling "
                     "(--use-rope-scaling, yarn)")

    def window_layer_pattern(self) -> List[int]:
        """1 for each (0-based) layer that attends through `window_size`, 0 for a layer with
        full attention (Megatron's is_layer_window_attention)."""
        if self.window_size is None or self.window_size[0] < 0:
            return [0] * self.num_layers
        if self.window_attn_skip_freq is None:
            return [1] * self.num_layers
        freq = parse_moe_layer_freq(self.window_attn_skip_freq, "--window-attn-skip-freq")
        if isinstance(freq, int):
            _require(freq >= 1, f"--window-attn-skip-freq must be >= 1, got {freq}")
            return [int((index + 1) % freq != 0) for index in range(self.num_layers)]
        _require(
            len(freq) == self.num_layers and set(freq) <= {0, 1},
            f"--window-attn-skip-freq pattern {freq} must hold one 0 or 1 per layer "
            f"(--num-layers {self.num_layers})",
        )
        return list(freq)

    def layer_window_size(self, layer_number: int) -> Optional[Tuple[int, int]]:
        """The sliding window of global 1-based layer `layer_number`; None: full attention."""
        index = self.layer_pattern_number(layer_number) - 1
        return self.window_size if self.window_layer_pattern()[index] else None

    def _validate_mla(self, parallel: ParallelConfig) -> None:
        """--multi-latent-attention: what transformer/mla.py builds, and what it does not yet."""
        _require(self.position_embedding_type in ("rope", "yarn"),
                 "--multi-latent-attention rotates its positional channels: add "
                 "--position-embedding-type rope (YaRN: yarn)")
        for flag, value in (("--kv-lora-rank", self.kv_lora_rank),
                            ("--qk-head-dim", self.qk_head_dim),
                            ("--v-head-dim", self.v_head_dim),
                            ("--q-lora-rank", 1 if self.q_lora_rank is None
                             else self.q_lora_rank)):
            _require(value >= 1, f"{flag} must be >= 1, got {value}")
        _require(self.qk_pos_emb_head_dim >= 2 and self.qk_pos_emb_head_dim % 2 == 0,
                 f"--qk-pos-emb-head-dim must be even and >= 2, got {self.qk_pos_emb_head_dim}")
        _require(self.rotary_percent == 1.0,
                 "--rotary-percent: multi-latent attention rotates all --qk-pos-emb-head-dim "
                 "channels and none of the others; drop --rotary-percent")
        unsupported = [flag for flag, on in (
            ("--window-size", self.window_size is not None),
            ("--group-query-attention", self.num_query_groups != self.num_attention_heads),
        ) if on]
        _require(not unsupported, "--multi-latent-attention does not support "
                 f"{', '.join(unsupported)} yet")

    def _validate_mtp(self, parallel: ParallelConfig) -> None:
        """--mtp-num-layers: what transformer/multi_token_prediction.py builds."""
        _require(self.mtp_num_layers >= 1,
                 f"--mtp-num-layers must be >= 1, got {self.mtp_num_layers}")
        _require(self.mtp_loss_scaling_factor >= 0,
                 f"--mtp-loss-scaling-factor must be >= 0, got {self.mtp_loss_scaling_factor}")
        _require(
            parallel.pipeline_model_parallel_size == 1
            or self.position_embedding_type != "learned_absolute",
            "--mtp-num-layers with --pipeline-model-parallel-size > 1 and learned absolute "
            "positions: the last stage's MTP would need a copy of the position table, which "
            "is not kept in sync; use --position-embedding-type rope (DeepSeek-V3's) or one "
            "pipeline stage",
        )

    def _hybrid_main_pattern(self) -> Optional[str]:
        if self.hybrid_layer_pattern is None:
            return None
        return self.hybrid_layer_pattern.split(HYBRID_MTP_SEPARATOR)[0]

    def hybrid_layer_symbols(self) -> Optional[str]:
        """The decoder's part of --hybrid-layer-pattern (before any `/`) without its stage
        breaks: one symbol per layer, or None."""
        main = self._hybrid_main_pattern()
        return None if main is None else main.replace(HYBRID_STAGE_BREAK, "")

    def hybrid_mtp_symbols(self) -> Optional[str]:
        """The layers of one multi-token-prediction depth (Megatron's "<main>/<mtp>/<mtp>":
        every `/` part is one depth, all alike), or None without `/` parts."""
        if not self.hybrid_mtp_depths():
            return None
        return self.hybrid_layer_pattern.split(HYBRID_MTP_SEPARATOR)[1]

    def hybrid_mtp_depths(self) -> int:
        """How many `/` parts (multi-token-prediction depths) --hybrid-layer-pattern has."""
        if self.hybrid_layer_pattern is None:
            return 0
        return self.hybrid_layer_pattern.count(HYBRID_MTP_SEPARATOR)

    def hybrid_stage_layer_counts(self) -> Optional[List[int]]:
        """Layers of each `|`-separated segment of --hybrid-layer-pattern; None without breaks."""
        main = self._hybrid_main_pattern()
        if main is None or HYBRID_STAGE_BREAK not in main:
            return None
        return [len(part) for part in main.split(HYBRID_STAGE_BREAK)]

    def linear_attention_pattern(self) -> List[int]:
        """1 for each (0-based) GPT layer whose attention is a Gated DeltaNet
        (--linear-attention-freq: N gives N - 1 linear layers then one full one)."""
        if self.linear_attention_freq is None:
            return [0] * self.num_layers
        freq = parse_moe_layer_freq(self.linear_attention_freq, "--linear-attention-freq")
        if isinstance(freq, int):
            _require(freq >= 1, f"--linear-attention-freq must be >= 1, got {freq}")
            return [int((index + 1) % freq != 0) for index in range(self.num_layers)]
        _require(len(freq) == self.num_layers and set(freq) <= {0, 1},
                 f"--linear-attention-freq pattern {freq} must hold one 0 or 1 per layer "
                 f"(--num-layers {self.num_layers})")
        return list(freq)

    def mamba_heads(self) -> int:
        """Mamba-2 heads: --mamba-num-heads, else 2 * hidden / --mamba-head-dim (Megatron's)."""
        if self.mamba_num_heads is not None:
            return self.mamba_num_heads
        return 2 * self.hidden_size // self.mamba_head_dim

    def _validate_hybrid(self, parallel: ParallelConfig) -> None:
        """--hybrid-layer-pattern, --linear-attention-freq and the mixers' sizes."""
        tp = parallel.tensor_model_parallel_size
        symbols = self.hybrid_layer_symbols()
        uses_mamba = uses_gdn = False
        if symbols is not None:
            mtp_parts = self.hybrid_layer_pattern.split(HYBRID_MTP_SEPARATOR)[1:]
            if mtp_parts:
                mtp = mtp_parts[0]
                _require(all(part == mtp for part in mtp_parts) and mtp
                         and set(mtp) <= set(HYBRID_SYMBOLS) and mtp.count("E") <= 1,
                         f"--hybrid-layer-pattern {self.hybrid_layer_pattern!r}: each "
                         "multi-token-prediction part after a '/' is one depth; they must be "
                         "equal, non-empty, of M G * - E (no '|'), with at most one E")
                _require(self.mtp_num_layers == len(mtp_parts),
                         f"--mtp-num-layers ({self.mtp_num_layers}) must equal the "
                         f"{len(mtp_parts)} '/' parts of --hybrid-layer-pattern (or be left out)")
            unknown = sorted(set(symbols) - set(HYBRID_SYMBOLS))
            _require(not unknown and symbols,
                     f"--hybrid-layer-pattern {self.hybrid_layer_pattern!r}: unknown symbols "
                     f"{unknown}; use M (Mamba), G (Gated DeltaNet), * (attention), - (MLP), "
                     "E (MoE) and | (pipeline stage break)")
            _require(len(symbols) == self.num_layers,
                     f"--hybrid-layer-pattern has {len(symbols)} layers but --num-layers is "
                     f"{self.num_layers}; the pattern decides the layer count (drop --num-layers)")
            _require("E" not in self.hybrid_layer_pattern or self.num_moe_experts is not None,
                     "--hybrid-layer-pattern has MoE layers (E): give --num-experts")
            _require(self.linear_attention_freq is None,
                     "--linear-attention-freq picks linear attention in GPT layers; with "
                     "--hybrid-layer-pattern write G where a Gated DeltaNet goes instead")
            _require(self.mtp_num_layers is None or mtp_parts,
                     "--mtp-num-layers with --hybrid-layer-pattern: write the prediction "
                     "depths into the pattern (\"M*M*/*-/*-\": two depths of \"*-\")")
            every = symbols + "".join(mtp_parts)
            uses_mamba, uses_gdn = "M" in every, "G" in every
        if self.linear_attention_freq is not None:
            _require(self.experimental_attention_variant in ("gated_delta_net", "gdn"),
                     "--linear-attention-freq needs --experimental-attention-variant "
                     "gated_delta_net (the linear attention it places)")
            uses_gdn = uses_gdn or any(self.linear_attention_pattern())
        _require(self.experimental_attention_variant in (None, "gated_delta_net", "gdn"),
                 f"--experimental-attention-variant {self.experimental_attention_variant!r} is "
                 "not supported; gated_delta_net (gdn) is")
        # As in Megatron: in a GPT stack the variant's layers are placed by the frequency; a
        # hybrid pattern places them by its G symbols.
        _require(self.experimental_attention_variant is None or symbols is not None
                 or self.linear_attention_freq is not None,
                 f"--experimental-attention-variant {self.experimental_attention_variant} needs "
                 "--linear-attention-freq N (N - 1 Gated DeltaNet layers, then one attention "
                 "layer), or a --hybrid-layer-pattern with G where they go")
        if uses_mamba:
            heads, groups = self.mamba_heads(), self.mamba_num_groups
            _require(min(heads, groups, self.mamba_head_dim, self.mamba_state_dim) >= 1
                     and heads % groups == 0,
                     f"Mamba: --mamba-num-heads ({heads}) must be a multiple of "
                     f"--mamba-num-groups ({groups}), all sizes >= 1")
            _require(groups % tp == 0,
                     f"Mamba: --mamba-num-groups ({groups}) must be divisible by "
                     f"--tensor-model-parallel-size ({tp}): each rank holds whole groups")
        if uses_gdn:
            keys, values = self.linear_num_key_heads, self.linear_num_value_heads
            _require(min(keys, values, self.linear_key_head_dim, self.linear_value_head_dim,
                         self.linear_conv_kernel_dim) >= 1 and values % keys == 0,
                     f"Gated DeltaNet: --linear-num-value-heads ({values}) must be a multiple "
                     f"of --linear-num-key-heads ({keys}), all sizes >= 1")
            _require(keys % tp == 0,
                     f"Gated DeltaNet: --linear-num-key-heads ({keys}) must be divisible by "
                     f"--tensor-model-parallel-size ({tp})")
        # Context parallelism (Megatron's all-to-all over the mixers' groups): each CP rank
        # scans the whole sequence for whole groups of its TP rank's.
        cp = parallel.context_parallel_size
        if uses_mamba:
            _require(groups % (tp * cp) == 0,
                     f"Mamba: --mamba-num-groups ({groups}) must be divisible by "
                     f"--tensor-model-parallel-size x --context-parallel-size ({tp * cp}): "
                     "each rank scans whole groups")
        if uses_gdn:
            _require(keys % (tp * cp) == 0,
                     f"Gated DeltaNet: --linear-num-key-heads ({keys}) must be divisible by "
                     f"--tensor-model-parallel-size x --context-parallel-size ({tp * cp})")

    def layer_pattern_number(self, layer_number: int) -> int:
        """The decoder layer whose kind (window, MoE or dense) global layer `layer_number`
        takes: itself, or for the multi-token-prediction layers (numbered num_layers + 1 ..)
        the last decoder layer, as Megatron builds them from its spec."""
        return min(layer_number, self.num_layers)

    def _validate_recompute_modules(self) -> None:
        modules = self.recompute_modules
        if modules is None:
            return
        _require(self.recompute_granularity == "selective",
                 "--recompute-modules chooses what --recompute-granularity selective recomputes: "
                 "add --recompute-granularity selective (or --recompute-activations), or drop it")
        unknown = sorted(set(modules) - set(RECOMPUTE_MODULES))
        _require(not unknown, f"--recompute-modules: unknown {', '.join(unknown)}; choose from "
                 f"{', '.join(RECOMPUTE_MODULES)}")
        # Megatron's rule: moe_act recomputes the grouped experts' activation.
        _require("moe_act" not in modules or self.moe_grouped_gemm,
                 "--recompute-modules moe_act recomputes the grouped-GEMM experts' activation: "
                 "add --moe-grouped-gemm (with --num-experts), or drop it")
        _require("mla_up_proj" not in modules or self.multi_latent_attention,
                 "--recompute-modules mla_up_proj recomputes multi-latent attention's "
                 "up-projections: add --multi-latent-attention, or drop it")
        _require("moe" not in modules or self.num_moe_experts is not None,
                 "--recompute-modules moe recomputes mixture-of-experts layers: add "
                 "--num-experts, or drop it")
        _require("shared_experts" not in modules
                 or self.moe_shared_expert_intermediate_size is not None,
                 "--recompute-modules shared_experts recomputes the MoE layers' shared "
                 "experts: add --moe-shared-expert-intermediate-size, or drop it")

    def _validate_moe(self, parallel: ParallelConfig, name: dict) -> None:
        ep, tp = parallel.expert_model_parallel_size, parallel.tensor_model_parallel_size
        ep_flag = name["expert_model_parallel_size"]
        if self.num_moe_experts is None:
            _require(
                ep == 1,
                f"{ep_flag} {ep} needs a mixture-of-experts model: give --num-experts (or "
                "transform a Mixtral / Qwen2-MoE model)",
            )
            return
        experts = self.num_moe_experts
        _require(experts >= 1, f"--num-experts must be >= 1, got {experts}")
        _require(
            experts % ep == 0,
            f"--num-experts ({experts}) must be divisible by {ep_flag} ({ep})",
        )
        _require(
            1 <= self.moe_router_topk <= experts,
            f"--moe-router-topk ({self.moe_router_topk}) must be between 1 and --num-experts "
            f"({experts})",
        )
        choices = {
            "--moe-router-load-balancing-type": (
                self.moe_router_load_balancing_type,
                ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")),
            "--moe-token-dispatcher-type": (self.moe_token_dispatcher_type,
                                            ("allgather", "alltoall")),
            "--moe-token-drop-policy": (self.moe_token_drop_policy, ("probs", "position")),
        }
        for flag, (value, allowed) in choices.items():
            _require(value in allowed,
                     f"{flag} must be one of {', '.join(allowed)}; got {value!r}")
        self._check_router(experts)
        _require(
            not (self.moe_router_load_balancing_type == "sinkhorn" and self.moe_aux_loss_coeff),
            "--moe-router-load-balancing-type sinkhorn balances without an auxiliary loss; "
            "drop --moe-aux-loss-coeff or use aux_loss",
        )
        _require(
            self.moe_expert_capacity_factor is None or self.moe_expert_capacity_factor > 0,
            f"--moe-expert-capacity-factor must be > 0, got {self.moe_expert_capacity_factor}",
        )
        _require(
            not self.moe_pad_expert_input_to_capacity
            or self.moe_expert_capacity_factor is not None,
            "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor",
        )
        _require(
            not (self.moe_router_load_balancing_type == "sinkhorn"
                 and self.moe_expert_capacity_factor is not None),
            "--moe-expert-capacity-factor applies to top-k routing; use "
            "--moe-router-load-balancing-type aux_loss, seq_aux_loss, global_aux_loss or none",
        )
        _require(
            self.moe_ffn_hidden_size % tp == 0,
            f"--moe-ffn-hidden-size ({self.moe_ffn_hidden_size}) must be divisible by "
            f"--tensor-model-parallel-size ({tp})",
        )
        shared = self.moe_shared_expert_intermediate_size
        _require(
            shared is None or (shared >= 1 and shared % tp == 0),
            f"--moe-shared-expert-intermediate-size ({shared}) must be positive and divisible "
            f"by --tensor-model-parallel-size ({tp})",
        )
        _require(
            not self.moe_shared_expert_gate or shared is not None,
            "--moe-shared-expert-gate needs --moe-shared-expert-intermediate-size",
        )
        _require(
            self.moe_latent_size is None or self.moe_latent_size >= 1,
            f"--moe-latent-size must be >= 1, got {self.moe_latent_size}",
        )
        _require(
            tp == 1 or self.sequence_parallel,
            "mixture-of-experts layers with --tensor-model-parallel-size > 1 need "
            "--sequence-parallel (as in Megatron-LM)",
        )
        etp = parallel.expert_tensor_parallel_size
        _require(
            etp is None or etp == tp,
            f"--expert-tensor-parallel-size {etp}: experts are split over the tensor-parallel "
            f"group like the dense MLP; leave it out or set it to --tensor-model-parallel-size "
            f"({tp})",
        )
        self.moe_layer_pattern()  # raises for a malformed or wrong-length pattern

    def _check_router(self, experts: int) -> None:
        """The DeepSeek-V3 router flags (sigmoid scores, expert bias, group-limited top-k)."""
        _require(self.moe_router_score_function in ("softmax", "sigmoid", "sqrtsoftplus"),
                 f"--moe-router-score-function must be softmax, sigmoid or sqrtsoftplus, got "
                 f"{self.moe_router_score_function!r}")
        _require(self.moe_router_dtype in (None, "fp32", "fp64"),
                 f"--moe-router-dtype must be fp32 or fp64, got {self.moe_router_dtype!r}")
        # sigmoid and sqrtsoftplus score every expert before top-k, which is what
        # --moe-router-pre-softmax asks (Megatron accepts the pair; it changes nothing there).
        sigmoid = self.moe_router_score_function in ("sigmoid", "sqrtsoftplus")
        _require(not self.moe_router_enable_expert_bias or sigmoid,
                 "--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid "
                 "or sqrtsoftplus (as in Megatron-LM)")
        _require(self.moe_router_bias_update_rate >= 0,
                 f"--moe-router-bias-update-rate must be >= 0, got "
                 f"{self.moe_router_bias_update_rate}")
        special = [flag for flag, on in (
            (f"--moe-router-score-function {self.moe_router_score_function}", sigmoid),
            ("--moe-router-num-groups", self.moe_router_num_groups is not None),
            ("--moe-router-topk-scaling-factor",
             self.moe_router_topk_scaling_factor is not None)) if on]
        _require(not (special and self.moe_router_load_balancing_type == "sinkhorn"),
                 f"{', '.join(special)} apply to top-k routing; --moe-router-load-balancing-type "
                 "sinkhorn chooses experts its own way (use aux_loss, seq_aux_loss, global_aux_loss "
                 "or none)")
        groups, group_topk = self.moe_router_num_groups, self.moe_router_group_topk
        _require((groups is None) == (group_topk is None),
                 "--moe-router-num-groups and --moe-router-group-topk go together")
        if groups is not None:
            topk = self.moe_router_topk
            _require(groups >= 1 and experts % groups == 0,
                     f"--moe-router-num-groups ({groups}) must divide --num-experts ({experts})")
            _require(1 <= group_topk <= groups,
                     f"--moe-router-group-topk ({group_topk}) must be between 1 and "
                     f"--moe-router-num-groups ({groups})")
            # Each group is scored by the sum of its topk/group_topk best experts (Megatron's).
            _require(topk % group_topk == 0 and topk <= group_topk * (experts // groups),
                     f"--moe-router-topk ({topk}) must be a multiple of --moe-router-group-topk "
                     f"({group_topk}) and at most group_topk x experts per group "
                     f"({group_topk * (experts // groups)})")

    def moe_layer_pattern(self) -> List[int]:
        """1 for each (0-based) layer that is a mixture of experts, 0 for a dense one."""
        if self.num_moe_experts is None:
            return [0] * self.num_layers
        freq = parse_moe_layer_freq(self.moe_layer_freq)
        if isinstance(freq, int):
            _require(freq >= 1, f"--moe-layer-freq must be >= 1, got {freq}")
            return [1 if index % freq == 0 else 0 for index in range(self.num_layers)]
        _require(
            len(freq) == self.num_layers and set(freq) <= {0, 1},
            f"--moe-layer-freq pattern {freq} must hold one 0 or 1 per layer "
            f"(--num-layers {self.num_layers})",
        )
        return list(freq)

    def padded_vocab_size(self, tensor_model_parallel_size: int) -> int:
        multiple = self.make_vocab_size_divisible_by * tensor_model_parallel_size
        return int(math.ceil(self.vocab_size / multiple) * multiple)

    def replace(self, **changes) -> "TransformerConfig":
        return dataclasses.replace(self, **changes)


def parse_moe_layer_freq(text: Union[str, int, List[int]],
                         flag: str = "--moe-layer-freq") -> Union[int, List[int]]:
    """Megatron's --moe-layer-freq (and --window-attn-skip-freq, `flag`, the same type): an
    int N (every N-th layer) or a 0/1 pattern such as "([1]*3+[0]*1)*2" or "[1,0,1,0]",
    evaluated without `eval` (list displays of integers, `+` and `*` only)."""
    import ast

    if isinstance(text, (int, list)):
        return text
    source = text.strip()
    try:
        return int(source)
    except ValueError:
        pass

    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.List):
            items = [value(item) for item in node.elts]
            if all(type(item) is int for item in items):
                return items
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Add) and type(left) is type(right):
                return left + right
            if isinstance(node.op, ast.Mult) and (type(left) is int or type(right) is int):
                count, items = (left, right) if type(left) is int else (right, left)
                length = count if type(items) is int else count * len(items)
                if length > 100_000:  # a pattern longer than any model
                    raise ValueError
                return left * right
        raise ValueError

    try:
        pattern = value(ast.parse(source, mode="eval").body)
    except (SyntaxError, ValueError, RecursionError):
        pattern = None
    if not isinstance(pattern, (int, list)):
        raise ConfigError(
            f"{flag} {text!r}: give an integer N (every N-th layer) or a 0/1 "
            "list per layer such as \"([1]*3+[0]*1)*2\""
        )
    return pattern


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
        """Check the optimizer settings (once per contents)."""
        key = _fingerprint(self)
        if not _validated(self, key):
            self._check()
            _remember_validated(self, key)

    def _check(self) -> None:
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
        _require(
            self.use_layer_wise_param_layout or self.use_layer_wise_distributed_optimizer,
            "--no-use-layer-wise-param-layout chooses how the layer-wise distributed optimizer "
            "places params: add --optimizer muon (or lion) --use-distributed-optimizer, or "
            "drop it",
        )


@dataclass
class TrainingConfig:
    micro_batch_size: int = 1
    global_batch_size: Optional[int] = None  # None: micro_batch_size * data-parallel size
    seq_length: int = 1024
    # None with --train-samples: pretrain derives it (Megatron's update_train_iters).
    train_iters: Optional[int] = 100
    train_samples: Optional[int] = None
    # Megatron's --rampup-batch-size START INCREMENT SAMPLES: the global batch grows from
    # START by INCREMENT over SAMPLES consumed samples (training/num_microbatches.py).
    rampup_batch_size: Optional[List[int]] = None
    # Megatron-LM main's --step-batch-size-schedule "THRESHOLD:BS ...": the global batch is BS
    # from THRESHOLD consumed tokens on (K/M/B/T suffixes; training/num_microbatches.py).
    step_batch_size_schedule: Optional[str] = None
    seed: int = 1234
    # LoRA fine-tuning (Megatron-Bridge's names and defaults): --lora-rank > 0 attaches
    # adapters to --lora-target-modules and freezes the rest (tensor_parallel/lora.py).
    lora_rank: int = 0
    lora_alpha: float = 32.0
    lora_dropout: float = 0.0
    lora_target_modules: List[str] = field(
        default_factory=lambda: ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"])
    log_interval: int = 10
    eval_interval: int = 1000
    eval_iters: int = 10
    tensorboard_dir: Optional[str] = None
    pipeline_schedule: str = "interleaved"  # SMP: "simple" | "interleaved"
    exit_interval: Optional[int] = None
    # Logging, as Megatron's flags of the same names.
    log_throughput: bool = False  # tokens/s and TFLOP/s/GPU in the log line
    log_timers_to_tensorboard: bool = False  # iteration-time scalar
    log_validation_ppl_to_tensorboard: bool = False  # "<loss> validation ppl" scalars
    log_memory_to_tensorboard: bool = False  # mem-* scalars (CUDA allocator, or RSS on CPU)
    tensorboard_log_interval: int = 1
    tensorboard_queue_size: int = 1000
    # Python's cyclic garbage collector off, run every `manual_gc_interval` iterations instead
    # (0: only at start and around evaluation), so collections do not stall random steps.
    manual_gc: bool = False
    manual_gc_interval: int = 0
    manual_gc_eval: bool = True  # collect before and after each evaluation
    # Megatron's --empty-unused-memory-level: hand the CUDA caching allocator's unused blocks
    # back after each training step's forward-backward and each evaluation step (>= 1), and
    # after the optimizer step too (2). A CPU run has no such cache.
    empty_unused_memory_level: int = 0
    # Run control, as Megatron's flags of the same names (training/run_control.py): each
    # exit condition saves a checkpoint (with --save) and ends the run without the final
    # evaluation.
    exit_duration_in_mins: Optional[int] = None
    exit_signal_handler: bool = False
    exit_signal: str = "SIGTERM"  # a signal.Signals name
    skip_train: bool = False  # evaluate validation and test sets only
    deterministic_mode: bool = False  # torch.use_deterministic_algorithms(True)
    # Megatron's result validation (training/result_validation.py): NaN/Inf in each loss and
    # each bucket's local grad norm stops the run, after an in-place rerun in
    # "validate_results" mode; "disabled" raises at once.
    check_for_nan_in_loss_and_grad: bool = True
    rerun_mode: str = "validate_results"
    check_weight_hash_across_dp_replicas_interval: Optional[int] = None
    # torch.compile backend for each transformer layer (--torch-compile; None: eager).
    torch_compile: Optional[str] = None
    log_params_norm: bool = False  # " params norm:" field and params-norm scalar
    log_progress: bool = False  # <--save>/progress.txt: job starts, saves, throughput
    log_loss_scale_to_tensorboard: bool = True  # loss-scale scalar
    log_world_size_to_tensorboard: bool = False  # world-size scalar
    # Megatron's --moe-per-layer-logging: moe/<loss>_layer_<i> scalars per MoE layer.
    moe_per_layer_logging: bool = False
    logging_level: Optional[int] = None  # Python logging's root level (MEGATRON_LOGGING_LEVEL)
    # torch.profiler trace of iterations profile_step_start..profile_step_end-1 (Megatron's
    # --profile --use-pytorch-profiler) on the global ranks in profile_ranks.
    profile: bool = False
    use_pytorch_profiler: bool = False
    profile_step_start: int = 10
    profile_step_end: int = 12
    profile_ranks: list = field(default_factory=lambda: [0])
    # CUDA: the caching allocator's history, pickled to memory_snapshot_path by the last rank
    # at each --log-interval (torch.cuda.memory._snapshot(), for pytorch.org/memory_viz).
    record_memory_history: bool = False
    memory_snapshot_path: str = "snapshot.pickle"
    # --report-memory: rank 0 prints training/memory_planner.py's per-rank estimate first.
    report_memory: bool = False
    # Weights & Biases logging of the TensorBoard scalars on the last rank (wandb optional).
    wandb_project: Optional[str] = None
    wandb_exp_name: Optional[str] = None
    wandb_save_dir: Optional[str] = None
    wandb_entity: Optional[str] = None

    def num_microbatches(self, data_parallel_size: int) -> int:
        global_batch = self.global_batch_size or self.micro_batch_size * data_parallel_size
        per_step = self.micro_batch_size * data_parallel_size
        _require(
            global_batch % per_step == 0,
            f"--global-batch-size ({global_batch}) must be divisible by --micro-batch-size "
            f"({self.micro_batch_size}) x data-parallel size ({data_parallel_size}) = {per_step}",
        )
        return global_batch // per_step


@dataclass
class DataConfig:
    data_path: list = field(default_factory=list)  # Megatron's "[weight] prefix ..." list
    split: str = "969,30,1"
    mock_data: bool = False
    tokenizer_type: str = "NullTokenizer"
    tokenizer_model: Optional[str] = None
    vocab_file: Optional[str] = None
    merge_file: Optional[str] = None
    vocab_size: Optional[int] = None
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    # Megatron's --sft: --data-path is conversations with a loss mask
    # (tools/preprocess_sft_data.py), packed several per sequence with a document mask.
    sft: bool = False
    num_workers: int = 0
    data_cache_path: Optional[str] = None
    # megatron-core's cache flags: every rank loads prepared caches at once (no rank-0 build,
    # no waiting), or maps each .npy at its dataset's first read; both need the caches built
    # (tools/prepare_cache.py) in --data-cache-path.
    dataloader_fast_cache_load: bool = False
    dataloader_defer_npy_index_mmap: bool = False
    # JSON {prefix: [sequence count, document count]}: .idx headers are not read
    # (tools/build_sequences_per_dataset.py writes it).
    per_dataset_sequences_path: Optional[str] = None
    # SentencePieceTokenizer: T5-style <extra_id_i> tokens appended to the vocabulary.
    vocab_extra_ids: int = 0
    # Separate datasets per split (Megatron's --train/valid/test-data-path), instead of
    # --data-path cut by --split.
    train_data_path: Optional[list] = None
    valid_data_path: Optional[list] = None
    test_data_path: Optional[list] = None
    # The same lists read from files, for blends too long for a command line: a text file
    # holding a --data-path list, a JSON file {"train": ..., "valid": ..., "test": ...}.
    data_args_path: Optional[str] = None
    per_split_data_args_path: Optional[str] = None
    # Blend components draw this fraction more samples than their share (megatron-core).
    mid_level_dataset_surplus: float = 0.005
    # False: read .bin slices with file reads instead of mmap (--no-mmap-bin-files).
    mmap_bin_files: bool = True
    # Megatron's --legacy-tokenizer: megatron/training's tokenizers (SentencePiece appends
    # its own <EOD>) instead of megatron-core's (SentencePiece's eod is the model's eos).
    legacy_tokenizer: bool = False
    # HuggingFaceTokenizer: keep the bos / template tokens tokenizer(text) adds (legacy's ids).
    tokenizer_hf_include_special_tokens: bool = False
    # TikTokenizer (--tokenizer-type TikTokenizer).
    tiktoken_pattern: Optional[str] = None
    tiktoken_num_special_tokens: int = 1000
    tokenizer_special_tokens: Optional[list] = None


@dataclass
class CheckpointConfig:
    save: Optional[str] = None
    load: Optional[str] = None
    save_interval: Optional[int] = None
    no_load_optim: bool = False
    no_load_rng: bool = False
    finetune: bool = False
    # Megatron's --pretrained-checkpoint: the base model of a --lora-rank run (its checkpoints
    # hold only the adapters and record their base; this overrides the recorded one).
    pretrained_checkpoint: Optional[str] = None
    ckpt_format: str = "torch_dist"  # "torch_dist" | "torch"
    async_save: bool = False
    # Megatron's --no-save-rng / --no-save-optim: leave those states out of saved checkpoints.
    no_save_rng: bool = False
    no_save_optim: bool = False
    # Megatron: a checkpoint's LR-schedule values that differ from the flags are an error
    # unless one of these says which side wins.
    override_opt_param_scheduler: bool = False  # the command line wins
    use_checkpoint_opt_param_scheduler: bool = False  # the checkpoint wins
    # Megatron's handling of key mismatches on load ("unexpected": the model has it, the
    # checkpoint not; "missing": the reverse): assume_ok_unexpected | log_unexpected | log_all |
    # raise_unexpected | raise_all | return_unexpected | return_all | ignore_all.
    dist_ckpt_strictness: str = "assume_ok_unexpected"
    # Load any format; without it, --ckpt-format torch loads only legacy per-rank files.
    auto_detect_ckpt_format: bool = False
    # Optimizer state reshardable over TP/PP/DP (always so in "torch_dist"; "torch" is not).
    dist_ckpt_optim_fully_reshardable: bool = False
    # Megatron's --no-ckpt-fully-parallel-save clears it: a tensor replicated over ranks (the
    # model weights over data-parallel replicas) is written by the lowest of them instead of
    # spreading those writes evenly.
    ckpt_fully_parallel_save: bool = True
    # Megatron's --save-retain-interval: each new checkpoint deletes the one before it unless
    # that one's iteration is a multiple of this (None: keep every checkpoint).
    save_retain_interval: Optional[int] = None
