"""reset_peak_rss_kib (the peak-RSS baseline of tools/bench/bench_inference.py's memory runs):
the peak it measures is a known allocation's size, after that memory is freed, and a reset
really forgets an earlier peak."""
import os

import pytest
import torch

from megatron_smp.testing import proc_status_kib, reset_peak_rss_kib

pytestmark = pytest.mark.skipif(
    not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux /proc peak RSS reset"
)
MIB = 1024  # KiB


def test_peak_of_a_freed_100_mib_tensor_is_measured_and_reset_forgets_it():
    before = reset_peak_rss_kib()
    block = torch.ones(100 * 2**20 // 4)  # 100 MiB of fp32, every page written
    del block
    peak = proc_status_kib("VmHWM") - before
    assert 90 * MIB <= peak <= 110 * MIB, peak / MIB
    assert proc_status_kib("VmRSS") - before < 10 * MIB  # freed: the peak is what remains
    after = reset_peak_rss_kib()
    assert proc_status_kib("VmHWM") - after < 10 * MIB
