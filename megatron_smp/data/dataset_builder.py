"""`build_train_valid_test_datasets`: --data-path/--split/--mock-data to three datasets."""
from __future__ import annotations

import logging
import math
import os
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
# Components of a blend get this many more samples than their share, as in Megatron-LM, so
# rounding never leaves the blend short.
_BLEND_MARGIN = 1.005
_MOCK_NUM_DOCUMENTS = 4096


def parse_split(split: str) -> List[float]:
    """'969,30,1' (or '0.9/0.1') -> normalised [train, valid, test] weights."""
    pieces = [piece for piece in str(split).replace("/", ",").split(",") if piece.strip()]
    try:
        values = [float(piece) for piece in pieces]
    except ValueError:
        raise ConfigError(f"--split {split!r}: expected up to 3 numbers like 969,30,1") from None
    if not 1 <= len(values) <= 3 or any(v < 0 or not math.isfinite(v) for v in values):
        raise ConfigError(f"--split {split!r}: expected 1 to 3 non-negative numbers, e.g. 969,30,1")
    values += [0.0] * (3 - len(values))
    total = sum(values)
    if total <= 0:
        raise ConfigError(f"--split {split!r}: the weights sum to zero")
    return [v / total for v in values]


def split_boundaries(weights: Sequence[float], num_elements: int) -> List[int]:
    """Megatron-LM's document split: rounded cumulative shares, corrected to end at N."""
    boundaries = [0]
    for weight in weights:
        boundaries.append(boundaries[-1] + int(round(weight * float(num_elements))))
    excess = boundaries[-1] - num_elements
    return [0] + [b - excess for b in boundaries[1:]]


def parse_data_path(data_path) -> Tuple[List[float], List[str]]:
    """Megatron's --data-path list -> (normalised weights, prefixes).

    Accepts `prefix`, `w1 p1 w2 p2 ...`, or several prefixes without weights (then weighted
    by their token counts). A string is split on whitespace.
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
        prefixes = items
        for prefix in prefixes:
            _check_prefix(prefix)
        counts = [float(IndexedDataset(prefix).sizes.astype(np.int64).sum()) for prefix in prefixes]
        if sum(counts) <= 0:
            raise ConfigError(f"--data-path: the datasets {prefixes} hold no tokens")
        return [c / sum(counts) for c in counts], prefixes
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
        prefixes.append(prefix)
    if sum(weights) <= 0:
        raise ConfigError(f"--data-path: the weights {weights} sum to zero")
    for prefix in prefixes:
        _check_prefix(prefix)
    return [w / sum(weights) for w in weights], prefixes


def _check_prefix(prefix: str) -> None:
    for suffix in (".idx", ".bin"):
        if not os.path.isfile(prefix + suffix):
            hint = " (drop the .bin/.idx suffix)" if prefix.endswith((".bin", ".idx")) else ""
            raise ConfigError(
                f"--data-path: {prefix}{suffix} not found{hint}; give the prefix that "
                "tools/preprocess_data.py wrote, e.g. out_text_document"
            )


def _component_num_samples(num_samples: Optional[int], weight: float) -> Optional[int]:
    if num_samples is None:
        return None
    return int(math.ceil(math.ceil(num_samples * weight) * _BLEND_MARGIN))


def build_train_valid_test_datasets(
    data_config,
    seq_length: int,
    seed: int,
    train_val_test_num_samples: Sequence[Optional[int]],
    tokenizer,
    group=None,
):
    """Build (train, valid, test) GPT datasets; None for a split with zero weight.

    `train_val_test_num_samples` are the samples each split must provide (None: one epoch).
    Index arrays are built by rank 0 of `group` (default: the whole world if
    torch.distributed is initialized) and cached; every rank of `group` must call this.
    """
    if seq_length < 1:
        raise ConfigError(f"--seq-length must be positive, got {seq_length}")
    split_weights = parse_split(data_config.split)
    num_samples = list(train_val_test_num_samples) + [None] * (3 - len(train_val_test_num_samples))
    masks = dict(
        reset_position_ids=data_config.reset_position_ids,
        reset_attention_mask=data_config.reset_attention_mask,
        eod_mask_loss=data_config.eod_mask_loss,
    )

    if data_config.mock_data:
        mock = MockIndexedDataset(_MOCK_NUM_DOCUMENTS, tokenizer.vocab_size, tokenizer.eod, seed)
        boundaries = split_boundaries(split_weights, len(mock))
        return tuple(
            GPTDataset(
                mock, np.arange(boundaries[i], boundaries[i + 1]), num_samples[i], seq_length,
                seed, tokenizer.eod, SPLIT_NAMES[i], cache_dir=None, group=group, **masks,
            )
            if split_weights[i] > 0 and boundaries[i + 1] > boundaries[i]
            else None
            for i in range(3)
        )

    weights, prefixes = parse_data_path(data_config.data_path)
    cache_dir = default_cache_dir(prefixes[0], getattr(data_config, "data_cache_path", None))
    per_prefix = []  # per_prefix[d][split]
    for weight, prefix in zip(weights, prefixes):
        indexed = IndexedDataset(prefix)
        boundaries = split_boundaries(split_weights, indexed.num_documents)
        splits = []
        for i in range(3):
            if split_weights[i] == 0 or boundaries[i + 1] <= boundaries[i]:
                if split_weights[i] > 0:
                    logger.warning(
                        "%s has no documents for the %s split (%d documents, --split %s)",
                        prefix, SPLIT_NAMES[i], indexed.num_documents, data_config.split,
                    )
                splits.append(None)
                continue
            # Sequences of documents [b_i, b_{i+1}); whole-document data has one each.
            sequence_ids = np.arange(
                indexed.document_indices[boundaries[i]], indexed.document_indices[boundaries[i + 1]]
            )
            wanted = (
                num_samples[i]
                if len(prefixes) == 1
                else _component_num_samples(num_samples[i], weight)
            )
            splits.append(
                GPTDataset(
                    indexed, sequence_ids, wanted, seq_length, seed, tokenizer.eod,
                    SPLIT_NAMES[i], cache_dir=cache_dir,
                    description=dataset_description(prefix),
                    group=group, **masks,
                )
            )
        per_prefix.append(splits)

    if len(prefixes) == 1:
        return tuple(per_prefix[0])

    blended = []
    for i in range(3):
        parts = [
            (w, splits[i])
            for w, splits in zip(weights, per_prefix)
            if splits[i] is not None and w > 0
        ]
        if not parts:
            blended.append(None)
            continue
        part_weights = [w for w, _ in parts]
        part_weights = [w / sum(part_weights) for w in part_weights]
        if num_samples[i] is not None:
            size = int(num_samples[i])
        else:
            # One pass: as many samples as the scarcest component supports at its weight.
            size = int(min(len(d) / w for w, (_, d) in zip(part_weights, parts)))
        blended.append(
            BlendedDataset(
                [d for _, d in parts], part_weights, size, cache_dir=cache_dir,
                description={
                    "prefixes": [dataset_description(p) for p in prefixes],
                    "split": SPLIT_NAMES[i], "seq_length": seq_length, "seed": seed,
                },
                group=group,
            )
        )
    return tuple(blended)
