"""megatron_smp: Megatron-style model parallelism with the SageMaker model parallelism v2 API.

`import megatron_smp as smp` gives SMP v2's `init`, `is_initialized`, `state` and `transform`
(and `MoEConfig` for mixture-of-experts models).
"""
from megatron_smp.smp import MoEConfig, init, is_initialized, state, transform

__all__ = ["init", "is_initialized", "state", "transform", "MoEConfig"]
