"""Muon and Lion (optimizer/muon.py): against torch.optim.Muon, the flags' effects, the QKV
split, the parameter routing, the three TP modes and the layer-wise shard layout."""
import math

import pytest
import torch
import torch.optim._muon as torch_muon

from megatron_smp.config import OptimizerConfig
from megatron_smp.distributed.param_and_grad_buffer import layer_wise_shard_layout
from megatron_smp.optimizer import get_param_groups, is_muon_parameter
from megatron_smp.optimizer.muon import (
    Lion,
    Muon,
    MuonParamInfo,
    muon_scale_factor,
    newton_schulz,
    ns_coefficients,
)
from megatron_smp.testing import run_distributed


def _torch_ns_in_fp32(grad, ns_coefficients, ns_steps, eps):
    """torch.optim.Muon's own iteration, line for line, without its cast to bf16."""
    a, b, c = ns_coefficients
    ortho = grad.float()
    if grad.size(0) > grad.size(1):
        ortho = ortho.T
    ortho = ortho / ortho.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = ortho @ ortho.T
        update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        ortho = torch.addmm(ortho, update, ortho, beta=a)
    return ortho.T if grad.size(0) > grad.size(1) else ortho


def _run_both(shape, nesterov, precision, steps=10, seed=0):
    torch.manual_seed(seed)
    start = torch.randn(shape)
    theirs, ours = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    reference = torch.optim.Muon([theirs], lr=0.02, weight_decay=0.1, momentum=0.9,
                                 nesterov=nesterov)
    # torch's "original" lr adjustment is shape_scaling; its coefficients are "simple".
    muon = Muon([{"params": [ours], "optimizer": "muon"}], lr=0.02, weight_decay=0.1,
                momentum=0.9, nesterov=nesterov, scale_mode="shape_scaling",
                coefficient_type="simple", matmul_precision=precision)
    for _ in range(steps):
        grad = torch.randn(shape)
        theirs.grad, ours.grad = grad.clone(), grad.clone()
        reference.step()
        muon.step()
    return theirs.detach(), ours.detach(), start


@pytest.mark.parametrize("shape", [(24, 8), (8, 24)])
@pytest.mark.parametrize("nesterov", [False, True])
def test_equals_torch_muon_over_ten_steps(monkeypatch, shape, nesterov):
    monkeypatch.setattr(torch_muon, "_zeropower_via_newtonschulz", _torch_ns_in_fp32)
    theirs, ours, _ = _run_both(shape, nesterov, precision="high")
    # Params of magnitude ~1; the orders of decay and lr scaling differ by an ulp or two.
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("scale_mode", ["spectral", "shape_scaling", "unit_rms_norm"])
@pytest.mark.parametrize("precision", ["high", "medium"])
def test_equals_emerging_optimizers(scale_mode, precision):
    """Megatron's own Muon and Lion (emerging_optimizers needs Python >= 3.12: skipped on an
    older interpreter)."""
    eo_muon = pytest.importorskip("emerging_optimizers.orthogonalized_optimizers.muon")
    from emerging_optimizers.scalar_optimizers import Lion as TheirLion

    torch.manual_seed(6)
    start = torch.randn(32, 16)
    theirs, ours = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    reference = eo_muon.Muon([theirs], lr=0.02, momentum=0.9, nesterov=True, weight_decay=0.1,
                             weight_decay_method="decoupled", fp32_matmul_prec=precision,
                             coefficient_type="quintic", num_ns_steps=5, scale_mode=scale_mode)
    muon = Muon([{"params": [ours], "optimizer": "muon"}], lr=0.02, momentum=0.9,
                nesterov=True, weight_decay=0.1, scale_mode=scale_mode,
                matmul_precision=precision)
    lion_theirs, lion_ours = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    lion_reference = TheirLion([lion_theirs], lr=0.01, betas=(0.95, 0.98), weight_decay=0.1)
    lion = Lion([{"params": [lion_ours]}], lr=0.01, betas=(0.95, 0.98), weight_decay=0.1)
    for _ in range(10):
        grad = torch.randn(32, 16)
        theirs.grad, ours.grad = grad.clone(), grad.clone()
        lion_theirs.grad, lion_ours.grad = grad.clone(), grad.clone()
        for optimizer in (reference, muon, lion_reference, lion):
            optimizer.step()
    assert torch.equal(ours, theirs)
    torch.testing.assert_close(lion_ours, lion_theirs, rtol=1e-6, atol=1e-6)


def test_bf16_iteration_close_to_torch_muon():
    # --muon-fp32-matmul-prec medium (the default) iterates in bf16, as torch's Muon does
    # (which normalises in bf16, we in fp32 before the cast): bf16-rounding apart.
    theirs, ours, start = _run_both((24, 8), True, precision="medium")
    moved = (theirs - start).abs().max().item()
    assert (theirs - ours).abs().max().item() < 0.02 * moved


def test_lion_update_rule_and_decay():
    torch.manual_seed(1)
    param = torch.nn.Parameter(torch.randn(5, 3))
    lion = Lion([{"params": [param]}], lr=0.01, weight_decay=0.1, betas=(0.95, 0.98))
    expected, moment = param.detach().clone(), torch.zeros(5, 3)
    for _ in range(10):
        grad = torch.randn(5, 3)
        param.grad = grad.clone()
        lion.step()
        expected = expected * (1 - 0.01 * 0.1)
        expected = expected - 0.01 * torch.sign(0.95 * moment + 0.05 * grad)
        moment = 0.98 * moment + 0.02 * grad
    assert torch.allclose(param.detach(), expected, atol=1e-6)


def test_coefficient_sets_orthogonalise():
    torch.manual_seed(2)
    matrix = torch.randn(16, 48)
    for kind in ("simple", "quintic", "polar_express", "aol"):
        singular = torch.linalg.svdvals(newton_schulz(matrix, 5, kind, "high"))
        assert 0.3 < singular.min() and singular.max() < 1.3, (kind, singular)
    # Per-step sets: polar_express repeats its last triple, quintic cycles.
    assert ns_coefficients("polar_express", 10)[9] == ns_coefficients("polar_express", 8)[7]
    assert ns_coefficients("quintic", 6)[5] == ns_coefficients("quintic", 1)[0]
    with pytest.raises(ValueError, match="--muon-coefficient-type"):
        ns_coefficients("cubic", 5)


def test_flags_change_the_update():
    """--muon-scale-mode, --muon-extra-scale-factor, --muon-num-ns-steps,
    --muon-coefficient-type and --muon-momentum each change the step as they say."""
    torch.manual_seed(3)
    start, grads = torch.randn(12, 4), torch.randn(2, 12, 4)

    def delta(**kwargs):
        param = torch.nn.Parameter(start.clone())
        settings = dict(lr=0.1, momentum=0.9, matmul_precision="high")
        settings.update(kwargs)
        muon = Muon([{"params": [param], "optimizer": "muon"}], **settings)
        for grad in grads:
            param.grad = grad.clone()
            muon.step()
        return (param.detach() - start)

    spectral = delta()
    assert torch.allclose(delta(scale_mode="shape_scaling") * muon_scale_factor(12, 4, "spectral"),
                          spectral * muon_scale_factor(12, 4, "shape_scaling"), atol=1e-6)
    assert torch.allclose(delta(scale_mode="unit_rms_norm") / math.sqrt(3),
                          spectral / math.sqrt(12), atol=1e-6)
    assert torch.allclose(delta(extra_scale_factor=0.5), 0.5 * spectral, atol=1e-6)
    assert not torch.allclose(delta(num_ns_steps=2), spectral, atol=1e-3)
    assert not torch.allclose(delta(coefficient_type="polar_express"), spectral, atol=1e-3)
    assert not torch.allclose(delta(momentum=0.5), spectral, atol=1e-3)
    assert not torch.allclose(delta(nesterov=True), spectral, atol=1e-3)


def test_qkv_split_respects_gqa():
    """q, k and v of every query group are orthogonalised as three matrices; with
    --muon-no-split-qkv the fused weight is one."""
    torch.manual_seed(4)
    groups, q_per_group, head_dim, hidden = 2, 3, 4, 16
    shapes = (q_per_group * head_dim, head_dim, head_dim)
    momentum = torch.randn(groups * sum(shapes), hidden)
    muon = Muon([{"params": [torch.nn.Parameter(momentum.clone())], "optimizer": "muon"}],
                matmul_precision="high", scale_mode="shape_scaling")
    split = muon.orthogonalize(momentum, MuonParamInfo(qkv_split_shapes=shapes))
    per_group = momentum.view(groups, sum(shapes), hidden)
    for part, rows in zip(torch.split(per_group, shapes, dim=1),
                          torch.split(split.view(groups, sum(shapes), hidden), shapes, dim=1)):
        whole = part.reshape(-1, hidden)
        expected = newton_schulz(whole, 5, "quintic", "high") * muon_scale_factor(
            *whole.shape, "shape_scaling")
        assert torch.allclose(rows.reshape(-1, hidden), expected, atol=1e-6)
    fused = muon.orthogonalize(momentum, MuonParamInfo())
    assert torch.allclose(fused, newton_schulz(momentum, 5, "quintic", "high") * muon_scale_factor(
        *momentum.shape, "shape_scaling"), atol=1e-6)
    assert not torch.allclose(fused, split, atol=1e-2)


def _tiny_gpt(num_experts=None):
    from megatron_smp.config import ParallelConfig, TransformerConfig
    from megatron_smp.models.gpt import GPTModel
    from megatron_smp.parallel_state import build_parallel_state

    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=4,
                               num_query_groups=2, vocab_size=64, max_position_embeddings=8,
                               num_moe_experts=num_experts, add_bias_linear=True)
    return GPTModel(config, build_parallel_state(ParallelConfig()))


def test_param_routing_muon_and_scalar():
    model = _tiny_gpt(num_experts=2)
    config = OptimizerConfig(optimizer="muon", muon_scalar_optimizer="lion")
    groups = get_param_groups([model], config)
    names = {p: n for n, p in model.named_parameters()}
    muon = {names[p] for g in groups if g["optimizer"] == "muon" for p in g["params"]}
    scalar = {names[p] for g in groups if g["optimizer"] == "lion" for p in g["params"]}
    assert all(g["optimizer"] in ("muon", "lion") for g in groups)
    assert not any("embedding" in n or "bias" in n or "norm" in n for n in muon), muon
    assert any("word_embeddings" in n for n in scalar) and any("bias" in n for n in scalar)
    assert {n for n in muon if "local_experts" in n} == {
        n for n, p in model.named_parameters() if "local_experts" in n and p.dim() == 2}
    assert any("linear_qkv.weight" in n for n in muon)
    qkv = next(p for n, p in model.named_parameters() if n.endswith("linear_qkv.weight"))
    assert qkv.qkv_split_shapes == (2 * 4, 4, 4)  # 2 query heads per group, head dim 4
    assert not is_muon_parameter("embedding.position_embeddings.weight", torch.zeros(8, 16))
    adam_groups = get_param_groups([model], OptimizerConfig(optimizer="muon"))
    assert {g["optimizer"] for g in adam_groups} == {"muon", "adam"}


def test_layer_wise_shard_layout_balances_whole_params():
    numels = [4096, 64, 4096, 1024, 1024, 64, 4096, 4096]
    starts, shard_size = layer_wise_shard_layout(numels, 2)
    loads = [0, 0]
    for start, numel in zip(starts, numels):
        shard = start // shard_size
        assert (start + numel - 1) // shard_size == shard  # whole inside one shard
        loads[shard] += numel
    assert loads == [9280, 9280]  # sum 18560: a perfect split
    ranges = sorted(zip(starts, numels))
    assert all(a + n <= b for (a, n), (b, _) in zip(ranges, ranges[1:]))  # no overlap


def _tp_modes(rank, world_size):
    import torch.distributed as dist

    torch.manual_seed(5)
    whole = torch.randn(12, 20)
    results = {}
    for dim in (0, 1):
        shard = whole.chunk(world_size, dim=dim)[rank].contiguous()
        info = MuonParamInfo(partition_dim=dim, tp_group=dist.group.WORLD)
        for mode in ("blockwise", "duplicated", "distributed"):
            muon = Muon([{"params": [torch.nn.Parameter(shard.clone())], "optimizer": "muon"}],
                        tp_mode=mode, matmul_precision="high")
            results[(dim, mode)] = muon.orthogonalize(shard, info).numpy()
    return whole.numpy(), results  # numpy: torch tensors do not outlive the child


def test_tp_modes_against_whole_and_per_shard_references():
    outputs = [(torch.from_numpy(whole), {k: torch.from_numpy(v) for k, v in results.items()})
               for whole, results in run_distributed(_tp_modes, 2, timeout=120)]
    whole = outputs[0][0]
    reference = newton_schulz(whole, 5, "quintic", "high") * muon_scale_factor(12, 20, "spectral")
    for rank, (_, results) in enumerate(outputs):
        for dim in (0, 1):
            expected = reference.chunk(2, dim=dim)[rank]
            assert torch.allclose(results[(dim, "duplicated")], expected, atol=1e-6)
            assert torch.allclose(results[(dim, "distributed")], expected, atol=1e-5)
            shard = whole.chunk(2, dim=dim)[rank]
            blockwise = newton_schulz(shard, 5, "quintic", "high") * muon_scale_factor(
                *shard.shape, "spectral")
            assert torch.allclose(results[(dim, "blockwise")], blockwise, atol=1e-6)
            assert not torch.allclose(results[(dim, "blockwise")], expected, atol=1e-2)
