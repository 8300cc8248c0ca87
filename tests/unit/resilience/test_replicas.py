"""--fault-tolerance's flags: every bad combination is a ConfigError naming the flag."""
import pytest

from megatron_smp.config import ConfigError, ResilienceConfig

LIGHTHOUSE = {"fault_tolerance_lighthouse": "http://127.0.0.1:29510"}


@pytest.mark.parametrize("kwargs, message", [
    ({"fault_tolerance_group_size": 2}, "--fault-tolerance-group-size applies to replica "
     "groups: add --fault-tolerance"),
    ({"fault_tolerance": True, **LIGHTHOUSE}, "--fault-tolerance-group-size N"),
    ({"fault_tolerance": True, "fault_tolerance_group_size": 2,
      "fault_tolerance_replica_id": 2, **LIGHTHOUSE}, r"--fault-tolerance-replica-id must be "
     r"in \[0, 1\]"),
    ({"fault_tolerance": True, "fault_tolerance_group_size": 2,
      "fault_tolerance_min_replica_size": 3, **LIGHTHOUSE},
     "--fault-tolerance-min-replica-size"),
    ({"fault_tolerance": True, "fault_tolerance_group_size": 2,
      "fault_tolerance_process_group_timeout_ms": 0, **LIGHTHOUSE},
     "--fault-tolerance-process-group-timeout-ms"),
    ({"fault_tolerance": True, "fault_tolerance_group_size": 2},
     "--fault-tolerance-lighthouse http://HOST:PORT or the TORCHFT_LIGHTHOUSE"),
])
def test_bad_fault_tolerance_flags_name_themselves(kwargs, message, monkeypatch):
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    with pytest.raises(ConfigError, match=message):
        ResilienceConfig(**kwargs).validate(save=None, world_size=1)


def test_lighthouse_from_the_environment(monkeypatch):
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://127.0.0.1:1")
    config = ResilienceConfig(fault_tolerance=True, fault_tolerance_group_size=2)
    config.validate(save=None, world_size=1)
    assert config.lighthouse() == "http://127.0.0.1:1"


def test_fault_tolerance_refuses_fsdp2():
    from megatron_smp.training.arguments import parse_args, validate_configs

    argv = ("--num-layers 1 --hidden-size 8 --num-attention-heads 2 --seq-length 8 "
            "--max-position-embeddings 8 --micro-batch-size 1 --train-iters 1 --mock-data "
            "--tokenizer-type NullTokenizer --vocab-size 64 --use-torch-fsdp2 "
            "--fault-tolerance --fault-tolerance-group-size 2 "
            "--fault-tolerance-lighthouse http://127.0.0.1:1").split()
    with pytest.raises(ConfigError, match="--fault-tolerance does not apply to "
                       "--use-torch-fsdp2"):
        validate_configs(parse_args(argv), world_size=1)
