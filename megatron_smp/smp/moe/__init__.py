"""torch.sagemaker.moe: the MoE configuration of `transform`."""
from megatron_smp.smp.moe.moe_config import MoEConfig

__all__ = ["MoEConfig"]
