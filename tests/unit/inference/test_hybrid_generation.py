"""Generation for hybrid models: Mamba-2 and Gated DeltaNet layers keep a fixed-size recurrent
state per request (conv state + SSM / delta-rule state) beside the attention layers' paged KV
cache. Greedy tokens equal HF's `generate` (left-padded batch) for Qwen3-Next, Qwen3.5 (dense
and MoE) and Nemotron-H at TP=1, Qwen3-Next, Qwen3.5 and Nemotron-H at TP=2 (sequence
parallel), Qwen3.5 at PP=2, Qwen3.5-MoE at EP=2; tools/generate.py on a Megatron hybrid
pattern gives the same tokens at PP=2 as in one process; the log-probs of prompt and generated
tokens are HF's within 1e-4; a request's tokens do not depend on the batch or on which slot it
gets; padding never enters a state; the state bytes per request follow the formula."""
import pytest
import torch

import megatron_smp as smp
from megatron_smp.inference import InferenceEngine, SamplingParams
from megatron_smp.testing import run_distributed
from tests.unit.inference.common import PROMPT, hf_prompt_logprobs, prompts
from tests.unit.models.common import to_numpy, to_torch
from tests.unit.models.test_hf_hybrid import build_hf

FAMILIES = ("qwen3_next", "qwen3_5", "nemotron_h")
NEW = 8


def _hf(hf, ids, mask):
    """HF's greedy tokens [b, PROMPT + NEW] and the log-prob of each generated one [b, NEW]."""
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                          pad_token_id=0, eos_token_id=None, return_dict_in_generate=True,
                          output_logits=True)
    logprobs = torch.stack([torch.log_softmax(step.float(), -1) for step in out.logits], 1)
    return out.sequences, logprobs.gather(2, out.sequences[:, PROMPT:, None])[..., 0]


def _greedy(model, ids, mask):
    return model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                          pad_token_id=0, eos_token_id=None)


@pytest.mark.parametrize("family", FAMILIES + ("qwen3_5_moe",))
def test_greedy_tokens_and_logprobs_match_hf(family):
    smp.init({"random_seed": 3})
    hf = build_hf(family)
    ids, mask = prompts(hf.config.vocab_size)
    expected, expected_logprobs = _hf(hf, ids, mask)
    assert len(set(expected[:, PROMPT:].flatten().tolist())) > 4  # not one repeated token
    model = smp.transform(hf)
    assert torch.equal(_greedy(model, ids, mask), expected)

    # The engine: generated tokens' and prompt tokens' log-probs; requests joining as others
    # leave (max_requests 2: the third takes the first one's freed slot) give the same tokens.
    rows = [row[keep.bool()].tolist() for row, keep in zip(ids, mask)]
    engine = InferenceEngine(model.module, max_tokens=64, block_size=4, max_requests=2)
    params = SamplingParams(max_new_tokens=NEW, prompt_logprobs=True)
    requests = engine.generate(rows, [params, params.replace(max_new_tokens=3), params])
    assert requests[1].output == expected[1, PROMPT:PROMPT + 3].tolist()
    for index in (0, 2):
        assert requests[index].output == expected[index, PROMPT:].tolist()
        got = torch.tensor(requests[index].logprobs)
        assert (got - expected_logprobs[index]).abs().max() < 1e-4
        got = torch.tensor(requests[index].prompt_logprobs[1:])
        assert (got - hf_prompt_logprobs(hf, rows[index])).abs().max() < 1e-4
    assert engine.state_slots.num_free == 2  # every slot back


def _state_bytes(config, tp):
    """Per request and rank: conv channels/tp x (kernel - 1) + heads/tp x state dims, fp32."""
    if config.model_type == "nemotron_h":
        layers = config.hybrid_override_pattern.count("M")
        inner = config.mamba_num_heads * config.mamba_head_dim
        conv = (inner + 2 * config.n_groups * config.ssm_state_size) * (config.conv_kernel - 1)
        state = config.mamba_num_heads * config.mamba_head_dim * config.ssm_state_size
    else:
        layers = config.layer_types.count("linear_attention")
        keys = config.linear_num_key_heads * config.linear_key_head_dim
        values = config.linear_num_value_heads * config.linear_value_head_dim
        conv = (2 * keys + values) * (config.linear_conv_kernel_dim - 1)
        state = config.linear_num_value_heads * config.linear_key_head_dim \
            * config.linear_value_head_dim
    return layers * (conv + state) * 4 // tp


@pytest.mark.parametrize("family,expected", [("qwen3_5", 3 * (80 * 3 + 4 * 8 * 12) * 4),
                                             ("nemotron_h", 2 * (128 * 3 + 8 * 12 * 8) * 4)])
def test_state_bytes_per_request(family, expected):
    """Fixed per request (any length): allocated once per slot, held while running, beside
    the attention layers' per-token KV bytes."""
    smp.init({"random_seed": 3})
    hf = build_hf(family)
    assert _state_bytes(hf.config, 1) == expected
    engine = InferenceEngine(smp.transform(hf).module, max_tokens=32, block_size=16,
                             max_requests=3)
    assert engine.state_bytes_per_request == expected
    attention = 2 * 2 * 24 * 4  # one attention layer: keys and values, 2 kv heads x 24
    assert engine.bytes_per_token == attention
    assert engine.cache.allocated_bytes() == 32 * attention + 3 * expected
    request = engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=2))
    engine.step()
    assert engine.held_bytes(request) == 16 * attention + expected


def _tp2(rank, world_size):
    from tests.unit.inference.test_generation import _stage

    results = {}
    # PP=2: qwen3_5's stages are (GDN, GDN) and (GDN, attention); the engine passes each
    # step's hidden states on and each stage keeps its own layers' states.
    smp.init({"pipeline_parallel_degree": 2, "random_seed": 3})
    hf = build_hf("qwen3_5")
    ids, mask = prompts(hf.config.vocab_size)
    stage = _stage(hf, smp.state.parallel_state)
    engine = InferenceEngine(stage, max_tokens=64, max_requests=2)
    rows = [row[keep.bool()].tolist() for row, keep in zip(ids, mask)]
    requests = engine.generate(rows, [SamplingParams(max_new_tokens=NEW)] * 3)
    results["pipeline"] = ([r.output for r in requests], engine.state_bytes_per_request)
    smp.init({"expert_parallel_degree": 2, "random_seed": 3})
    hf = build_hf("qwen3_5_moe")
    ids, mask = prompts(hf.config.vocab_size)
    results["expert"] = _greedy(smp.transform(hf), ids, mask)
    for family in FAMILIES:
        smp.init({"tensor_parallel_degree": 2, "random_seed": 3})
        hf = build_hf(family)
        ids, mask = prompts(hf.config.vocab_size)
        model = smp.transform(hf)
        engine = InferenceEngine(model.module, max_tokens=64, max_requests=2)
        results[family] = (_greedy(model, ids, mask), engine.state_bytes_per_request)
    return to_numpy(results)


def test_tp2_pp2_ep2_generation_matches_hf():
    """TP=2 (sequence parallel where transform turns it on): each rank holds its groups'
    state (half the bytes) and both ranks give HF's tokens; PP=2 (qwen3_5): HF's tokens,
    each stage holding its own layers' states; EP=2 (qwen3_5_moe): HF's tokens."""
    results = to_torch(run_distributed(_tp2, 2, timeout=300))
    hf = build_hf("qwen3_5")
    ids, mask = prompts(hf.config.vocab_size)
    expected, _ = _hf(hf, ids, mask)
    per_layer = _state_bytes(hf.config, 1) // 3
    for rank in (0, 1):
        outputs, state_bytes = results[rank]["pipeline"]
        assert outputs == expected[:, PROMPT:].tolist(), rank
        assert state_bytes == (2 if rank == 0 else 1) * per_layer
    hf = build_hf("qwen3_5_moe")
    expected, _ = _hf(hf, *prompts(hf.config.vocab_size))
    for rank in (0, 1):
        assert torch.equal(results[rank]["expert"], expected), rank
    for family in FAMILIES:
        hf = build_hf(family)
        ids, mask = prompts(hf.config.vocab_size)
        expected, _ = _hf(hf, ids, mask)
        for rank in (0, 1):
            tokens, state_bytes = results[rank][family]
            assert torch.equal(tokens, expected), (family, rank)
            assert state_bytes == _state_bytes(hf.config, 2)


@pytest.mark.parametrize("family", ("qwen3_5", "nemotron_h"))
def test_padded_rows_leave_the_state_alone(family):
    """A cache step over right-padded rows (a group of requests of different lengths, from
    non-zero states) gives each request's outputs and new states as running it alone: the
    padding never enters the conv or the SSM / delta-rule state."""
    from megatron_smp.inference.kv_cache import recurrent_layers

    smp.init({"random_seed": 3})
    mixer = next(iter(recurrent_layers(smp.transform(build_hf(family)).module).values()))
    groups = mixer.in_proj.weight.shape[0] // sum(mixer.split_sizes)
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(2, 11, groups, sum(mixer.split_sizes), generator=generator)
    states = tuple(torch.randn(2, *shape, generator=generator).to(dtype)
                   for shape, dtype in mixer.state_shapes())
    lengths = torch.tensor([11, 6])
    with torch.no_grad():
        (joint,), joint_states = mixer._step([rows], lengths, states)
        for i, n in enumerate(lengths.tolist()):
            (alone,), alone_states = mixer._step([rows[i:i + 1, :n]], lengths[i:i + 1],
                                                 tuple(s[i:i + 1] for s in states))
            assert (joint[i, :n] - alone[0]).abs().max() < 1e-5
            for got, want in zip(joint_states, alone_states):
                assert (got[i] - want[0]).abs().max() < 1e-5


# Every symbol of Megatron's --hybrid-layer-pattern (Mamba-2, Gated DeltaNet, attention, MLP,
# MoE); the | puts two layers on the first of two pipeline stages.
HYBRID_FLAGS = (
    "--num-layers 5 --hidden-size 64 --num-attention-heads 4 --max-position-embeddings 64 "
    "--tokenizer-type NullTokenizer --vocab-size 1000 --seed 7 --normalization RMSNorm "
    "--disable-bias-linear --untie-embeddings-and-output-weights --group-query-attention "
    "--num-query-groups 2 --hybrid-layer-pattern MG|*-E --position-embedding-type none "
    "--squared-relu --mamba-state-dim 16 --mamba-head-dim 16 --mamba-num-groups 2 "
    "--linear-num-key-heads 2 --linear-num-value-heads 4 --linear-key-head-dim 16 "
    "--linear-value-head-dim 16 --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 64 "
    "--max-new-tokens 6"
).split()


def test_generate_tool_on_a_megatron_hybrid_pattern(tmp_path):
    """tools/generate.py on a --hybrid-layer-pattern model (the --seed initialisation, which
    does not depend on the layout): PP=2 (stages split at the |) gives the single process's
    tokens and log-probs."""
    import json

    from tests.unit.inference.common import launch, wait_all

    source = tmp_path / "prompts.jsonl"
    source.write_text('{"prompt_ids": [5, 9, 17, 3, 44]}\n'
                      '{"prompt_ids": [8, 2], "max_new_tokens": 3}\n')
    records = {}
    for world, layout in ((1, []), (2, ["--pipeline-model-parallel-size", "2"])):
        output = tmp_path / f"out{world}.jsonl"
        procs = launch("generate.py", HYBRID_FLAGS + layout + ["--input", source, "--output",
                                                               output], world, tmp_path)
        assert wait_all(procs, 180) == [0] * world, (tmp_path / "rank0.log").read_text()[-3000:]
        records[world] = [json.loads(line) for line in output.read_text().splitlines()]
    assert [len(r["tokens"]) for r in records[1]] == [6, 3]
    for one, two in zip(records[1], records[2]):
        assert one["tokens"] == two["tokens"]
        assert max(abs(a - b) for a, b in zip(one["logprobs"], two["logprobs"])) < 1e-4


def test_all_recurrent_model_needs_no_kv_blocks():
    """A Nemotron-H of Mamba and MLP layers only: no KV cache at all (no blocks, so a request
    longer than --inference-max-tokens still runs), only the state slots; HF's tokens."""
    import transformers as tf

    smp.init({"random_seed": 3})
    torch.manual_seed(0)
    hf = tf.NemotronHForCausalLM(tf.NemotronHConfig(
        vocab_size=301, hidden_size=64, layers_block_type=["mamba", "mlp", "mamba"],
        mamba_num_heads=8, mamba_head_dim=12, n_groups=2, ssm_state_size=8,
        intermediate_size=96, chunk_size=4, max_position_embeddings=64)).eval()
    ids, mask = prompts(hf.config.vocab_size)
    # HF's generate needs an attention layer in its cache: greedy by full forwards instead.
    expected = []
    for row, keep in zip(ids, mask):
        tokens = row[keep.bool()].tolist()
        for _ in range(NEW):
            with torch.no_grad():
                logits = hf(torch.tensor([tokens]), use_cache=False).logits[0, -1]
            tokens.append(int(logits.argmax()))
        expected.append(tokens[-NEW:])
    model = smp.transform(hf)
    assert _greedy(model, ids, mask)[:, PROMPT:].tolist() == expected
    engine = InferenceEngine(model.module, max_tokens=4, block_size=4, max_requests=2)
    assert engine.layout.kinds == [] and engine.bytes_per_token == 0
    assert engine.cache.allocated_bytes() == 2 * engine.state_bytes_per_request
    [request] = engine.generate([ids[0].tolist()], [SamplingParams(max_new_tokens=NEW)])
    assert request.output == expected[0]
    # An aborted request gives its slot back.
    request = engine.add_request(ids[1].tolist(), SamplingParams(max_new_tokens=NEW))
    engine.step()
    assert engine.state_slots.num_free == 1
    assert engine.held_bytes(request) == engine.state_bytes_per_request
    engine.abort(request.request_id)
    engine.step()
    assert request.finish_reason == "abort" and engine.state_slots.num_free == 2
