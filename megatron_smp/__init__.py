"""megatron_smp: Megatron-style model parallelism with the SageMaker model parallelism v2 API.

`import megatron_smp as smp` gives SMP v2's `init`, `is_initialized`, `state` and `transform`
(and `MoEConfig` for mixture-of-experts models), and `fully_shard` (FSDP2 with the
`hybrid_shard_degree`, offloading and FSDP keys of `init`).
"""
from megatron_smp.smp import MoEConfig, fully_shard, init, is_initialized, state, transform

__all__ = ["init", "is_initialized", "state", "transform", "MoEConfig", "fully_shard"]
