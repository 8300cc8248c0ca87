"""Megatron's data flags, from the command line to the samples they change."""
import os

import numpy as np
import pytest
import torch

from megatron_smp.config import ConfigError, DataConfig
from megatron_smp.data import build_train_valid_test_datasets
from megatron_smp.data.indexed_dataset import IndexedDataset
from megatron_smp.data.tokenizers import NullTokenizer
from megatron_smp.training.arguments import parse_args, validate_configs

from .conftest import random_documents

EOD = 1000
TOKENIZER = NullTokenizer(EOD)
MODEL = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 16 "
         "--train-iters 10 --micro-batch-size 2 --vocab-size 1000").split()


def data_config(argv, tmp_path):
    configs = parse_args(MODEL + argv + ["--data-cache-path", str(tmp_path / "cache")])
    configs.model.vocab_size = 1001
    validate_configs(configs, world_size=1)
    return configs.data


def all_tokens(dataset):
    return np.stack([dataset[i]["tokens"].numpy() for i in range(len(dataset))])


@pytest.fixture
def corpora(make_dataset):
    return (make_dataset("a", random_documents(120, seed=1, eod=EOD)),
            make_dataset("b", random_documents(80, seed=2, eod=EOD, vocab=500)))


def test_per_split_data_paths_use_one_dataset_each(corpora, tmp_path):
    a, b = corpora
    per_split = data_config(["--train-data-path", a, "--valid-data-path", "0.5", a, "0.5", b],
                            tmp_path)
    train, valid, test = build_train_valid_test_datasets(per_split, 16, 3, [40, 20, 5], TOKENIZER)
    assert test is None
    # The train split is all of `a`: the same samples as --data-path a --split 1,0,0.
    whole, _, _ = build_train_valid_test_datasets(
        data_config(["--data-path", a, "--split", "1,0,0"], tmp_path), 16, 3, [40, 0, 0],
        TOKENIZER)
    np.testing.assert_array_equal(all_tokens(train), all_tokens(whole))
    # The validation blend draws from both, in equal shares (b's ids stay below 500).
    from_b = [bool(valid[i]["tokens"].max() < 500) for i in range(len(valid))]
    assert len(valid) == 20 and 0 < sum(from_b) < 20
    assert np.bincount(valid.dataset_index).tolist() == [10, 10]


def test_data_path_and_per_split_paths_are_exclusive(corpora, tmp_path):
    a, _ = corpora
    with pytest.raises(ConfigError, match="--data-path and --valid-data-path are exclusive"):
        data_config(["--data-path", a, "--valid-data-path", a], tmp_path)
    with pytest.raises(ConfigError, match="--train-data-path"):
        data_config([], tmp_path)
    with pytest.raises(ConfigError, match="drop --split"):
        data_config(["--train-data-path", a, "--split", "99,1,0"], tmp_path)
    assert data_config(["--data-path", a], tmp_path).split == "969,30,1"  # Megatron's default


def test_no_mmap_bin_files_reads_the_same_tokens_without_mapping(corpora, tmp_path):
    a, _ = corpora
    mapped_config = data_config(["--data-path", a, "--split", "90,10,0"], tmp_path)
    read_config = data_config(["--data-path", a, "--split", "90,10,0", "--no-mmap-bin-files"],
                              tmp_path)
    assert mapped_config.mmap_bin_files and not read_config.mmap_bin_files
    assert data_config(["--data-path", a, "--mmap-bin-files"], tmp_path).mmap_bin_files
    mapped = build_train_valid_test_datasets(mapped_config, 16, 3, [60, 10, 0], TOKENIZER)
    read = build_train_valid_test_datasets(read_config, 16, 3, [60, 10, 0], TOKENIZER)
    for ours, theirs in zip(mapped[:2], read[:2]):
        np.testing.assert_array_equal(all_tokens(ours), all_tokens(theirs))

    def bin_mappings():
        with open("/proc/self/maps") as maps:
            return sum(os.path.realpath(a + ".bin") in line for line in maps)

    del mapped
    import gc

    gc.collect()
    before = bin_mappings()
    dataset = IndexedDataset(a, mmap=False)
    tokens = [dataset.get(i) for i in range(len(dataset))]
    assert bin_mappings() == before  # no mapping of the .bin was made
    assert IndexedDataset(a).get(5).tolist() == tokens[5].tolist()
    kept = IndexedDataset(a)
    assert bin_mappings() == before + 1  # while the mmap reader does map it
    del kept


def test_quoted_split_from_megatron_scripts(corpora, tmp_path):
    a, _ = corpora
    quoted = data_config(["--data-path", a, "--split", "'99,1,0'"], tmp_path)
    plain = data_config(["--data-path", a, "--split", "99,1,0"], tmp_path)
    built = [build_train_valid_test_datasets(c, 16, 3, [30, 4, 0], TOKENIZER)
             for c in (quoted, plain)]
    for ours, theirs in zip(built[0][:2], built[1][:2]):
        np.testing.assert_array_equal(all_tokens(ours), all_tokens(theirs))
    assert built[0][2] is None


def test_mid_level_dataset_surplus_sizes_blend_components(corpora, tmp_path):
    a, b = corpora
    argv = ["--data-path", "0.25", a, "0.75", b, "--split", "1,0,0"]
    # ceil(100 * 1.1) is 111 in floats, as in megatron-core.
    for surplus, expected in (("0.005", [101, 302]), ("0.1", [111, 330])):
        config = data_config(argv + ["--mid-level-dataset-surplus", surplus], tmp_path)
        train, _, _ = build_train_valid_test_datasets(config, 16, 3, [400, 0, 0], TOKENIZER)
        # ceil(ceil(400 * w) * (1 + surplus)) samples requested of each component.
        assert [d.num_samples for d in train.datasets] == expected
        assert len(train) == 400
    with pytest.raises(ConfigError, match="--mid-level-dataset-surplus"):
        data_config(argv + ["--mid-level-dataset-surplus", "-1"], tmp_path)


def test_legacy_tokenizer_flag_reaches_the_data_config(tmp_path):
    assert not data_config(["--mock-data"], tmp_path).legacy_tokenizer
    assert data_config(["--mock-data", "--legacy-tokenizer"], tmp_path).legacy_tokenizer
    torch.manual_seed(0)  # keeps this module free of global RNG side effects on others


def test_data_args_files_hold_the_same_lists(corpora, tmp_path):
    a, b = corpora
    (tmp_path / "blend.txt").write_text(f"0.3 {a}\n0.7 {b}\n")
    (tmp_path / "per_split.json").write_text(
        '{"train": "%s", "valid": ["0.5", "%s", "0.5", "%s"], "test": null}' % (a, a, b))
    from_file = data_config(["--data-args-path", str(tmp_path / "blend.txt"),
                             "--split", "90,10,0"], tmp_path)
    inline = data_config(["--data-path", "0.3", a, "0.7", b, "--split", "90,10,0"], tmp_path)
    built = [build_train_valid_test_datasets(c, 16, 3, [50, 10, 0], TOKENIZER)
             for c in (from_file, inline)]
    for ours, theirs in zip(built[0][:2], built[1][:2]):
        np.testing.assert_array_equal(all_tokens(ours), all_tokens(theirs))
    per_file = data_config(["--per-split-data-args-path", str(tmp_path / "per_split.json")],
                           tmp_path)
    per_flags = data_config(["--train-data-path", a, "--valid-data-path", "0.5", a, "0.5", b],
                            tmp_path)
    built = [build_train_valid_test_datasets(c, 16, 3, [50, 10, 5], TOKENIZER)
             for c in (per_file, per_flags)]
    assert built[0][2] is None and built[1][2] is None
    for ours, theirs in zip(built[0][:2], built[1][:2]):
        np.testing.assert_array_equal(all_tokens(ours), all_tokens(theirs))
    with pytest.raises(ConfigError, match="--data-path and --data-args-path are exclusive"):
        data_config(["--data-path", a, "--data-args-path", str(tmp_path / "blend.txt")],
                    tmp_path)


def _requested_sizes(rank, world_size, argv):
    from megatron_smp.training import pretrain
    from pretrain_gpt import forward_step, model_provider, train_valid_test_datasets_provider

    asked = []

    def datasets(num_samples, configs, tokenizer):
        asked.append(list(num_samples))
        return train_valid_test_datasets_provider(num_samples, configs, tokenizer)

    pretrain(datasets, model_provider, forward_step, argv=argv)
    return asked[0]


def test_pretrain_asks_megatrons_split_sizes():
    from megatron_smp.testing import run_distributed

    argv = ("--num-layers 1 --hidden-size 32 --num-attention-heads 2 --seq-length 16 "
            "--max-position-embeddings 16 --micro-batch-size 2 --global-batch-size 4 "
            "--train-iters 6 --eval-interval 4 --eval-iters 2 --lr 1e-3 --mock-data "
            "--tokenizer-type NullTokenizer --vocab-size 100").split()
    # train_iters * gbs, (train_iters // eval_interval + 1) * eval_iters * gbs,
    # eval_iters * gbs; with --skip-train the validation set serves one evaluation.
    assert run_distributed(_requested_sizes, 1, args=(argv,))[0] == [24, 16, 8]
    assert run_distributed(_requested_sizes, 1, args=(argv + ["--skip-train"],))[0] == [24, 8, 8]
