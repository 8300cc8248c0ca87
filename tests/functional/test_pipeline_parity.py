"""Whole training runs with pipeline parallelism follow the single-process trajectory."""
import json

import pytest

from megatron_smp.testing import run_distributed
from tests.functional.test_training_parity import COMMON, _train

# Four layers so that PP=4 and two virtual stages per rank both have work.
PIPELINE = ["--num-layers", "4"]

LAYOUTS = {
    "pp2_simple": (2, "--pipeline-model-parallel-size 2 --pipeline-schedule simple"),
    "pp2_1f1b_overlap": (2, "--pipeline-model-parallel-size 2 --pipeline-schedule interleaved "
                            "--overlap-grad-reduce"),
    # Megatron's microbatch groups: each chunk runs all 4 microbatches in turn (default 2).
    "pp2_virtual2_overlap": (2, "--pipeline-model-parallel-size 2 "
                                "--virtual-pipeline-model-parallel-size 2 --overlap-grad-reduce "
                                "--microbatch-group-size-per-virtual-pipeline-stage 4"),
    "pp4_simple": (4, "--pipeline-model-parallel-size 4 --pipeline-schedule simple"),
    "pp4_1f1b": (4, "--pipeline-model-parallel-size 4"),
    "pp4_virtual2": (4, "--pipeline-model-parallel-size 4 "
                        "--num-layers-per-virtual-pipeline-stage 1"),
    "pp2_uneven": (2, "--pipeline-model-parallel-size 2 --decoder-first-pipeline-num-layers 1"),
    # Megatron's layout string: 2 chunks a rank of 1 + 1 and 2 + 0 layers (the last: the loss).
    "pp2_layout": (2, "--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout "
                      "Et|tt|t|L"),
    "tp2_sp_pp2_dp2_distopt": (8, "--tensor-model-parallel-size 2 --sequence-parallel "
                                  "--pipeline-model-parallel-size 2 --use-distributed-optimizer"),
}


def _reference():
    key = "gpt_pp_reference"
    from tests.functional import test_training_parity

    if key not in test_training_parity._BASELINES:
        test_training_parity._BASELINES[key] = run_distributed(
            _train, 1, args=(COMMON + PIPELINE,))[0]
    return test_training_parity._BASELINES[key]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_pipeline_layout_matches_single_process(layout, tmp_path):
    world_size, flags = LAYOUTS[layout]
    flags = flags.split()
    trace = str(tmp_path / "timeline.json")
    if layout in ("pp2_uneven", "pp2_virtual2_overlap"):
        flags += ["--pipeline-timeline", trace]
    reference = _reference()
    results = run_distributed(_train, world_size, args=(COMMON + PIPELINE + flags,), timeout=300)
    assert len(reference) == 10 and reference[-1] < reference[0]
    for losses in results:  # every rank reports the last stage's losses
        assert losses == pytest.approx(reference, rel=1e-4), (layout, losses, reference)
    if layout == "pp2_virtual2_overlap":  # rank 0's first forwards: chunk 0 on microbatch 0-3
        with open(str(tmp_path / "timeline.rank0.json")) as handle:
            events = json.load(handle)["traceEvents"]
        forwards = [(e["args"]["chunk"], e["args"]["microbatch"]) for e in events
                    if e.get("cat") == "compute" and e["name"].startswith("F")]
        assert forwards[:8] == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1), (1, 2), (1, 3)]
    if layout == "pp2_uneven":
        for rank in range(world_size):
            with open(str(tmp_path / f"timeline.rank{rank}.json")) as handle:
                events = json.load(handle)["traceEvents"]
            # 10 iterations x 4 microbatches, each a forward and a backward span, and the
            # forwards of the validation and test evaluations after training (1 batch each)
            compute = [e for e in events if e.get("cat") == "compute"]
            assert len(compute) == 10 * 4 * 2 + 2 * 4
            assert sum(e["name"].startswith("B") for e in compute) == 10 * 4


def test_split_counting_the_embedding_and_loss_matches_single_process():
    """Megatron's --account-for-embedding-in-pipeline-split / --account-for-loss-in-pipeline-
    split at PP=2 x 2 virtual stages with 2 layers: 4 slots, one a chunk, so rank 0's first
    chunk holds only the embedding and rank 1's last only the final norm, output layer and
    loss; the losses are the single-process ones."""
    from tests.functional.test_training_parity import baseline

    flags = ("--pipeline-model-parallel-size 2 --virtual-pipeline-model-parallel-size 2 "
             "--account-for-embedding-in-pipeline-split "
             "--account-for-loss-in-pipeline-split").split()
    reference = baseline("gpt")
    for losses in run_distributed(_train, 2, args=(COMMON + flags,), timeout=300):
        assert losses == pytest.approx(reference, rel=1e-4)


BAD_LAYOUTS = {
    "layers_not_divisible": (
        "--pipeline-model-parallel-size 2 --num-layers 3",
        "--num-layers (3) is not divisible by --pipeline-model-parallel-size (2)"),
    "virtual_microbatches": (
        "--pipeline-model-parallel-size 2 --virtual-pipeline-model-parallel-size 2 "
        "--global-batch-size 6",
        "number of microbatches (3 = --global-batch-size"),

}


@pytest.mark.parametrize("case", list(BAD_LAYOUTS))
def test_bad_pipeline_layout_is_a_config_error_on_every_rank(case):
    flags, message = BAD_LAYOUTS[case]
    errors = run_distributed(_train, 2, args=(COMMON + PIPELINE + flags.split(),),
                             allow_errors=True, timeout=120)
    for error in errors:
        assert "ConfigError" in error and message in error, error[-2000:]
