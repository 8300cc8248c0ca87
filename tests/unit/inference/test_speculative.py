"""Speculative decoding inside the continuous-batching engine (`inference.speculative`):
greedy tokens equal plain decoding for n-gram lookup, a draft model and the model's MTP
layers, with speculating and plain requests in one batch, at one process, TP=2 and PP=2;
the MTP drafts are the training MTP layers' predictions; the accept / resample rule's
probabilities exactly, and its output distribution (seeded, a small vocabulary) against the
target's."""
import pytest
import torch

from megatron_smp.config import ConfigError
from megatron_smp.inference import InferenceEngine, SamplingParams
from megatron_smp.inference.speculative import (
    DraftModelRunner, SpeculativeConfig, accept_drafts, acceptance_probability, ngram_propose,
    residual_distribution,
)
from megatron_smp.testing import run_distributed

VOCAB = 97


def _model(state, layers=2, hidden=64, mtp=0, seed=5, moe=False):
    """A small Llama (peaky logits: fewer near-ties between greedy choices), with moe: 4
    experts (top 2) in every layer; under pipeline parallelism this rank's stage of it."""
    from megatron_smp.models import GPTModel, llama_config
    from megatron_smp.tensor_parallel.random import model_parallel_seed

    config = llama_config(layers, hidden, 4, VOCAB, max_position_embeddings=256,
                          ffn_hidden_size=2 * hidden, num_query_groups=2,
                          mtp_num_layers=mtp or None,
                          **(dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32)
                             if moe else {}))
    model_parallel_seed(seed, state)
    stage = {}
    if state.pp_size > 1:
        per_stage = layers // state.pp_size
        stage = dict(pre_process=state.is_pipeline_first_stage,
                     post_process=state.is_pipeline_last_stage,
                     layer_offset=state.pp_rank * per_stage, num_layers=per_stage)
    model = GPTModel(config, state, **stage)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.mul_(4.0)
    return model.eval()


def _requests():
    """Prompts (one repeating, so n-gram lookup finds drafts) and params: the third plain
    (num_speculative_tokens 0), the fourth stops at a token it emits."""
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB, (n,), generator=generator).tolist()
               for n in (5, 12, 9, 20)]
    prompts[1] = prompts[1][:6] * 3
    params = [SamplingParams(max_new_tokens=n) for n in (20, 17, 25, 9)]
    params[2] = params[2].replace(num_speculative_tokens=0)
    return prompts, params


def _compare(target, draft, mtp, **engine_kwargs):
    """{method: (plain outputs, speculative outputs, report)} on every rank."""
    prompts, params = _requests()
    plain = InferenceEngine(target, max_tokens=512, block_size=4, **engine_kwargs)
    expected = [r.output for r in plain.generate(prompts, params)]
    # a stop token the fourth request emits in the middle of its output
    params[3] = params[3].replace(stop_token_ids=[expected[3][4]])
    stopped = expected[3][:expected[3].index(expected[3][4]) + 1]
    expected[3] = stopped
    results = {}
    methods = [("ngram", None), ("draft_model", draft), ("draft_model", "self")]
    if mtp:
        methods.append(("mtp", None))
    for method, model in methods:
        if model == "self":
            model = target if target.state.world_size == 1 else None
            if model is None:
                continue
        speculative = SpeculativeConfig(method, 3, prompt_lookup_max=3)
        engine = InferenceEngine(target, max_tokens=512, block_size=4,
                                 speculative=speculative, draft_model=model, **engine_kwargs)
        got = engine.generate(prompts, params)
        results[(method, model is target)] = ([r.output for r in got], expected,
                                              engine.speculation_report() if engine.is_leader
                                              else None)
    return results


def _check(results):
    for key, (got, expected, report) in results.items():
        assert got == expected, key
        if report is not None:
            assert report["drafted_tokens"] > 0, key
            if key == ("draft_model", True):  # the model drafting for itself
                assert report["acceptance_rate"] == 1.0


def test_greedy_tokens_equal_plain_decoding():
    """One process: every method (MTP with 2 layers: depth 2, then depth 2 again a position
    on), mixed plain and speculating requests, a stop token inside an accepted run; and under
    chunked prefill with a step budget (drafts trimmed to it)."""
    from megatron_smp.config import ParallelConfig
    from megatron_smp.parallel_state import build_parallel_state

    state = build_parallel_state(ParallelConfig())
    target = _model(state, mtp=2)
    draft = _model(state, layers=1, hidden=32, seed=7)
    _check(_compare(target, draft, mtp=True))
    _check(_compare(target, draft, mtp=True, max_step_tokens=8, chunked_prefill=True))


def _layouts(rank, world_size):
    from megatron_smp.config import ParallelConfig
    from megatron_smp.parallel_state import build_parallel_state, local_parallel_state

    results = {}
    configs = {"tp": ParallelConfig(tensor_model_parallel_size=2),
               "pp": ParallelConfig(pipeline_model_parallel_size=2),
               "ep": ParallelConfig(expert_model_parallel_size=2)}
    for layout, config in configs.items():
        state = build_parallel_state(config)
        target = _model(state, mtp=1, moe=layout == "ep")
        draft = _model(local_parallel_state(), layers=1, hidden=32, seed=7) if rank == 0 \
            else None
        results[layout] = _compare(target, draft, mtp=True)  # (one world, new groups each)
    return results


def test_greedy_tokens_equal_plain_decoding_tp2_pp2_ep2():
    """TP=2 (MTP layers sharded, drafts made on both ranks alike), PP=2 (MTP on the last
    stage, its drafts sent to the leader; the draft model whole on the leader) and EP=2 (a
    MoE target, its MTP layer's experts over both ranks)."""
    for results in run_distributed(_layouts, 2, timeout=300):
        for layout in ("tp", "pp", "ep"):
            _check(results[layout])


def test_mtp_drafts_are_the_training_predictions():
    """After a prompt, the first drafts are the argmax of the training forward's MTP
    depth-1 and depth-2 logits at the prompt's last position (over prompt + the token
    emitted + the first draft)."""
    from megatron_smp.config import ParallelConfig
    from megatron_smp.parallel_state import build_parallel_state

    state = build_parallel_state(ParallelConfig())
    target = _model(state, mtp=2)
    engine = InferenceEngine(target, max_tokens=256, block_size=4,
                             speculative=SpeculativeConfig("mtp", 2))
    prompt = _requests()[0][0]
    request = engine.add_request(prompt, SamplingParams(max_new_tokens=10))
    engine.step()
    first, drafts = request.output[0], request.drafts
    ids = torch.tensor([prompt + [first, drafts[0]]])
    with torch.no_grad():
        hidden = target(ids, return_hidden_states=True)
        outputs = target.mtp(hidden, ids, None, None, target._rotary(hidden, None),
                             target.embedding)
        n = len(prompt) - 1
        want = [int(target._logits(out, None)[n, 0, :VOCAB].argmax()) for out in outputs]
    assert drafts == want


def test_ngram_lookup():
    assert ngram_propose([1, 2, 3, 4, 1, 2], 3, 3, 1) == [3, 4, 1]
    assert ngram_propose([1, 2, 3, 9, 2, 3, 5, 2, 3], 2, 2, 1) == [5, 2]  # the latest match
    assert ngram_propose([1, 2, 3], 2, 3, 1) == []
    assert ngram_propose([7, 1, 7], 4, 2, 2) == []  # no 2-gram repeats; 1-grams not tried
    assert ngram_propose([7, 1, 7], 4, 2, 1) == [1, 7]


def test_accept_and_residual_probabilities():
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    q = torch.tensor([0.2, 0.5, 0.2, 0.1])
    assert acceptance_probability(p, q, 0) == 1.0
    assert acceptance_probability(p, q, 1) == pytest.approx(0.6)
    assert acceptance_probability(p, q, 3) == 0.0
    assert acceptance_probability(p, None, 1) == pytest.approx(0.3)  # a one-hot draft
    assert torch.allclose(residual_distribution(p, q, 1), torch.tensor([1.0, 0, 0, 0]))
    r = torch.tensor([0.5, 0.0, 0.2, 0.0]) / 0.7
    assert torch.allclose(residual_distribution(p, None, 1), r)
    assert torch.equal(residual_distribution(p, p, 1), p)  # never rejected: p itself
    # p = q accepts everything and adds one token of row k
    generator = torch.Generator().manual_seed(0)
    target = torch.tensor([[0.0, 1.0], [1.0, 0.0], [0.0, 1.0]])
    assert accept_drafts(target, [1, 0], target[:2], generator) == ([1, 0, 1], 2)
    # a draft the target gives probability 0 is always rejected, replaced from the residual
    assert accept_drafts(target, [0, 0], None, generator) == ([1], 0)


@pytest.mark.parametrize("deterministic", [False, True])
def test_accept_rule_samples_the_target_distribution(deterministic):
    """A context-free target p over 5 tokens, drafts from q (or a fixed draft, q one-hot):
    the emitted stream's token and pair frequencies over 30,000 tokens pass chi-square
    against p and p x p (seeded; 99.9% critical values 18.47 for 4 and 51.18 for 24
    degrees of freedom)."""
    p = torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05])
    q = torch.tensor([0.1, 0.1, 0.2, 0.3, 0.3])
    generator = torch.Generator().manual_seed(1234)
    stream, k = [], 3
    while len(stream) < 30000:
        if deterministic:
            drafts, draft_probs = [3, 3, 0], None
        else:
            drafts = torch.multinomial(q, k, replacement=True, generator=generator).tolist()
            draft_probs = q.expand(k, -1)
        emitted, accepted = accept_drafts(p.expand(k + 1, -1), drafts, draft_probs, generator)
        assert len(emitted) == accepted + 1
        stream.extend(emitted)
    tokens = torch.tensor(stream)
    counts = torch.bincount(tokens, minlength=5).double()
    expected = p.double() * len(tokens)
    assert float(((counts - expected) ** 2 / expected).sum()) < 18.47
    pairs = torch.bincount(tokens[:-1] * 5 + tokens[1:], minlength=25).double()
    expected = torch.outer(p, p).flatten().double() * (len(tokens) - 1)
    assert float(((pairs - expected) ** 2 / expected).sum()) < 51.18


class _FakeModel:
    """A model whose state spans two ranks (only what the draft runner reads first)."""

    class config:
        vocab_size = VOCAB

    class state:
        group_ranks = {"tp": [0, 1], "pp": [0]}


def test_configuration_errors():
    from megatron_smp.config import ParallelConfig
    from megatron_smp.parallel_state import build_parallel_state

    state = build_parallel_state(ParallelConfig())
    target = _model(state)
    for config, match in ((SpeculativeConfig("eagle", 2), "method must be one of"),
                          (SpeculativeConfig("ngram", 0), "num_speculative_tokens"),
                          (SpeculativeConfig("ngram", 2, 2, 3), "prompt_lookup_min"),
                          (SpeculativeConfig("mtp", 2), "mtp-num-layers"),
                          (SpeculativeConfig("draft_model", 2), "needs a draft model")):
        with pytest.raises(ConfigError, match=match):
            InferenceEngine(target, max_tokens=64, speculative=config)
    with pytest.raises(ConfigError, match="alone"):
        DraftModelRunner(_FakeModel(), VOCAB, 8, 4, 2, "cpu")
    with pytest.raises(ConfigError, match="takes no draft model"):
        InferenceEngine(target, max_tokens=64, speculative=SpeculativeConfig("ngram", 2),
                        draft_model=target)
    with pytest.raises(ConfigError, match="unknown keys"):
        SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2,
                                     "draft": "x"})
    engine = InferenceEngine(target, max_tokens=64, speculative=SpeculativeConfig("ngram", 2))
    with pytest.raises(ConfigError, match="above the engine's 2"):
        engine.add_request([1, 2], SamplingParams(num_speculative_tokens=3))
    plain = InferenceEngine(target, max_tokens=64)
    with pytest.raises(ConfigError, match="without speculative decoding"):
        plain.add_request([1, 2], SamplingParams(num_speculative_tokens=1))


def test_sampled_requests_are_seeded_and_counted():
    """Sampling with drafts from a draft model: a seed gives the same tokens alone or in a
    batch, top_k=1 gives the greedy tokens, and the drafted / accepted counts add up."""
    from megatron_smp.config import ParallelConfig
    from megatron_smp.parallel_state import build_parallel_state

    state = build_parallel_state(ParallelConfig())
    target = _model(state)
    draft = _model(state, layers=1, hidden=32, seed=7)
    prompts, _ = _requests()
    speculative = SpeculativeConfig("draft_model", 3)
    sampled = SamplingParams(max_new_tokens=12, temperature=0.8, seed=3)
    engine = InferenceEngine(target, max_tokens=512, speculative=speculative, draft_model=draft)
    alone = engine.generate([prompts[0]], [sampled])[0]
    batch = engine.generate(prompts[:3], [sampled, sampled.replace(seed=4),
                                          SamplingParams(max_new_tokens=12)])
    assert batch[0].output == alone.output and len(alone.output) == 12
    greedy = InferenceEngine(target, max_tokens=512).generate(
        [prompts[1]], [SamplingParams(max_new_tokens=12)])[0].output
    top1 = engine.generate([prompts[1]], [sampled.replace(top_k=1)])[0].output
    assert top1 == greedy
    report = engine.speculation_report()
    assert report["drafted_tokens"] >= report["accepted_tokens"] > 0


def test_engine_samples_the_model_distribution_with_a_draft_model():
    """A 6-token vocabulary, temperature 1, a draft model that disagrees with the target:
    over 3,000 seeded requests the first two tokens' joint frequencies (the second verified
    against one draft) pass chi-square against the target's exact p(t1) p(t2 | t1) (35
    degrees of freedom, 99.9% critical value 66.62); plain sampling passes the same test."""
    from megatron_smp.config import ParallelConfig
    from megatron_smp.models import GPTModel, llama_config
    from megatron_smp.parallel_state import build_parallel_state
    from megatron_smp.tensor_parallel.random import model_parallel_seed

    state = build_parallel_state(ParallelConfig())

    def tiny(seed):
        config = llama_config(1, 16, 2, 6, max_position_embeddings=16, ffn_hidden_size=32)
        model_parallel_seed(seed, state)
        model = GPTModel(config, state).eval()
        with torch.no_grad():  # logits of order 1: no token near-certain
            model.output_layer.weight.mul_(4.0)
        return model

    target, draft = tiny(1), tiny(2)
    prompt = [1, 4, 2]
    with torch.no_grad():
        first = torch.softmax(target(torch.tensor([prompt]))[0, -1, :6].float(), dim=-1)
        joint = torch.stack([first[t] * torch.softmax(
            target(torch.tensor([prompt + [t]]))[0, -1, :6].float(), dim=-1)
            for t in range(6)]).flatten().double()
    assert joint.min() * 3000 > 5  # (chi-square wants 5 expected per cell)
    count = 3000
    params = [SamplingParams(max_new_tokens=3, temperature=1.0, seed=seed)
              for seed in range(count)]
    for speculative, model in ((SpeculativeConfig("draft_model", 1), draft), (None, None)):
        engine = InferenceEngine(target, max_tokens=16 * 64, block_size=4, max_requests=64,
                                 speculative=speculative, draft_model=model)
        requests = engine.generate([prompt] * count, params)
        pairs = torch.tensor([r.output[0] * 6 + r.output[1] for r in requests])
        observed = torch.bincount(pairs, minlength=36).double()
        expected = joint * count
        assert float(((observed - expected) ** 2 / expected).sum()) < 66.62
        if speculative is not None:
            report = engine.speculation_report()
            assert report["drafted_tokens"] == count and 0 < report["accepted_tokens"] < count
