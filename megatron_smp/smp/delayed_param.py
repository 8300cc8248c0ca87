"""torch.sagemaker.delayed_param: delayed parameter initialisation."""
from megatron_smp.distributed.delayed_init import DelayedParamIniter

__all__ = ["DelayedParamIniter"]
