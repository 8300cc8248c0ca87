"""The index arrays behind GPT and blended datasets, built with vectorised numpy.

These reproduce Megatron-LM's `_build_document_index`, `helpers.build_sample_idx`,
`_build_shuffle_index`, `helpers.build_blending_indices` and
`helpers.build_exhaustive_blending_indices` (C++ there), value for value.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import numpy as np


def build_document_index(
    documents: np.ndarray,
    num_epochs: int,
    rng: np.random.RandomState,
    separate_final_epoch: bool,
) -> np.ndarray:
    """`num_epochs` shuffled copies of `documents` (sequence ids), as one int32/int64 array.

    With `separate_final_epoch` the last epoch is shuffled on its own, so that the samples
    drawn from a partly used final epoch are a uniform sample of it.
    """
    if not separate_final_epoch or num_epochs == 1:
        dtype = np.int32 if documents.size == 0 or documents.max() < 2**31 - 1 else np.int64
        document_index = np.tile(np.asarray(documents, dtype=dtype), num_epochs)
        rng.shuffle(document_index)
        return document_index
    head = build_document_index(documents, num_epochs - 1, rng, False)
    tail = build_document_index(documents, 1, rng, False)
    return np.concatenate((head, tail))


def build_sample_index(
    sizes: np.ndarray, document_index: np.ndarray, seq_length: int, add_extra_token: int = 1
) -> np.ndarray:
    """`[num_samples + 1, 2]` int64: (position in document_index, token offset) where sample
    i starts; sample i spans to the start of sample i+1 plus `add_extra_token` tokens.

    Sample i covers tokens [i * seq_length, (i + 1) * seq_length + add_extra_token) of the
    documents concatenated in `document_index` order, so one epoch's samples cover every
    token exactly once (apart from the final partial sample, which is dropped).
    """
    document_sizes = np.asarray(sizes)[document_index].astype(np.int64)
    starts = np.zeros(document_sizes.size + 1, dtype=np.int64)
    np.cumsum(document_sizes, out=starts[1:])
    total_tokens = int(starts[-1])
    num_samples = max((total_tokens - add_extra_token) // seq_length, 0)
    positions = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    # side="right" skips empty documents: a position lands in the document that holds it.
    containing = np.searchsorted(starts, positions, side="right") - 1
    sample_index = np.empty((num_samples + 1, 2), dtype=np.int64)
    sample_index[:, 0] = containing
    sample_index[:, 1] = positions - starts[containing]
    return sample_index


def build_shuffle_index(
    num_samples: int, total_size: int, rng: np.random.RandomState
) -> np.ndarray:
    """A permutation of [0, num_samples) followed by a separate permutation of the rest."""
    dtype = np.uint32 if total_size < 2**32 - 1 else np.int64
    head = np.arange(num_samples, dtype=dtype)
    rng.shuffle(head)
    if num_samples == total_size:
        return head
    tail = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(tail)
    return np.concatenate((head, tail))


_NEGATIVE_INFINITY = float("-inf")


def _greedy_blend(
    weights: Sequence[float], size: int, limits: Optional[Sequence[int]] = None
) -> Tuple[np.ndarray, np.ndarray]:
    """megatron-core's blending recurrence: sample i comes from the dataset d with the largest
    `weights[d] * max(i, 1) - drawn[d]` (the same float64 products and differences as its C++,
    ties to the lowest d); with `limits`, dataset d leaves once it has given limits[d]."""
    weights = [float(w) for w in weights]
    drawn = [0] * len(weights)
    active = list(range(len(weights)))
    dataset_index = [0] * size
    dataset_sample_index = [0] * size
    # A plain Python loop: the recurrence is sequential, and one numpy call per sample costs
    # more than this loop up to dozens of datasets (measured).
    for sample in range(size):
        scale = float(max(sample, 1))
        best, best_error = -1, _NEGATIVE_INFINITY
        for dataset in active:  # ascending: a tie keeps the lowest index
            error = weights[dataset] * scale - drawn[dataset]
            if error > best_error:
                best, best_error = dataset, error
        dataset_index[sample] = best
        dataset_sample_index[sample] = drawn[best]
        drawn[best] += 1
        if limits is not None and drawn[best] == limits[best]:
            active.remove(best)
    return np.asarray(dataset_index, dtype=np.int16), np.asarray(dataset_sample_index, np.int64)


def build_blending_indices(
    weights: Sequence[float], size: int
) -> Tuple[np.ndarray, np.ndarray]:
    """Megatron-LM's greedy blending: sample i comes from the dataset furthest behind its
    share (`weight * i - drawn so far`), ties to the lowest index, so every prefix of the
    blend is within one sample per dataset of the requested proportions.

    Returns (dataset_index [size] int16, dataset_sample_index [size] int64).
    """
    return _greedy_blend(weights, int(size))


def build_exhaustive_blending_indices(sizes: Sequence[int]) -> Tuple[np.ndarray, np.ndarray]:
    """Draw exactly sizes[d] samples from dataset d, interleaved by the same greedy rule as
    `build_blending_indices` with weights sizes / sum(sizes); a dataset leaves the race once
    it is spent.

    Returns (dataset_index [sum(sizes)] int16, dataset_sample_index [sum(sizes)] int64).
    """
    sizes = [int(s) for s in sizes]
    total = sum(sizes)
    return _greedy_blend([s / float(total) for s in sizes], total, limits=sizes)
