"""Generation for hybrid models (Mamba-2 / Gated DeltaNet layers beside attention)."""
import pytest
import torch

import megatron_smp as smp
from megatron_smp.config import ConfigError
from tests.unit.inference.common import prompts
from tests.unit.models.test_hf_hybrid import build_hf


@pytest.mark.parametrize("family,kind", [("qwen3_5", "GatedDeltaNet"),
                                         ("nemotron_h", "MambaMixer")])
def test_recurrent_layers_are_a_clear_error(family, kind):
    smp.init({"random_seed": 3})
    hf = build_hf(family)
    ids, mask = prompts(hf.config.vocab_size)
    with pytest.raises(ConfigError, match=f"recurrent mixers.*{kind}"):
        smp.transform(hf).generate(ids, attention_mask=mask, max_new_tokens=2)
