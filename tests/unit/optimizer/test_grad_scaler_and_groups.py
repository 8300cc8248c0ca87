"""Loss scalers, param groups and Range (single process, no collectives)."""
import torch

from megatron_smp.config import OptimizerConfig
from megatron_smp.optimizer import (
    ConstantGradScaler,
    DistributedOptimizer,
    DynamicGradScaler,
    Range,
    get_param_groups,
)
from tests.unit.distributed.toy_training import ToyModel


def test_dynamic_scaler_hysteresis_backoff_growth_and_floor():
    scaler = DynamicGradScaler(initial_scale=2.0**10, min_scale=2.0**8, growth_interval=3, hysteresis=2)
    scaler.update(True)
    assert scaler.scale.item() == 2.0**10  # first overflow absorbed by hysteresis
    scaler.update(True)
    assert scaler.scale.item() == 2.0**9
    scaler.update(True)  # hysteresis is only refilled on growth: halves again at once
    assert scaler.scale.item() == 2.0**8
    scaler.update(True)
    assert scaler.scale.item() == 2.0**8  # min-loss-scale
    for _ in range(3):
        scaler.update(False)
    assert scaler.scale.item() == 2.0**9  # window of clean steps doubles it
    scaler.update(True)
    assert scaler.scale.item() == 2.0**9  # hysteresis refilled by the growth
    assert scaler.inv_scale.item() == 2.0**-9

    restored = DynamicGradScaler(initial_scale=1.0, growth_interval=3, hysteresis=2)
    restored.load_state_dict(scaler.state_dict())
    scaler.update(True)
    restored.update(True)
    assert restored.scale.item() == scaler.scale.item() == 2.0**8


def test_constant_scaler_never_changes():
    scaler = ConstantGradScaler(128.0)
    scaler.update(True)
    scaler.update(False)
    assert scaler.scale.item() == 128.0


def test_param_groups_no_weight_decay_for_biases_and_norms():
    model = ToyModel()
    groups = get_param_groups([model], OptimizerConfig(weight_decay=0.1, lr=3e-4))
    names = {p: n for n, p in model.named_parameters()}
    decay, no_decay = groups
    assert sorted(names[p] for p in decay["params"]) == [
        "embed.weight", "fc1.weight", "fc2.weight", "head.weight",
    ]
    assert all(names[p].endswith("bias") or "norm" in names[p] for p in no_decay["params"])
    assert (decay["wd_mult"], decay["weight_decay"]) == (1.0, 0.1)
    assert (no_decay["wd_mult"], no_decay["weight_decay"]) == (0.0, 0.0)
    assert decay["lr"] == no_decay["lr"] == 3e-4


def test_param_range_map_pieces():
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (5, 3, 4)]
    # Buffer offsets of a 12-element bucket split over 3 ranks: [0,4) [4,8) [8,12).
    index_map = {params[0]: (0, 5, 0), params[1]: (5, 8, 0), params[2]: (8, 12, 0)}
    ranges = DistributedOptimizer.build_model_gbuf_param_range_map(index_map, Range(4, 8), 0)
    assert set(ranges) == {params[0], params[1]}
    assert ranges[params[0]] == {
        "gbuf_world": Range(4, 5), "gbuf_local": Range(0, 1), "param": Range(4, 5)
    }
    assert ranges[params[1]] == {
        "gbuf_world": Range(5, 8), "gbuf_local": Range(1, 4), "param": Range(0, 3)
    }
    assert Range(3, 7).normalize(10) == Range(10, 14) and len(Range(3, 7)) == 4
