"""TransformerConfig's hybrid part: --hybrid-layer-pattern, linear attention (Gated
DeltaNet) and the Mamba-2 mixer (transformer/hybrid.py, transformer/ssm/)."""
from __future__ import annotations

from typing import List, Optional

from megatron_smp.config.errors import _require
from megatron_smp.config.moe import parse_moe_layer_freq
from megatron_smp.config.parallel import ParallelConfig


# --hybrid-layer-pattern's symbols (Megatron's): Mamba, Gated DeltaNet, attention, MLP, MoE.
HYBRID_SYMBOLS = "MG*-E"
HYBRID_STAGE_BREAK = "|"
HYBRID_MTP_SEPARATOR = "/"


class HybridChecks:
    """Mixed into TransformerConfig: the hybrid layer pattern and the mixers' sizes."""

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
