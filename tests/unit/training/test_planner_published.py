"""The step-time planner against published runs (tests/fixtures/published_runs): with one set
of GPU efficiency constants, every Megatron-LM run (its README's 2024 H100 table and the 2021
A100 table of Narayanan et al.) and every torchtitan Llama 3.1 8B run (eager and
torch.compile, 8 and 128 of its 500 W HBM2e H100s) is predicted within 15% of the tokens/s per
GPU it reports, and torch.compile predicted faster than eager, as published."""
import json
import os

import pytest

from tools.bench.planner_published import FIXTURE, evaluate


@pytest.fixture(scope="module")
def rows():
    return evaluate()


def test_fixture_rows_are_the_sources(rows):
    """Every row names its source; the derived tokens/s follow from the published TFLOP/s with
    the source's own FLOP formula."""
    from megatron_smp.config import TransformerConfig
    from megatron_smp.training.planner import model_flops

    with open(FIXTURE) as f:
        fixture = json.load(f)
    assert {row["source"] for row in fixture["rows"]} == set(fixture["sources"])
    for row in fixture["rows"]:
        published = row["published"]
        if "tflops_per_gpu" not in published:
            assert row["tokens_per_s_per_gpu"] == published["tokens_per_s_per_gpu"]
            continue
        flags = dict(zip(row["flags"][::2], row["flags"][1::2]))
        seq = int(flags["--seq-length"])
        config = TransformerConfig(
            num_layers=int(flags["--num-layers"]), hidden_size=int(flags["--hidden-size"]),
            num_attention_heads=int(flags["--num-attention-heads"]),
            vocab_size=int(flags["--vocab-size"]), max_position_embeddings=seq,
            ffn_hidden_size=4 * int(flags["--hidden-size"]))
        per_token = model_flops(config, seq, 1, row["options"]["attention_flops"],
                                row["options"].get("count_recompute_flops", False)) / seq
        assert row["tokens_per_s_per_gpu"] == pytest.approx(
            published["tflops_per_gpu"] * 1e12 / per_token, abs=0.06)
    assert len(rows) == len(fixture["rows"]) == 23


def test_published_runs_within_15_percent(rows):
    ratios = {(r["source"], r["name"]): r["ratio"] for r in rows}
    assert len([key for key in ratios if key[0].startswith("torchtitan")]) == 4
    outside = {key: round(ratio, 3) for key, ratio in ratios.items()
               if not 0.85 <= ratio <= 1.15}
    assert not outside, outside
    predicted = {r["name"]: r["predicted"] for r in rows}
    for gpus in ("", ", 128 GPUs"):
        assert (predicted[f"Llama 3.1 8B FSDP + torch.compile{gpus}"]
                > predicted[f"Llama 3.1 8B FSDP{gpus}"])
