"""assert_follows_trajectory (the bf16 tolerances of the FSDP2 and context-parallel tests)
fails for a run that did not train and for a tolerance too loose to tell."""
import pytest

from megatron_smp.testing import assert_follows_trajectory

# The fp32 single-process GPT losses of test_fsdp (they move ~3% in 10 iterations).
REFERENCE = [6.9459, 6.9301, 6.9087, 6.8842, 6.8604, 6.8361, 6.8155, 6.7946, 6.7741, 6.7523]


def test_a_run_within_measured_error_passes():
    bf16 = [loss * (1 + 4e-5 * (-1) ** i) for i, loss in enumerate(REFERENCE)]
    assert assert_follows_trajectory(bf16, REFERENCE, 5e-4) == pytest.approx(4e-5, rel=1e-3)


def test_a_run_that_did_not_train_fails():
    untrained = [REFERENCE[0] + 0.002 * (-1) ** i for i in range(len(REFERENCE))]  # lr = 0
    with pytest.raises(AssertionError):
        assert_follows_trajectory(untrained, REFERENCE, 5e-4)


def test_a_tolerance_as_large_as_the_movement_is_refused():
    with pytest.raises(AssertionError, match="a run that does not train would pass"):
        assert_follows_trajectory(REFERENCE, REFERENCE, 1e-2)
