"""TransformerConfig's multi-latent attention part (DeepSeek-V2/V3, transformer/mla.py)."""
from __future__ import annotations

from megatron_smp.config.errors import _require
from megatron_smp.config.parallel import ParallelConfig


class MLAChecks:
    """Mixed into TransformerConfig: --multi-latent-attention and its sizes."""

    def _validate_mla(self, parallel: ParallelConfig) -> None:
        """--multi-latent-attention: what transformer/mla.py builds, and what it does not yet."""
        _require(self.rotary_type() in ("rope", "yarn"),
                 "--multi-latent-attention rotates its positional channels: give "
                 "--position-embedding-type rope or yarn, or --rope-type beside learned "
                 "absolute positions")
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
