"""Parallel layers at TP=2 and TP=4 against the TP=1 model built from the same seed.

One small model exercises every layer option and every mapping:
embedding (all-reduce or reduce-scatter) -> fused SwiGLU column (stride 2) -> row ->
tied output column (weight=) -> vocab-parallel cross-entropy (padded vocab 1000 -> 1024),
plus a gather_output column with skip_bias_add, a row with input_is_parallel=False and a
gather from the sequence-parallel region into a replicated consumer.
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_smp.config import ParallelConfig
from megatron_smp.parallel_state import build_parallel_state
from megatron_smp.testing import run_distributed
from megatron_smp.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    gather_from_sequence_parallel_region,
    init_method_normal,
    param_is_not_tensor_parallel_duplicate,
    scaled_init_method_normal,
    scatter_to_sequence_parallel_region,
    vocab_parallel_cross_entropy,
)
from tests.unit.tensor_parallel.common import (
    gather_param,
    gather_param_grad,
    max_diff,
    tiny_config,
)

SEQ, BATCH, HIDDEN, FFN, OUT, VOCAB = 8, 2, 8, 8, 12, 1000


class TinyModel(torch.nn.Module):
    def __init__(self, config, tp_group, device=None):
        super().__init__()
        init = init_method_normal(0.5)  # large std: differences would show
        output_init = scaled_init_method_normal(0.5, config.num_layers)
        common = dict(config=config, tp_group=tp_group, device=device)
        self.embedding = VocabParallelEmbedding(
            VOCAB, HIDDEN, init_method=init,
            reduce_scatter_embeddings=config.sequence_parallel, **common,
        )
        self.fc1 = ColumnParallelLinear(HIDDEN, 2 * FFN, init_method=init, stride=2, **common)
        self.fc2 = RowParallelLinear(FFN, HIDDEN, init_method=output_init, **common)
        self.output_layer = ColumnParallelLinear(
            HIDDEN, self.embedding.padded_vocab_size, init_method=init, bias=False,
            skip_weight_param_allocation=True, **common,
        )
        self.head = ColumnParallelLinear(
            HIDDEN, OUT, init_method=init, gather_output=True, skip_bias_add=True, **common
        )
        self.tail = RowParallelLinear(
            OUT, HIDDEN, init_method=init, input_is_parallel=False, sequence_parallel=False,
            **common,
        )
        with torch.no_grad():  # non-zero biases (independent of TP) so that their handling shows
            for module in (self.fc1, self.fc2, self.head, self.tail):
                full = torch.linspace(-1.0, 1.0, module.output_size)
                if module.bias.tensor_model_parallel:
                    chunks = full.chunk(module.stride * module.tp_size)
                    full = torch.cat(chunks[module.tp_rank :: module.tp_size])
                module.bias.copy_(full)

    def forward(self, ids_sb, x, targets, weights, tp_group):
        sp = self.fc1.sequence_parallel
        ids = ids_sb if sp else ids_sb.t()  # [s, b] for the reduce-scatter, else [b, s]
        embedded = self.embedding(ids)
        if not sp:
            embedded = embedded.transpose(0, 1)
        hidden = embedded + (scatter_to_sequence_parallel_region(x, tp_group) if sp else x)
        gate_up, _ = self.fc1(hidden)
        gate, up = gate_up.chunk(2, dim=-1)
        hidden, _ = self.fc2(F.silu(gate) * up)
        logits, _ = self.output_layer(hidden, weight=self.embedding.weight)
        loss = vocab_parallel_cross_entropy(logits, targets, tp_group, vocab_size=VOCAB)
        smoothed = vocab_parallel_cross_entropy(logits, targets, tp_group, VOCAB, 0.1)
        head, head_bias = self.head(hidden)
        head = head + head_bias
        tail, _ = self.tail(head)
        full_hidden = (
            gather_from_sequence_parallel_region(hidden, tp_group, False) if sp else hidden
        )
        objective = (
            (loss * weights[0]).sum() + (smoothed * weights[1]).sum()
            + (head * weights[2]).sum() + (tail * weights[3]).sum()
            + (full_hidden * weights[4]).sum()
        )
        return objective, dict(loss=loss, smoothed=smoothed, logits=logits, head=head, tail=tail)


def _inputs():
    generator = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (SEQ, BATCH), generator=generator)
    targets = torch.randint(0, VOCAB, (SEQ, BATCH), generator=generator)
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=generator)
    weights = [
        torch.rand(SEQ, BATCH, generator=generator),
        torch.rand(SEQ, BATCH, generator=generator),
        torch.randn(SEQ, BATCH, OUT, generator=generator),
        torch.randn(SEQ, BATCH, HIDDEN, generator=generator),
        torch.randn(SEQ, BATCH, HIDDEN, generator=generator),
    ]
    return ids, targets, x, weights


def _run(model, tp_group):
    ids, targets, x, weights = _inputs()
    x.requires_grad_(True)
    objective, outputs = model(ids, x, targets, weights, tp_group)
    objective.backward()
    return objective.detach(), outputs, x.grad


def _compare_with_tp1(rank, world_size):
    state = build_parallel_state(ParallelConfig(tensor_model_parallel_size=world_size))
    tp_group = state.tp_group
    single_group, _ = dist.new_subgroups(group_size=1)  # this rank alone: the TP=1 reference

    torch.manual_seed(1234)
    reference = TinyModel(tiny_config(), single_group)
    ref_objective, ref_outputs, ref_x_grad = _run(reference, single_group)
    ref_params = dict(reference.named_parameters())
    # Gathered, unpadded logits through F.cross_entropy: what the vocab-parallel loss must equal.
    ref_logits = ref_outputs["logits"][..., :VOCAB].reshape(-1, VOCAB)
    _, targets, _, _ = _inputs()
    torch_loss = F.cross_entropy(ref_logits, targets.reshape(-1), reduction="none")
    torch_smoothed = F.cross_entropy(
        ref_logits, targets.reshape(-1), reduction="none", label_smoothing=0.1
    )

    diffs = {
        "torch_loss": max_diff(ref_outputs["loss"].reshape(-1), torch_loss),
        "torch_smoothed": max_diff(ref_outputs["smoothed"].reshape(-1), torch_smoothed),
    }
    for sequence_parallel in (False, True):
        tag = "sp" if sequence_parallel else "tp"
        torch.manual_seed(1234)
        model = TinyModel(tiny_config(sequence_parallel=sequence_parallel), tp_group)
        # Padding rows are zero; the gathered weights are the TP=1 weights exactly.
        assert model.embedding.padded_vocab_size == 1024
        for name, param in model.named_parameters():
            full = gather_param(param, tp_group)
            if name == "embedding.weight":
                diffs[f"{tag}_padding_rows"] = full[VOCAB:].abs().max().item()
            diffs[f"{tag}_init_{name}"] = max_diff(full, ref_params[name])
        objective, outputs, x_grad = _run(model, tp_group)
        diffs[f"{tag}_objective"] = max_diff(objective, ref_objective)
        diffs[f"{tag}_x_grad"] = max_diff(x_grad, ref_x_grad)
        for key in ("loss", "smoothed", "head", "tail"):
            diffs[f"{tag}_{key}"] = max_diff(outputs[key], ref_outputs[key])
        # This rank's logits are its vocabulary shard of the TP=1 logits.
        shard = outputs["logits"].shape[-1]
        diffs[f"{tag}_logits"] = max_diff(
            outputs["logits"], ref_outputs["logits"][..., rank * shard : (rank + 1) * shard]
        )
        for name, param in model.named_parameters():
            diffs[f"{tag}_grad_{name}"] = max_diff(
                gather_param_grad(param, tp_group), ref_params[name].grad
            )
        sequence_parallel_params = sorted(
            n for n, p in model.named_parameters() if getattr(p, "sequence_parallel", False)
        )
    counted = sorted(
        n for n, p in model.named_parameters()
        if param_is_not_tensor_parallel_duplicate(p, state.tp_rank)
    )
    return diffs, sequence_parallel_params, counted


@pytest.mark.parametrize("tp", [2, 4])
def test_layers_match_tp1(tp):
    results = run_distributed(_compare_with_tp1, tp)
    for rank, (diffs, sequence_parallel_params, counted) in enumerate(results):
        bad = {k: v for k, v in diffs.items() if not v <= 2e-5}
        assert not bad, (rank, bad)
        # 2 torch checks + per mode: padding, 9 inits, objective, x grad, 5 outputs, 9 grads.
        assert len(diffs) == 2 + 2 * 26, sorted(diffs)
        # A row bias under SP sees one sequence shard: its grad needs a TP all-reduce.
        assert sequence_parallel_params == ["fc2.bias"]
        # Replicated row biases count in grad norms on TP rank 0 only.
        replicated = {"fc2.bias", "tail.bias"}
        expected = {
            "embedding.weight", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias",
            "head.weight", "head.bias", "tail.weight", "tail.bias",
        }
        assert set(counted) == (expected if rank == 0 else expected - replicated)


def test_single_process_layers_and_meta_init():
    """Without torch.distributed the layers are plain layers; a meta-built model reset in
    construction order equals the eagerly built one; attributes are set."""
    config = tiny_config(params_dtype=torch.float64)
    torch.manual_seed(5)
    eager = TinyModel(config, None)
    meta = TinyModel(config, None, device="meta")
    assert meta.fc1.weight.is_meta
    meta.to_empty(device="cpu")
    torch.manual_seed(5)
    for module in (meta.embedding, meta.fc1, meta.fc2, meta.output_layer, meta.head, meta.tail):
        module.reset_parameters()
    for (name, a), (_, b) in zip(eager.named_parameters(), meta.named_parameters()):
        assert a.dtype == torch.float64
        if name.endswith("bias"):
            assert torch.count_nonzero(b) == 0  # reset zeroes biases
        else:
            assert torch.equal(a, b), name
    assert eager.fc1.weight.partition_dim == 0 and eager.fc1.weight.partition_stride == 2
    assert eager.fc2.weight.partition_dim == 1 and eager.fc2.bias.tensor_model_parallel is False
    assert eager.fc1.weight.allreduce is True
    expert = ColumnParallelLinear(
        4, 4, config=config, tp_group=None, init_method=init_method_normal(1.0), is_expert=True
    )
    assert expert.weight.allreduce is False and expert.bias.allreduce is False

    # The unpadded rows of an untied output layer are drawn like an unpadded layer's.
    torch.manual_seed(3)
    plain = ColumnParallelLinear(4, 10, config=config, tp_group=None,
                                 init_method=init_method_normal(1.0))
    torch.manual_seed(3)
    padded = ColumnParallelLinear(4, 16, config=config, tp_group=None,
                                  init_method=init_method_normal(1.0), true_output_size=10)
    assert torch.equal(padded.weight[:10], plain.weight)
    assert torch.count_nonzero(padded.weight[10:]) == 0

    output, bias = plain(torch.ones(3, 2, 4, dtype=torch.float64))
    assert bias is None and output.shape == (3, 2, 10)
    with pytest.raises(ValueError, match="weight="):
        ColumnParallelLinear(4, 4, config=config, tp_group=None, skip_weight_param_allocation=True,
                             init_method=init_method_normal(1.0))(torch.ones(1, 4))


def test_inference_linear_takes_onednn_and_equals_f_linear():
    """`linear` under inference mode on the CPU in fp32 with >= ONEDNN_MIN_ROWS rows calls
    oneDNN's GEMM (the same product to rounding); fewer rows, autograd or no_grad (training,
    evaluation) keep F.linear bit for bit."""
    from torch.profiler import profile

    from megatron_smp.tensor_parallel.layers import linear

    generator = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(24, 16, generator=generator), torch.randn(24, generator=generator)
    onednn = []
    for shape in ((1, 16), (3, 16), (4, 16), (9, 1, 16)):
        x = torch.randn(*shape, generator=generator)
        expected = F.linear(x, weight, bias)
        assert torch.equal(linear(x, weight, bias), expected)
        with torch.no_grad():
            assert torch.equal(linear(x, weight, bias), expected)
        with torch.inference_mode(), profile() as prof:
            out = linear(x, weight, bias)
        if any("_linear_pointwise" in event.name for event in prof.events()):
            onednn.append(shape)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert onednn == [(4, 16), (9, 1, 16)] or not torch.backends.mkldnn.is_available()
