"""Build every split's dataset index caches on a CPU node, so that the GPU job starts in seconds.

    python tools/prepare_cache.py <the job's pretrain flags> [--world-size N]

Give the flags of the training job (model flags may stay: they are parsed and ignored here);
what shapes the samples must match it: --data-path / --train-data-path ... / --split,
--seq-length, --seed, --train-iters or --train-samples, --eval-interval, --eval-iters,
--global-batch-size (or --micro-batch-size with --world-size and the parallel sizes, which
give the data-parallel size), --data-cache-path. The caches land where the job looks for them
(--data-cache-path, else next to the data); the job then memory-maps them and builds nothing,
and with --dataloader-fast-cache-load (or --dataloader-defer-npy-index-mmap) it also skips
waiting for rank 0. Those two flags describe the job's loading: this tool builds regardless.
Prints each split's sample count, the cache directory and the time taken.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_smp.cli import run_entry  # noqa: E402

from megatron_smp.config import ConfigError  # noqa: E402
from megatron_smp.data import build_tokenizer, build_train_valid_test_datasets  # noqa: E402
from megatron_smp.training.arguments import parse_args, validate_configs  # noqa: E402
from megatron_smp.training.num_microbatches import NumMicrobatchesCalculator  # noqa: E402
from megatron_smp.training.pretrain import dataset_num_samples  # noqa: E402


def prepare(argv, world_size: int = 1):
    """Build the caches for the pretrain flags `argv` at `world_size` ranks; returns the
    (train, valid, test) datasets and their sample counts."""
    configs = parse_args(argv)
    data = configs.data
    if data.mock_data:
        raise ConfigError("--mock-data datasets are built in memory; there is no cache to prepare")
    # The loading flags would refuse a cache that is not there yet: this run makes it.
    data.dataloader_fast_cache_load = False
    data.dataloader_defer_npy_index_mmap = False
    tokenizer = build_tokenizer(data)
    configs.model.vocab_size = tokenizer.vocab_size
    validate_configs(configs, world_size=world_size)
    training = configs.training
    batch_sizes = NumMicrobatchesCalculator(
        training, configs.parallel.data_parallel_size_for(world_size)
    )
    training = dataclasses.replace(training, train_iters=batch_sizes.train_iters(
        training.train_iters, training.train_samples))
    num_samples = dataset_num_samples(training, batch_sizes.global_batch_size)
    datasets = build_train_valid_test_datasets(
        data, training.seq_length, training.seed, num_samples, tokenizer
    )
    return datasets, num_samples


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], add_help=False)
    parser.add_argument("--world-size", type=int, default=1,
                        help="ranks of the training job (for the data-parallel size)")
    ours, rest = parser.parse_known_args(argv)
    start = time.perf_counter()
    datasets, num_samples = prepare(rest, ours.world_size)
    for name, dataset, wanted in zip(("train", "valid", "test"), datasets, num_samples):
        if dataset is None:
            print(f"{name:<6} (none)")
            continue
        print(f"{name:<6} {len(dataset):>12} samples (asked {wanted})")
    where = datasets_cache_dir(rest)
    print(f"index caches ready in {where} ({time.perf_counter() - start:.1f} s)")


def datasets_cache_dir(argv) -> str:
    data = parse_args(argv).data
    return data.data_cache_path or "the cache/GPTDataset_indices directory beside the data"


if __name__ == "__main__":
    sys.exit(run_entry(main))
