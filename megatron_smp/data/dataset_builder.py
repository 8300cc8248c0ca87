"""`build_train_valid_test_datasets`: --data-path/--split/--mock-data to three datasets."""
from __future__ import annotations

import logging
import math
import os
import re
from typing import List, Optional, Sequence, Tuple

import numpy as np

from megatron_smp.config import ConfigError
from megatron_smp.data.blended_dataset import BlendedDataset
from megatron_smp.data.gpt_dataset import (
    GPTDataset,
    MockIndexedDataset,
    dataset_description,
    default_cache_dir,
)
from megatron_smp.data.indexed_dataset import IndexedDataset

logger = logging.getLogger(__name__)

SPLIT_NAMES = ("train", "valid", "test")
_MOCK_NUM_DOCUMENTS = 4096


def parse_split(split: str) -> List[float]:
    """'969,30,1' -> normalised [train, valid, test] weights, as megatron-core parses them.

    Every run of digits and dots is a number, so '969, 30, 1', '90/8/2' and the quoted
    "'99,1,0'" Megatron's example scripts pass all work; missing trailing weights are 0.
    """
    try:
        values = [float(piece) for piece in re.findall(r"[.0-9]+", str(split))]
    except ValueError:
        values = []
    if not 1 <= len(values) <= 3 or not all(math.isfinite(v) for v in values):
        raise ConfigError(f"--split {split!r}: expected 1 to 3 non-negative numbers, e.g. 969,30,1")
    values += [0.0] * (3 - len(values))
    total = float(np.sum(np.array(values, dtype=np.float64)))
    if total <= 0:
        raise ConfigError(f"--split {split!r}: the weights sum to zero")
    return (np.array(values, dtype=np.float64) / total).tolist()


def split_matrix(weights: Sequence[float]) -> List[Optional[Tuple[float, float]]]:
    """[0.9, 0.08, 0.02] -> [(0, 0.9), (0.9, 0.98), (0.98, 1.0)]; None for an empty split.

    The book-ends are running float sums, exactly as megatron-core accumulates them: its
    rounding of `bookend * num_sequences` decides which sequence lands in which split.
    """
    ends = [0.0]
    for weight in weights:
        ends.append(ends[-1] + weight)
    return [(a, b) if b > a else None for a, b in zip(ends[:-1], ends[1:])]


def split_range(bookends: Tuple[float, float], num_sequences: int) -> Tuple[int, int]:
    """The [begin, end) sequence ids of one split (Python's round: half to even)."""
    return (
        int(round(bookends[0] * float(num_sequences))),
        int(round(bookends[1] * float(num_sequences))),
    )


def parse_data_path(data_path) -> Tuple[List[str], Optional[List[float]]]:
    """Megatron's --data-path list -> (prefixes, weights or None), as `get_blend_from_list`.

    Accepts `prefix`, `w1 p1 w2 p2 ...`, or several prefixes without weights (then each split
    blends them by their sample counts). A string is split on whitespace.
    """
    items = data_path.split() if isinstance(data_path, str) else [str(x) for x in data_path]
    if not items:
        raise ConfigError("--data-path is empty; give a dataset prefix or use --mock-data")

    def as_number(text: str) -> Optional[float]:
        try:
            return float(text)
        except ValueError:
            return None

    numbers = [as_number(item) for item in items]
    if all(number is None for number in numbers):
        prefixes = [item.strip() for item in items]
        for prefix in prefixes:
            _check_prefix(prefix)
        return prefixes, None
    if len(items) % 2 != 0:
        raise ConfigError(
            f"--data-path {' '.join(items)}: expected weight/prefix pairs like "
            "'0.7 a_text_document 0.3 b_text_document' (got an odd number of items)"
        )
    weights, prefixes = [], []
    for weight_text, prefix in zip(items[0::2], items[1::2]):
        weight = as_number(weight_text)
        if weight is None:
            raise ConfigError(
                f"--data-path: {weight_text!r} should be a weight before prefix {prefix!r}"
            )
        if as_number(prefix) is not None:
            raise ConfigError(f"--data-path: {prefix!r} should be a dataset prefix, not a number")
        if weight < 0 or not math.isfinite(weight):
            raise ConfigError(f"--data-path: weight {weight_text} of {prefix} must be >= 0")
        weights.append(weight)
        prefixes.append(prefix.strip())
    if sum(weights) <= 0:
        raise ConfigError(f"--data-path: the weights {weights} sum to zero")
    if 0.0 in weights:
        zero = [p for w, p in zip(weights, prefixes) if w == 0.0]
        raise ConfigError(
            f"--data-path: {zero} have weight 0 (megatron-core refuses them too); drop them"
        )
    for prefix in prefixes:
        _check_prefix(prefix)
    return prefixes, (np.array(weights, dtype=np.float64) / np.sum(weights)).tolist()


def _check_prefix(prefix: str) -> None:
    for suffix in (".idx", ".bin"):
        if not os.path.isfile(prefix + suffix):
            hint = " (drop the .bin/.idx suffix)" if prefix.endswith((".bin", ".idx")) else ""
            raise ConfigError(
                f"--data-path: {prefix}{suffix} not found{hint}; give the prefix that "
                "tools/preprocess_data.py wrote, e.g. out_text_document"
            )


def sizes_per_dataset(
    weights: Sequence[float], sizes: Sequence[Optional[int]], surplus: float = 0.0
) -> List[List[Optional[int]]]:
    """[dataset][split] samples each blend component provides: ceil(ceil(size * weight) *
    (1 + surplus)), megatron-core's `_get_size_per_split_per_dataset`."""
    return [
        [
            None if size is None else int(math.ceil(math.ceil(size * weight) * (1 + surplus)))
            for size in sizes
        ]
        for weight in weights
    ]


class _Builder:
    """megatron-core's BlendedMegatronDatasetBuilder over our GPTDataset / BlendedDataset."""

    def __init__(self, data_config, seq_length, seed, tokenizer, group):
        self.data_config = data_config
        self.seq_length = seq_length
        self.seed = seed
        self.tokenizer = tokenizer
        self.group = group
        self.surplus = float(getattr(data_config, "mid_level_dataset_surplus", 0.005))
        self.mmap = bool(getattr(data_config, "mmap_bin_files", True))
        self.cache_flags = dict(
            fast_load=bool(getattr(data_config, "dataloader_fast_cache_load", False)),
            defer_mmap=bool(getattr(data_config, "dataloader_defer_npy_index_mmap", False)),
        )
        self.sequences = read_sequences_per_dataset(data_config)
        # megatron-core picks the token dtype from the vocabulary when headers go unread.
        self.token_dtype = (
            np.uint16 if tokenizer.vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32
        )
        self.masks = dict(
            reset_position_ids=data_config.reset_position_ids,
            reset_attention_mask=data_config.reset_attention_mask,
            eod_mask_loss=data_config.eod_mask_loss,
        )
        self.data_config = data_config
        self.cache_dir = None

    def _sample_transform(self):
        """--fim-data: each dataset's FIM transform (its own RandomState, as Megatron's)."""
        if not getattr(self.data_config, "fim_data", False):
            return None
        from megatron_smp.data.fim import FIMTransform

        return FIMTransform(self.tokenizer, self.data_config, self.seed)

    def mid_level_splits(self, prefix, matrix, sizes):
        """One GPTDataset per split of `prefix` (None where `matrix` has no split)."""
        if self.sequences is None:
            indexed = IndexedDataset(prefix, mmap=self.mmap)
        else:
            if prefix not in self.sequences:
                raise ConfigError(
                    f"--per-dataset-sequences-path {self.data_config.per_dataset_sequences_path}"
                    f" has no entry for {prefix}; rebuild it with "
                    "tools/build_sequences_per_dataset.py and the same data flags"
                )
            indexed = IndexedDataset(
                prefix, mmap=self.mmap, counts=self.sequences[prefix], dtype=self.token_dtype
            )
        if self.cache_dir is None:
            self.cache_dir = default_cache_dir(
                prefix, getattr(self.data_config, "data_cache_path", None)
            )
        datasets = []
        for i, bookends in enumerate(matrix):
            if bookends is None:
                datasets.append(None)
                continue
            # megatron-core splits GPT data by sequences, not documents.
            begin, end = split_range(bookends, len(indexed))
            if end <= begin:
                logger.warning(
                    "%s has no sequences for the %s split (%d sequences, --split %s)",
                    prefix, SPLIT_NAMES[i], len(indexed), self.data_config.split,
                )
                datasets.append(None)
                continue
            datasets.append(
                GPTDataset(
                    indexed, np.arange(begin, end, dtype=np.int32), sizes[i], self.seq_length,
                    self.seed, self.tokenizer.eod, SPLIT_NAMES[i], cache_dir=self.cache_dir,
                    description=dataset_description(prefix), group=self.group, **self.masks,
                    **self.cache_flags, sample_transform=self._sample_transform(),
                )
            )
        return datasets

    def blend(self, prefixes, weights, matrix, sizes, splits):
        """The `splits` of a blend of several prefixes (BlendedDataset each)."""
        if weights is None:
            buffer = [[None] * 3 for _ in prefixes]
        else:
            target = sizes_per_dataset(weights, sizes)
            buffer = sizes_per_dataset(weights, sizes, surplus=self.surplus)
        per_prefix = [
            self.mid_level_splits(prefix, matrix, buffer[d]) for d, prefix in enumerate(prefixes)
        ]
        blended = [None] * 3
        for i in splits:
            if matrix[i] is None:
                continue
            parts = [splits_of[i] for splits_of in per_prefix]
            if any(part is None for part in parts):
                missing = [p for p, part in zip(prefixes, parts) if part is None]
                raise ConfigError(
                    f"the {SPLIT_NAMES[i]} split of {missing} is empty, so the blend cannot "
                    "follow its weights; change --split or drop those prefixes"
                )
            if weights is not None:
                if sizes[i] is None:
                    raise ConfigError(
                        f"weighted --data-path blends need a sample count for the "
                        f"{SPLIT_NAMES[i]} split"
                    )
                split_weights, size = weights, sum(row[i] for row in target)
            else:
                # Unweighted: components in proportion to their sample counts.
                split_weights = [len(part) for part in parts]
                size = None if sizes[i] is None else min(sizes[i], sum(split_weights))
            blended[i] = BlendedDataset(
                parts, split_weights, size, SPLIT_NAMES[i], cache_dir=self.cache_dir,
                description={
                    "prefixes": [dataset_description(p) for p in prefixes],
                    "seq_length": self.seq_length, "seed": self.seed,
                },
                group=self.group, **self.cache_flags,
            )
        return blended

    def build(self, blend, matrix, sizes, splits=(0, 1, 2)):
        prefixes, weights = blend
        if len(prefixes) == 1 and weights is None:
            return self.mid_level_splits(prefixes[0], matrix, sizes)
        return self.blend(prefixes, weights, matrix, sizes, splits)


def read_sequences_per_dataset(data_config) -> Optional[dict]:
    """--per-dataset-sequences-path's JSON {prefix: [sequence count, document count]}."""
    path = getattr(data_config, "per_dataset_sequences_path", None)
    if not path:
        return None
    import json

    flag = "--per-dataset-sequences-path"
    try:
        table = json.loads(_read_text(path, flag))
        return {
            str(prefix): (int(counts[0]), int(counts[1])) for prefix, counts in table.items()
        }
    except (ValueError, TypeError, IndexError, AttributeError) as error:
        raise ConfigError(
            f"{flag} {path}: expected a JSON object {{prefix: [sequence count, document "
            f"count]}}, as tools/build_sequences_per_dataset.py writes ({error})"
        ) from None


def check_cache_flags(data_config) -> None:
    """The cache flags' requirements, raised before anything is built (on every rank)."""
    for flag, field in (
        ("--dataloader-fast-cache-load", "dataloader_fast_cache_load"),
        ("--dataloader-defer-npy-index-mmap", "dataloader_defer_npy_index_mmap"),
    ):
        if not getattr(data_config, field, False):
            continue
        if data_config.mock_data:
            raise ConfigError(f"{flag} loads prepared index caches; --mock-data has none")
        if not data_config.data_cache_path:
            raise ConfigError(
                f"{flag} needs --data-cache-path: the directory tools/prepare_cache.py built "
                "the index caches in"
            )
    if getattr(data_config, "per_dataset_sequences_path", None) and data_config.mock_data:
        raise ConfigError("--per-dataset-sequences-path describes data files; --mock-data has "
                          "none")


def _read_text(path: str, flag: str) -> str:
    if not os.path.isfile(path):
        raise ConfigError(f"{flag} {path}: file not found")
    with open(path, "r", encoding="utf-8") as handle:
        return handle.read()


def whole_data_path(data_config) -> Optional[list]:
    """--data-path, or the list --data-args-path's file holds (whitespace-separated)."""
    if data_config.data_args_path:
        return _read_text(data_config.data_args_path, "--data-args-path").split()
    return data_config.data_path or None


def per_split_data_paths(data_config) -> List[Optional[list]]:
    """[--train-data-path, --valid-data-path, --test-data-path] (None where not given), or the
    "train"/"valid"/"test" lists (or strings) of --per-split-data-args-path's JSON file."""
    if data_config.per_split_data_args_path:
        import json

        path = data_config.per_split_data_args_path
        try:
            per_split = json.loads(_read_text(path, "--per-split-data-args-path"))
            paths = [per_split[name] for name in SPLIT_NAMES]
        except (ValueError, KeyError, TypeError) as error:
            raise ConfigError(f"--per-split-data-args-path {path}: expected a JSON object with "
                              f"train, valid and test lists ({error})") from None
        return [(p.split() if isinstance(p, str) else p) or None for p in paths]
    paths = (data_config.train_data_path, data_config.valid_data_path, data_config.test_data_path)
    return [p or None for p in paths]


def build_train_valid_test_datasets(
    data_config,
    seq_length: int,
    seed: int,
    train_val_test_num_samples: Sequence[Optional[int]],
    tokenizer,
    group=None,
    context_parallel_size: int = 1,
    sft_options: Optional[dict] = None,
):
    """Build (train, valid, test) GPT datasets; None for a split with zero weight.

    Follows megatron-core 0.16.1's BlendedMegatronDatasetBuilder, so the same --data-path
    (or --train/valid/test-data-path), --split, --seed, --seq-length and sizes give the same
    samples. `train_val_test_num_samples` are the samples each split must provide (None: one
    epoch). Index arrays are built by rank 0 of `group` (default: the whole world if
    torch.distributed is initialized) and cached; every rank of `group` must call this.
    With --sft and `context_parallel_size` > 1 every conversation is padded to a multiple of
    2 x that size, so that each one splits the load-balanced way over the CP ranks;
    `sft_options` are `build_sft_splits`'s `group_size` / `token_values` (preference pairs).
    """
    if seq_length < 1:
        raise ConfigError(f"--seq-length must be positive, got {seq_length}")
    check_cache_flags(data_config)
    num_samples = list(train_val_test_num_samples) + [None] * (3 - len(train_val_test_num_samples))
    masks = dict(
        reset_position_ids=data_config.reset_position_ids,
        reset_attention_mask=data_config.reset_attention_mask,
        eod_mask_loss=data_config.eod_mask_loss,
    )
    if getattr(data_config, "fim_data", False) and data_config.mock_data:
        raise ConfigError("--fim-data rearranges real text: it does not take --mock-data (as "
                          "in Megatron-LM); give --data-path")

    if data_config.mock_data and getattr(data_config, "sft", False):
        raise ConfigError("--sft trains on conversations from --data-path "
                          "(tools/preprocess_sft_data.py); --mock-data has none")
    if data_config.mock_data:
        split_weights = parse_split(data_config.split)
        mock = MockIndexedDataset(_MOCK_NUM_DOCUMENTS, tokenizer.vocab_size, tokenizer.eod, seed)
        matrix = split_matrix(split_weights)
        ranges = [split_range(b, len(mock)) if b else (0, 0) for b in matrix]
        return tuple(
            GPTDataset(
                mock, np.arange(*ranges[i]), num_samples[i], seq_length,
                seed, tokenizer.eod, SPLIT_NAMES[i], cache_dir=None, group=group, **masks,
            )
            if ranges[i][1] > ranges[i][0]
            else None
            for i in range(3)
        )

    if getattr(data_config, "sft", False):
        return _build_sft(data_config, seq_length, seed, num_samples, tokenizer,
                          2 * context_parallel_size if context_parallel_size > 1 else 1,
                          **(sft_options or {}))

    builder = _Builder(data_config, seq_length, seed, tokenizer, group)
    per_split = per_split_data_paths(data_config)
    data_path = whole_data_path(data_config)
    if data_path:
        if any(per_split):
            raise ConfigError(
                "--data-path and --train-data-path/--valid-data-path/--test-data-path are "
                "exclusive; give one or the other"
            )
        matrix = split_matrix(parse_split(data_config.split))
        return tuple(builder.build(parse_data_path(data_path), matrix, num_samples))
    if not any(per_split):
        raise ConfigError("--data-path is empty; give a dataset prefix or use --mock-data")
    datasets = [None] * 3
    for i, paths in enumerate(per_split):
        if paths is None:
            continue
        # Each split's paths are a whole dataset: the split spans all of its sequences.
        matrix = [None] * 3
        matrix[i] = (0.0, 1.0)
        sizes = [0] * 3
        sizes[i] = num_samples[i]
        try:
            blend = parse_data_path(paths)
        except ConfigError as error:
            raise ConfigError(str(error).replace("--data-path", f"--{SPLIT_NAMES[i]}-data-path"))
        datasets[i] = builder.build(blend, matrix, sizes, splits=(i,))[i]
    return tuple(datasets)


def _build_sft(data_config, seq_length, seed, num_samples, tokenizer, pad_to_multiple=1,
               **options):
    """--sft: packed conversations of one --data-path prefix, cut by --split."""
    from megatron_smp.data.sft_dataset import build_sft_splits

    data_path = whole_data_path(data_config)
    if any(per_split_data_paths(data_config)) or not data_path:
        raise ConfigError("--sft reads one --data-path prefix cut by --split; "
                          "--train/valid/test-data-path are not supported with --sft")
    prefixes, weights = parse_data_path(data_path)
    if len(prefixes) != 1:
        raise ConfigError(f"--sft reads one --data-path prefix, got {len(prefixes)} "
                          "(blends of SFT data are not supported)")
    pad = getattr(tokenizer, "pad", None)
    pad = tokenizer.eod if pad is None or pad < 0 else pad
    return tuple(build_sft_splits(
        prefixes[0], split_matrix(parse_split(data_config.split)), num_samples, seq_length,
        seed, pad, split_range, SPLIT_NAMES, mmap=bool(getattr(data_config, "mmap_bin_files",
                                                               True)),
        pad_to_multiple=pad_to_multiple, **options,
    ))
