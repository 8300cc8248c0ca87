"""Pipeline schedules on a toy stage model against the single-process run.

One multi-process run per pipeline size does all the work (process start-up dominates on
this machine); the tests then assert on its results.
"""
import collections
import itertools
import json

import pytest
import torch

from megatron_smp.testing import run_distributed
from tests.unit.pipeline_parallel.toy import (
    HIDDEN, MICRO_BATCH, SEQ, ToyStage, forward_step, microbatches, named_grads, reference,
)

NUM_LAYERS = 8
# schedule -> virtual stages per rank
SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2}


class _LiveActivations:
    """Counts microbatches whose saved activations are alive (autograd saved-tensor hooks):
    a microbatch stays live from its forward until its backward frees the graph."""

    def __init__(self):
        self.live = collections.Counter()
        self.peak = 0
        self.tag = None

    def pack(self, tensor):
        return _Saved(self, tensor, self.tag)

    def forward_step(self, counter):
        def step(data_iterator, model):
            self.tag = next(counter)
            return forward_step(data_iterator, model)
        return step


class _Saved:
    def __init__(self, tracker, tensor, tag):
        self.tracker, self.tensor, self.tag = tracker, tensor, tag
        tracker.live[tag] += 1
        tracker.peak = max(tracker.peak, len(+tracker.live))

    def __del__(self):
        self.tracker.live[self.tag] -= 1


def _run_schedule(state, name, num_microbatches, timeline=None, forward_only=False,
                  group_size=None):
    from megatron_smp.distributed import allreduce_embedding_grads
    from megatron_smp.pipeline_parallel.schedules import ScheduleHooks, get_forward_backward_func
    from megatron_smp.pipeline_parallel.stages import pipeline_layer_layout

    virtual = SCHEDULES[name]
    layout = pipeline_layer_layout(NUM_LAYERS, state.pp_size, virtual_size=virtual)
    chunks = []
    for index, (offset, count) in enumerate(layout[state.pp_rank]):
        chunks.append(ToyStage(
            NUM_LAYERS, pre_process=state.is_pipeline_first_stage and index == 0,
            post_process=state.is_pipeline_last_stage and index == virtual - 1,
            layer_offset=offset, num_layers=count, pipeline_size=state.pp_size))
    tracker = _LiveActivations()
    func = get_forward_backward_func(state.pp_size, name)
    extra = {} if group_size is None else {"microbatch_group_size_per_vp_stage": group_size}
    hooks = ScheduleHooks(finalize_model_grads_func=lambda c: allreduce_embedding_grads(c, state))
    with torch.autograd.graph.saved_tensors_hooks(tracker.pack, lambda saved: saved.tensor):
        reports = func(
            forward_step_func=tracker.forward_step(itertools.count()),
            data_iterator=iter(microbatches(num_microbatches)), model=chunks,
            num_microbatches=num_microbatches, hooks=hooks, state=state,
            forward_only=forward_only,
            tensor_shape=(SEQ, MICRO_BATCH, HIDDEN), dtype=torch.float32, timeline=timeline,
            **extra)
    grads = {}
    for chunk, (offset, _) in zip(chunks, layout[state.pp_rank] if not forward_only else []):
        # numpy: torch tensors would cross the result queue as shared memory of a dead child
        grads.update({k: v.numpy() for k, v in named_grads(chunk, offset).items()})
    losses = [float(r["loss"]) for r in reports]
    return {"losses": losses, "grads": grads, "peak_live": tracker.peak}


def _body(rank, world_size, num_microbatches, trace_path):
    from megatron_smp.config import ConfigError, ParallelConfig
    from megatron_smp.parallel_state import build_parallel_state
    from megatron_smp.pipeline_parallel.timeline import PipelineTimeline

    state = build_parallel_state(ParallelConfig(pipeline_model_parallel_size=world_size))
    results = {}
    for name in SCHEDULES:
        timeline = PipelineTimeline(trace_path, rank) if name == "1f1b" and trace_path else None
        results[name] = _run_schedule(state, name, num_microbatches, timeline)
        results[f"{name}_eval"] = _run_schedule(state, name, num_microbatches, forward_only=True)
    # Edge counts: interleaved_1f1b with m == pp is all warm-up on rank 0 only; 1f1b and
    # gpipe take any m; with groups of pp + 1, interleaved_1f1b takes m = 2 pp + 1 (a last
    # group of pp).
    results["interleaved_1f1b_m_eq_pp"] = _run_schedule(state, "interleaved_1f1b", world_size)
    results["1f1b_odd_m"] = _run_schedule(state, "1f1b", world_size + 1)
    results["gpipe_odd_m"] = _run_schedule(state, "gpipe", world_size + 1)
    results["interleaved_1f1b_groups"] = _run_schedule(
        state, "interleaved_1f1b", 2 * world_size + 1, group_size=world_size + 1)
    try:  # a microbatch count the virtual schedule cannot take: fails here, on every rank
        _run_schedule(state, "interleaved_1f1b", num_microbatches + 1)
    except ConfigError as error:
        results["interleaved_1f1b_error"] = str(error)
    return results


_RESULTS = {}


def results_for(pp, tmp_path_factory):
    if pp not in _RESULTS:
        trace = str(tmp_path_factory.mktemp("trace") / "trace.json")
        num_microbatches = 2 * pp  # a multiple of pp, more than pp: every schedule phase runs
        _RESULTS[pp] = (run_distributed(_body, pp, args=(num_microbatches, trace), timeout=240),
                        num_microbatches, trace)
    return _RESULTS[pp]


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("pp", [2, 4])
def test_schedule_matches_single_process(pp, name, tmp_path_factory):
    results, num_microbatches, _ = results_for(pp, tmp_path_factory)
    ref_losses, ref_grads = reference(NUM_LAYERS, num_microbatches)
    last = results[-1][name]
    assert last["losses"] == pytest.approx(ref_losses, rel=1e-5)
    for rank in range(pp - 1):
        assert results[rank][name]["losses"] == []  # losses live on the last stage
    seen = set()
    for rank, rank_results in enumerate(results):
        for key, grad in rank_results[name]["grads"].items():
            # Both copies of the tied embedding hold the full grad after the all-reduce.
            expected = ref_grads["embed" if key == "output" else key]
            torch.testing.assert_close(torch.from_numpy(grad), expected, rtol=1e-5, atol=1e-6,
                                       msg=f"{key} {rank}")
            seen.add(key)
    assert seen >= set(ref_grads) | {"output"}  # every layer was somewhere


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("pp", [2, 4])
def test_forward_only_gives_the_losses_and_keeps_nothing(pp, name, tmp_path_factory):
    results, num_microbatches, _ = results_for(pp, tmp_path_factory)
    ref_losses, _ = reference(NUM_LAYERS, num_microbatches)
    assert results[-1][f"{name}_eval"]["losses"] == pytest.approx(ref_losses, rel=1e-5)
    for rank_results in results:
        assert rank_results[f"{name}_eval"]["peak_live"] == 0  # no graph under no_grad


EDGE_CASES = {  # case -> microbatches at pp
    "interleaved_1f1b_m_eq_pp": lambda pp: pp,
    "1f1b_odd_m": lambda pp: pp + 1,
    "gpipe_odd_m": lambda pp: pp + 1,
    "interleaved_1f1b_groups": lambda pp: 2 * pp + 1,
}


@pytest.mark.parametrize("case", sorted(EDGE_CASES))
@pytest.mark.parametrize("pp", [2, 4])
def test_edge_microbatch_counts(pp, case, tmp_path_factory):
    results, _, _ = results_for(pp, tmp_path_factory)
    num_microbatches = EDGE_CASES[case](pp)
    ref_losses, ref_grads = reference(NUM_LAYERS, num_microbatches)
    assert results[-1][case]["losses"] == pytest.approx(ref_losses, rel=1e-5)
    for rank_results in results:
        for key, grad in rank_results[case]["grads"].items():
            expected = ref_grads["embed" if key == "output" else key]
            torch.testing.assert_close(torch.from_numpy(grad), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("pp", [2, 4])
def test_1f1b_bounds_live_activations_and_gpipe_does_not(pp, tmp_path_factory):
    results, num_microbatches, _ = results_for(pp, tmp_path_factory)
    for rank, rank_results in enumerate(results):
        # Stage r warms up with pp - r - 1 forwards: at most pp - r microbatches live.
        assert rank_results["1f1b"]["peak_live"] == pp - rank
        assert rank_results["gpipe"]["peak_live"] == num_microbatches


@pytest.mark.parametrize("pp", [2, 4])
def test_interleaved_live_activations_follow_megatrons_warmup(pp, tmp_path_factory):
    from megatron_smp.pipeline_parallel.schedules import interleaved_num_warmup

    results, num_microbatches, _ = results_for(pp, tmp_path_factory)
    virtual = SCHEDULES["interleaved_1f1b"]
    cases = [("interleaved_1f1b", num_microbatches, None),
             ("interleaved_1f1b_m_eq_pp", pp, None),
             ("interleaved_1f1b_groups", 2 * pp + 1, pp + 1)]
    for name, count, group in cases:
        total = count * virtual
        for rank, rank_results in enumerate(results):
            # A (microbatch, chunk) forward is live until its backward: the warm-up plus the
            # steady state's forward before its backward, or everything if all is warm-up.
            warmup = interleaved_num_warmup(count, pp, rank, virtual, group)
            assert rank_results[name]["peak_live"] == min(warmup + 1, total), (name, rank)


@pytest.mark.parametrize("pp", [2, 4])
def test_virtual_microbatch_count_is_a_config_error_on_every_rank(pp, tmp_path_factory):
    results, num_microbatches, _ = results_for(pp, tmp_path_factory)
    for rank_results in results:
        message = rank_results["interleaved_1f1b_error"]
        assert f"microbatches ({num_microbatches + 1}" in message
        assert f"--pipeline-model-parallel-size ({pp})" in message


def test_timeline_is_a_chrome_trace_with_every_span(tmp_path_factory):
    from megatron_smp.pipeline_parallel.timeline import bubble_fraction, per_rank_path

    results, num_microbatches, trace = results_for(2, tmp_path_factory)
    traces = []
    for rank in range(2):
        with open(per_rank_path(trace, rank)) as handle:
            events = json.load(handle)["traceEvents"]
        traces.append(events)
        names = [e["name"] for e in events if e.get("cat") == "compute"]
        assert sorted(names) == sorted(
            [f"F{i}" for i in range(num_microbatches)] + [f"B{i}" for i in range(num_microbatches)]
        )
        assert any(e.get("cat") == "comm" for e in events)
        in_flight = [e["args"]["microbatches in flight"] for e in events if e["ph"] == "C"]
        assert max(in_flight) == 2 - rank
    assert 0.0 < bubble_fraction(traces, step=0) < 1.0


def test_p2p_frees_sent_outputs_and_backward_still_works():
    from megatron_smp.pipeline_parallel.p2p import backward_output_tensor, deallocate_output_tensor

    weight = torch.randn(3, 3, requires_grad=True)
    hidden = torch.randn(4, 3)
    output = hidden @ weight + 1.0
    grad = torch.randn(4, 3)
    deallocate_output_tensor(output)
    assert output.numel() == 1
    backward_output_tensor(output, grad)
    torch.testing.assert_close(weight.grad, hidden.t() @ grad)
