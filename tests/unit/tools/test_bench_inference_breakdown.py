"""bench_inference.py --breakdown: a profiled engine run's step time split over the engine's
ranges and the model's ops adds up to the steps' time, with the GEMMs, the attention and the
logits where they run."""
import os
import sys

import torch

import megatron_smp as smp
from megatron_smp.inference import InferenceEngine, SamplingParams
from tests.unit.inference.common import build

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "tools", "bench"))
import bench_inference  # noqa: E402


def test_step_breakdown_adds_up_to_the_steps():
    from torch.profiler import ProfilerActivity, profile

    smp.init({"random_seed": 3})
    module = smp.transform(build("llama")).module
    engine = InferenceEngine(module, max_tokens=128, block_size=4)
    prompts = [[1, 2, 3, 4, 5, 6], [7, 8, 9]]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.generate(prompts, [SamplingParams(max_new_tokens=4)] * 2)
    events = prof.events()
    totals = bench_inference.step_breakdown(events)
    steps = [e for e in events if e.name == "inference::step"]
    assert len(steps) == engine.steps + 1 == 5  # and the step that stops the engine
    whole = sum(e.cpu_time_total for e in steps)
    assert abs(sum(totals.values()) - whole) <= 1e-6 * whole + len(events) * 1e-3
    for category in ("GEMMs", "attention", "logits & sampling", "step plan", "model Python"):
        assert totals[category] > 0, category
    assert totals["MTP drafts"] == 0
    # every SDPA call counts as attention: at least their own time
    sdpa = sum(e.self_cpu_time_total for e in events if "scaled_dot_product" in e.name)
    assert totals["attention"] >= sdpa - 1e-6
