"""Pretrain a GPT model (learned positions, LayerNorm, GeLU) with Megatron's flags.

    torchrun --nproc-per-node 2 pretrain_gpt.py --num-layers 4 --hidden-size 256 ...
"""
from functools import partial

import torch

from megatron_smp.context_parallel import (
    get_batch_on_this_cp_rank,
    masked_mean_over_context_parallel,
)
from megatron_smp.training import main, pretrain
from megatron_smp.training.per_token_loss import masked_sum_and_count


def model_provider(configs, state, pre_process=True, post_process=True, **stage):
    from megatron_smp.models.gpt import GPTModel

    return GPTModel(configs.model, state, pre_process=pre_process, post_process=post_process,
                    **stage)


def train_valid_test_datasets_provider(train_val_test_num_samples, configs, tokenizer):
    from megatron_smp.data import build_train_valid_test_datasets

    return build_train_valid_test_datasets(
        configs.data, configs.training.seq_length, configs.training.seed,
        train_val_test_num_samples, tokenizer,
        context_parallel_size=configs.parallel.context_parallel_size,
    )


def get_batch(data_iterator, device, state=None):
    """The next microbatch on `device`; with context parallelism (`state`) this rank's share
    of each sequence (chunks i and 2cp-1-i, global position ids; of each document for packed
    rows with `document_ids`)."""
    batch = next(data_iterator)
    batch = {key: value.to(device, non_blocking=True) for key, value in batch.items()}
    if state is not None:
        batch = get_batch_on_this_cp_rank(batch, state.cp_size, state.cp_rank)
    return batch


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor, cp_group=None,
              per_token: bool = False):
    """Mean per-token loss over the unmasked tokens of the microbatch (over the whole
    sequences with context parallelism: see `masked_mean_over_context_parallel`); with
    --calculate-per-token-loss (`per_token`) the masked sum. Either way this rank's tokens are
    reported as [sum, count], as Megatron's pretrain_gpt does, so the logged `lm loss` is the
    token-weighted mean over the global batch (equal to the mean of microbatch means unless
    the microbatches have different numbers of unmasked tokens)."""
    if per_token:
        loss, reported = masked_sum_and_count(output_tensor, loss_mask)
        return loss, {"lm loss": reported}
    loss, _ = masked_mean_over_context_parallel(output_tensor, loss_mask, cp_group)
    _, reported = masked_sum_and_count(output_tensor.detach(), loss_mask)
    return loss, {"lm loss": reported}


def forward_step(data_iterator, model):
    device = next(model.parameters()).device
    state = model.state
    batch = get_batch(data_iterator, device, state) if data_iterator is not None else None
    output = model(
        batch["tokens"] if batch else None,
        position_ids=batch["position_ids"] if batch else None,
        attention_mask=batch.get("attention_mask") if batch else None,
        labels=batch["labels"] if batch else None,
        document_ids=batch.get("document_ids") if batch else None,
        loss_mask=batch["loss_mask"] if batch else None,
    )
    return output, partial(loss_func, batch["loss_mask"] if batch else None,
                           cp_group=state.cp_group if state.cp_size > 1 else None,
                           per_token=getattr(getattr(model, "config", None),
                                             "calculate_per_token_loss", False))


if __name__ == "__main__":
    main(lambda: pretrain(
        train_valid_test_datasets_provider, model_provider, forward_step,
        args_defaults={"tokenizer_type": "GPT2BPETokenizer"},
    ))
