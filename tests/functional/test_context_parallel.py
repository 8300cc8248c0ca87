"""Training under context parallelism follows the single-process losses: GPT and Llama at
CP=2, CP=4, CP2 x TP2 + SP, CP2 x PP2 and CP2 x DP2 with the distributed optimizer, every
--cp-comm-type among them; and a checkpoint saved at CP=2 resumes at CP=1 and back."""
import pytest

from megatron_smp.testing import assert_follows_trajectory, run_distributed
from tests.functional.test_training_parity import COMMON, LLAMA, _train, baseline

# (world size, flags) per layout; each model runs each layout with one comm type, so every
# comm type meets MHA and GQA (Llama: 4 heads, 2 query groups) somewhere.
# Recompute (selective: the CP core attention alone; full: whole layers) changes no number,
# so two layouts run with it.
LAYOUTS = {
    "cp2": (2, "--context-parallel-size 2 --recompute-granularity selective"),
    "cp4": (4, "--context-parallel-size 4 --recompute-granularity full"),
    "cp2_tp2_sp": (4, "--context-parallel-size 2 --tensor-model-parallel-size 2 "
                      "--sequence-parallel"),
    "cp2_pp2": (4, "--context-parallel-size 2 --pipeline-model-parallel-size 2"),
    "cp2_dp2_distopt": (4, "--context-parallel-size 2 --use-distributed-optimizer"),
}
COMM_TYPE = {
    ("gpt", "cp2"): "p2p", ("llama", "cp2"): "a2a",
    ("gpt", "cp4"): "all_gather", ("llama", "cp4"): "p2p",
    ("gpt", "cp2_tp2_sp"): "a2a", ("llama", "cp2_tp2_sp"): "all_gather",
    ("gpt", "cp2_pp2"): "p2p", ("llama", "cp2_pp2"): "all_gather",
    ("gpt", "cp2_dp2_distopt"): "all_gather", ("llama", "cp2_dp2_distopt"): "p2p",
}
MODELS = {"gpt": [], "llama": LLAMA}


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_context_parallel_layout_matches_single_process(model, layout):
    world_size, flags = LAYOUTS[layout]
    comm_type = COMM_TYPE[(model, layout)]
    reference = baseline(model)
    argv = COMMON + MODELS[model] + flags.split() + ["--cp-comm-type", comm_type]
    results = run_distributed(_train, world_size, args=(argv,), timeout=400)
    assert len(reference) == 10 and reference[-1] < reference[0]
    for losses in results:
        assert losses == pytest.approx(reference, rel=1e-4), (layout, comm_type, losses,
                                                                reference)


def test_context_parallel_with_virtual_pipeline_stages():
    """pretrain_llama.py at CP2 x PP2 with two virtual stages per rank (4 layers)."""
    from tests.functional.test_llama_pipeline_parity import LLAMA_FLAGS, _reference

    flags = LLAMA_FLAGS + ("--context-parallel-size 2 --pipeline-model-parallel-size 2 "
                           "--virtual-pipeline-model-parallel-size 2").split()
    reference = _reference()
    for losses in run_distributed(_train, 4, args=(flags, "pretrain_llama"), timeout=400):
        assert losses == pytest.approx(reference, rel=1e-4), (losses, reference)


def test_context_parallel_bf16_follows_single_process_bf16():
    """bf16 parameters and activations at CP=2 (a2a): the bf16 single-process losses (the
    order of the sums differs: measured at most 1.7e-5 relative; the bound is ten times
    that, far inside the trajectory's movement)."""
    flags = COMMON + LLAMA + ["--bf16"]
    reference = run_distributed(_train, 1, args=(flags,))[0]
    results = run_distributed(_train, 2, args=(flags + "--context-parallel-size 2 "
                                               "--cp-comm-type a2a".split(),), timeout=300)
    assert reference[-1] < reference[0]
    for losses in results:
        error = assert_follows_trajectory(losses, reference, 2e-4, "cp2 bf16")
        print(f"\nCP=2 bf16 vs single-process bf16: max relative loss error {error:.2e}")


@pytest.mark.parametrize("save_cp, load_cp", [(2, 1), (1, 2)])
def test_checkpoint_resumes_at_another_context_parallel_size(tmp_path, save_cp, load_cp):
    """CP changes no tensor shape: 5 iterations saved at one CP size continue at the other
    with the uninterrupted single-process losses of iterations 6-10."""
    reference = baseline("llama")
    save = ["--save", str(tmp_path), "--exit-interval", "5"]
    saved = run_distributed(
        _train, save_cp,
        args=(COMMON + LLAMA + [f"--context-parallel-size={save_cp}"] + save,), timeout=300,
    )
    assert saved[0] == pytest.approx(reference[:5], rel=1e-4)
    resumed = run_distributed(
        _train, load_cp,
        args=(COMMON + LLAMA + [f"--context-parallel-size={load_cp}", "--load", str(tmp_path)],),
        timeout=300,
    )
    for losses in resumed:
        assert losses == pytest.approx(reference[5:], rel=1e-4), (losses, reference)
