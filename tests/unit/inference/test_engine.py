"""The continuous-batching engine: batch invariance (a prompt's greedy tokens alone equal its
tokens inside a batch of 8 requests of different lengths arriving at different steps, under a
memory budget that makes some of them queue), sliding windows that keep only the window (a
ring of blocks, wrapping, still HF's tokens; bytes held to the byte), admission control,
stop strings and abort."""
import pytest
import torch

import megatron_smp as smp
from megatron_smp.config import ConfigError
from megatron_smp.inference import InferenceEngine, SamplingParams
from tests.unit.inference.common import NEW, PROMPT, build, hf_greedy, prompts


def _module(family):
    smp.init({"random_seed": 3})
    hf = build(family)
    return hf, smp.transform(hf).module


def _drain(engine, arrivals):
    """Step the engine, adding arrivals[k] (prompt, params) before step k; returns the
    requests in arrival order and the most requests ever running / waiting at once."""
    requests, most_running, most_waiting, step = [], 0, 0, 0
    while step < len(arrivals) or engine.has_work:
        for prompt, params in arrivals[step] if step < len(arrivals) else []:
            requests.append(engine.add_request(prompt, params))
        engine.step()
        most_running = max(most_running, len(engine.running))
        most_waiting = max(most_waiting, len(engine.waiting))
        step += 1
    return requests, most_running, most_waiting


@pytest.mark.parametrize("family", ["llama31", "gpt_oss"])
def test_batch_invariance_under_continuous_batching(family, monkeypatch):
    from megatron_smp.inference.kv_cache import StepBatch

    hf, module = _module(family)
    vocab = hf.config.vocab_size
    generator = torch.Generator().manual_seed(5)
    lengths = [9, 3, 14, 6, 1, 11, 5, 8]
    batch = [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in lengths]
    news = [12, 5, 9, 14, 3, 7, 10, 6]
    params = [SamplingParams(max_new_tokens=n) for n in news]
    # A request alone on consecutive blocks reads its full-attention keys as a view of the
    # pool (no slot plan for them); in a batch, or on scattered blocks, they are gathered.
    plans = []
    keys = StepBatch._keys
    monkeypatch.setattr(StepBatch, "_keys", lambda self, group, kind: (
        plans.append(kind), keys(self, group, kind))[1])
    alone, alone_requests = [], []
    for prompt, p in zip(batch, params):
        engine = InferenceEngine(module, max_tokens=64, block_size=4)
        alone_requests.append(engine.generate([prompt], [p])[0])
        alone.append(alone_requests[-1].output)
    assert None not in plans
    engine = InferenceEngine(module, max_tokens=128, block_size=4)
    allocator = engine.allocators[None]
    allocator.free(allocator.allocate(allocator.num_free)[1::2])  # every other block free
    scattered = engine.generate([batch[2]], [params[2]])[0]
    assert None in plans and scattered.output == alone[2]
    assert torch.allclose(torch.tensor(scattered.logprobs),
                          torch.tensor(alone_requests[2].logprobs), atol=1e-5)
    # 8 requests over 6 steps; 64 cache tokens hold 3-4 of them: the rest queue.
    engine = InferenceEngine(module, max_tokens=64, block_size=4, max_requests=8)
    arrivals = [[(batch[0], params[0]), (batch[1], params[1])], [], [(batch[2], params[2])],
                [(batch[3], params[3]), (batch[4], params[4])], [(batch[5], params[5])],
                [(batch[6], params[6]), (batch[7], params[7])]]
    requests, most_running, most_waiting = _drain(engine, arrivals)
    assert [r.output for r in requests] == alone
    assert [r.finish_reason for r in requests] == ["length"] * 8
    assert most_running >= 3 and most_waiting >= 1
    assert all(a.num_free == a.num_blocks for a in engine.allocators.values())
    # and HF's own greedy tokens for the first prompt
    expected = hf_greedy(hf, torch.tensor([batch[0]]), None, new=12, eos_token_id=None)
    assert alone[0] == expected[0, 9:].tolist()


@pytest.mark.parametrize("family", ["mistral", "gpt_oss"])
def test_windowed_layers_keep_only_the_window(family):
    """Window 5 (4 keys back), blocks of 4: a windowed layer's ring is 2 blocks (8 tokens),
    which 21-token requests wrap around; the tokens stay HF's and each request holds exactly
    its rings plus its full-attention blocks."""
    hf, module = _module(family)
    ids, mask = prompts(hf.config.vocab_size)
    expected = hf_greedy(hf, ids, mask, eos_token_id=None)
    engine = InferenceEngine(module, max_tokens=256, block_size=4, max_requests=4)
    assert engine.layout.num_blocks[4] == 4 * 2
    rows = [row[keep.bool()].tolist() for row, keep in zip(ids, mask)]
    requests = [engine.add_request(r, SamplingParams(max_new_tokens=NEW)) for r in rows]
    engine.step()
    d, groups, size = 12 if family == "gpt_oss" else 16, 2, 4
    per_layer = 2 * groups * d * size
    windowed = [module.config.layer_window_size(n) is not None for n in (1, 2)]
    for request in requests:
        total = len(request.prompt) + NEW
        blocks = sum(2 if w else -(-total // 4) for w in windowed)
        assert len(request.blocks[4]) == 2
        assert engine.held_bytes(request) == blocks * 4 * per_layer
    engine.run_until_done()
    assert [r.output for r in requests] == expected[:, PROMPT:].tolist()


def test_admission_errors_stop_strings_and_abort():
    hf, module = _module("llama")
    engine = InferenceEngine(module, max_tokens=32, block_size=4, max_seq_length=24)
    with pytest.raises(ConfigError, match="longer than the context"):
        engine.add_request([1] * 20, SamplingParams(max_new_tokens=5))
    small = InferenceEngine(module, max_tokens=16, block_size=4)
    with pytest.raises(ConfigError, match="does not fit in the KV cache.*inference-max-tokens"):
        small.add_request([1] * 10, SamplingParams(max_new_tokens=10))
    for bad, match in (({"temperature": -1.0}, "temperature"), ({"top_p": 0.0}, "top_p"),
                       ({"top_k": -2}, "top_k"), ({"max_new_tokens": -1}, "max_new_tokens")):
        with pytest.raises(ConfigError, match=match):
            engine.add_request([1, 2], SamplingParams(**bad))
    with pytest.raises(ConfigError, match="token ids"):
        engine.add_request([5000], SamplingParams())
    # stop strings: the checker sees the request (here: text = the ids joined)
    free = engine.generate([[5, 6, 7]], [SamplingParams(max_new_tokens=6)])[0].output
    target = f" {free[2]}"

    def checker(request):
        text = "".join(f" {t}" for t in request.output)
        return next((s for s in request.params.stop if s in text), None)

    engine.stop_checker = checker
    [stopped] = engine.generate([[5, 6, 7]], [SamplingParams(max_new_tokens=6, stop=[target])])
    assert stopped.output == free[:3] and stopped.finish_reason == "stop"
    assert stopped.stop_string == target
    # stop ids are kept in the output
    [stopped] = engine.generate([[5, 6, 7]], [SamplingParams(max_new_tokens=6,
                                                             stop_token_ids=[free[1]])])
    assert stopped.output == free[:2] and stopped.finish_reason == "stop"
    # abort frees the blocks at the next step
    request = engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=6))
    engine.step()
    assert engine.allocators[None].num_free < engine.allocators[None].num_blocks
    engine.abort(request.request_id)
    engine.step()
    assert request.finish_reason == "abort" and not engine.has_work
    assert engine.allocators[None].num_free == engine.allocators[None].num_blocks


def test_alibi_decoding_equals_full_recomputation():
    """ALiBi (no HF family of the zoo has it): the log-probs of the prompt and of every
    generated token, decoded over the cache, equal one uncached forward of the whole
    sequence."""
    from megatron_smp.models.gpt import GPTModel
    from megatron_smp.models.hf import get_adapter

    smp.init({"random_seed": 3})
    config = get_adapter("gpt2").config_from_hf(build("gpt2").config).replace(
        position_embedding_type="alibi")
    torch.manual_seed(0)
    model = GPTModel(config, smp.state.parallel_state).eval()
    prompt = [5, 17, 300, 2, 9, 44, 801]
    engine = InferenceEngine(model, max_tokens=64, block_size=4)
    [request] = engine.generate([prompt], [SamplingParams(max_new_tokens=9, temperature=1.0,
                                                          seed=2, prompt_logprobs=True)])
    sequence = prompt + request.output
    with torch.no_grad():
        logits = model(torch.tensor([sequence]))[0, :-1, :config.vocab_size]
    expected = torch.log_softmax(logits, dim=-1).gather(
        1, torch.tensor(sequence[1:])[:, None])[:, 0]
    got = torch.tensor(request.prompt_logprobs[1:] + request.logprobs)
    assert len(set(request.output)) > 3 and (got - expected).abs().max() < 1e-5

