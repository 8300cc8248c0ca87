"""GPTModel: TP=2 (+SP) equals TP=1 (weights, losses, grads); pipeline stages hold the
single-stage model's weights; the sharding layout matches the parameters' attributes."""
import pytest
import torch
import torch.distributed as dist

from megatron_smp.config import ParallelConfig, TransformerConfig
from megatron_smp.models import GPTModel, gather_full_logits, llama_config
from megatron_smp.models.sharding import (
    default_layout,
    merge_state_dicts,
    tensor_parallel_layout,
)
from megatron_smp.parallel_state import build_parallel_state
from megatron_smp.tensor_parallel.random import model_parallel_seed
from megatron_smp.testing import run_distributed
from tests.unit.models.common import to_numpy, to_torch

BATCH, SEQ, VOCAB = 2, 16, 1003


def gpt_config(**overrides):
    settings = dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=VOCAB,
                    max_position_embeddings=SEQ, hidden_dropout=0.0, attention_dropout=0.0)
    settings.update(overrides)
    return TransformerConfig(**settings)


CONFIGS = {
    "gpt": lambda **kw: gpt_config(**kw),
    "llama": lambda **kw: llama_config(2, 64, 4, VOCAB, max_position_embeddings=SEQ,
                                       num_query_groups=2, ffn_hidden_size=96, **kw),
    "neox": lambda **kw: gpt_config(position_embedding_type="rope", rotary_percent=0.5,
                                    parallel_residual=True,
                                    untie_embeddings_and_output_weights=True, **kw),
    "alibi": lambda **kw: gpt_config(position_embedding_type="alibi", num_attention_heads=8,
                                     num_query_groups=4, **kw),
}


def _batch():
    generator = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    return ids, labels


def _step(state, config):
    """Build with seed 1234, one forward/backward; SP-partial grads summed over TP."""
    model_parallel_seed(1234, state)
    model = GPTModel(config, state)
    ids, labels = _batch()
    loss = model(ids, labels=labels)
    loss.sum().backward()
    for param in model.parameters():
        if getattr(param, "sequence_parallel", False):
            dist.all_reduce(param.grad, group=state.tp_group)
    # Explicit, shuffled position ids: each SP rank must pick its own shard's positions.
    positions = ((torch.arange(SEQ) * 3) % SEQ).expand(BATCH, SEQ)
    logits = gather_full_logits(model(ids, position_ids=positions), state, config.vocab_size)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    sp_marked = sorted(
        n for n, p in model.named_parameters() if getattr(p, "sequence_parallel", False)
    )
    return loss.detach(), logits.detach(), weights, grads, sp_marked, tensor_parallel_layout(model)


def _tp_worker(rank, world_size, family, sequence_parallel):
    state = build_parallel_state(ParallelConfig(tensor_model_parallel_size=world_size))
    return to_numpy(_step(state, CONFIGS[family](sequence_parallel=sequence_parallel)))


@pytest.fixture(scope="module")
def single_state():
    return build_parallel_state(ParallelConfig())


@pytest.mark.parametrize("family,sequence_parallel", [("gpt", True), ("llama", True),
                                                      ("neox", False), ("alibi", False)])
def test_tp2_equals_tp1(single_state, family, sequence_parallel):
    config = CONFIGS[family]()
    loss, logits, weights, grads, _, layout = _step(single_state, config)
    results = to_torch(run_distributed(_tp_worker, 2, args=(family, sequence_parallel)))

    assert layout == {k: v for k, v in default_layout(config).items() if k in layout}
    merged_weights = merge_state_dicts([r[2] for r in results], config)
    assert merged_weights.keys() == weights.keys()
    for name in weights:
        assert torch.equal(merged_weights[name], weights[name]), name
    merged_grads = merge_state_dicts([r[3] for r in results], config)
    for name in grads:
        assert torch.allclose(merged_grads[name], grads[name], atol=2e-5, rtol=1e-4), name
    for rank_loss, rank_logits, *_ in results:
        assert (rank_loss - loss).abs().max() < 1e-5
        assert (rank_logits - logits).abs().max() < 1e-5
    sp_marked = results[0][4]
    if sequence_parallel:  # every norm weight (and row-parallel bias) is marked
        assert "decoder.final_layernorm.weight" in sp_marked
        assert "decoder.layers.0.input_layernorm.weight" in sp_marked
        assert "decoder.layers.1.pre_mlp_layernorm.weight" in sp_marked
    else:
        assert sp_marked == []


def test_logits_exclude_padding(single_state):
    config = gpt_config()
    model = GPTModel(config, single_state)
    ids, _ = _batch()
    logits = model(ids)
    assert logits.shape == (BATCH, SEQ, config.padded_vocab_size(1))
    assert gather_full_logits(logits, single_state, VOCAB).shape == (BATCH, SEQ, VOCAB)


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_pipeline_stage_weights_equal_single_model(single_state, family):
    config = CONFIGS[family](num_layers=4) if family == "gpt" else llama_config(
        4, 64, 4, VOCAB, num_query_groups=2, ffn_hidden_size=96)
    torch.manual_seed(3)
    full = GPTModel(config, single_state).state_dict()
    stages = [dict(pre_process=True, post_process=False, layer_offset=0, num_layers=1),
              dict(pre_process=False, post_process=False, layer_offset=1, num_layers=2),
              dict(pre_process=False, post_process=True, layer_offset=3, num_layers=1)]
    seen = set()
    for stage in stages:
        torch.manual_seed(3)
        model = GPTModel(config, single_state, **stage)
        for name, tensor in model.state_dict().items():
            if name.startswith("decoder.layers."):
                parts = name.split(".")
                parts[2] = str(int(parts[2]) + stage["layer_offset"])
                global_name = ".".join(parts)
            elif name == "output_layer.weight" and "output_layer.weight" not in full:
                global_name = "embedding.word_embeddings.weight"  # tied copy on the last stage
            else:
                global_name = name
            assert torch.equal(tensor, full[global_name]), (stage, name)
            seen.add(global_name)
    assert seen == set(full)


def test_pipeline_stages_hidden_states_chain(single_state):
    config = gpt_config(num_layers=2)
    ids, labels = _batch()
    torch.manual_seed(3)
    full = GPTModel(config, single_state)
    torch.manual_seed(3)
    first = GPTModel(config, single_state, post_process=False, num_layers=1)
    torch.manual_seed(3)
    last = GPTModel(config, single_state, pre_process=False, layer_offset=1, num_layers=1)
    hidden = first(ids)
    assert hidden.shape == (SEQ, BATCH, config.hidden_size)
    last.set_input_tensor(hidden)
    assert torch.allclose(last(None, labels=labels), full(ids, labels=labels), atol=1e-6)


def _pipeline_worker(rank, world_size):
    state = build_parallel_state(ParallelConfig(pipeline_model_parallel_size=2))
    torch.manual_seed(3)
    model = GPTModel(gpt_config(), state, pre_process=rank == 0, post_process=rank == 1,
                     layer_offset=rank, num_layers=1)
    marked = [n for n, p in model.named_parameters() if getattr(p, "shared_embedding", False)]
    table = model.shared_embedding_or_output_weight().detach().clone()
    summed = table.clone()
    dist.all_reduce(summed, group=state.embedding_group)
    return marked, bool(torch.equal(summed, 2 * table))


def test_pipeline_tied_embedding_copies_are_marked_and_equal():
    first, last = run_distributed(_pipeline_worker, 2)
    assert first == (["embedding.word_embeddings.weight"], True)
    assert last == (["output_layer.weight"], True)
