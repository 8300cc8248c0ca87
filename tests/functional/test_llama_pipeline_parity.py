"""pretrain_llama.py (untied output layer) under pipeline parallelism follows its
single-process losses: an untied model takes no part in the tied-embedding reduction."""
import pytest

from megatron_smp.testing import run_distributed
from tests.functional.test_training_parity import COMMON, _train

# Four layers so that two virtual stages per pipeline rank each hold one; grouped-query
# attention as in Llama-2/3 (LLAMA_DEFAULTS gives RMSNorm, SwiGLU, RoPE, untied output).
LLAMA_FLAGS = COMMON + "--num-layers 4 --group-query-attention --num-query-groups 2".split()

LAYOUTS = {
    "pp2": (2, "--pipeline-model-parallel-size 2"),
    "pp2_virtual2": (2, "--pipeline-model-parallel-size 2 "
                        "--virtual-pipeline-model-parallel-size 2"),
    "tp2_sp_pp2": (4, "--tensor-model-parallel-size 2 --sequence-parallel "
                      "--pipeline-model-parallel-size 2"),
}

_REFERENCE = []


def _reference():
    if not _REFERENCE:
        _REFERENCE.append(run_distributed(_train, 1, args=(LLAMA_FLAGS, "pretrain_llama"))[0])
    return _REFERENCE[0]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_llama_script_pipeline_layout_matches_single_process(layout):
    world_size, flags = LAYOUTS[layout]
    reference = _reference()
    results = run_distributed(
        _train, world_size, args=(LLAMA_FLAGS + flags.split(), "pretrain_llama"), timeout=300
    )
    assert len(reference) == 10 and reference[-1] < reference[0]
    for losses in results:  # every rank reports the last stage's losses
        assert losses == pytest.approx(reference, rel=1e-4), (layout, losses, reference)
