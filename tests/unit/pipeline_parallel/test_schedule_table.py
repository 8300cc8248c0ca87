"""The schedules' names and the interleaved schedule's order, without processes."""
import itertools

import pytest

from megatron_smp.config import ConfigError
from megatron_smp.pipeline_parallel.schedules import (
    forward_backward_no_pipelining,
    forward_backward_pipelining_gpipe,
    forward_backward_pipelining_with_interleaving,
    forward_backward_pipelining_without_interleaving,
    get_forward_backward_func,
    get_schedule_table,
    interleaved_num_warmup,
    schedule_name,
    schedule_step,
)

# (m, pp, v, group) -> the table written out by hand
EXPECTED_TABLES = {
    (4, 2, 2, None): [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0), (2, 1), (3, 1)],
    (2, 2, 2, None): [(0, 0), (1, 0), (0, 1), (1, 1)],
    (4, 4, 3, None): [(0, 0), (1, 0), (2, 0), (3, 0), (0, 1), (1, 1), (2, 1), (3, 1),
                      (0, 2), (1, 2), (2, 2), (3, 2)],
    (6, 2, 3, None): [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2),
                      (2, 0), (3, 0), (2, 1), (3, 1), (2, 2), (3, 2),
                      (4, 0), (5, 0), (4, 1), (5, 1), (4, 2), (5, 2)],
    # Megatron's own example (PP2, groups of 3, M5, VP2): a last group of 2.
    (5, 2, 2, 3): [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1), (3, 0), (4, 0), (3, 1),
                   (4, 1)],
    (4, 2, 2, 4): [(0, 0), (1, 0), (2, 0), (3, 0), (0, 1), (1, 1), (2, 1), (3, 1)],
}


@pytest.mark.parametrize("key", list(EXPECTED_TABLES))
def test_schedule_table_matches_the_hand_written_order(key):
    m, pp, v, group = key
    assert get_schedule_table(m, pp, v, group) == EXPECTED_TABLES[key]


def test_backward_walks_the_table_with_chunks_reversed():
    table = get_schedule_table(4, 2, 2)
    forwards = [schedule_step(table, k, 2) for k in range(len(table))]
    backwards = [schedule_step(table, k, 2, forward=False) for k in range(len(table))]
    assert forwards == EXPECTED_TABLES[(4, 2, 2, None)]
    assert backwards == [(0, 1), (1, 1), (0, 0), (1, 0), (2, 1), (3, 1), (2, 0), (3, 0)]


LAYOUTS = [(m, pp, v, None) for m, pp, v in itertools.product([4, 8, 12], [2, 4], [2, 3])
           if m % pp == 0] + [(5, 2, 2, 3), (7, 3, 2, 4), (9, 4, 3, 5), (8, 2, 2, 8)]


@pytest.mark.parametrize("m, pp, v, group", LAYOUTS)
def test_every_step_once_and_in_dependency_order(m, pp, v, group):
    table = get_schedule_table(m, pp, v, group)
    assert sorted(table) == sorted(itertools.product(range(m), range(v)))  # each exactly once
    for direction in (True, False):
        steps = [schedule_step(table, k, v, forward=direction) for k in range(len(table))]
        for chunk in range(v):  # a chunk takes microbatches in order (its FIFOs rely on it)
            assert [mb for mb, c in steps if c == chunk] == list(range(m))
        for microbatch in range(m):  # forward visits the chunks up, backward down
            chunks = [c for mb, c in steps if mb == microbatch]
            assert chunks == (list(range(v)) if direction else list(range(v - 1, -1, -1)))


def test_megatron_warmup_counts():
    # (pp - r - 1) * 2 + (v - 1) * group, at most v * m
    assert [interleaved_num_warmup(8, 4, r, 2) for r in range(4)] == [10, 8, 6, 4]
    assert [interleaved_num_warmup(2, 2, r, 2) for r in range(2)] == [4, 2]
    assert [interleaved_num_warmup(5, 2, r, 2, 3) for r in range(2)] == [5, 3]
    assert [interleaved_num_warmup(4, 4, r, 3) for r in range(4)] == [12, 12, 10, 8]


@pytest.mark.parametrize("m, pp, v, group, message", [
    (5, 2, 2, None, "microbatches (5 = --global-batch-size"),
    (1, 2, 2, None, "--pipeline-model-parallel-size (2)"),
    (6, 4, 2, 2, "must lie between --pipeline-model-parallel-size (4)"),
    (4, 2, 2, 5, "and the number of microbatches (4)"),
    (6, 3, 2, 4, "last group holds 2 microbatches"),
])
def test_counts_the_schedule_cannot_run_are_config_errors(m, pp, v, group, message):
    with pytest.raises(ConfigError) as info:
        get_schedule_table(m, pp, v, group)
    assert message in str(info.value)


@pytest.mark.parametrize("name, virtual, expected", [
    ("simple", 1, "gpipe"),
    ("interleaved", 1, "1f1b"),
    ("interleaved", 2, "interleaved_1f1b"),
    ("gpipe", 1, "gpipe"),
    ("1f1b", 1, "1f1b"),
    ("interleaved_1f1b", 4, "interleaved_1f1b"),
])
def test_schedule_name_maps_smp_names_onto_the_internal_ones(name, virtual, expected):
    assert schedule_name(name, virtual) == expected


@pytest.mark.parametrize("name, virtual, message", [
    ("simple", 2, "--pipeline-schedule gpipe does not take virtual stages"),
    ("1f1b", 3, "--pipeline-schedule 1f1b does not take virtual stages"),
    ("interleaved_1f1b", 1, "interleaved_1f1b needs virtual stages"),
    ("pipedream", 1, "simple, interleaved, gpipe, 1f1b, interleaved_1f1b, got 'pipedream'"),
])
def test_schedule_name_errors_name_the_flag_and_what_works(name, virtual, message):
    with pytest.raises(ConfigError) as info:
        schedule_name(name, virtual)
    assert message in str(info.value)


def test_get_forward_backward_func_takes_the_internal_names():
    assert get_forward_backward_func(2, "gpipe") is forward_backward_pipelining_gpipe
    assert get_forward_backward_func(2, "1f1b") is forward_backward_pipelining_without_interleaving
    assert (get_forward_backward_func(4, "interleaved_1f1b")
            is forward_backward_pipelining_with_interleaving)
    for name in ("gpipe", "1f1b", "interleaved_1f1b"):  # one stage: no pipelining, any name
        assert get_forward_backward_func(1, name) is forward_backward_no_pipelining
    with pytest.raises(ConfigError) as info:
        get_forward_backward_func(2, "simple")  # SMP's names go through schedule_name
    assert "gpipe, 1f1b, interleaved_1f1b" in str(info.value)
