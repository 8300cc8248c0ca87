"""Padding-free packed batches through smp.transform, as Hugging Face decides them: rows of
several documents (odd lengths) with restarting position_ids, no attention mask and no cache,
or flash attention's cu_seq_lens_q/k + max_length_q/k, or seq_idx, give HF's logits and loss
(every document attending only to itself) for every family of the zoo (sliding windows, sinks,
MLA, MoE) at TP=1, TP=2 (SP for MoE) and EP=2, and under context parallelism (all_gather, split
per document) or a clear error. Boundaries that disagree, and keywords that cannot be honoured,
are ConfigErrors naming them."""
import warnings

import pytest
import torch

import megatron_smp as smp
from megatron_smp.config import ConfigError
from megatron_smp.testing import run_distributed

warnings.filterwarnings("ignore", message=".*")

SEQ = 16
ODD_DOCUMENTS = ([5, 3, 7, 1], [3, 9, 3, 1])  # windows of 5 reach inside the 7 and the 9
EVEN_DOCUMENTS = ([4, 8, 4], [8, 4, 4])  # each divides by 2 x cp: CP splits per document
MOE = ("mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss", "deepseek_v3")
TOLERANCE_LOGITS, TOLERANCE_LOSS = 2e-4, 1e-5  # against HF's logits and loss


def build(family):
    """A small random HF model of `family` (eval mode)."""
    import transformers as tf

    from tests.unit.models.test_deepseek_v3 import build_hf as build_deepseek_v3
    from tests.unit.models.test_hf_adapters import build_hf
    from tests.unit.models.test_hf_gpt_oss import build_gpt_oss
    from tests.unit.models.test_hf_zoo import _windowed

    if family == "gpt_oss":  # sinks, a sliding-window layer, YaRN, MoE
        return build_gpt_oss()
    if family == "deepseek_v3":  # MLA, grouped sigmoid routing, a dense first layer
        return build_deepseek_v3()
    if family == "qwen2_window":  # windows of 5 on layers 2-3 of 4
        return _windowed("qwen2")
    if family == "qwen3":
        torch.manual_seed(0)
        return tf.Qwen3ForCausalLM(tf.Qwen3Config(
            vocab_size=1003, num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=96, head_dim=24,
            max_position_embeddings=32)).eval()
    no_dropout = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return build_hf(family, **(no_dropout if family in ("gpt2", "gptj") else {}))


FAMILIES = ("gpt2", "llama", "llama31", "mistral", "qwen2", "qwen2_window", "qwen3",
            "gpt_neox", "gptj") + MOE


def packed_batch(vocab_size, documents=ODD_DOCUMENTS):
    """input_ids, position_ids (restarting per document), labels (-100 at each document's
    first label, as the flattening collators set them) [b, SEQ], and flash attention's
    cu_seq_lens over the flattened rows, the longest document, seq_idx [b, SEQ]."""
    generator = torch.Generator().manual_seed(7)
    ids = torch.randint(0, vocab_size, (len(documents), SEQ), generator=generator)
    lengths = torch.tensor([n for row in documents for n in row])
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in documents])
    labels = ids.masked_fill(positions == 0, -100)
    cu_seq_lens = torch.cat([torch.zeros(1, dtype=torch.int32),
                             lengths.cumsum(0).to(torch.int32)])
    seq_idx = torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32),
                                      lengths).view(len(documents), SEQ)
    return ids, positions, labels, cu_seq_lens, int(lengths.max()), seq_idx


def _hf_reference(hf, documents=ODD_DOCUMENTS):
    """HF's logits and loss of the packed batch, as HF decides it (position ids, no mask, no
    cache)."""
    ids, positions, labels, *_ = packed_batch(hf.config.vocab_size, documents)
    with torch.no_grad():
        out = hf(ids, position_ids=positions, labels=labels, use_cache=False)
    return out.logits, out.loss


def _hf_by_document(hf, documents=ODD_DOCUMENTS):
    """HF's logits of every document run alone, put back in their rows, and HF's loss of
    them: what packed attention means, for families whose HF masks ignore position ids."""
    ids, _, labels, *_ = packed_batch(hf.config.vocab_size, documents)
    rows = []
    with torch.no_grad():
        for row, lengths in enumerate(documents):
            pieces, start = [], 0
            for length in lengths:
                pieces.append(hf(ids[row:row + 1, start:start + length], use_cache=False).logits)
                start += length
            rows.append(torch.cat(pieces, dim=1))
        logits = torch.cat(rows)
        loss = hf.loss_function(logits=logits, labels=labels, vocab_size=hf.config.vocab_size)
    return logits, loss


def _diffs(model, hf, documents=ODD_DOCUMENTS, variants=("position_ids", "cu_seq_lens",
                                                          "seq_idx")):
    """{variant: (max |logit diff|, |loss diff|)} of `model` against HF on a packed batch.
    gpt-oss: HF's masks ignore position ids (so does the model, see
    test_gpt_oss_packs_by_flash_keywords_only), so the flash keywords are held against its
    documents run alone."""
    ids, positions, labels, cu, longest, seq_idx = packed_batch(hf.config.vocab_size, documents)
    packed = _hf_reference(hf, documents)
    alone = _hf_by_document(hf, documents) if hf.config.model_type == "gpt_oss" else packed
    calls = {
        # HF's own rule: restarting positions, no attention mask, no cache.
        "position_ids": dict(position_ids=positions, use_cache=False),
        # What DataCollatorWithFlattening(return_flash_attn_kwargs=True) sends; the cache
        # (config.use_cache) turns the position-id rule off, so the boundaries come from these.
        "cu_seq_lens": dict(position_ids=positions, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                            max_length_q=longest, max_length_k=longest),
        "seq_idx": dict(position_ids=positions, seq_idx=seq_idx),
    }
    out = {}
    with torch.no_grad():
        for variant in variants:
            expected_logits, expected_loss = packed if variant == "position_ids" else alone
            result = model(ids, labels=labels, return_logits=True, **calls[variant])
            out[variant] = (float((result.logits - expected_logits).abs().max()),
                            float((result.loss - expected_loss).abs()))
    return out


def _assert_close(diffs, where):
    for variant, (logits, loss) in diffs.items():
        assert logits < TOLERANCE_LOGITS and loss < TOLERANCE_LOSS, (where, variant, logits, loss)


@pytest.mark.parametrize("family", FAMILIES)
def test_tp1_matches_hf(family):
    smp.init({})
    hf = build(family)
    model = smp.transform(hf)
    _assert_close(_diffs(model, hf), family)
    # The documents are in HF's logits: one causal mask over each row (an all-ones padding
    # mask turns packing off) differs.
    ids, positions, *_ = packed_batch(hf.config.vocab_size)
    with torch.no_grad():
        across = model(ids, position_ids=positions, attention_mask=torch.ones_like(ids)).logits
    assert (across - _hf_by_document(hf)[0]).abs().max() > 1e-3


def test_gpt_oss_packs_by_flash_keywords_only():
    """transformers' GptOssModel builds its masks without position ids: restarting positions
    leave its documents attending to each other (checked here, so a transformers release that
    changes it shows), and the transformed model does the same, with a warning; the flash
    keywords separate them (held against the documents run alone in test_tp1_matches_hf)."""
    smp.init({})
    hf = build("gpt_oss")
    model = smp.transform(hf)
    ids, positions, *_ = packed_batch(hf.config.vocab_size)
    packed_logits = _hf_reference(hf)[0]
    assert (packed_logits - _hf_by_document(hf)[0]).abs().max() > 1e-2
    with torch.no_grad(), pytest.warns(UserWarning, match="builds its attention masks without"):
        got = model(ids, position_ids=positions, use_cache=False).logits
    assert (got - packed_logits).abs().max() < TOLERANCE_LOGITS


def _fused_head_loss(model, hf, ids, positions, labels):
    """The loss as TRL's fused LM head forms it: `base_model`'s hidden states through
    `get_output_embeddings()`'s full weight, HF's loss function."""
    hidden = model.base_model(input_ids=ids, position_ids=positions,
                              use_cache=False).last_hidden_state
    logits = hidden @ model.get_output_embeddings().weight.t()
    return hf.loss_function(logits=logits, labels=labels, vocab_size=hf.config.vocab_size)


def _grad_diff(model, hf, documents=ODD_DOCUMENTS, fused_head=False):
    """Max |grad - HF's grad| of the packed batch's loss over this rank's parameters: HF's
    grads sharded like this rank's (TP), this rank's grads summed over CP (and SP's partial
    ones over TP, as the data-parallel wrappers do). `fused_head`: the
    loss of TRL's fused LM head (`_fused_head_loss`) instead of the model's own."""
    import torch.distributed as dist

    from megatron_smp.models.hf import get_adapter
    from megatron_smp.models.sharding import shard_state_dict

    ids, positions, labels, *_ = packed_batch(hf.config.vocab_size, documents)
    hf.zero_grad(), model.zero_grad()
    expected_loss = hf(ids, position_ids=positions, labels=labels, use_cache=False).loss
    expected_loss.backward()
    if fused_head:
        loss = _fused_head_loss(model, hf, ids, positions, labels)
        assert abs(float(loss - expected_loss)) < TOLERANCE_LOSS
    else:
        loss = model(ids, position_ids=positions, labels=labels, use_cache=False).loss
    loss.backward()
    state = model.module.state
    full = get_adapter(hf).from_hf({name: p.grad for name, p in hf.named_parameters()},
                                   model.transformer_config)
    expected = shard_state_dict(full, model.transformer_config, state.tp_size, state.tp_rank)
    worst = 0.0
    for name, param in model.module.named_parameters():
        grad = param.grad.clone()
        if getattr(param, "sequence_parallel", False):  # partial over SP, as DDP sums them
            dist.all_reduce(grad, group=state.tp_group)
        if state.cp_size > 1:
            dist.all_reduce(grad, group=state.cp_group)
        worst = max(worst, float((grad - expected[name]).abs().max()))
    return worst


def _parallel_worker(rank, world_size):
    out = {}
    layouts = {"tp2": {"tensor_parallel_degree": 2}, "ep2": {"expert_parallel_degree": 2}}
    for layout, degrees in layouts.items():
        smp.init(dict(degrees))
        for family in FAMILIES:
            if layout == "ep2" and family not in MOE:
                continue
            hf = build(family)
            out[(layout, family)] = _diffs(smp.transform(hf), hf)
            if layout == "tp2" and family == "llama":  # sequence parallelism too; grads
                out[("tp2+sp", family)] = _diffs(
                    smp.transform(hf, config={"sequence_parallel": True}), hf)
                out["grads tp2"] = _grad_diff(smp.transform(hf), hf)
                out["grads tp2 fused head"] = _grad_diff(smp.transform(hf), hf, fused_head=True)
                out["grads tp2+sp fused head"] = _grad_diff(
                    smp.transform(hf, config={"sequence_parallel": True}), hf, fused_head=True)
    smp.init({"context_parallel_degree": 2})
    for family in ("llama", "gpt2", "gptj", "qwen3_moe", "deepseek_v3"):
        hf = build(family)
        model = smp.transform(hf, cp_comm_type="all_gather")
        # Odd lengths: the rows are split as a whole; lengths dividing 2 x cp: per document.
        out[("cp2", family)] = _diffs(model, hf, variants=("position_ids", "cu_seq_lens"))
        out[("cp2 per document", family)] = _diffs(model, hf, EVEN_DOCUMENTS, ("position_ids",))
        if family == "llama":
            out["grads cp2"] = _grad_diff(model, hf)
            out["grads cp2 per document"] = _grad_diff(model, hf, EVEN_DOCUMENTS)
            out["grads cp2 fused head"] = _grad_diff(model, hf, EVEN_DOCUMENTS, fused_head=True)
    errors = {}
    for family, comm_type in (("llama", "p2p"), ("llama", "a2a"), ("mistral", "all_gather")):
        hf = build(family)
        model = smp.transform(hf, cp_comm_type=comm_type)
        ids, positions, *_ = packed_batch(hf.config.vocab_size)
        try:
            model(ids, position_ids=positions, use_cache=False)
        except ConfigError as error:
            errors[(family, comm_type)] = str(error)
    out["cp errors"] = errors
    return out


def test_tp2_ep2_and_cp2_match_hf_or_refuse():
    results = run_distributed(_parallel_worker, 2, timeout=600)
    for result in results:
        errors = result.pop("cp errors")
        for layout in ("grads tp2", "grads cp2", "grads cp2 per document",
                       "grads tp2 fused head", "grads tp2+sp fused head",
                       "grads cp2 fused head"):
            assert result.pop(layout) < 1e-5, layout
        for where, diffs in result.items():
            _assert_close(diffs, where)
        assert {layout for layout, _ in result} == {"tp2", "tp2+sp", "ep2", "cp2",
                                                    "cp2 per document"}
        assert sum(layout == "ep2" for layout, _ in result) == len(MOE)
        assert "cp_comm_type 'all_gather'" in errors[("llama", "p2p")]
        assert "cp_comm_type 'all_gather'" in errors[("llama", "a2a")]
        assert "sliding windows" in errors[("mistral", "all_gather")]


def test_boundaries_that_disagree_or_cannot_be_honoured_are_errors():
    smp.init({})
    hf = build("llama")
    model = smp.transform(hf)
    ids, positions, labels, cu, longest, seq_idx = packed_batch(hf.config.vocab_size)
    flash = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest,
                 max_length_k=longest)
    other = cu.clone()
    other[1] += 1
    with pytest.raises(ConfigError, match="position_ids and cu_seq_lens_q/k put the document"):
        model(ids, position_ids=positions, use_cache=False,
              **dict(flash, cu_seq_lens_q=other, cu_seq_lens_k=other))
    with pytest.raises(ConfigError, match="seq_idx and cu_seq_lens_q/k"):
        model(ids, seq_idx=torch.zeros_like(seq_idx), **flash)
    with pytest.raises(ConfigError, match="without max_length_q, max_length_k"):
        model(ids, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    with pytest.raises(ConfigError, match="cu_seq_lens_q differs from cu_seq_lens_k"):
        model(ids, **dict(flash, cu_seq_lens_k=other))
    with pytest.raises(ConfigError, match="with an attention_mask"):
        model(ids, attention_mask=torch.ones_like(ids), **flash)
    with pytest.raises(ConfigError, match="max_length_k=3 is shorter"):
        model(ids, **dict(flash, max_length_k=3))
    across_rows = torch.tensor([0, 5, 8, 18, 32], dtype=torch.int32)
    with pytest.raises(ConfigError, match="from one row of the batch into the next"):
        model(ids, **dict(flash, cu_seq_lens_q=across_rows, cu_seq_lens_k=across_rows))
    with pytest.raises(ConfigError, match="from 0 to the batch's 2 x 16 = 32 tokens"):
        model(ids, **dict(flash, cu_seq_lens_q=cu[:-1], cu_seq_lens_k=cu[:-1]))
    with pytest.raises(ConfigError, match="seq_idx must be integer ids"):
        model(ids, seq_idx=seq_idx.flatten()[None])
    # HF keywords the model cannot honour, by their 5.x names too.
    for keyword, value in (("cache", object()), ("output_router_logits", True)):
        with pytest.raises(ConfigError, match=keyword):
            model(ids, **{keyword: value})
    with pytest.raises(ConfigError, match="unknown keyword 'foo'.*cu_seq_lens_q"):
        model(ids, foo=1)


def test_use_cache_decides_like_hf():
    """HF reads documents from position_ids only without a cache: use_cache=None falls back
    on config.use_cache (True), and then documents attend to each other, in HF and here (with
    a warning saying how to pack)."""
    smp.init({})
    hf = build("llama")
    model = smp.transform(hf)
    ids, positions, *_ = packed_batch(hf.config.vocab_size)
    with torch.no_grad():
        expected = hf(ids, position_ids=positions).logits
        with pytest.warns(UserWarning, match="pass use_cache=False"):
            got = model(ids, position_ids=positions).logits
        assert (got - expected).abs().max() < TOLERANCE_LOGITS
        hf.config.use_cache = False
        expected = hf(ids, position_ids=positions).logits
        assert (model(ids, position_ids=positions).logits - expected).abs().max() < 2e-4
        # A padding mask: HF's padding path, position ids only move RoPE.
        padding = torch.ones_like(ids)
        expected = hf(ids, position_ids=positions, attention_mask=padding).logits
        got = model(ids, position_ids=positions, attention_mask=padding).logits
        assert (got - expected).abs().max() < TOLERANCE_LOGITS


def test_config_defaults_that_cannot_be_honoured_are_errors():
    """HF takes output_router_logits (its loss then carries the balancing term),
    output_hidden_states and output_attentions from the config when the call leaves them out."""
    smp.init({})
    hf = build("qwen3_moe")
    model = smp.transform(hf)
    ids = torch.zeros(1, 4, dtype=torch.long)
    for name in ("output_router_logits", "output_hidden_states"):  # (sdpa refuses attentions)
        setattr(hf.config, name, True)
        with pytest.raises(ConfigError, match=f"config.{name}=True"):
            model(ids)
        assert model(ids, **{name: False}).logits.shape == (1, 4, 1003)
        setattr(hf.config, name, False)


def test_the_decision_follows_hf_attention_implementation():
    """HF's masks (sdpa / eager) start a document wherever a position is not its predecessor's
    plus one, without a cache; HF's flash path where the position is the smallest, in a batch
    of one row only, cache or not (and for every family)."""
    from megatron_smp.smp.hf_contract import packed_document_ids

    jump = torch.tensor([[0, 1, 2, 5, 6, 0, 1]])
    assert packed_document_ids(jump.shape, None, jump, False).tolist() == [[0, 0, 0, 1, 1, 2, 2]]
    for masks_read_position_ids in (True, False):
        flash = packed_document_ids(jump.shape, None, jump, True, attn_implementation=(
            "flash_attention_2"), masks_read_position_ids=masks_read_position_ids)
        assert flash.tolist() == [[0, 0, 0, 0, 0, 1, 1]]
    two_rows = jump.expand(2, -1)
    with pytest.warns(UserWarning, match="batch of one row only"):
        assert packed_document_ids(two_rows.shape, None, two_rows, False,
                                   attn_implementation="flash_attention_2") is None
    one_document = torch.arange(7)[None] + 3  # not from 0: still one document
    assert packed_document_ids(one_document.shape, None, one_document, False) is None
    assert packed_document_ids(jump.shape, torch.ones_like(jump), jump, False) is None


def test_data_collator_with_flattening_batches_match_hf():
    """transformers' DataCollatorWithFlattening with every keyword it can send (position ids,
    flash attention's arguments, seq_idx) goes straight into the transformed model."""
    from transformers import DataCollatorWithFlattening

    smp.init({})
    hf = build("qwen2")
    model = smp.transform(hf)
    generator = torch.Generator().manual_seed(3)
    features = [{"input_ids": torch.randint(0, 1003, (n,), generator=generator).tolist()}
                for n in (5, 3, 7, 1, 9)]
    for feature in features:
        feature["labels"] = list(feature["input_ids"])
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)(
        features)
    assert {"cu_seq_lens_q", "max_length_q", "seq_idx", "position_ids"} <= set(batch)
    with torch.no_grad():
        expected = hf(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                      labels=batch["labels"], use_cache=False)
        got = model(**batch, return_logits=True)
    assert (got.logits - expected.logits).abs().max() < TOLERANCE_LOGITS
    assert abs(float(got.loss - expected.loss)) < TOLERANCE_LOSS
