import numpy as np
import torch

from megatron_smp.data import build_pretraining_data_loader
from megatron_smp.data.samplers import MegatronPretrainingSampler


class IndexDataset(torch.utils.data.Dataset):
    def __len__(self):
        return 103

    def __getitem__(self, index):
        return {"tokens": torch.tensor([index, index]), "loss_mask": torch.ones(2)}


def batches(loader, count):
    iterator = iter(loader)
    return [next(iterator)["tokens"][:, 0].tolist() for _ in range(count)]


def test_each_rank_gets_its_slice_of_every_global_micro_step():
    per_rank = [
        list(MegatronPretrainingSampler(103, 0, 3, rank, 2)) for rank in range(2)
    ]
    assert per_rank[0][:2] == [[0, 1, 2], [6, 7, 8]]
    assert per_rank[1][:2] == [[3, 4, 5], [9, 10, 11]]
    seen = sorted(i for rank in per_rank for batch in rank for i in batch)
    assert seen == list(range(102))  # 17 full global steps of 6; the last 1 is dropped
    assert len(MegatronPretrainingSampler(103, 0, 3, 0, 2)) == 17


def test_resume_continues_with_exactly_the_next_batch():
    dataset = IndexDataset()
    micro_batch, data_parallel_size = 2, 2
    for rank in range(data_parallel_size):
        uninterrupted = batches(
            build_pretraining_data_loader(dataset, 0, micro_batch, rank, data_parallel_size), 12
        )
        # Stopped after 5 iterations of 2 micro-batches each (global batch 8).
        consumed = 5 * 2 * micro_batch * data_parallel_size
        resumed = batches(
            build_pretraining_data_loader(
                dataset, consumed, micro_batch, rank, data_parallel_size, num_workers=0
            ),
            2,
        )
        assert resumed == uninterrupted[10:12]


def test_batched_dicts_and_missing_split():
    loader = build_pretraining_data_loader(IndexDataset(), 0, 4, 0, 1)
    batch = next(iter(loader))
    assert batch["tokens"].shape == (4, 2) and batch["loss_mask"].dtype == torch.float32
    assert build_pretraining_data_loader(None, 0, 4, 0, 1) is None


def test_resume_on_a_gpt_dataset(make_dataset):
    from megatron_smp.data.gpt_dataset import GPTDataset
    from megatron_smp.data.indexed_dataset import IndexedDataset

    from .conftest import random_documents

    dataset = GPTDataset(
        IndexedDataset(make_dataset("ds", random_documents(80, seed=3, eod=1000))),
        np.arange(80), None, 16, 11, 1000,
    )
    full = [b["tokens"] for b in build_pretraining_data_loader(dataset, 0, 2, 1, 2)]
    resumed = [b["tokens"] for b in build_pretraining_data_loader(dataset, 3 * 4, 2, 1, 2)]
    assert len(resumed) == len(full) - 3
    assert all(torch.equal(x, y) for x, y in zip(resumed, full[3:]))
