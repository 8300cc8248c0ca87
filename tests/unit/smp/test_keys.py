"""SMP v2 key checks made before anything collective."""
import pytest

from megatron_smp.config import ConfigError
from megatron_smp.smp import parse_smp_config


def test_context_parallel_degree_at_most_hybrid_shard_degree():
    for ok in ({"context_parallel_degree": 2, "hybrid_shard_degree": 2},
               {"context_parallel_degree": 2, "hybrid_shard_degree": 4},
               {"context_parallel_degree": 2}):  # 0: every dp x cp rank
        parse_smp_config(ok, 4)
    for bad in ({"context_parallel_degree": 2, "hybrid_shard_degree": 1},
                {"context_parallel_degree": 4, "hybrid_shard_degree": 2}):
        with pytest.raises(ConfigError, match="context_parallel_degree .* <= hybrid_shard_degree"):
            parse_smp_config(bad, 4)
