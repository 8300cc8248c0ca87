"""TransformerConfig's multi-token prediction part (DeepSeek-V3,
transformer/multi_token_prediction.py)."""
from __future__ import annotations

from megatron_smp.config.errors import _require
from megatron_smp.config.parallel import ParallelConfig


class MTPChecks:
    """Mixed into TransformerConfig: --mtp-num-layers and --mtp-loss-scaling-factor."""

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
