"""vocab_parallel_cross_entropy against torch.nn.functional.cross_entropy."""
import pytest
import torch
import torch.nn.functional as F

from megatron_smp.config import ParallelConfig
from megatron_smp.parallel_state import build_parallel_state
from megatron_smp.testing import run_distributed
from megatron_smp.tensor_parallel import vocab_parallel_cross_entropy
from tests.unit.tensor_parallel.common import max_diff


def _reference(full_logits, target, vocab_size, label_smoothing, loss_weights):
    logits = full_logits.detach().clone().requires_grad_(True)
    v = logits.shape[-1]
    loss = F.cross_entropy(
        logits[..., :vocab_size].reshape(-1, vocab_size),
        target.reshape(-1),
        reduction="none",
        label_smoothing=label_smoothing,
    ).view(target.shape)
    (loss * loss_weights).sum().backward()
    assert logits.grad.shape[-1] == v
    return loss.detach(), logits.grad


def _sharded(rank, world_size, vocab_size, padded_vocab_size):
    state = build_parallel_state(ParallelConfig(tensor_model_parallel_size=world_size))
    generator = torch.Generator().manual_seed(11)
    # Large logits: exp() would overflow without the max subtraction.
    full = 50.0 * torch.randn(3, 2, padded_vocab_size, generator=generator)
    target = torch.randint(0, vocab_size, (3, 2), generator=generator)
    weights = torch.rand(3, 2, generator=generator)
    shard = padded_vocab_size // world_size
    diffs = {}
    for dtype, label_smoothing in (
        (torch.float32, 0.0), (torch.float32, 0.2), (torch.bfloat16, 0.2)
    ):
        local = full[..., rank * shard : (rank + 1) * shard].to(dtype).clone().requires_grad_(True)
        loss = vocab_parallel_cross_entropy(
            local, target, state.tp_group, vocab_size, label_smoothing
        )
        (loss * weights).sum().backward()
        ref_loss, ref_grad = _reference(
            full.to(dtype).float(), target, vocab_size, label_smoothing, weights
        )
        tag = f"{dtype}_{label_smoothing}"
        diffs[f"loss_{tag}"] = max_diff(loss, ref_loss)
        diffs[f"grad_{tag}"] = max_diff(
            local.grad.float(), ref_grad[..., rank * shard : (rank + 1) * shard]
        )
        assert loss.dtype == torch.float32 and local.grad.dtype == dtype
    return diffs


def test_vocab_parallel_cross_entropy_tp4_with_padding_only_shards():
    # Vocabulary 100 padded to 512: ranks 1-3 hold only padding columns.
    results = run_distributed(_sharded, 4, args=(100, 512))
    for rank, diffs in enumerate(results):
        assert len(diffs) == 6
        # bf16 logits are exact in fp32, so the loss has fp32's tolerance; the grad is
        # rounded to bf16 (relative error 2**-8).
        tolerance = {k: 5e-3 if k.startswith("grad_torch.bfloat16") else 1e-5 for k in diffs}
        bad = {k: v for k, v in diffs.items() if v >= tolerance[k]}
        assert not bad, (rank, bad)


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_single_rank_matches_torch(label_smoothing):
    generator = torch.Generator().manual_seed(3)
    full = 10.0 * torch.randn(4, 3, 16, generator=generator)
    target = torch.randint(0, 13, (4, 3), generator=generator)
    weights = torch.rand(4, 3, generator=generator)
    # bf16 input: computed in fp32, grad returned in bf16.
    for dtype, tolerance in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        logits = full.to(dtype).clone().requires_grad_(True)
        loss = vocab_parallel_cross_entropy(logits, target, None, 13, label_smoothing)
        (loss * weights).sum().backward()
        ref_loss, ref_grad = _reference(
            full.to(dtype).float(), target, 13, label_smoothing, weights
        )
        assert loss.dtype == torch.float32 and logits.grad.dtype == dtype
        assert max_diff(loss, ref_loss) < tolerance
        assert max_diff(logits.grad.float(), ref_grad) < tolerance
        # Padding columns get exactly zero gradient.
        assert torch.count_nonzero(logits.grad[..., 13:]) == 0
    # inplace=True (GPTModel's loss: nothing reads the logits after it) works on the fp32
    # logits themselves and gives the same loss and grads, bit for bit.
    source = full.clone().requires_grad_(True)
    logits = source * 1.0  # a non-leaf, as the output layer's
    loss = vocab_parallel_cross_entropy(logits, target, None, 13, label_smoothing,
                                        inplace=True)
    (loss * weights).sum().backward()
    copied = full.clone().requires_grad_(True)
    reference = vocab_parallel_cross_entropy(copied * 1.0, target, None, 13, label_smoothing)
    (reference * weights).sum().backward()
    assert torch.equal(loss, reference) and torch.equal(source.grad, copied.grad)
    assert not torch.equal(logits, full)  # overwritten, as documented
