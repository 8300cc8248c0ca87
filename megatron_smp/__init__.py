"""megatron_smp: Megatron-style model parallelism with the SageMaker model parallelism v2 API.

`import megatron_smp as smp` gives SMP v2's `init`, `is_initialized`, `state` and `transform`
(and `MoEConfig` for mixture-of-experts models), and `fully_shard` (FSDP2 with the
`hybrid_shard_degree`, offloading and FSDP keys of `init`).

The package root imports nothing itself: each name loads its module at first use, so that
`import megatron_smp.config` or a data tool imports only what it uses.
"""
from __future__ import annotations

_LAZY = {name: "megatron_smp.smp" for name in
         ("init", "is_initialized", "state", "transform", "MoEConfig", "fully_shard")}


def __getattr__(name):
    import importlib

    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if not name.startswith("_"):
        # A subpackage reached as an attribute (`megatron_smp.smp.x`), as when the root
        # imported it eagerly.
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as error:
            if error.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module 'megatron_smp' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_LAZY))


__all__ = list(_LAZY)
