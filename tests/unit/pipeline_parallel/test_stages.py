"""Layer layouts of pipeline stages, and the errors of layouts that cannot work."""
import pytest

from megatron_smp.config import ConfigError
from megatron_smp.pipeline_parallel.stages import pipeline_layer_layout


def test_even_split():
    assert pipeline_layer_layout(8, 4) == [[(0, 2)], [(2, 2)], [(4, 2)], [(6, 2)]]


def test_uneven_split_with_first_and_last_stage_counts():
    assert pipeline_layer_layout(10, 4, first_stage_layers=1, last_stage_layers=3) == [
        [(0, 1)], [(1, 3)], [(4, 3)], [(7, 3)]]
    assert pipeline_layer_layout(5, 2, first_stage_layers=2) == [[(0, 2)], [(2, 3)]]
    assert pipeline_layer_layout(7, 3, last_stage_layers=1) == [[(0, 3)], [(3, 3)], [(6, 1)]]


def test_virtual_stages_interleave_layers_over_ranks():
    # Chunk c of rank r is virtual stage c * pp + r.
    expected = [[(0, 1), (4, 1)], [(1, 1), (5, 1)], [(2, 1), (6, 1)], [(3, 1), (7, 1)]]
    assert pipeline_layer_layout(8, 4, virtual_size=2) == expected
    assert pipeline_layer_layout(8, 4, layers_per_virtual_stage=1) == expected
    assert pipeline_layer_layout(12, 2, virtual_size=3) == [
        [(0, 2), (4, 2), (8, 2)], [(2, 2), (6, 2), (10, 2)]]


@pytest.mark.parametrize("kwargs, flag", [
    (dict(num_layers=6, pipeline_size=4), "--num-layers (6) is not divisible by "
                                          "--pipeline-model-parallel-size (4)"),
    (dict(num_layers=8, pipeline_size=4, virtual_size=3), "virtual stages"),
    (dict(num_layers=8, pipeline_size=2, layers_per_virtual_stage=3),
     "--num-layers-per-virtual-pipeline-stage (3)"),
    (dict(num_layers=8, pipeline_size=2, virtual_size=2, layers_per_virtual_stage=1),
     "contradicts"),
    (dict(num_layers=8, pipeline_size=4, first_stage_layers=1, last_stage_layers=2),
     "--decoder-first-pipeline-num-layers (1)"),
    (dict(num_layers=4, pipeline_size=2, first_stage_layers=4), "leaves 0 layers"),
    (dict(num_layers=4, pipeline_size=2, first_stage_layers=0), "must be >= 1"),
])
def test_bad_layouts_are_config_errors_naming_the_flags(kwargs, flag):
    with pytest.raises(ConfigError, match=None) as info:
        pipeline_layer_layout(**kwargs)
    assert flag in str(info.value)


def test_split_counting_the_embedding_and_the_loss_follows_megatron():
    """Megatron's get_num_layers_to_build with --account-for-embedding/loss-in-pipeline-split
    (its functional test: 6 layers, PP=4, 2 virtual stages)."""
    from megatron_smp.config import ConfigError
    from megatron_smp.pipeline_parallel.stages import pipeline_layer_layout

    assert pipeline_layer_layout(6, 4, virtual_size=2, account_for_embedding=True,
                                 account_for_loss=True) == [
        [(0, 0), (3, 1)], [(0, 1), (4, 1)], [(1, 1), (5, 1)], [(2, 1), (6, 0)]]
    assert pipeline_layer_layout(5, 2, account_for_embedding=True) == [[(0, 2)], [(2, 3)]]
    with pytest.raises(ConfigError, match="must be divisible by --pipeline-model-parallel"):
        pipeline_layer_layout(4, 4, account_for_loss=True)
    with pytest.raises(ConfigError, match="do not combine with --account-for-embedding"):
        pipeline_layer_layout(4, 2, first_stage_layers=1, account_for_embedding=True)


def test_megatron_layout_strings():
    """--pipeline-model-parallel-layout as Megatron's PipelineParallelLayerLayout reads it:
    stage k of the string on rank k mod pp, repeats unrolled, E / L / t / m counted."""
    from megatron_smp.config import ConfigError
    import re

    from megatron_smp.pipeline_parallel.stages import megatron_pipeline_layout

    # Megatron-LM's functional-test layout: 16 layers and one MTP layer over PP=2 x 4.
    assert megatron_pipeline_layout("Et*3|(tt|)*6tmL", 2, 16, 1) == [
        [(0, 3), (5, 2), (9, 2), (13, 2)], [(3, 2), (7, 2), (11, 2), (15, 1)]]
    assert megatron_pipeline_layout("Et,t|tL", 2, 3, None) == [[(0, 2)], [(2, 1)]]
    for text, message in (("Ett|tL", "holds 3 transformer layers t, not --num-layers (2)"),
                          ("tE|tL", "the embedding E must come first"),
                          ("Et|t|L", "not a multiple of --pipeline-model-parallel-size"),
                          ("Etx|tL", "unknown layer character"),
                          ("Etm|tL", "transformer layers must come before the MTP layers")):
        with pytest.raises(ConfigError, match=re.escape(message)):
            megatron_pipeline_layout(text, 2, 2, 1 if "m" in text else None)
