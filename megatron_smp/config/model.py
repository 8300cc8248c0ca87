"""TransformerConfig: shape and numerics of a decoder-only transformer.

Every field is declared here; the checks and derived patterns of each concern live beside it
(attention.py, moe.py, mla.py, mtp.py, hybrid.py) as the mixins TransformerConfig is built from.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Optional, Tuple, Union

from megatron_smp.config.attention import AttentionChecks
from megatron_smp.config.errors import _require
from megatron_smp.config.hybrid import HybridChecks
from megatron_smp.config.mla import MLAChecks
from megatron_smp.config.moe import MoEChecks, parse_moe_layer_freq
from megatron_smp.config.mtp import MTPChecks
from megatron_smp.config.parallel import FLAG_NAMES, ParallelConfig, name_of

if TYPE_CHECKING:
    import torch


# Attention over packed sequences (`transformer.packed`).
PACKED_ATTENTION_BACKENDS = ("auto", "varlen", "flex", "segments", "mask")


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
    "yarn_correction_range_round_to_int", "mla_rope_type",
    "hybrid_layer_pattern", "linear_attention_freq", "attention_output_gate", "mamba_dt_min",
    # Gemma 3's numerics (see TransformerConfig).
    "sandwich_norm", "apply_embedding_scaling", "softmax_scale", "final_logit_softcapping",
    "local_rotary_base", "rotary_seq_len_interpolation_factor",
)


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
class TransformerConfig(AttentionChecks, MoEChecks, MLAChecks, MTPChecks, HybridChecks):
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
    # Megatron's --test-mode: every attention forward checks that the data- and
    # tensor-parallel replicas of its q/k norm parameters are equal (its real-time test of
    # silent corruption), raising on every rank of a group that disagrees.
    test_mode: bool = False
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
    # Multi-latent attention rotates its positional channels whatever the position embedding
    # (Megatron's MLA builds its own rotary embedding from --rope-type, default yarn): with
    # position_embedding_type "learned_absolute" or "none" this is that RoPE ("rope" |
    # "yarn"), beside the learned positions. None: from position_embedding_type.
    mla_rope_type: Optional[str] = None
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
    # Megatron's --embedding-init-method-std: the word and position embeddings (and, under muP,
    # an untied output layer) start at N(0, this) instead of init_method_std.
    embedding_init_method_std: Optional[float] = None
    # Megatron's --init-method-xavier-uniform: every weight matrix drawn by init_method (the
    # layers' matrices, the output layer, and the embeddings unless embedding_init_method_std
    # differs from init_method_std) is Xavier-uniform over its full (unsplit) shape instead.
    init_method_xavier_uniform: bool = False
    # Megatron scales the init of output projections by 1/sqrt(2 * num_layers).
    use_scaled_init_method: bool = True

    # None: torch.float32, set at construction (so that importing the configs needs no torch).
    params_dtype: Optional[torch.dtype] = None
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
    moe_token_dispatcher_type: str = "allgather"  # allgather | alltoall | flex
    # Megatron-LM main's fused kernel for the flex dispatcher's exchange (deepep | hybridep |
    # ncclep; --moe-enable-deepep is deepep): a kernel choice, the exchange is the same.
    moe_flex_dispatcher_backend: str = "deepep"
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
    # Megatron-LM main's muP (--use-mup), with width multiplier m = hidden_size /
    # mup_base_hidden_size (None: hidden_size, m = 1): hidden matrices start at
    # N(0, init_method_std / sqrt(m)) (output projections also / sqrt(2 L)), the embeddings and
    # an untied output layer at N(0, init_method_std); embeddings are multiplied by
    # mup_embedding_mult, logits by mup_output_mult (1.0 with m != 1: 1 / m); attention
    # scores by sqrt(mup_base_head_dim or 1) / kv_channels ** mup_attn_scale_power unless
    # softmax_scale is set; the optimizer gives hidden matrices LR and Adam eps / m
    # (`mup_width_mult`, `mup_logit_mult`, `attention_softmax_scale`).
    use_mup: bool = False
    mup_base_hidden_size: Optional[int] = None
    mup_embedding_mult: float = 1.0
    mup_output_mult: float = 1.0
    mup_base_head_dim: Optional[float] = None
    mup_attn_scale_power: float = 1.0

    @property
    def mup_width_mult(self) -> float:
        """hidden_size / mup_base_hidden_size with --use-mup, else 1."""
        if not self.use_mup:
            return 1.0
        return self.hidden_size / (self.mup_base_hidden_size or self.hidden_size)

    def mup_logit_mult(self) -> float:
        """What the logits are multiplied by (1 without --use-mup)."""
        if not self.use_mup:
            return 1.0
        width = self.mup_width_mult
        return 1.0 / width if self.mup_output_mult == 1.0 and width != 1.0 else \
            self.mup_output_mult

    def attention_softmax_scale(self) -> Optional[float]:
        """The scale of q.k: --softmax-scale, else muP's, else None (1/sqrt(head dim))."""
        if self.softmax_scale is not None or not self.use_mup:
            return self.softmax_scale
        base = 1.0 if self.mup_base_head_dim is None else self.mup_base_head_dim ** 0.5
        return base / self.kv_channels ** self.mup_attn_scale_power

    def __post_init__(self) -> None:
        if self.params_dtype is None:
            import torch

            self.params_dtype = torch.float32
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
        """Check the model against the parallel layout (and sequence length). Pure; run once
        where the configs are built (`validate_configs`, `smp.transform`); a config built by
        hand is checked by calling this before `GPTModel`, which does not."""
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
            self.mup_base_hidden_size is None or self.mup_base_hidden_size > 0,
            f"--mup-base-hidden-size must be positive, got {self.mup_base_hidden_size}",
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

    def embedding_init_is_xavier(self) -> bool:
        """Megatron-LM main: with --init-method-xavier-uniform the embeddings take the layers'
        init method unless --embedding-init-method-std gives them another std."""
        return self.init_method_xavier_uniform and self.embedding_init_method_std in (
            None, self.init_method_std)

    def embedding_init_std(self) -> float:
        """The embeddings' init std: --embedding-init-method-std, else --init-method-std."""
        return (self.init_method_std if self.embedding_init_method_std is None
                else self.embedding_init_method_std)

    def padded_vocab_size(self, tensor_model_parallel_size: int) -> int:
        multiple = self.make_vocab_size_divisible_by * tensor_model_parallel_size
        return int(math.ceil(self.vocab_size / multiple) * multiple)

    def replace(self, **changes) -> "TransformerConfig":
        return dataclasses.replace(self, **changes)
