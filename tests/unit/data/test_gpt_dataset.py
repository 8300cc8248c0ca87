import os

import numpy as np
import pytest
import torch

from megatron_smp.config import ConfigError, DataConfig
from megatron_smp.data import build_train_valid_test_datasets
from megatron_smp.data.gpt_dataset import GPTDataset, get_ltor_masks_and_position_ids
from megatron_smp.data.indexed_dataset import IndexedDataset
from megatron_smp.data.tokenizers import NullTokenizer
from megatron_smp.testing import run_distributed

from .conftest import random_documents

EOD = 1000
TOKENIZER = NullTokenizer(EOD)


def test_one_epoch_covers_every_token_once(make_dataset):
    documents = random_documents(300, seed=1, eod=EOD)
    documents[5] = []  # an empty document is skipped, not a crash
    dataset = GPTDataset(
        IndexedDataset(make_dataset("ds", documents)), np.arange(300), None, 32, 7, EOD
    )
    # Epoch order: the documents in document_index order, concatenated.
    assert sorted(dataset.document_index.tolist()) == list(range(300))
    stream = np.concatenate([documents[i] for i in dataset.document_index if documents[i]])
    assert len(dataset) == (stream.size - 1) // 32
    assert sorted(dataset.shuffle_index.tolist()) == list(range(len(dataset)))
    covered = np.zeros(stream.size, dtype=np.int64)
    for index in range(len(dataset)):
        sample = dataset[index]
        start = int(dataset.shuffle_index[index]) * 32
        assert sample["tokens"].dtype == torch.int64 and sample["tokens"].shape == (32,)
        assert sample["tokens"].tolist() == stream[start : start + 32].tolist()
        assert sample["labels"].tolist() == stream[start + 1 : start + 33].tolist()
        covered[start : start + 32] += 1
    # Every token once, apart from the tail that cannot fill a last sample.
    assert (covered[: len(dataset) * 32] == 1).all() and stream.size - len(dataset) * 32 <= 32


def test_more_samples_than_an_epoch_repeats_documents(make_dataset):
    documents = random_documents(50, seed=2, eod=EOD)
    tokens = sum(len(d) for d in documents)
    wanted = 2 * tokens // 16 + 3
    dataset = GPTDataset(
        IndexedDataset(make_dataset("ds", documents)), np.arange(50), wanted, 16, 3, EOD
    )
    assert len(dataset) >= wanted
    assert np.bincount(dataset.document_index, minlength=50).tolist() == [3] * 50
    assert dataset[len(dataset) - 1]["tokens"].shape == (16,)


def test_masks_and_position_ids():
    tokens = torch.tensor([5, 6, EOD, 7, 8, EOD, 9])
    loss_mask, position_ids, document_ids = get_ltor_masks_and_position_ids(
        tokens, EOD, reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True
    )
    assert loss_mask.dtype == torch.float32
    assert loss_mask.tolist() == [1, 1, 0, 1, 1, 0, 1]
    assert position_ids.tolist() == [0, 1, 2, 0, 1, 2, 0]
    assert document_ids.tolist() == [0, 0, 0, 1, 1, 1, 2]
    from megatron_smp.transformer.packed import PackedSequence

    allowed = ~PackedSequence(document_ids[None]).dense_mask()[0, 0]
    # Token 4 sees its own document (3, 4) only; token 6 only itself.
    assert allowed[4].nonzero().flatten().tolist() == [3, 4]
    assert allowed[6].nonzero().flatten().tolist() == [6]
    _, position_ids, document_ids = get_ltor_masks_and_position_ids(
        tokens, EOD, False, True, False
    )
    assert position_ids.tolist() == list(range(7)) and document_ids.tolist()[-1] == 2
    loss_mask, position_ids, document_ids = get_ltor_masks_and_position_ids(
        tokens, EOD, False, False, False
    )
    assert document_ids is None and position_ids.tolist() == list(range(7))
    assert loss_mask.tolist() == [1.0] * 7


def config(tmp_path, data_path, **changes):
    return DataConfig(
        data_path=data_path, data_cache_path=str(tmp_path / "cache"), **changes
    )


def test_split_uses_disjoint_documents_and_caches_indices(make_dataset, tmp_path):
    documents = [[i] * 20 + [EOD] for i in range(100)]
    prefix = make_dataset("ds", documents)
    train, valid, test = build_train_valid_test_datasets(
        config(tmp_path, [prefix], split="80,20,0", reset_attention_mask=True),
        seq_length=10, seed=1, train_val_test_num_samples=[None, None, None],
        tokenizer=TOKENIZER,
    )
    assert test is None
    first_ids = lambda dataset: {int(i) for i in dataset.document_index}  # noqa: E731
    assert first_ids(train) == set(range(80)) and first_ids(valid) == set(range(80, 100))
    assert set(train[0]) == {"tokens", "labels", "loss_mask", "position_ids", "document_ids"}
    assert train[0]["document_ids"].shape == (10,)
    cached = sorted(os.listdir(tmp_path / "cache"))
    assert sum(name.endswith("sample_index.npy") for name in cached) == 2
    again, _, _ = build_train_valid_test_datasets(
        config(tmp_path, [prefix], split="80,20,0", reset_attention_mask=True),
        10, 1, [None, None, None], TOKENIZER,
    )
    assert isinstance(again.sample_index, np.memmap)  # loaded, not rebuilt
    assert sorted(os.listdir(tmp_path / "cache")) == cached
    assert torch.equal(again[3]["tokens"], train[3]["tokens"])


def test_blending_matches_weights_within_one_percent(make_dataset, tmp_path):
    a = make_dataset("a", [[1] * 30 + [EOD]] * 200)
    b = make_dataset("b", [[2] * 30 + [EOD]] * 200)
    c = make_dataset("c", [[3] * 30 + [EOD]] * 200)
    train, _, _ = build_train_valid_test_datasets(
        config(tmp_path, ["0.5", a, "0.3", b, "0.2", c], split="1,0,0"),
        8, 1, [10000, None, None], TOKENIZER,
    )
    assert len(train) == 10000
    counts = np.bincount(train.dataset_index, minlength=3) / 10000
    assert np.allclose(counts, [0.5, 0.3, 0.2], atol=0.01)
    # The samples really come from the named dataset.
    first_tokens = [int(train[i]["tokens"][0]) for i in range(0, 10000, 97)]
    origin = {1: 0, 2: 1, 3: 2, EOD: None}
    for i, token in zip(range(0, 10000, 97), first_tokens):
        assert origin[token] in (None, int(train.dataset_index[i]))
    # Greedy blending keeps every prefix on target, not just the total.
    prefix_share = np.bincount(train.dataset_index[:100], minlength=3) / 100
    assert np.allclose(prefix_share, [0.5, 0.3, 0.2], atol=0.02)


def test_mock_data_is_deterministic():
    data_config = DataConfig(mock_data=True, split="90,10,0")
    tokenizer = NullTokenizer(500)
    train, valid, test = build_train_valid_test_datasets(
        data_config, 64, 5, [100, 10, 0], tokenizer
    )
    again, _, _ = build_train_valid_test_datasets(data_config, 64, 5, [100, 10, 0], tokenizer)
    assert test is None and len(train) >= 100 and len(valid) >= 10
    assert torch.equal(train[17]["tokens"], again[17]["tokens"])
    assert int(train[17]["tokens"].max()) <= 500


@pytest.mark.parametrize(
    "data_path, message",
    [
        (["0.5", "PREFIX", "0.5"], "odd number"),
        (["-1", "PREFIX", "2", "PREFIX"], "must be >= 0"),
        (["0", "PREFIX", "0", "PREFIX"], "sum to zero"),
        (["x", "PREFIX", "0.5", "PREFIX"], "'x' should be a weight"),
        (["1", "PREFIX", "1", "missing"], "missing.idx not found"),
        (["PREFIX.bin"], "drop the .bin/.idx suffix"),
        ([], "--data-path is empty"),
    ],
)
def test_bad_data_paths_are_config_errors(make_dataset, tmp_path, data_path, message):
    prefix = make_dataset("ds", [[1, 2, 3, EOD]] * 10)
    data_path = [item.replace("PREFIX", prefix) for item in data_path]
    with pytest.raises(ConfigError, match="--data-path") as error:
        build_train_valid_test_datasets(config(tmp_path, data_path), 4, 1, [10, 0, 0], TOKENIZER)
    assert message in str(error.value)


def test_bad_split_and_too_little_data(make_dataset, tmp_path):
    prefix = make_dataset("ds", [[1, 2, 3, EOD]] * 10)
    with pytest.raises(ConfigError, match="--split"):
        build_train_valid_test_datasets(
            config(tmp_path, [prefix], split="a,b"), 4, 1, [1], TOKENIZER
        )
    # One epoch (no sample count) of 40 tokens holds no sample of 500.
    with pytest.raises(ConfigError, match="--seq-length 500"):
        build_train_valid_test_datasets(
            config(tmp_path, [prefix], split="1"), 500, 1, [None], TOKENIZER
        )
    # With a count, megatron-core repeats the 40 tokens over as many epochs as it needs.
    train, _, _ = build_train_valid_test_datasets(
        config(tmp_path, [prefix], split="1"), 500, 1, [1], TOKENIZER
    )
    assert len(train) == 1 and train[0]["tokens"].tolist()[:8] == [1, 2, 3, EOD] * 2


def _build_on_two_ranks(rank, world_size, prefix, cache_dir):
    import torch.distributed as dist

    data_config = DataConfig(data_path=[prefix], split="1,0,0", data_cache_path=cache_dir)
    # Rank 1 waits for rank 0 to post that the cache is written, then maps the files.
    train, _, _ = build_train_valid_test_datasets(data_config, 16, 9, [50, 0, 0], TOKENIZER)
    written_before = sorted(os.listdir(cache_dir))
    dist.barrier()
    return (
        type(train.sample_index).__name__,
        train[7]["tokens"].tolist(),
        written_before,
    )


def test_rank_zero_builds_others_load(make_dataset, tmp_path):
    prefix = make_dataset("ds", random_documents(100, seed=4, eod=EOD))
    cache_dir = str(tmp_path / "cache")
    (kind0, tokens0, files0), (kind1, tokens1, files1) = run_distributed(
        _build_on_two_ranks, world_size=2, args=(prefix, cache_dir), timeout=90
    )
    assert kind0 == "ndarray" and kind1 == "memmap"  # built on rank 0, mapped on rank 1
    assert tokens0 == tokens1 and files0 == files1
