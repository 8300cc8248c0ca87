"""Our GPT / blended datasets draw the same samples as megatron-core 0.16.1.

The references in tests/fixtures/data_megatron were recorded from megatron-core itself by
make_megatron_samples.py (see its docstring): per case, the sha1 of each of the first 1000
training samples and of every validation and test sample, and the first 8 samples in full.
"""
import hashlib
import json
import os

import numpy as np
import pytest

from megatron_smp.data.dataset_builder import (
    build_train_valid_test_datasets,
    parse_split,
    split_matrix,
    split_range,
)
from megatron_smp.config import DataConfig
from megatron_smp.data.tokenizers import NullTokenizer

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "..", "fixtures", "data_megatron")
REFERENCE = np.load(os.path.join(FIXTURES, "samples.npz"))
CASES = json.loads(str(REFERENCE["cases"]))
TOKENIZER = NullTokenizer(999)  # eod 999, as recorded


def _paths(items):
    if items is None:
        return None
    return [os.path.join(FIXTURES, item) if item.startswith("corpus_") else item for item in items]


def _sample_hash(sample) -> int:
    window = np.append(sample["tokens"].numpy(), int(sample["labels"][-1])).astype(np.int64)
    return int.from_bytes(hashlib.sha1(window.tobytes()).digest()[:8], "little")


@pytest.mark.parametrize("name", sorted(CASES))
def test_samples_equal_megatron_core(name, tmp_path):
    case = CASES[name]
    data_config = DataConfig(
        data_path=_paths(case.get("data_path")) or [],
        split=case.get("split", "969,30,1"),
        train_data_path=_paths(case.get("train_data_path")),
        valid_data_path=_paths(case.get("valid_data_path")),
        test_data_path=_paths(case.get("test_data_path")),
        data_cache_path=str(tmp_path),
    )
    gbs = case["global_batch_size"]
    sizes = [
        case["train_iters"] * gbs,
        (case["train_iters"] // case["eval_interval"] + 1) * case["eval_iters"] * gbs,
        case["eval_iters"] * gbs,
    ]
    datasets = build_train_valid_test_datasets(
        data_config, case["seq_length"], case["seed"], sizes, TOKENIZER
    )
    for split, dataset in zip(("train", "valid", "test"), datasets):
        length = int(REFERENCE[f"{name}/{split}/length"])
        if length < 0:
            assert dataset is None, split
            continue
        assert len(dataset) == length, split
        expected = REFERENCE[f"{name}/{split}/hashes"]
        assert expected.size == (min(length, 1000) if split == "train" else length)
        ours = np.array([_sample_hash(dataset[i]) for i in range(expected.size)], np.uint64)
        assert int((ours == expected).sum()) == expected.size, split
        first = np.stack([dataset[i]["tokens"].numpy() for i in range(8)])
        np.testing.assert_array_equal(first, REFERENCE[f"{name}/{split}/first_tokens"])


def test_split_boundaries_equal_megatron_core():
    reference = np.load(os.path.join(FIXTURES, "split_boundaries.npz"))
    sizes = reference["sizes"]
    for split in reference.files:
        if split == "sizes":
            continue
        matrix = split_matrix(parse_split(split))
        ours = np.full((sizes.size, 3, 2), -1, dtype=np.int32)
        for row, size in enumerate(sizes):
            for i, bookends in enumerate(matrix):
                if bookends is not None:
                    ours[row, i] = split_range(bookends, int(size))
        np.testing.assert_array_equal(ours, reference[split], err_msg=split)


@pytest.mark.parametrize("text", ["'99,1,0'", "99, 1, 0", "99/1/0", "99,1"])
def test_split_spellings_megatron_scripts_pass(text):
    assert parse_split(text) == pytest.approx([0.99, 0.01, 0.0], abs=0)
