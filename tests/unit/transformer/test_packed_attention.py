"""Packed sequences (transformer/packed.py): every backend gives the dense document mask's
attention and grads, no attention weight crosses a document boundary (checked on the weights
the kernel is handed, and by perturbing other documents), the context-parallel query runs
attend exactly, and the backend choice follows the device's capability."""
import pytest
import torch
import torch.nn.functional as F

import megatron_smp.transformer.packed as packed_module
from megatron_smp.config import ConfigError
from megatron_smp.context_parallel.split import packed_rank_indices
from megatron_smp.transformer.packed import PackedSequence, packed_attention_plan

# Two rows: documents of 5, 11, 8 tokens and of 20, 4 (lengths that batch unevenly).
DOCUMENTS = torch.tensor([[0] * 5 + [1] * 11 + [2] * 8, [0] * 20 + [1] * 4])
B, NQ, NKV, S, D = 2, 4, 2, 24, 8


def _qkv(seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(B, n, S, D, generator=generator, requires_grad=True)
            for n in (NQ, NKV, NKV)]


def _reference(q, k, v):
    mask = PackedSequence(DOCUMENTS).dense_mask()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=~mask, enable_gqa=True)


def _grads(out, inputs):
    return torch.autograd.grad(out.square().sum(), inputs)


def test_backends_equal_the_dense_document_mask():
    q, k, v = _qkv()
    expected = _reference(q, k, v)
    expected_grads = _grads(expected, (q, k, v))
    for backend in ("auto", "segments", "mask"):
        out = PackedSequence(DOCUMENTS, backend=backend).attend(q, k, v)
        assert (out - expected).abs().max() < 1e-5, backend
        for grad, want in zip(_grads(out, (q, k, v)), expected_grads):
            assert (grad - want).abs().max() < 1e-5, backend
    with torch.no_grad():  # flex on the CPU: forward only (torch has no CPU flex backward)
        out = PackedSequence(DOCUMENTS, backend="flex").attend(q, k, v)
    assert (out - expected).abs().max() < 1e-5
    with pytest.raises(ConfigError, match="'flex' on the CPU"):
        PackedSequence(DOCUMENTS, backend="flex").attend(q, k, v)


def test_no_attention_weight_crosses_a_document(monkeypatch):
    """The segments engine is handed only same-document (query, key) pairs: each SDPA call's
    rows hold one document's queries and keys (plus zero padding that causality hides), and
    the weights it forms are zero outside them. Changing one document's tokens changes no
    other document's output, and the grads of the others' outputs do not reach it."""
    sequence = PackedSequence(DOCUMENTS)
    q, k, v = _qkv()
    calls = []
    original = F.scaled_dot_product_attention

    def spy(query, key, value, attn_mask=None, is_causal=False, **kwargs):
        scores = query @ key.repeat_interleave(query.shape[1] // key.shape[1], 1).transpose(-1, -2)
        if is_causal:
            scores = scores.masked_fill(
                torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
        calls.append(torch.softmax(scores, -1).detach())
        return original(query, key, value, attn_mask=attn_mask, is_causal=is_causal, **kwargs)

    monkeypatch.setattr(packed_module.F, "scaled_dot_product_attention", spy)
    sequence.attend(q, k, v)
    monkeypatch.undo()
    groups, _ = sequence._groups(q.device)
    flat_documents = (DOCUMENTS + 100 * torch.arange(B)[:, None]).flatten()
    padded = torch.cat([flat_documents, flat_documents.new_tensor([-1])])
    work = 0
    assert len(calls) == len(groups)
    for weights, group in zip(calls, groups):
        query_docs, key_docs = padded[group.q_index], padded[group.k_index]  # [n, Lq], [n, Lk]
        real_query = query_docs >= 0
        for row in range(len(query_docs)):
            assert len(set(query_docs[row][real_query[row]].tolist())) == 1
            own = set(query_docs[row][real_query[row]].tolist())
            assert set(key_docs[row].tolist()) - {-1} == own
        crossing = (query_docs[:, None, :, None] != key_docs[:, None, None, :]) \
            & real_query[:, None, :, None]
        assert torch.all(weights[crossing.expand_as(weights)] == 0)
        work += group.q_index.numel() * group.k_index.shape[1]
    # The work: about the documents' own squares, far from the rows' squares.
    assert work < 0.6 * B * S * S

    out = sequence.attend(q, k, v)
    first = DOCUMENTS == 0
    changed = [t.detach().clone() for t in (q, k, v)]
    for t in changed:
        t[0, :, first[0]] += 3.0  # row 0's first document only
    again = PackedSequence(DOCUMENTS).attend(*changed)
    keep = ~first[0]
    assert torch.equal(again[0][:, keep], out[0][:, keep].detach())
    assert torch.equal(again[1], out[1].detach())
    grads = torch.autograd.grad(out[0][:, keep].sum(), (q, k, v))
    for grad in grads:
        assert torch.all(grad[0][:, first[0]] == 0)


def test_context_parallel_runs_attend_exactly():
    """With cp = 2, rank r's queries (each document split load-balanced: chunks r and 3 - r)
    attend to the whole rows' keys exactly as the dense mask's rows of those tokens."""
    documents = torch.tensor([[0] * 8 + [1] * 4 + [2] * 12, [0] * 20 + [1] * 4])
    indices = packed_rank_indices(documents, 2)
    # Document 0 of row 0 (8 tokens) gives rank 0 its chunks 0 and 3: [0, 1] and [6, 7].
    assert indices[0, 0, :4].tolist() == [0, 1, 6, 7] and indices[1, 0, :4].tolist() == [2, 3, 4, 5]
    q, k, v = _qkv(1)
    mask = PackedSequence(documents).dense_mask()
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=~mask, enable_gqa=True)
    flat = lambda t: t.permute(0, 2, 1, 3).reshape(-1, t.shape[1], D)  # noqa: E731
    for rank in range(2):
        sequence = PackedSequence(documents, indices, rank)
        local = indices[rank]
        local_q = q.gather(2, local[:, None, :, None].expand(B, NQ, S // 2, D))
        out = sequence.attend_segments(flat(local_q), flat(k), flat(v))
        want = expected.gather(2, local[:, None, :, None].expand(B, NQ, S // 2, D))
        assert (out.view(B, S // 2, NQ, D).permute(0, 2, 1, 3) - want).abs().max() < 1e-5
    # Lengths that do not divide by 2 cp: the row is split as a whole.
    assert packed_rank_indices(DOCUMENTS, 2)[1, 0].tolist() == list(range(6, 18))


def test_backend_choice():
    bf16 = torch.bfloat16
    assert packed_attention_plan("auto", "cuda", bf16, 128, (9, 0), has_varlen=True) == "varlen"
    for args in (("cuda", bf16, 128, (7, 5)), ("cuda", torch.float32, 128, (9, 0)),
                 ("cuda", bf16, 100, (9, 0)), ("cpu", torch.float32, 64, (0, 0))):
        assert packed_attention_plan("auto", *args, has_varlen=True) == "segments", args
    assert packed_attention_plan("auto", "cuda", bf16, 128, (9, 0), dropout_p=0.1,
                                 has_varlen=True) == "segments"
    assert packed_attention_plan("auto", "cuda", bf16, 128, (9, 0), context_parallel=True,
                                 has_varlen=True) == "segments"
    assert packed_attention_plan("auto", "cuda", bf16, 128, (9, 0), has_varlen=False) == "segments"
    with pytest.raises(ConfigError, match="'varlen' needs .*capability 8.0"):
        packed_attention_plan("varlen", "cpu", torch.float32, 64)
    with pytest.raises(ConfigError, match="only 'segments'"):
        packed_attention_plan("mask", "cpu", torch.float32, 64, context_parallel=True)
    with pytest.raises(ConfigError, match="packed_attention must be one of"):
        packed_attention_plan("fast", "cpu", torch.float32, 64)
    assert packed_attention_plan("flex", "cuda", torch.float32, 64, (9, 0)) == "flex"
