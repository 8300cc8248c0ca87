"""GPTModel at TP=2 with sequence parallelism through our DDP, finalize_model_grads and the
distributed optimizer equals TP=1 trained with plain torch: the SP norm grads are summed
over TP and the clipped grad norm counts TP-replicated params once."""
import torch

from megatron_smp.config import OptimizerConfig, ParallelConfig, TransformerConfig
from megatron_smp.distributed import DistributedDataParallel, finalize_model_grads
from megatron_smp.models import GPTModel
from megatron_smp.optimizer import get_megatron_optimizer
from megatron_smp.parallel_state import build_parallel_state
from megatron_smp.tensor_parallel.random import model_parallel_seed
from megatron_smp.testing import run_distributed
from tests.unit.distributed.toy_training import max_relative_difference

SEQ, VOCAB, ITERS = 16, 211, 3
OPTIMIZER = dict(lr=3e-3, weight_decay=0.1, clip_grad=0.5)


def _config(sequence_parallel):
    return TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB,
        max_position_embeddings=SEQ, hidden_dropout=0.0, attention_dropout=0.0,
        sequence_parallel=sequence_parallel,
    )


def _batch(iteration):
    generator = torch.Generator().manual_seed(iteration)
    return (torch.randint(0, VOCAB, (2, SEQ), generator=generator),
            torch.randint(0, VOCAB, (2, SEQ), generator=generator))


def _body(rank, world_size):
    # TP=1 reference on every rank, plain torch optimizer and clipping.
    state = build_parallel_state(ParallelConfig(tensor_model_parallel_size=1, data_parallel_size=2))
    model_parallel_seed(1234, state)
    reference = GPTModel(_config(False), state)
    named = list(reference.named_parameters())
    optimizer = torch.optim.AdamW(
        [{"params": [p for n, p in named if p.dim() > 1 and not n.endswith(".bias")]},
         {"params": [p for n, p in named if p.dim() == 1 or n.endswith(".bias")],
          "weight_decay": 0.0}],
        lr=OPTIMIZER["lr"], weight_decay=OPTIMIZER["weight_decay"], fused=True,
    )
    reference_losses, reference_norms = [], []
    for iteration in range(ITERS):
        ids, labels = _batch(iteration)
        optimizer.zero_grad()
        loss = reference(ids, labels=labels).mean()
        loss.backward()
        reference_norms.append(torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5).item())
        optimizer.step()
        reference_losses.append(loss.item())

    tp_state = build_parallel_state(
        ParallelConfig(tensor_model_parallel_size=2)
    )
    model_parallel_seed(1234, tp_state)
    config = OptimizerConfig(**OPTIMIZER, use_distributed_optimizer=True, overlap_grad_reduce=True)
    ddp = DistributedDataParallel(GPTModel(_config(True), tp_state), config, tp_state)
    tp_optimizer = get_megatron_optimizer(config, [ddp], tp_state)
    losses, norms = [], []
    for iteration in range(ITERS):
        ids, labels = _batch(iteration)
        tp_optimizer.zero_grad()
        loss = ddp(ids, labels=labels).mean()
        loss.backward()
        finalize_model_grads([ddp], tp_state)
        update_successful, grad_norm, _ = tp_optimizer.step()
        assert update_successful
        losses.append(loss.item())
        norms.append(grad_norm)
    return reference_losses, reference_norms, losses, norms


def test_gpt_tp2_sequence_parallel_matches_tp1():
    for reference_losses, reference_norms, losses, norms in run_distributed(_body, 2):
        assert max_relative_difference(norms, reference_norms) < 1e-4
        assert max_relative_difference(losses, reference_losses) < 1e-4
