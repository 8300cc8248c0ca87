"""SMP v1's smdistributed.modelparallel.torch.nn.huggingface.gptj: the GPT-J state-dict
translators on v1's own layout (see megatron_smp.models.hf.smp_v1)."""
from megatron_smp.models.hf.smp_v1 import (
    translate_hf_gptj_state_dict_to_smdistributed,
    translate_hf_state_dict_to_smdistributed_gptj,
    translate_state_dict_to_hf_gptj,
)

__all__ = [
    "translate_state_dict_to_hf_gptj",
    "translate_hf_state_dict_to_smdistributed_gptj",
    "translate_hf_gptj_state_dict_to_smdistributed",  # v1's older name
]
