"""The index arrays behind GPT and blended datasets.

These reproduce Megatron-LM's `_build_document_index`, `helpers.build_sample_idx`,
`_build_shuffle_index`, `helpers.build_blending_indices` and
`helpers.build_exhaustive_blending_indices` (C++ there), value for value. The per-sample
loops (sample index, blending) run in the C of helpers.c when it compiles (compiled.py);
the numpy/Python code here is the reference and the fallback, and tests hold the two equal.
"""
from __future__ import annotations

import array
from typing import Optional, Sequence, Tuple

import numpy as np

from megatron_smp.data import compiled


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
    dtype = np.int32 if documents.size == 0 or documents.max() < 2**31 - 1 else np.int64
    document_index = np.tile(np.asarray(documents, dtype=dtype), num_epochs)
    if not separate_final_epoch or num_epochs == 1:
        rng.shuffle(document_index)
        return document_index
    # Shuffling the two views in place draws what shuffling two arrays would, without the copy.
    head_size = documents.size * (num_epochs - 1)
    rng.shuffle(document_index[:head_size])
    rng.shuffle(document_index[head_size:])
    return document_index


def build_sample_index(
    sizes: np.ndarray, document_index: np.ndarray, seq_length: int, add_extra_token: int = 1
) -> np.ndarray:
    """`[num_samples + 1, 2]` int64: (position in document_index, token offset) where sample
    i starts; sample i spans to the start of sample i+1 plus `add_extra_token` tokens.

    Sample i covers tokens [i * seq_length, (i + 1) * seq_length + add_extra_token) of the
    documents concatenated in `document_index` order, so one epoch's samples cover every
    token exactly once (apart from the final partial sample, which is dropped). As in
    megatron-core's build_sample_idx, entry i > 0 names the document holding the last token
    sample i - 1 reads (token i * seq_length - 1 + add_extra_token), so without the extra
    token a sample ending at a document's end leaves the next one at (that document, its
    length); entry 0 is (0, 0).
    """
    library = compiled.library()
    if library is not None and document_index.dtype in (np.int32, np.int64):
        return _sample_index_compiled(library, sizes, document_index, seq_length, add_extra_token)
    return _sample_index_numpy(sizes, document_index, seq_length, add_extra_token)


def _sample_index_compiled(library, sizes, document_index, seq_length, add_extra_token):
    sizes = np.ascontiguousarray(sizes, dtype=np.int32)
    document_index = np.ascontiguousarray(document_index)
    suffix = "i32" if document_index.dtype == np.int32 else "i64"
    total_tokens = getattr(library, f"msmp_total_tokens_{suffix}")(
        compiled.address(sizes), compiled.address(document_index), document_index.size
    )
    num_samples = max((total_tokens - add_extra_token) // seq_length, 0)
    sample_index = np.empty((num_samples + 1, 2), dtype=np.int64)
    getattr(library, f"msmp_build_sample_index_{suffix}")(
        compiled.address(sample_index), compiled.address(sizes),
        compiled.address(document_index), document_index.size, int(seq_length), num_samples,
        int(add_extra_token),
    )
    return sample_index


def _sample_index_numpy(sizes, document_index, seq_length, add_extra_token):
    document_sizes = np.asarray(sizes)[document_index].astype(np.int64)
    starts = np.zeros(document_sizes.size + 1, dtype=np.int64)
    np.cumsum(document_sizes, out=starts[1:])
    total_tokens = int(starts[-1])
    num_samples = max((total_tokens - add_extra_token) // seq_length, 0)
    positions = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    last_read = positions - 1 + add_extra_token
    # side="right" skips empty documents: a token lands in the document that holds it.
    containing = np.searchsorted(starts, last_read, side="right") - 1
    containing[0] = 0
    sample_index = np.empty((num_samples + 1, 2), dtype=np.int64)
    sample_index[:, 0] = containing
    sample_index[:, 1] = positions - starts[containing]
    return sample_index


def build_shuffle_index(
    num_samples: int, total_size: int, rng: np.random.RandomState
) -> np.ndarray:
    """A permutation of [0, num_samples) followed by a separate permutation of the rest."""
    dtype = np.uint32 if total_size < 2**32 - 1 else np.int64
    shuffle_index = np.arange(total_size, dtype=dtype)
    # In-place shuffles of the two views draw what shuffling two arrays would, without a copy.
    rng.shuffle(shuffle_index[:num_samples])
    if num_samples < total_size:
        rng.shuffle(shuffle_index[num_samples:])
    return shuffle_index


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
    # Typed arrays, not lists: 10 bytes a sample (the output) instead of ~60.
    dataset_index = array.array("h", bytes(2 * size))
    dataset_sample_index = array.array("q", bytes(8 * size))
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
    # frombuffer shares the arrays' memory (no copy); they stay alive through the views.
    return (
        np.frombuffer(dataset_index, dtype=np.int16) if size else np.zeros(0, np.int16),
        np.frombuffer(dataset_sample_index, dtype=np.int64) if size else np.zeros(0, np.int64),
    )


def build_blending_indices(
    weights: Sequence[float], size: int
) -> Tuple[np.ndarray, np.ndarray]:
    """Megatron-LM's greedy blending: sample i comes from the dataset furthest behind its
    share (`weight * i - drawn so far`), ties to the lowest index, so every prefix of the
    blend is within one sample per dataset of the requested proportions.

    Returns (dataset_index [size] int16, dataset_sample_index [size] int64).
    """
    size = int(size)
    library = compiled.library()
    if library is None or len(weights) == 0:
        return _greedy_blend(weights, size)
    weights = np.ascontiguousarray(weights, dtype=np.float64)
    dataset_index = np.empty(size, dtype=np.int16)
    dataset_sample_index = np.empty(size, dtype=np.int64)
    drawn = np.zeros(weights.size, dtype=np.int64)
    library.msmp_build_blending_indices(
        compiled.address(dataset_index), compiled.address(dataset_sample_index),
        compiled.address(weights), compiled.address(drawn), weights.size, size,
    )
    return dataset_index, dataset_sample_index


def build_exhaustive_blending_indices(sizes: Sequence[int]) -> Tuple[np.ndarray, np.ndarray]:
    """Draw exactly sizes[d] samples from dataset d, interleaved by the same greedy rule as
    `build_blending_indices` with weights sizes / sum(sizes); a dataset leaves the race once
    it is spent.

    Returns (dataset_index [sum(sizes)] int16, dataset_sample_index [sum(sizes)] int64).
    """
    sizes = [int(s) for s in sizes]
    total = sum(sizes)
    weights = [s / float(total) for s in sizes]
    library = compiled.library()
    if library is None:
        return _greedy_blend(weights, total, limits=sizes)
    weights = np.asarray(weights, dtype=np.float64)
    limits = np.asarray(sizes, dtype=np.int64)
    dataset_index = np.empty(total, dtype=np.int16)
    dataset_sample_index = np.empty(total, dtype=np.int64)
    drawn = np.zeros(len(sizes), dtype=np.int64)
    active = np.empty(len(sizes), dtype=np.int32)
    library.msmp_build_exhaustive_blending_indices(
        compiled.address(dataset_index), compiled.address(dataset_sample_index),
        compiled.address(weights), compiled.address(limits), compiled.address(drawn),
        compiled.address(active), len(sizes), total,
    )
    return dataset_index, dataset_sample_index
