"""--gradient-accumulation-fusion (on by default, as in Megatron-LM): linear layers add their
weight grads straight into `main_grad` and hand autograd no weight grad; the result is the
unfused path's, the DDP hook still fires once per weight (readiness), and a tied weight's
other grad (the embedding's) still arrives and is added."""
import pytest
import torch

from megatron_smp.config import OptimizerConfig, ParallelConfig, TransformerConfig
from megatron_smp.distributed import DistributedDataParallel
from megatron_smp.models import GPTModel
from megatron_smp.parallel_state import build_parallel_state
from megatron_smp.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    init_method_normal,
)
from megatron_smp.tensor_parallel.random import model_parallel_seed
from megatron_smp.testing import run_distributed
from tests.unit.training.test_arguments import BASE, parse

H, V, FFN = 8, 128, 16  # V: a multiple of 128, so the embedding is not padded


class _Net(torch.nn.Module):
    """embedding -> column (bias) -> row (bias) -> output layer tied to the embedding."""

    def __init__(self, fusion: bool, dtype=torch.float64):
        super().__init__()
        config = TransformerConfig(
            num_layers=1, hidden_size=H, num_attention_heads=2, vocab_size=V, max_position_embeddings=4,
            params_dtype=dtype, gradient_accumulation_fusion=fusion)
        init = init_method_normal(0.2)
        torch.manual_seed(0)
        self.embedding = VocabParallelEmbedding(V, H, config=config, tp_group=None,
                                                init_method=init)
        self.fc1 = ColumnParallelLinear(H, FFN, config=config, tp_group=None, init_method=init)
        self.fc2 = RowParallelLinear(FFN, H, config=config, tp_group=None, init_method=init)
        self.output_layer = ColumnParallelLinear(H, V, config=config, tp_group=None,
                                                 init_method=init, bias=False,
                                                 skip_weight_param_allocation=True)
        with torch.no_grad():
            self.fc1.bias.normal_()
            self.fc2.bias.normal_()

    def forward(self, ids):
        h = self.embedding(ids)
        h = h + self.fc2(torch.tanh(self.fc1(h)[0]))[0]
        return self.output_layer(h, weight=self.embedding.weight)[0]


def _backward(net, main_grads: bool):
    """One backward; returns (grad of each param as the optimizer would see it, hook calls)."""
    calls = {}
    for name, param in net.named_parameters():
        if main_grads:
            # fp32 main grads (fp64 for an fp64 model, to compare exactly)
            dtype = torch.float64 if param.dtype == torch.float64 else torch.float32
            param.main_grad = torch.zeros_like(param, dtype=dtype)

        def hook(p, name=name):
            calls[name] = calls.get(name, 0) + 1
            if main_grads and p.grad is not None:  # what our DDP's hook does
                p.main_grad.add_(p.grad)
                p.grad = None

        param.register_post_accumulate_grad_hook(hook)
    ids = torch.tensor([[1, 5, 7, 1], [3, 3, 0, 127]])
    logits = net(ids)
    (logits.float().square().mean() + logits.float().sum(-1).mean()).backward()
    grads = {n: (p.main_grad if main_grads else p.grad).double().clone()
             for n, p in net.named_parameters()}
    return grads, calls


def test_fused_weight_grads_land_in_main_grad_exactly_once():
    reference, _ = _backward(_Net(fusion=False), main_grads=False)
    unfused, unfused_calls = _backward(_Net(fusion=False), main_grads=True)
    net = _Net(fusion=True)
    fused, fused_calls = _backward(net, main_grads=True)
    names = {"embedding.weight", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
    assert set(fused) == names
    for name in names:
        torch.testing.assert_close(unfused[name], reference[name], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(fused[name], reference[name], rtol=1e-12, atol=1e-12)
    # The hook ran once per param either way (DDP marks readiness there), also for the
    # weights whose autograd grad is now None.
    assert fused_calls == unfused_calls == {name: 1 for name in names}
    # The tied weight's main grad holds both contributions: the embedding's (through the
    # hook) and the output layer's (fused). Neither alone is the total.
    tied = reference["embedding.weight"]
    assert (tied.abs().sum(-1) > 0).all()
    assert all(p.grad is None for p in net.parameters())


def test_fusion_is_off_without_main_grad_and_with_the_flag_off():
    # No main_grad (FSDP2, a bare module): plain autograd grads, fusion or not.
    net = _Net(fusion=True)
    grads, _ = _backward(net, main_grads=False)
    reference, _ = _backward(_Net(fusion=False), main_grads=False)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, reference[name], rtol=1e-12, atol=1e-12)
    # Fusion off with main grads: the autograd grads arrive in .grad (the hook adds them).
    net = _Net(fusion=False)
    seen = []
    net.fc1.weight.main_grad = torch.zeros_like(net.fc1.weight)
    net.fc1.weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad is None))
    net(torch.tensor([[1, 2]])).sum().backward()
    assert seen == [False] and net.fc1.weight.main_grad.abs().sum() == 0
    net = _Net(fusion=True)
    seen.clear()
    net.fc1.weight.main_grad = torch.zeros_like(net.fc1.weight)
    net.fc1.weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad is None))
    net(torch.tensor([[1, 2]])).sum().backward()
    assert seen == [True] and net.fc1.weight.main_grad.abs().sum() > 0


def test_bf16_weights_accumulate_into_fp32_main_grads():
    reference, _ = _backward(_Net(fusion=False, dtype=torch.bfloat16), main_grads=True)
    fused, _ = _backward(_Net(fusion=True, dtype=torch.bfloat16), main_grads=True)
    for name, grad in fused.items():
        if name == "embedding.weight":
            # Unfused, autograd first sums the tied weight's two bf16 grads in bf16; fused,
            # each is added to the fp32 main grad: equal to bf16 rounding.
            torch.testing.assert_close(grad, reference[name], rtol=2**-7, atol=2**-7)
        else:  # the same bf16 products, added to fp32 in backward rather than in the hook
            torch.testing.assert_close(grad, reference[name], rtol=0, atol=0)


@pytest.mark.parametrize("flag, expected", [([], True),
                                            (["--no-gradient-accumulation-fusion"], False)])
def test_flag(flag, expected):
    assert parse(BASE + flag).model.gradient_accumulation_fusion is expected


SEQ, VOCAB = 8, 64


def _gpt_grads(rank, world_size):
    state = build_parallel_state(ParallelConfig())
    out = {}
    for fusion in (True, False):
        model_parallel_seed(1234, state)
        config = TransformerConfig(
            num_layers=2, hidden_size=16, num_attention_heads=4, vocab_size=VOCAB,
            max_position_embeddings=SEQ, hidden_dropout=0.0, attention_dropout=0.0,
            gradient_accumulation_fusion=fusion)
        model = GPTModel(config, state)
        # Small buckets: several reductions launched during backward, each once its
        # params' hooks have all fired.
        ddp = DistributedDataParallel(
            model, OptimizerConfig(overlap_grad_reduce=True, ddp_bucket_size=700), state)
        launched = []
        for buffer in ddp.param_and_grad_buffers:
            buffer.on_grad_sync_start = lambda bucket: launched.append(bucket.index)
        ddp.zero_grad_buffer()
        generator = torch.Generator().manual_seed(rank)
        for microbatch in range(2):
            ids = torch.randint(0, VOCAB, (2, SEQ), generator=generator)
            loss = model(ids, labels=torch.roll(ids, -1, 1)).mean()
            if microbatch == 0:
                with ddp.no_sync():
                    loss.backward()
            else:
                loss.backward()
        during_backward = list(launched)
        ddp.finish_grad_sync()
        # numpy: tensors would travel back through shared-memory file descriptors
        out[fusion] = ({n: p.main_grad.numpy().copy() for n, p in model.named_parameters()},
                       sorted(during_backward), len(ddp.param_and_grad_buffers[0].buckets),
                       [n for n, p in model.named_parameters() if p.grad is not None])
    return out


def test_gpt_under_ddp_with_overlap_and_two_microbatches_matches_unfused():
    results = run_distributed(_gpt_grads, 2)
    for out in results:
        fused, launched, buckets, leftover = out[True]
        unfused, unfused_launched, _, _ = out[False]
        assert buckets >= 3 and launched == unfused_launched == list(range(buckets))
        assert leftover == []
        for name, grad in unfused.items():
            assert abs(grad).sum() > 0, name
            torch.testing.assert_close(torch.from_numpy(fused[name]), torch.from_numpy(grad),
                                       rtol=1e-5, atol=1e-7, msg=name)
    # Reduced: the same on both ranks.
    for name, grad in results[0][True][0].items():
        assert (grad == results[1][True][0][name]).all(), name
