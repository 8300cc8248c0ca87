"""`megatron_smp.smp.moe.moe_config.MoEConfig` (torch.sagemaker.moe.moe_config.MoEConfig)."""
from __future__ import annotations

import dataclasses
from typing import Any, Dict

from megatron_smp.config import ConfigError, not_supported


@dataclasses.dataclass
class MoEConfig:
    """SMP v2's `torch.sagemaker.moe.moe_config.MoEConfig`, passed as `transform(model,
    config=MoEConfig(...))` for a Mixtral / Qwen2-MoE model. Fields map onto Megatron's:

    * moe_load_balancing: "aux_loss" | "sinkhorn" | "none" -> --moe-router-load-balancing-type;
      "balanced" is top-k routing with every expert capped at its even share of the tokens
      (--moe-expert-capacity-factor 1.0, tokens beyond it dropped by probability);
    * moe_aux_loss_coeff: the auxiliary loss's coefficient, used with "aux_loss" only;
    * moe_z_loss_coeff: --moe-z-loss-coeff (0 disables the z-loss);
    * moe_all_to_all_dispatcher: --moe-token-dispatcher-type alltoall (else allgather);
    * random_seed: seeds the per-expert-parallel-rank stream ("expert-parallel-rng": seed +
      1024 + 100 * ep_rank + tp_rank, as Megatron derives it) that the random ops of the
      expert modules (the router's input jitter) draw from, and the transformed model's own
      initialisation (the weights are the HF model's unless it is on the meta device);
    * smp_moe=False (HF's own MoE blocks) and global_token_shuffle=True are not supported:
      transform always builds the framework's expert-parallel layers, and dropless routing
      makes a shuffle change nothing but the traffic.
    """

    smp_moe: bool = True
    random_seed: int = 12345
    moe_load_balancing: str = "sinkhorn"
    global_token_shuffle: bool = False
    moe_all_to_all_dispatcher: bool = True
    moe_aux_loss_coeff: float = 0.001
    moe_z_loss_coeff: float = 0.001

    def transformer_overrides(self) -> Dict[str, Any]:
        """TransformerConfig fields these settings set; ConfigError for values that cannot
        work, naming the field."""
        balancing = {"aux_loss": "aux_loss", "sinkhorn": "sinkhorn", "none": "none",
                     "balanced": "none"}
        if self.moe_load_balancing not in balancing:
            raise ConfigError(
                f"MoEConfig.moe_load_balancing must be one of {sorted(balancing)}, got "
                f"{self.moe_load_balancing!r}"
            )
        if not self.smp_moe:
            raise not_supported("MoEConfig(smp_moe=False)", "Hugging Face's own MoE blocks "
                                "inside transform (it always builds expert-parallel layers)")
        if self.global_token_shuffle:
            raise not_supported("MoEConfig(global_token_shuffle=True)", "token shuffling "
                                "across expert-parallel ranks")
        for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
            if getattr(self, name) < 0:
                raise ConfigError(f"MoEConfig.{name} must be >= 0, got {getattr(self, name)}")
        overrides = {
            "moe_router_load_balancing_type": balancing[self.moe_load_balancing],
            "moe_aux_loss_coeff": (self.moe_aux_loss_coeff
                                   if self.moe_load_balancing == "aux_loss" else 0.0),
            "moe_z_loss_coeff": self.moe_z_loss_coeff or None,
            "moe_token_dispatcher_type": "alltoall" if self.moe_all_to_all_dispatcher
            else "allgather",
        }
        if self.moe_load_balancing == "balanced":
            overrides.update(moe_expert_capacity_factor=1.0, moe_token_drop_policy="probs")
        return overrides
