"""SMP v1 config keys: each maps to its v2 key / our setting with one log line, or is a
ConfigError naming what replaces it. The configs are the seeds' v1 examples."""
import json
import logging

import pytest

import megatron_smp.smp as tsm
from megatron_smp.config import ConfigError
from tests.unit.training.test_arguments import BASE, parse

# The optimizer-state-sharding document's v1 options (estimator wrapper included) and the
# pipeline / general document's.
SHARDING_V1 = {"enabled": True, "parameters": {
    "microbatches": 4, "pipeline_parallel_degree": 2, "placement_strategy": "cluster",
    "tensor_parallel_degree": 2, "ddp": True, "shard_optimizer_state": True}}
PIPELINE_V1 = {"microbatches": 4, "placement_strategy": "spread", "pipeline": "simple",
               "optimize": "speed", "partitions": 2, "ddp": True}


def _logged(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "megatron_smp.smp"]


def test_seed_v1_configs_map_onto_the_training_scripts(monkeypatch, caplog):
    caplog.set_level(logging.WARNING, logger="megatron_smp.smp")
    monkeypatch.setenv("WORLD_SIZE", "4")  # tp 2 x pp 2: one replica, "cluster" is our layout
    configs = parse(BASE + ["--smp-config", json.dumps(SHARDING_V1)])
    assert configs.parallel.tensor_model_parallel_size == 2
    assert configs.parallel.pipeline_model_parallel_size == 2
    assert configs.optimizer.use_distributed_optimizer
    assert configs.training.global_batch_size == 2 * 1 * 4  # micro 2 x dp 1 x microbatches 4
    logged = _logged(caplog)
    for key in ("parameters", "microbatches=4", "ddp=True", "placement_strategy='cluster'"):
        assert sum(key in line for line in logged) == 1, (key, logged)

    caplog.clear()
    configs = parse(BASE + ["--smp-config", json.dumps(PIPELINE_V1)])  # dp 2 x pp 2
    assert configs.parallel.pipeline_model_parallel_size == 2
    assert configs.training.pipeline_schedule == "simple"
    assert configs.training.global_batch_size == 2 * 2 * 4
    assert not configs.model.sequence_parallel
    logged = _logged(caplog)
    for key in ("partitions=2", "pipeline='simple'", "optimize='speed'", "microbatches=4",
                "ddp=True", "placement_strategy='spread'"):
        assert sum(key in line for line in logged) == 1, (key, logged)


def test_v1_keys_that_cannot_work_are_errors(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")  # dp 2 x pp 2 x tp 2: "cluster" (DPT) is not ours
    with pytest.raises(ConfigError, match="placement_strategy 'cluster'.*PDT"):
        parse(BASE + ["--smp-config", json.dumps(SHARDING_V1)])
    config = dict(SHARDING_V1["parameters"], placement_strategy="PDT")
    assert parse(BASE + ["--smp-config", json.dumps(config)]).training.global_batch_size == 16
    with pytest.raises(ConfigError, match="ddp false.*2 data-parallel replicas"):
        parse(BASE + ["--smp-config", json.dumps(dict(config, ddp=False))])
    with pytest.raises(ConfigError, match="partitions.*pipeline_parallel_degree.*disagree"):
        parse(BASE + ["--smp-config", '{"partitions": 2, "pipeline_parallel_degree": 4}'])
    with pytest.raises(ConfigError, match="microbatches 4 means --global-batch-size 16"):
        parse(BASE + ["--smp-config", json.dumps(config), "--global-batch-size", "8"])
    for key, replacement in (("auto_partition", "split the layers evenly"),
                             ("offload_activations", "sm_activation_offloading"),
                             ("sharded_data_parallel_degree", "hybrid_shard_degree"),
                             ("fp16", "dtype")):
        with pytest.raises(ConfigError, match=f"v1 key '{key}'.*{replacement}"):
            parse(BASE + ["--smp-config", json.dumps({key: True})])
    for bad in ({"pipeline": "fancy"}, {"optimize": "fast"}, {"placement_strategy": "DDT"},
                {"microbatches": 0}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            parse(BASE + ["--smp-config", json.dumps(bad)])


def test_v1_keys_in_init_and_transform(caplog):
    from tests.unit.models.test_hf_adapters import build_hf

    caplog.set_level(logging.WARNING, logger="megatron_smp.smp")
    tsm.init({"partitions": 1, "ddp": True, "optimize": "memory", "placement_strategy": "cluster"})
    assert tsm.state.pipeline_parallel_degree == 1
    assert len(_logged(caplog)) == 4
    # optimize: memory -> sequence parallelism, which only exists at TP > 1.
    assert not tsm.transform(build_hf("llama")).transformer_config.sequence_parallel
    with pytest.raises(ConfigError, match=r"\['microbatches', 'pipeline'\].*--smp-config"):
        tsm.init({"microbatches": 2, "pipeline": "interleaved"})
    with pytest.raises(ConfigError, match="enabled: false"):
        tsm.init({"enabled": False, "parameters": {}})
