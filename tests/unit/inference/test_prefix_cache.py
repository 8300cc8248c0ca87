"""Prefix caching (--inference-dynamic-batching-prefix-caching): requests sharing a prompt
prefix give the same tokens as without it, while the model computes fewer prompt tokens
(counted) and running requests hold fewer cache bytes; `lru` keeps prefixes for later
requests and evicts the least recently used; models it cannot serve are a clear error.
Chunked prefill (--enable-chunked-prefill under --inference-dynamic-batching-max-tokens):
the same tokens (greedy and seeded sampling, windows and sinks too), no step over the budget,
and a running request keeps decoding while a long prompt is computed chunk by chunk."""
import pytest
import torch

import megatron_smp as smp
from megatron_smp.config import ConfigError
from megatron_smp.inference import InferenceEngine, SamplingParams
from megatron_smp.inference.kv_cache import blocks_for
from megatron_smp.inference.prefix_cache import PrefixCachingAllocator, block_hashes
from tests.unit.inference.common import build, hf_greedy

BLOCK = 4
PREFIX = 21  # 5 full blocks shared
SUFFIXES = (3, 1, 6, 2)
NEW = 6


@pytest.fixture(scope="module")
def llama():
    smp.init({"random_seed": 3})
    hf = build("llama")
    generator = torch.Generator().manual_seed(0)
    vocab = hf.config.vocab_size
    prefix = torch.randint(0, vocab, (PREFIX,), generator=generator).tolist()
    prompts = [prefix + torch.randint(0, vocab, (n,), generator=generator).tolist()
               for n in SUFFIXES]
    return hf, smp.transform(hf).module, prompts


def _params():
    return [SamplingParams(max_new_tokens=NEW) for _ in SUFFIXES]


def test_same_tokens_fewer_prompt_tokens_fewer_bytes(llama):
    hf, module, prompts = llama
    plain = InferenceEngine(module, max_tokens=256, block_size=BLOCK)
    expected = [r.output for r in plain.generate(prompts, _params())]
    assert expected[0] == hf_greedy(hf, torch.tensor([prompts[0]]), None, new=NEW,
                                    eos_token_id=None)[0, len(prompts[0]):].tolist()
    # Together (ref_zero): the first request computes the 5 prefix blocks, the others read them.
    cached = InferenceEngine(module, max_tokens=256, block_size=BLOCK,
                             prefix_caching="ref_zero")
    requests = [cached.add_request(p, q) for p, q in zip(prompts, _params())]
    cached.step()  # all four prefill in one step
    shared = (PREFIX // BLOCK) * BLOCK
    assert [r.cached_tokens for r in requests] == [0, shared, shared, shared]
    whole = sum(blocks_for(len(p) + NEW, BLOCK) for p in prompts)
    held = cached.memory_report()["held_bytes"]
    assert held == (whole - 3 * (PREFIX // BLOCK)) * BLOCK * cached.bytes_per_token
    cached.run_until_done()
    assert [r.output for r in requests] == expected
    decodes = len(prompts) * (NEW - 1)
    assert plain.computed_tokens == sum(map(len, prompts)) + decodes
    assert cached.computed_tokens == plain.computed_tokens - 3 * shared
    # ref_zero freed everything: one after another, nothing is shared.
    assert cached.prefix_cache.num_cached == 0 and cached.memory_report()["held_bytes"] == 0
    # lru keeps the prefix: requests one after another read it.
    lru = InferenceEngine(module, max_tokens=256, block_size=BLOCK, prefix_caching="lru")
    alone = [lru.generate([p], [q])[0] for p, q in zip(prompts, _params())]
    assert [r.output for r in alone] == expected
    # (the third prompt's 6th block holds its own suffix: only the 5 prefix blocks are shared)
    assert [r.cached_tokens for r in alone] == [0, shared, shared, shared]
    assert lru.prefix_cache.num_free == lru.prefix_cache.num_blocks  # all evictable
    # Prompt log-probs need every prompt token's logits: such a request computes its prompt.
    wants = SamplingParams(max_new_tokens=1, prompt_logprobs=True)
    with_lp = lru.generate([prompts[1]], [wants])[0]
    without = plain.generate([prompts[1]], [wants])[0]
    assert with_lp.cached_tokens == 0
    assert with_lp.prompt_logprobs[1:] == pytest.approx(without.prompt_logprobs[1:], abs=1e-5)


def test_chunked_prompt_shares_only_the_blocks_already_computed(llama):
    """A prompt computed in chunks: a request arriving meanwhile reads only the prefix blocks
    whose keys are in the cache (or come in the same step), computes the rest itself and
    gives its tokens alone."""
    _, module, prompts = llama
    first, second = prompts[2][:PREFIX + 3], prompts[0]  # 24 and 24 tokens, 5 blocks shared
    params = SamplingParams(max_new_tokens=NEW)
    alone = InferenceEngine(module, max_tokens=256, block_size=BLOCK)
    expected = [r.output for r in alone.generate([first, second], [params, params])]
    engine = InferenceEngine(module, max_tokens=256, block_size=BLOCK, max_step_tokens=6,
                             chunked_prefill=True, prefix_caching="ref_zero")
    a = engine.add_request(first, params)
    engine.step()  # a: tokens 0-5 (block 0 complete)
    b = engine.add_request(second, params)
    engine.step()  # a: tokens 6-11 (blocks 1, 2), then b joins: blocks 0-2 are known
    assert b.cached_tokens == 3 * BLOCK
    engine.run_until_done()
    assert [a.output, b.output] == expected


def test_lru_evicts_least_recently_used_first():
    allocator = PrefixCachingAllocator(num_blocks=6, block_size=2, eviction_policy="lru")
    first, second = [1, 2, 3, 4, 5], [7, 8, 9, 10, 11]  # 2 full blocks each
    table_a, _ = allocator.admit(first, 6)
    table_b, _ = allocator.admit(second, 6)
    assert allocator.num_cached == 0  # hashed once a step computes them
    allocator.register(first, table_a, 5)
    allocator.register(second, table_b, 5)
    allocator.free(table_a)
    allocator.free(table_b)  # both cached, a used less recently
    assert allocator.num_free == 6 and allocator.num_cached == 4
    table, cached = allocator.admit([20, 21, 22], 4)  # 2 blocks: the 2 free ones
    allocator.register([20, 21, 22], table, 3)
    assert cached == 0 and allocator.num_cached == 5  # its own full block is hashed
    allocator.admit([30, 31, 32], 3)  # 2 more blocks: evicts a's two
    hashes_a, hashes_b = block_hashes(first, 2), block_hashes(second, 2)
    assert not any(h in allocator.block_of for h in hashes_a)
    assert all(h in allocator.block_of for h in hashes_b)
    allocator.free(table)  # its block 2 cached (most recent), block 5 free
    # b's prefix still hits: 2 blocks (4 tokens) read, not computed; 1 new block (5)
    assert allocator.admit(second + [12], 6)[1] == 4
    allocator.admit([40, 41], 2)  # evicts block 2, the last cached one nobody holds
    assert block_hashes([20, 21, 22], 2)[0] not in allocator.block_of
    assert allocator.num_free == 0 and allocator.admit([50, 51], 2) is None


def test_prefix_caching_needs_full_attention():
    smp.init({"random_seed": 3})
    module = smp.transform(build("mistral")).module  # sliding-window layers
    with pytest.raises(ConfigError, match="--inference-dynamic-batching-prefix-caching"):
        InferenceEngine(module, max_tokens=64, block_size=4, prefix_caching="lru")
    with pytest.raises(ConfigError, match="eviction-policy"):
        PrefixCachingAllocator(4, 4, "fifo")


@pytest.mark.parametrize("family", ["llama", "gpt_oss"])
def test_chunked_prefill_same_tokens_within_the_step_budget(family):
    smp.init({"random_seed": 3})
    hf = build(family)
    module = smp.transform(hf).module
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, hf.config.vocab_size, (n,), generator=generator).tolist()
               for n in (23, 5, 17, 2, 30)]
    params = [SamplingParams(max_new_tokens=7) for _ in prompts]
    params[1] = SamplingParams(max_new_tokens=7, temperature=1.0, seed=5)
    expected = [r.output for r in InferenceEngine(module, max_tokens=512, block_size=4)
                .generate(prompts, params)]
    engine = InferenceEngine(module, max_tokens=512, block_size=4, max_step_tokens=8,
                             chunked_prefill=True)
    requests = [engine.add_request(p, q) for p, q in zip(prompts, params)]
    per_step = []
    while engine.has_work:
        before = engine.computed_tokens
        engine.step()
        per_step.append(engine.computed_tokens - before)
    assert [r.output for r in requests] == expected
    assert max(per_step) == 8 and sum(per_step) == sum(map(len, prompts)) + 5 * 6
    # A request decoding while a 30-token prompt arrives: it gains a token every step.
    first = engine.add_request(prompts[1], SamplingParams(max_new_tokens=8))
    engine.step()
    long = engine.add_request(prompts[4], SamplingParams(max_new_tokens=2))
    for count in range(2, 6):
        engine.step()
        assert len(first.output) == count and not long.output
    engine.run_until_done()
    assert long.output == expected[4][:2]
    # a prompt asking for its log-probs is not split: it waits for a step with room for it
    wants = SamplingParams(max_new_tokens=2, prompt_logprobs=True)
    first = engine.add_request(prompts[1], SamplingParams(max_new_tokens=4))
    engine.step()
    scored = engine.add_request(prompts[3] * 4, wants)  # 8 tokens: after first's decodes
    engine.run_until_done()
    alone = InferenceEngine(module, max_tokens=512, block_size=4).generate([prompts[3] * 4],
                                                                          [wants])[0]
    assert scored.output == alone.output
    assert scored.prompt_logprobs[1:] == pytest.approx(alone.prompt_logprobs[1:], abs=1e-5)
    # without chunks, a prompt longer than a step is an error naming the flags
    whole = InferenceEngine(module, max_tokens=512, block_size=4, max_step_tokens=8)
    with pytest.raises(ConfigError, match="--enable-chunked-prefill"):
        whole.add_request(prompts[0], params[0])


def test_flags_that_need_another():
    """The tools' flags: an eviction policy without prefix caching, chunked prefill without a
    step budget are errors, before any process group exists."""
    from megatron_smp.training.inference_flags import build_inference_engine

    model = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
             "--max-position-embeddings", "32", "--tokenizer-type", "NullTokenizer",
             "--vocab-size", "99"]
    with pytest.raises(ConfigError, match="needs --inference-dynamic-batching-prefix-caching"):
        build_inference_engine(model + [
            "--inference-dynamic-batching-prefix-caching-eviction-policy", "lru"])
    with pytest.raises(ConfigError, match="add --inference-dynamic-batching-max-tokens"):
        build_inference_engine(model + ["--enable-chunked-prefill"])
