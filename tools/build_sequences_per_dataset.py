"""Write the --per-dataset-sequences-path file: each dataset's sequence and document counts.

    python tools/build_sequences_per_dataset.py --data-path 0.7 a_text_document \
        0.3 b_text_document --per-dataset-sequences-path blend-sequences.json

Takes the data flags of the job (--data-path, --train/valid/test-data-path, --data-args-path,
--per-split-data-args-path) and writes JSON {prefix: [sequence count, document count]} as
Megatron-LM's tool of the same name does; a job given the file reads no .idx header.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_smp.cli import run_entry  # noqa: E402

from megatron_smp.config import DataConfig  # noqa: E402
from megatron_smp.data.dataset_builder import (  # noqa: E402
    parse_data_path,
    per_split_data_paths,
    whole_data_path,
)
from megatron_smp.data.indexed_dataset import IndexedDataset  # noqa: E402


def sequences_per_dataset(data_config) -> dict:
    """{prefix: [sequence count, document count]} of every prefix the data flags name."""
    lists = [whole_data_path(data_config)] + per_split_data_paths(data_config)
    table = {}
    for paths in lists:
        if not paths:
            continue
        prefixes, _ = parse_data_path(paths)
        for prefix in prefixes:
            if prefix not in table:
                dataset = IndexedDataset(prefix)
                table[prefix] = [len(dataset), int(dataset.document_indices.size)]
    return table


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag in ("--data-path", "--train-data-path", "--valid-data-path", "--test-data-path"):
        parser.add_argument(flag, nargs="*", default=None)
    parser.add_argument("--data-args-path")
    parser.add_argument("--per-split-data-args-path")
    parser.add_argument("--per-dataset-sequences-path", required=True,
                        help="the JSON file to write")
    args = parser.parse_args(argv)
    data_config = DataConfig(
        data_path=args.data_path or [], train_data_path=args.train_data_path,
        valid_data_path=args.valid_data_path, test_data_path=args.test_data_path,
        data_args_path=args.data_args_path, per_split_data_args_path=args.per_split_data_args_path,
    )
    table = sequences_per_dataset(data_config)
    with open(args.per_dataset_sequences_path, "w") as handle:
        json.dump(table, handle, indent=1)
    print(f"{len(table)} datasets -> {args.per_dataset_sequences_path}")


if __name__ == "__main__":
    sys.exit(run_entry(main))
