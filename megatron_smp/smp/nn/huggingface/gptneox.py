"""SMP v1's smdistributed.modelparallel.torch.nn.huggingface.gptneox: the GPT-NeoX state-dict
translators on v1's own layout (see megatron_smp.models.hf.smp_v1)."""
from megatron_smp.models.hf.smp_v1 import (
    translate_hf_gptneox_state_dict_to_smdistributed,
    translate_hf_state_dict_to_smdistributed_gptneox,
    translate_state_dict_to_hf_gptneox,
)

__all__ = [
    "translate_state_dict_to_hf_gptneox",
    "translate_hf_state_dict_to_smdistributed_gptneox",
    "translate_hf_gptneox_state_dict_to_smdistributed",  # v1's older name
]
