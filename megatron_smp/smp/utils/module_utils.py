"""torch.sagemaker.utils.module_utils: helpers for custom delayed-initialisation functions."""
from megatron_smp.distributed.delayed_init import empty_module_params, move_buffers_to_device

__all__ = ["empty_module_params", "move_buffers_to_device"]
