"""Dataset index caches at scale: rank 0 builds while the others poll (no collective timeout),
--dataloader-fast-cache-load, --dataloader-defer-npy-index-mmap, --per-dataset-sequences-path,
and tools/prepare_cache.py."""
import json
import logging
import os
import sys
import time

import numpy as np
import pytest

from megatron_smp.config import ConfigError
from megatron_smp.data import build_train_valid_test_datasets, cache, gpt_dataset
from megatron_smp.data.tokenizers import NullTokenizer
from megatron_smp.testing import run_distributed

from .conftest import random_documents
from .test_data_flags import EOD, MODEL, TOKENIZER, all_tokens, data_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
sys.path.insert(0, os.path.join(REPO, "tools"))

SIZES = [40, 20, 5]


@pytest.fixture
def corpora(make_dataset):
    return (make_dataset("a", random_documents(120, seed=1, eod=EOD)),
            make_dataset("b", random_documents(80, seed=2, eod=EOD, vocab=500)))


def _build(argv, tmp_path, sizes=SIZES):
    return build_train_valid_test_datasets(data_config(argv, tmp_path), 16, 3, sizes, TOKENIZER)


def _no_builds(monkeypatch):
    """Make every index build fail, to prove a run builds nothing."""
    def refuse(*args, **kwargs):
        raise AssertionError("an index was built")

    for name in ("build_document_index", "build_sample_index", "build_shuffle_index"):
        monkeypatch.setattr(gpt_dataset, name, refuse)
    from megatron_smp.data import blended_dataset

    monkeypatch.setattr(blended_dataset, "build_blending_indices", refuse)
    monkeypatch.setattr(blended_dataset, "build_exhaustive_blending_indices", refuse)


# --- rank 0 builds, the others poll ----------------------------------------------------------

def _three_builds(rank, world_size, prefix, tmp, delay):
    """A slow rank-0 build into a shared directory, node-local directories, a failing build."""
    import torch.distributed as dist

    from megatron_smp.config import DataConfig
    from megatron_smp.data import cache, gpt_dataset

    cache.PROGRESS_SECONDS = 1.0
    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("megatron_smp.data").addHandler(handler)
    logging.getLogger("megatron_smp.data").setLevel(logging.INFO)
    builds, scenario = [], {}
    original = gpt_dataset.build_sample_index

    def build_sample_index(*args, **kwargs):
        builds.append((scenario["name"], rank))
        if rank == 0:
            time.sleep(scenario["delay"])  # longer than the collective timeout of the group
            if scenario["name"] == "fail":
                raise ValueError("disk full")
        return original(*args, **kwargs)

    gpt_dataset.build_sample_index = build_sample_index
    results = {}
    # A different seed per scenario: a different cache key (and store key) each.
    for seed, name, cache_dir, wait in (
        (9, "slow", os.path.join(tmp, "shared"), delay),
        (10, "local", os.path.join(tmp, f"node{rank}"), 0.0),
        (11, "fail", os.path.join(tmp, "shared"), 0.2),
    ):
        scenario.update(name=name, delay=wait)
        config = DataConfig(data_path=[prefix], split="1,0,0", data_cache_path=cache_dir)
        start = time.monotonic()
        try:
            train, _, _ = build_train_valid_test_datasets(config, 16, seed, [50, 0, 0],
                                                          TOKENIZER)
            results[name] = (train[7]["tokens"].tolist(), time.monotonic() - start)
        except (ValueError, RuntimeError) as error:
            results[name] = (str(error), time.monotonic() - start)
    dist.barrier()  # the group is still healthy after the waits
    return results, builds, messages


def test_rank_zero_builds_while_the_others_poll(make_dataset, tmp_path):
    prefix = make_dataset("ds", random_documents(100, seed=4, eod=EOD))
    (results0, builds0, _), (results1, builds1, messages) = run_distributed(
        _three_builds, world_size=2, args=(prefix, str(tmp_path), 3.0),
        collective_timeout=1.0, timeout=150,
    )
    # Slow: rank 1 loaded rank 0's files, after waiting well past the 1 s collective timeout,
    # with a progress line.
    assert ("slow", 0) in builds0 and ("slow", 1) not in builds1
    assert results0["slow"][0] == results1["slow"][0] and results1["slow"][1] > 2.5
    assert any("waiting for rank 0 to build the train GPTDataset indices" in m
               for m in messages), messages
    # Node-local directories: rank 1 cannot see rank 0's files and builds its own.
    assert ("local", 0) in builds0 and ("local", 1) in builds1
    assert results0["local"][0] == results1["local"][0]
    # A failing rank-0 build fails the waiting rank too, with rank 0's error.
    assert results0["fail"][0] == "disk full"
    assert results1["fail"][0] == (
        "rank 0 failed to build the dataset indices: error: ValueError: disk full")


# --- --dataloader-fast-cache-load ------------------------------------------------------------

def test_fast_cache_load_loads_without_building_or_waiting(corpora, tmp_path, monkeypatch):
    a, b = corpora
    argv = ["--train-data-path", "0.5", a, "0.5", b, "--valid-data-path", a]
    fast = argv + ["--dataloader-fast-cache-load"]
    # Without the prepared cache the flag refuses to build, naming itself and the tool.
    with pytest.raises(ConfigError, match="--dataloader-fast-cache-load.*tools/prepare_cache.py"):
        _build(fast, tmp_path)
    reference = _build(argv, tmp_path)  # builds the cache (the default path)
    _no_builds(monkeypatch)
    # Not even the store: fast loading talks to no other rank.
    monkeypatch.setattr(cache, "_distributed", lambda group: pytest.fail("synchronised"))
    loaded = _build(fast, tmp_path)
    for ours, expected in zip(loaded[:2], reference[:2]):
        np.testing.assert_array_equal(all_tokens(ours), all_tokens(expected))
        assert isinstance(ours.dataset_index if hasattr(ours, "dataset_index")
                          else ours.sample_index, np.memmap)


def test_cache_flags_need_a_cache_path(corpora, tmp_path):
    from megatron_smp.training.arguments import parse_args, validate_configs

    for flag in ("--dataloader-fast-cache-load", "--dataloader-defer-npy-index-mmap"):
        configs = parse_args(MODEL + ["--data-path", corpora[0], flag])
        configs.model.vocab_size = 1001
        with pytest.raises(ConfigError, match=f"{flag} needs --data-cache-path"):
            validate_configs(configs, world_size=1)
        configs = parse_args(MODEL + ["--mock-data", "--data-cache-path", str(tmp_path), flag])
        configs.model.vocab_size = 1001
        with pytest.raises(ConfigError, match=f"{flag} loads prepared index caches"):
            validate_configs(configs, world_size=1)
    configs = parse_args(MODEL + ["--mock-data", "--per-dataset-sequences-path", "x.json"])
    configs.model.vocab_size = 1001
    with pytest.raises(ConfigError, match="--per-dataset-sequences-path describes data files"):
        validate_configs(configs, world_size=1)
    bad = tmp_path / "bad.json"
    bad.write_text('{"a": 3}')
    with pytest.raises(ConfigError, match="--per-dataset-sequences-path .*expected a JSON"):
        _build(["--data-path", corpora[0], "--per-dataset-sequences-path", str(bad)], tmp_path)


# --- --dataloader-defer-npy-index-mmap -------------------------------------------------------

def test_defer_npy_index_mmap_maps_at_first_read(corpora, tmp_path):
    a, b = corpora
    argv = ["--data-path", "0.3", a, "0.7", b, "--split", "8,2,0"]
    deferred = argv + ["--dataloader-defer-npy-index-mmap"]
    with pytest.raises(ConfigError, match="--dataloader-defer-npy-index-mmap.*prepare_cache"):
        _build(deferred, tmp_path, [40, 20, 0])
    reference = _build(argv, tmp_path, [40, 20, 0])
    train, valid, _ = _build(deferred, tmp_path, [40, 20, 0])
    lazy = [train._arrays] + [part._arrays for part in train.datasets]
    assert all(isinstance(m, cache.DeferredArrays) and not m.loaded for m in lazy)
    assert len(train) == len(reference[0]) and len(valid) == len(reference[1])
    assert [len(p) for p in train.datasets] == [len(p) for p in reference[0].datasets]
    assert not any(m.loaded for m in lazy)  # len() maps nothing
    train[0]
    assert train._arrays.loaded
    # A data loader worker gets the paths, not copies of the arrays, and maps them itself.
    import pickle

    copy = pickle.loads(pickle.dumps(train))
    assert not copy._arrays.loaded and len(pickle.dumps(train._arrays)) < 2000
    np.testing.assert_array_equal(all_tokens(copy), all_tokens(reference[0]))
    np.testing.assert_array_equal(all_tokens(train), all_tokens(reference[0]))
    np.testing.assert_array_equal(all_tokens(valid), all_tokens(reference[1]))


# --- --per-dataset-sequences-path ------------------------------------------------------------

def test_per_dataset_sequences_path_skips_the_index_header(corpora, tmp_path):
    import build_sequences_per_dataset

    a, b = corpora
    table = str(tmp_path / "sequences.json")
    build_sequences_per_dataset.main(["--data-path", "0.5", a, "0.5", b,
                                      "--per-dataset-sequences-path", table])
    argv = ["--data-path", "0.5", a, "0.5", b, "--split", "1,0,0"]
    reference = _build(argv, tmp_path, [40, 0, 0])[0]
    # Break a's header: only a run that reads it notices.
    with open(a + ".idx", "r+b") as handle:
        handle.write(b"NOTANIDX!")
    with pytest.raises(ConfigError, match="not a Megatron-LM mmap index"):
        _build(argv, tmp_path / "other", [40, 0, 0])
    with_table = argv + ["--per-dataset-sequences-path", table]
    ours = _build(with_table, tmp_path / "other", [40, 0, 0])[0]
    np.testing.assert_array_equal(all_tokens(ours), all_tokens(reference))

    # Counts that do not fit the file, a dataset the table lacks, a tokenizer that implies
    # another token dtype: clear errors naming the flag.
    entries = json.load(open(table))
    entries[a][0] += 1
    json.dump(entries, open(table, "w"))
    with pytest.raises(ConfigError, match="--per-dataset-sequences-path.*bytes"):
        _build(with_table, tmp_path, [40, 0, 0])
    json.dump({b: entries[b]}, open(table, "w"))
    with pytest.raises(ConfigError, match=f"has no entry for {a}"):
        _build(with_table, tmp_path, [40, 0, 0])
    build_sequences_per_dataset.main(["--data-path", b, "--per-dataset-sequences-path", table])
    with pytest.raises(ConfigError, match="does not hold int32 tokens"):
        build_train_valid_test_datasets(
            data_config(["--data-path", b, "--per-dataset-sequences-path", table], tmp_path),
            16, 3, [40, 0, 0], NullTokenizer(70000),
        )


# --- tools/prepare_cache.py ------------------------------------------------------------------

def test_job_against_prepared_cache_builds_nothing(corpora, tmp_path, monkeypatch, capsys):
    import prepare_cache

    a, b = corpora
    cache_dir = str(tmp_path / "prepared")
    job = MODEL + ["--data-path", "0.4", a, "0.6", b, "--split", "90,8,2", "--eval-interval",
                   "5", "--eval-iters", "2", "--global-batch-size", "4",
                   "--data-cache-path", cache_dir, "--dataloader-fast-cache-load"]
    prepare_cache.main(job)
    printed = capsys.readouterr().out
    assert "train" in printed and "index caches ready in " + cache_dir in printed
    # A fresh build elsewhere: the samples the job must draw.
    expected, sizes = prepare_cache.prepare(
        [x if x != cache_dir else str(tmp_path / "fresh") for x in job])
    assert sizes == [40, 24, 8]  # 10 iterations x 4; 3 evaluations x 2 x 4; 2 x 4

    _no_builds(monkeypatch)
    from megatron_smp.training.arguments import parse_args

    configs = parse_args(job)
    datasets = build_train_valid_test_datasets(
        configs.data, configs.training.seq_length, configs.training.seed, sizes, TOKENIZER)
    for ours, reference in zip(datasets, expected):
        np.testing.assert_array_equal(all_tokens(ours), all_tokens(reference))


def _pretrain_losses(rank, world_size, runs):
    from megatron_smp.data import blended_dataset, gpt_dataset
    from megatron_smp.training import pretrain
    from pretrain_gpt import forward_step, model_provider, train_valid_test_datasets_provider

    out = []
    for argv, refuse_builds in runs:
        if refuse_builds:
            def refuse(*args, **kwargs):
                raise AssertionError(f"rank {rank} built an index")

            for module, names in ((gpt_dataset, ("build_document_index", "build_sample_index",
                                                 "build_shuffle_index")),
                                  (blended_dataset, ("build_blending_indices",))):
                for name in names:
                    setattr(module, name, refuse)
        result = pretrain(train_valid_test_datasets_provider, model_provider, forward_step,
                          argv=argv)
        out.append({i: v["lm loss"] for i, v in result.train_losses.items()})
    return out


def test_pretrain_against_prepared_cache_same_losses(corpora, tmp_path):
    """tools/prepare_cache.py at --world-size 2 (the global batch from micro-batch x DP),
    then pretrain_gpt at DP=2 with --dataloader-fast-cache-load: nothing is built, and the
    losses equal those of a job that builds its own caches."""
    import prepare_cache
    from tests.functional.test_training_parity import COMMON

    a, b = corpora
    base = [x for x in COMMON if x != "--mock-data"]
    for flag in ("--global-batch-size", "--train-iters", "--eval-interval"):
        index = base.index(flag)
        del base[index:index + 2]
    job = base + ["--train-iters", "3", "--eval-interval", "2", "--data-path", "0.4", a,
                  "0.6", b, "--split", "90,8,2"]
    prepared = str(tmp_path / "prepared")
    prepare_cache.main(job + ["--data-cache-path", prepared, "--world-size", "2"])
    fresh, from_cache = run_distributed(
        _pretrain_losses, 2, args=([
            (job + ["--data-cache-path", str(tmp_path / "fresh")], False),
            (job + ["--data-cache-path", prepared, "--dataloader-fast-cache-load"], True),
        ],), timeout=300,
    )[0]
    assert sorted(fresh) == [1, 2, 3] and from_cache == fresh
