"""Train a GPT with a loss of one's own through `Trainer` (label-smoothed cross entropy on
a counting task), at any layout:

    torchrun --nproc-per-node 2 examples/trainer_custom_loss.py --tensor-model-parallel-size 2
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron_smp.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy  # noqa: E402
from megatron_smp.training import Trainer, build_configs  # noqa: E402
from pretrain_gpt import model_provider  # noqa: E402

FLAGS = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
         "--max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 8 "
         "--train-iters 30 --lr 3e-3 --tokenizer-type NullTokenizer --vocab-size 64 "
         "--hidden-dropout 0 --attention-dropout 0 --mock-data").split()  # (batches made below)


def counting_batches(vocab_size, batch, length, seed):
    """Microbatches whose next token is always the previous one plus one."""
    generator = torch.Generator().manual_seed(seed)
    while True:
        start = torch.randint(0, vocab_size, (batch, 1), generator=generator)
        tokens = (start + torch.arange(length + 1)) % vocab_size
        yield {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}


def main(argv):
    configs, _ = build_configs(FLAGS + argv)
    trainer = Trainer.build(configs, model_provider)
    state, vocab_size = trainer.state, configs.model.vocab_size

    def loss_fn(logits, batch):  # logits [b, s, padded_vocab / tp], this rank's shard
        per_token = vocab_parallel_cross_entropy(logits, batch["targets"], state.tp_group,
                                                 vocab_size, label_smoothing=0.1)
        loss = per_token.mean()
        return loss, {"lm loss": loss.detach()}

    data = counting_batches(vocab_size, configs.training.micro_batch_size,
                            configs.training.seq_length, seed=state.dp_rank)
    while trainer.iteration < configs.training.train_iters:
        trainer.train_step(data, loss_fn=loss_fn)
    return [losses["lm loss"] for _, losses in sorted(trainer.read_losses().items())]


if __name__ == "__main__":
    print(main(sys.argv[1:]))
