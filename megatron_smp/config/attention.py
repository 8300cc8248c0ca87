"""TransformerConfig's attention part: position embeddings (RoPE scaling, YaRN), sliding
windows, softmax variants (gpt-oss, Gemma) and context parallelism's attention (the fields
are declared with the rest in model.py)."""
from __future__ import annotations

import math
from typing import List, Optional, Tuple

from megatron_smp.config.errors import _require
from megatron_smp.config.moe import parse_moe_layer_freq
from megatron_smp.config.parallel import CP_COMM_TYPES


# Megatron's --softmax-type: "vanilla" softmax, "off-by-one" (a zero logit in every
# denominator) or "learnable" (a learned logit per head: gpt-oss's attention sinks).
SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")


class AttentionChecks:
    """Mixed into TransformerConfig: position embeddings, windows and softmax numerics."""

    def uses_rotary_embedding(self) -> bool:
        """RoPE, plain or scaled (position_embedding_type "rope" or "yarn", or multi-latent
        attention's own `mla_rope_type`)."""
        return self.rotary_type() is not None

    def rotary_type(self) -> Optional[str]:
        """"rope", "yarn" (RoPE with YaRN's scaling) or None: the rotary embedding built."""
        if self.position_embedding_type in ("rope", "yarn"):
            return self.position_embedding_type
        return self.mla_rope_type if self.multi_latent_attention else None

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
        if self.rotary_type() == "yarn":
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
