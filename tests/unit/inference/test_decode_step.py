"""The fixed-shape decode step (`inference.decode_step`): compiled with torch.compile, the
engine's greedy tokens equal its eager ones over a batch whose size changes as requests
finish (padded to the buckets); the buckets; what it refuses, naming the flag."""
import pytest
import torch
from torch._dynamo.utils import counters

import megatron_smp as smp
from megatron_smp.config import ConfigError
from megatron_smp.inference import InferenceEngine, SamplingParams
from megatron_smp.inference.decode_step import decode_batch_sizes
from tests.unit.inference.common import build


def _module(family):
    smp.init({"random_seed": 3})
    hf = build(family)
    return hf, smp.transform(hf).module


def test_decode_batch_sizes():
    assert decode_batch_sizes(24, 16) == [1, 3, 6, 12, 24]
    assert decode_batch_sizes(24, 2) == [12, 24]
    assert decode_batch_sizes(24, 4, "linear") == [6, 12, 18, 24]
    assert decode_batch_sizes(5, -1, "linear") == [1, 2, 3, 4, 5]
    with pytest.raises(ConfigError, match="--inference-dynamic-batching-num-cuda-graphs 0"):
        decode_batch_sizes(8, 0)


def test_compiled_decode_step_gives_the_eager_tokens():
    hf, module = _module("llama")
    generator = torch.Generator().manual_seed(5)
    lengths, news = [5, 9, 3], [6, 2, 4]
    prompts = [torch.randint(0, hf.config.vocab_size, (n,), generator=generator).tolist()
               for n in lengths]
    params = [SamplingParams(max_new_tokens=n) for n in news]
    eager = InferenceEngine(module, max_tokens=64, block_size=16, max_requests=3)
    expected = [r.output for r in eager.generate(prompts, params)]
    # One bucket (one compile): batch sizes 3, 2, 1 padded to 3; keys to 16 positions.
    counters.clear()
    engine = InferenceEngine(module, max_tokens=64, block_size=16, max_requests=3,
                             decode_step="compile", num_decode_graphs=1)
    assert engine.decode_runner.batch_sizes == [3]
    assert [r.output for r in engine.generate(prompts, params)] == expected
    assert engine.decode_runner.steps == max(news) - 1
    # one graph, no breaks (a break would run the step's pieces eagerly between graphs)
    assert not counters["graph_break"] and counters["stats"]["unique_graphs"] == 1


def test_decode_step_refusals():
    _, mistral = _module("mistral")
    with pytest.raises(ConfigError, match="--inference-torch-compile: .*full attention"):
        InferenceEngine(mistral, max_tokens=64, block_size=4, decode_step="compile")


def test_decode_step_flags():
    """The tools' flags (tools/generate.py, the server, train_rl.py's rollouts) reach the
    engine's runner; contradictions and CUDA graphs off CUDA are errors naming the flag."""
    from megatron_smp.inference.decode_step import decode_step_options
    from megatron_smp.training.arguments.modes import add_inference_args
    from megatron_smp.training.arguments import parse_args

    model = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
             "--max-position-embeddings", "32", "--tokenizer-type", "NullTokenizer",
             "--vocab-size", "99", "--seq-length", "8"]
    defaults = {"micro_batch_size": 1, "train_iters": 1, "mock_data": True}

    def inference(*flags):
        config = parse_args(model + list(flags), add_inference_args, defaults).inference
        config.validate()  # (validate_configs calls it)
        return config

    assert inference().decode_step is None
    compiled = inference("--inference-torch-compile", "--inference-max-requests", "8",
                         "--inference-dynamic-batching-num-cuda-graphs", "4",
                         "--inference-dynamic-batching-cuda-graph-sizing-distribution", "linear")
    graphs = inference("--cuda-graph-impl", "local", "--cuda-graph-warmup-steps", "2")
    assert (graphs.decode_step, graphs.cuda_graph_warmup_steps) == ("cuda_graph", 2)
    _, module = _module("llama")
    engine = InferenceEngine(module, max_tokens=64, block_size=4, max_requests=8,
                             **decode_step_options(compiled))
    assert engine.decode_runner.mode == "compile"
    assert engine.decode_runner.batch_sizes == [2, 4, 6, 8]
    with pytest.raises(ConfigError, match="--cuda-graph-impl local .*CUDA device"):
        InferenceEngine(module, max_tokens=64, block_size=4, **decode_step_options(graphs))
    for flags, match in (
            (["--cuda-graph-impl", "local", "--inference-torch-compile"], "give one"),
            (["--cuda-graph-impl", "transformer_engine"], "--cuda-graph-impl transformer_engine"),
            (["--inference-dynamic-batching-num-cuda-graphs", "0"], "num-cuda-graphs"),
            (["--cuda-graph-warmup-steps", "-1"], "--cuda-graph-warmup-steps")):
        with pytest.raises(ConfigError, match=match):
            inference(*flags)
    with pytest.raises(ConfigError, match="--cuda-graph-impl local captures CUDA graphs of "
                                          "training steps"):
        parse_args(model + ["--cuda-graph-impl", "local"], None, defaults)
