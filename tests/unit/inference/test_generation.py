"""KV-cache generation against Hugging Face's `generate`: greedy tokens equal for every family of
the zoo (left-padded prompts, RoPE scaling past the original context, windows, sinks, MLA
with absorbed up-projections, MoE routing one token at a time) through
`transform(...).generate`, at TP=1, TP=2, EP=2 and (through the engine on pipeline stages)
PP=2; prompt log-probs within 1e-4 of HF's; HF's keywords and GenerationConfig; cache bytes
per token to the byte."""
import re

import pytest
import torch

import megatron_smp as smp
from megatron_smp.config import ConfigError
from megatron_smp.inference import InferenceEngine, SamplingParams
from megatron_smp.testing import run_distributed
from tests.unit.inference.common import (
    FAMILIES, NEW, PROMPT, build, hf_greedy, hf_prompt_logprobs, prompts,
)
from tests.unit.models.common import to_numpy, to_torch


def _greedy(model, ids, mask, **kwargs):
    return model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                          pad_token_id=0, eos_token_id=None, **kwargs)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_and_prompt_logprobs_match_hf(family):
    smp.init({"random_seed": 3})
    hf = build(family)
    ids, mask = prompts(hf.config.vocab_size)
    expected = hf_greedy(hf, ids, mask, eos_token_id=None)
    model = smp.transform(hf)
    assert torch.equal(_greedy(model, ids, mask), expected)
    engine = InferenceEngine(model.module, max_tokens=64, block_size=4)
    prompt = ids[0].tolist()
    [request] = engine.generate([prompt], [SamplingParams(max_new_tokens=0,
                                                          prompt_logprobs=True)])
    assert request.prompt_logprobs[0] is None and request.output == []
    got = torch.tensor(request.prompt_logprobs[1:])
    assert (got - hf_prompt_logprobs(hf, prompt)).abs().max() < 1e-4


def test_hf_keywords_generation_config_and_eos():
    """eos stops a row and pads it with pad_token_id (HF's contract), GenerationConfig and
    max_length work as in HF; what the engine does not do is a clear error."""
    from transformers import GenerationConfig

    smp.init({"random_seed": 3})
    hf = build("llama31")
    ids, mask = prompts(hf.config.vocab_size)
    model = smp.transform(hf)
    free = hf_greedy(hf, ids, mask, eos_token_id=None)
    eos = int(free[0, PROMPT + 2])  # row 0 stops after 3 tokens
    config = GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=eos,
                              pad_token_id=7)
    with torch.no_grad():
        expected = hf.generate(ids, attention_mask=mask, generation_config=config)
    got = model.generate(ids, attention_mask=mask, generation_config=config)
    assert torch.equal(got, expected) and (got[0, PROMPT + 3:] == 7).all()
    with torch.no_grad():
        expected = hf.generate(ids, max_length=PROMPT + 4, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, max_length=PROMPT + 4, pad_token_id=0), expected)
    for kwargs, match in (({"num_beams": 2}, "num_beams"),
                          ({"repetition_penalty": 1.3}, "repetition_penalty"),
                          ({"frobnicate": 1}, "unknown"),
                          ({"num_return_sequences": 2}, "do_sample")):
        with pytest.raises(ConfigError, match=match):
            model.generate(ids, max_new_tokens=2, **kwargs)
    right = torch.ones_like(ids)
    right[0, -2:] = 0
    with pytest.raises(ConfigError, match="left padding"):
        model.generate(ids, attention_mask=right, max_new_tokens=2)


def test_sampling_is_seeded_and_follows_hf_warpers():
    """A seed gives the same tokens alone or in a batch; top_k=1 is greedy; the warpers equal
    HF's temperature / top-k / top-p processors."""
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper,
    )

    from megatron_smp.inference.sampling import warp_logits

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    for temperature, top_k, top_p in ((0.7, 5, 1.0), (1.3, 0, 0.8), (1.0, 10, 0.5)):
        expected = TemperatureLogitsWarper(temperature)(None, logits)
        if top_k:
            expected = TopKLogitsWarper(top_k)(None, expected)
        if top_p < 1.0:
            expected = TopPLogitsWarper(top_p)(None, expected)
        got = torch.stack([warp_logits(row, temperature, top_k, top_p) for row in logits])
        assert torch.equal(torch.isinf(got), torch.isinf(expected))
        assert torch.allclose(got[~torch.isinf(got)], expected[~torch.isinf(expected)])

    smp.init({"random_seed": 3})
    hf = build("qwen2")
    ids, _ = prompts(hf.config.vocab_size)
    module = smp.transform(hf).module
    prompt = ids[0].tolist()
    sampled = SamplingParams(max_new_tokens=8, temperature=1.5, top_p=0.9, seed=11)
    engine = InferenceEngine(module, max_tokens=256)
    alone = engine.generate([prompt], [sampled])[0].output
    batch = engine.generate([ids[1].tolist(), prompt, prompt],
                            [sampled.replace(seed=5), sampled, sampled.replace(seed=12)])
    assert batch[1].output == alone and batch[2].output != alone
    greedy = engine.generate([prompt], [SamplingParams(max_new_tokens=8)])[0].output
    top1 = engine.generate([prompt], [sampled.replace(top_k=1, top_p=1.0)])[0].output
    assert top1 == greedy


@pytest.mark.parametrize("family,per_layer", [("llama", 2 * 2 * 16 * 4),
                                              ("deepseek_v3", (12 + 4) * 4)])
def test_kv_cache_bytes_per_token(family, per_layer):
    """Standard attention: 2 (key, value) x kv heads x head dim x 4 bytes per layer; MLA: the
    latent (kv_lora_rank 12) and the rope key (4) only, not 2 x heads x head dims."""
    smp.init({"random_seed": 3})
    module = smp.transform(build(family)).module
    engine = InferenceEngine(module, max_tokens=100, block_size=16)
    layers = module.config.num_layers
    assert engine.max_tokens == 112  # whole blocks
    assert engine.bytes_per_token == layers * per_layer
    assert engine.cache.allocated_bytes() == 112 * layers * per_layer


def _stage(hf, state):
    """This rank's pipeline stage of `hf`, loaded with its layers' weights."""
    from megatron_smp.models.gpt import GPTModel
    from megatron_smp.models.hf import get_adapter
    from megatron_smp.models.sharding import shard_state_dict

    adapter = get_adapter(hf)
    config = adapter.config_from_hf(hf.config)
    full = adapter.from_hf(hf.state_dict(), config)
    per_stage = config.num_layers // state.pp_size
    offset = state.pp_rank * per_stage
    first, last = state.is_pipeline_first_stage, state.is_pipeline_last_stage
    model = GPTModel(config, state, pre_process=first, post_process=last, layer_offset=offset,
                     num_layers=per_stage)
    ours = {}
    for name, tensor in full.items():
        match = re.match(r"decoder\.layers\.(\d+)\.(.*)", name)
        if match:
            if offset <= int(match.group(1)) < offset + per_stage:
                ours[f"decoder.layers.{int(match.group(1)) - offset}.{match.group(2)}"] = tensor
        elif name.startswith("embedding.") and first:
            ours[name] = tensor
        elif name.startswith(("output_layer.", "decoder.final_layernorm.")) and last:
            ours[name] = tensor
    model.load_state_dict(shard_state_dict(ours, config, 1, 0), strict=True)
    return model


def _layouts(rank, world_size, cases):
    results = {}
    for layout, family in cases:
        degree = {"tensor": "tensor_parallel_degree", "expert": "expert_parallel_degree",
                  "pipeline": "pipeline_parallel_degree"}[layout]
        smp.init({degree: 2, "random_seed": 3})
        hf = build(family)
        ids, mask = prompts(hf.config.vocab_size)
        if layout == "pipeline":
            engine = InferenceEngine(_stage(hf, smp.state.parallel_state), max_tokens=128)
            rows = [row[keep.bool()].tolist() for row, keep in zip(ids, mask)]
            requests = engine.generate(rows, [SamplingParams(max_new_tokens=NEW,
                                                             prompt_logprobs=True)] * 3)
            results[(layout, family)] = ([r.output for r in requests],
                                         requests[0].prompt_logprobs[1:])
        else:
            results[(layout, family)] = _greedy(smp.transform(hf), ids, mask)
    return to_numpy(results)


# GQA + Llama 3 RoPE, MoE under sequence parallelism, windows + sinks, MLA (TP splits its
# heads, the latent cache is whole on each rank); sigmoid grouped routing + shared experts
# over EP; stages passing the hidden states.
CASES = [("tensor", "llama31"), ("tensor", "qwen3_moe"), ("tensor", "gpt_oss"),
         ("tensor", "deepseek_v3"), ("expert", "deepseek_v3"), ("pipeline", "llama31")]


def test_tp2_ep2_pp2_generation_matches_hf():
    """TP=2 (qwen3_moe with sequence parallelism: each step's tokens padded to whole shards),
    EP=2 (one token per request routed over the expert-parallel ranks) and PP=2 (stages
    pass each step's hidden states) give HF's greedy tokens on both ranks."""
    results = to_torch(run_distributed(_layouts, 2, args=(CASES,), timeout=300))
    for layout, family in CASES:
        hf = build(family)
        ids, mask = prompts(hf.config.vocab_size)
        expected = hf_greedy(hf, ids, mask, eos_token_id=None)
        for rank in (0, 1):
            got = results[rank][(layout, family)]
            if layout == "pipeline":
                outputs, prompt_logprobs = got
                assert outputs == expected[:, PROMPT:].tolist(), (layout, family, rank)
                reference = hf_prompt_logprobs(hf, ids[0].tolist())
                assert (torch.tensor(prompt_logprobs) - reference).abs().max() < 1e-4
            else:
                assert torch.equal(got, expected), (layout, family, rank)
