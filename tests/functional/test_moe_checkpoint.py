"""An MoE checkpoint saved at EP=2 x TP=2 + SP with the distributed optimizer resumes at EP=1
and at EP=4: experts are stored under their global index, optimizer state included."""
import pytest

from megatron_smp.testing import run_distributed
from tests.functional.test_moe_parity import MOE, _train
from tests.functional.test_training_parity import COMMON, LLAMA

RUN = COMMON + LLAMA + MOE + ["--moe-token-dispatcher-type", "alltoall"]


def test_ep2_tp2_checkpoint_resumes_at_ep1_and_ep4(tmp_path):
    save_dir = str(tmp_path / "ckpt")
    straight = run_distributed(_train, 1, args=(RUN,), timeout=300)[0]
    saving = RUN + ["--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
                    "--sequence-parallel", "--use-distributed-optimizer", "--save", save_dir,
                    "--save-interval", "5", "--exit-interval", "5"]
    first = run_distributed(_train, 4, args=(saving,), timeout=300)
    assert len(first[0]) == 5
    for world_size, flags in ((1, []), (4, ["--expert-model-parallel-size", "4",
                                            "--use-distributed-optimizer"])):
        resumed = run_distributed(_train, world_size, args=(RUN + flags + ["--load", save_dir],),
                                  timeout=300)
        for losses in resumed:
            assert len(losses) == 5  # iterations 6..10
            for got, want in zip(losses, straight[5:]):
                assert got == pytest.approx(want, rel=1e-4), (world_size, got, want)
