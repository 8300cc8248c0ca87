"""torch.sagemaker.distributed.checkpoint.state_dict_loader: DCP load, in place, resharding."""
from megatron_smp.checkpointing.engine.loader import load

__all__ = ["load"]
