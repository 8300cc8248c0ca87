"""The chunked scans of the recurrent mixers equal their step-by-step recurrences (fp64),
for chunk sizes that do and do not divide the length, with and without packed documents."""
import pytest
import torch

from megatron_smp.transformer.ssm.ops import (
    causal_conv1d,
    gated_delta_rule_chunked,
    gated_delta_rule_recurrent,
    l2norm,
    segment_ids,
    ssd_chunked,
    ssd_recurrent,
)

TOL = 1e-10


def _segments(b, s, packed):
    if not packed:
        return None
    doc = torch.zeros(b, s, dtype=torch.long)
    doc[0, 5:] = 1
    doc[0, 14:] = 2  # a document boundary inside a chunk and one on... any chunk size
    if b > 1:
        doc[1, 8:] = 7
    return segment_ids(doc)


def _ssd_inputs(b=2, s=23, h=4, p=3, g=2, n=5):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(b, s, h, p, generator=gen, dtype=torch.float64)
    dt = torch.nn.functional.softplus(torch.randn(b, s, h, generator=gen, dtype=torch.float64))
    A = -torch.rand(h, generator=gen, dtype=torch.float64) * 2 - 0.1
    B = torch.randn(b, s, g, n, generator=gen, dtype=torch.float64)
    C = torch.randn(b, s, g, n, generator=gen, dtype=torch.float64)
    D = torch.randn(h, generator=gen, dtype=torch.float64)
    state = torch.randn(b, h, p, n, generator=gen, dtype=torch.float64)
    return x, dt, A, B, C, D, state


@pytest.mark.parametrize("chunk", [1, 4, 8, 23, 32])
@pytest.mark.parametrize("packed", [False, True])
def test_ssd_chunked_equals_recurrence(chunk, packed):
    x, dt, A, B, C, D, state = _ssd_inputs()
    segments = _segments(x.shape[0], x.shape[1], packed)
    ref, ref_state = ssd_recurrent(x, dt, A, B, C, D, state, segments, return_final_state=True)
    out, out_state = ssd_chunked(x, dt, A, B, C, chunk, D, state, segments,
                                 return_final_state=True)
    assert (out - ref).abs().max() < TOL
    assert (out_state - ref_state).abs().max() < TOL


def _gdn_inputs(b=2, s=23, hk=2, hv=4, dk=3, dv=5):
    gen = torch.Generator().manual_seed(1)
    q = l2norm(torch.randn(b, s, hk, dk, generator=gen, dtype=torch.float64))
    k = l2norm(torch.randn(b, s, hk, dk, generator=gen, dtype=torch.float64))
    v = torch.randn(b, s, hv, dv, generator=gen, dtype=torch.float64)
    g = -torch.nn.functional.softplus(torch.randn(b, s, hv, generator=gen, dtype=torch.float64))
    beta = torch.rand(b, s, hv, generator=gen, dtype=torch.float64)
    state = torch.randn(b, hv, dk, dv, generator=gen, dtype=torch.float64)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("chunk", [1, 4, 8, 23, 32])
@pytest.mark.parametrize("packed", [False, True])
def test_gated_delta_rule_chunked_equals_recurrence(chunk, packed):
    q, k, v, g, beta, state = _gdn_inputs()
    segments = _segments(q.shape[0], q.shape[1], packed)
    ref, ref_state = gated_delta_rule_recurrent(q, k, v, g, beta, None, state, segments, True)
    out, out_state = gated_delta_rule_chunked(q, k, v, g, beta, chunk, None, state, segments,
                                              True)
    assert (out - ref).abs().max() < TOL
    assert (out_state - ref_state).abs().max() < TOL


def test_packed_documents_equal_documents_run_alone():
    """A packed row's documents give what each gives alone (state reset at each start)."""
    x, dt, A, B, C, D, _ = _ssd_inputs(b=1)
    q, k, v, g, beta, _ = _gdn_inputs(b=1)
    doc = torch.tensor([[0] * 9 + [1] * 14])
    segments = segment_ids(doc)
    ssd = ssd_chunked(x, dt, A, B, C, 4, D, segments=segments)
    gdn = gated_delta_rule_chunked(q, k, v, g, beta, 4, segments=segments)
    for start, end in ((0, 9), (9, 23)):
        part = slice(start, end)
        alone = ssd_chunked(x[:, part], dt[:, part], A, B[:, part], C[:, part], 4, D)
        assert (ssd[:, part] - alone).abs().max() < TOL
        alone = gated_delta_rule_chunked(q[:, part], k[:, part], v[:, part], g[:, part],
                                         beta[:, part], 4)
        assert (gdn[:, part] - alone).abs().max() < TOL


def test_causal_conv1d_resets_and_continues():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 11, 6, generator=gen, dtype=torch.float64)
    w = torch.randn(6, 4, generator=gen, dtype=torch.float64)
    bias = torch.randn(6, generator=gen, dtype=torch.float64)
    plain = causal_conv1d(x, w, bias)
    # The shifted-sum path (used with segments / a state) equals conv1d's.
    same_doc = torch.zeros(2, 11, dtype=torch.long)
    assert (causal_conv1d(x, w, bias, segments=same_doc) - plain).abs().max() < TOL
    doc = torch.tensor([[0] * 4 + [1] * 7, [0] * 11])
    packed = causal_conv1d(x, w, bias, segments=segment_ids(doc))
    assert (packed[0, 4:] - causal_conv1d(x[:1, 4:], w, bias)[0]).abs().max() < TOL
    # A conv state continues a sequence: the second half given the first half's last inputs.
    state = x[:, 3:6].transpose(1, 2)
    assert (causal_conv1d(x[:, 6:], w, bias, initial_state=state) - plain[:, 6:]).abs().max() < TOL
