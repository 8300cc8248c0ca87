"""SMP v1's smdistributed.modelparallel.torch.nn.huggingface.gpt2: the GPT-2 state-dict
translators on v1's own layout (see megatron_smp.models.hf.smp_v1)."""
from megatron_smp.models.hf.smp_v1 import (
    translate_hf_state_dict_to_smdistributed,
    translate_hf_state_dict_to_smdistributed_gpt2,
    translate_hf_state_dict_to_smdistributed_gpt2_layer,
    translate_state_dict_to_hf_gpt2,
    translate_state_dict_to_hf_gpt2_layer,
)

__all__ = [
    "translate_state_dict_to_hf_gpt2",
    "translate_hf_state_dict_to_smdistributed_gpt2",
    "translate_hf_state_dict_to_smdistributed",  # v1's older name
    "translate_state_dict_to_hf_gpt2_layer",  # v1's custom GPT-2 (DistributedTransformerLayers)
    "translate_hf_state_dict_to_smdistributed_gpt2_layer",
]
