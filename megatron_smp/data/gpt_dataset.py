"""GPT pretraining samples: fixed-length windows over shuffled, concatenated documents."""
from __future__ import annotations

import os
from typing import Dict, Optional

import numpy as np
import torch

from megatron_smp.data.cache import build_or_load_cached, description_hash
from megatron_smp.data.indexed_dataset import IndexedDataset, index_file_path
from megatron_smp.data.indices import (
    build_document_index,
    build_sample_index,
    build_shuffle_index,
)

# A final epoch of which fewer than this fraction is used is shuffled on its own (Megatron).
_SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80


def document_ids_and_position_ids(
    document_starts, seq_length: int, reset_position_ids: bool, reset_attention_mask: bool,
):
    """Position ids [s] int64 and, with `reset_attention_mask`, document_ids [s] int32 (the
    document number of every position: each document attends only to itself, see
    `transformer.packed`) of a sequence whose documents begin at `document_starts`
    (increasing positions in [0, s); position 0 is implied).

    The one implementation of document boundaries: pretraining with --reset-attention-mask /
    --reset-position-ids and packed SFT sequences both build them here. No [s, s] mask is
    made: the attention reads the documents from the ids.
    """
    starts = torch.zeros(seq_length, dtype=torch.bool)
    starts[0] = True
    inside = [int(start) for start in document_starts if 0 < int(start) < seq_length]
    starts[inside] = True
    document_ids = torch.cumsum(starts, 0, dtype=torch.int32) - 1
    position_ids = torch.arange(seq_length, dtype=torch.int64)
    if reset_position_ids:
        first = torch.where(starts, position_ids, torch.zeros_like(position_ids))
        position_ids = position_ids - first.cummax(0).values
    return position_ids, (document_ids if reset_attention_mask else None)


def get_ltor_masks_and_position_ids(
    tokens: torch.Tensor,
    eod_token: int,
    reset_position_ids: bool,
    reset_attention_mask: bool,
    eod_mask_loss: bool,
):
    """Left-to-right masks for one sample `tokens [s]`.

    Returns loss_mask [s] float32, position_ids [s] int64 and, only with
    `reset_attention_mask`, document_ids [s] int32 (a new document after each eod; Megatron
    builds the equivalent [1, s, s] mask, here the attention skips other documents' keys).
    """
    seq_length = tokens.numel()
    loss_mask = torch.ones(seq_length, dtype=torch.float32)
    if eod_mask_loss:
        loss_mask[tokens == eod_token] = 0.0
    document_starts = []
    if reset_position_ids or reset_attention_mask:
        # A document starts after each eod.
        document_starts = ((tokens == eod_token).nonzero(as_tuple=True)[0] + 1).tolist()
    position_ids, document_ids = document_ids_and_position_ids(
        document_starts, seq_length, reset_position_ids, reset_attention_mask
    )
    return loss_mask, position_ids, document_ids


class GPTDataset(torch.utils.data.Dataset):
    """Samples of `seq_length + 1` tokens drawn across document boundaries.

    `indexed_dataset` is an IndexedDataset (or anything with `sizes` and `get(i, offset,
    length)`); `sequence_ids` are the sequences of this split. Index arrays are built by
    rank 0 and cached in `cache_dir` (keyed by a hash of everything that shapes them).
    Each item is a dict: tokens [s] int64, labels [s] int64, loss_mask [s] float32,
    position_ids [s] int64, and document_ids [s] int32 with reset_attention_mask.
    """

    def __init__(
        self,
        indexed_dataset,
        sequence_ids: np.ndarray,
        num_samples: Optional[int],
        seq_length: int,
        seed: int,
        eod: int,
        split_name: str = "train",
        reset_position_ids: bool = False,
        reset_attention_mask: bool = False,
        eod_mask_loss: bool = False,
        cache_dir: Optional[str] = None,
        description: Optional[Dict] = None,
        group=None,
        fast_load: bool = False,
        defer_mmap: bool = False,
        sample_transform=None,
    ) -> None:
        # Called on each sample's seq_length + 1 ids before the split into tokens and labels
        # (--fim-data: data.fim.FIMTransform).
        self.sample_transform = sample_transform
        self.indexed_dataset = indexed_dataset
        self.sequence_ids = np.asarray(sequence_ids)
        self.num_samples = num_samples
        self.seq_length = int(seq_length)
        self.seed = int(seed)
        self.eod = int(eod)
        self.split_name = split_name
        self.reset_position_ids = reset_position_ids
        self.reset_attention_mask = reset_attention_mask
        self.eod_mask_loss = eod_mask_loss
        self.tokens_per_epoch = int(
            np.asarray(indexed_dataset.sizes)[self.sequence_ids].sum(dtype=np.int64)
        )
        # megatron-core repeats a short split over as many epochs as the samples need; with
        # too few tokens for one sample and no count to reach, it would loop or yield nothing.
        if self.tokens_per_epoch < 2 or (
            num_samples is None and self.tokens_per_epoch <= self.seq_length
        ):
            from megatron_smp.config import ConfigError

            raise ConfigError(
                f"the {split_name} split has {self.tokens_per_epoch} tokens, fewer than one "
                f"sample of --seq-length {self.seq_length} + 1; add data, shorten --seq-length "
                "or change --split"
            )
        full_description = dict(description or {})
        full_description.update(
            {
                "class": type(self).__name__,
                "split": split_name,
                "num_sequences": int(self.sequence_ids.size),
                "first_sequence": int(self.sequence_ids[0]) if self.sequence_ids.size else -1,
                "tokens_per_epoch": self.tokens_per_epoch,
                "num_samples": num_samples,
                "seq_length": self.seq_length,
                "seed": self.seed,
            }
        )
        self.cache_key = description_hash(full_description)
        # A mapping: with defer_mmap the .npy files are mapped at the first sample read.
        self._arrays = build_or_load_cached(
            cache_dir,
            full_description,
            ("document_index", "sample_index", "shuffle_index"),
            self._build_indices,
            group=group,
            fast_load=fast_load,
            defer_mmap=defer_mmap,
        )

    @property
    def document_index(self) -> np.ndarray:
        return self._arrays["document_index"]

    @property
    def sample_index(self) -> np.ndarray:
        return self._arrays["sample_index"]

    @property
    def shuffle_index(self) -> np.ndarray:
        return self._arrays["shuffle_index"]

    def num_epochs(self) -> int:
        if self.num_samples is None:
            return 1
        needed = self.num_samples * self.seq_length + 1
        return max(1, -(-needed // self.tokens_per_epoch))

    def _build_indices(self) -> Dict[str, np.ndarray]:
        num_epochs = self.num_epochs()
        separate_final_epoch = False
        samples_before_final_epoch = None
        if num_epochs > 1:
            samples_before_final_epoch = (
                (num_epochs - 1) * self.tokens_per_epoch - 1
            ) // self.seq_length
            samples_from_final_epoch = self.num_samples - samples_before_final_epoch
            samples_per_epoch = (self.tokens_per_epoch - 1) // self.seq_length
            separate_final_epoch = samples_from_final_epoch < int(
                _SEPARATE_FINAL_EPOCH_THRESHOLD * samples_per_epoch
            )
        rng = np.random.RandomState(self.seed)
        document_index = build_document_index(
            self.sequence_ids, num_epochs, rng, separate_final_epoch
        )
        sample_index = build_sample_index(
            self.indexed_dataset.sizes, document_index, self.seq_length
        )
        total_samples = sample_index.shape[0] - 1
        shuffle_index = build_shuffle_index(
            samples_before_final_epoch if separate_final_epoch else total_samples,
            total_samples,
            rng,
        )
        return {
            "document_index": document_index,
            "sample_index": sample_index,
            "shuffle_index": shuffle_index,
        }

    def __len__(self) -> int:
        # From the token count, as build_sample_index sizes it, so that a deferred dataset
        # need not map its sample index to answer.
        return max((self.num_epochs() * self.tokens_per_epoch - 1) // self.seq_length, 0)

    def sample_tokens(self, index: int) -> np.ndarray:
        """The `seq_length + 1` token ids of sample `index` (before shuffling)."""
        first, first_offset = (int(v) for v in self.sample_index[index])
        last, last_offset = (int(v) for v in self.sample_index[index + 1])
        get = self.indexed_dataset.get
        if first == last:
            return np.array(
                get(int(self.document_index[first]), first_offset, last_offset - first_offset + 1),
                dtype=np.int64,
            )
        parts = [get(int(self.document_index[first]), first_offset)]
        parts.extend(get(int(self.document_index[i])) for i in range(first + 1, last))
        parts.append(get(int(self.document_index[last]), 0, last_offset + 1))
        return np.concatenate(parts).astype(np.int64)

    def __getitem__(self, index: int) -> Dict[str, torch.Tensor]:
        text = self.sample_tokens(int(self.shuffle_index[index]))
        if self.sample_transform is not None:
            text = self.sample_transform(text)
        text = torch.from_numpy(text)
        tokens, labels = text[:-1].contiguous(), text[1:].contiguous()
        loss_mask, position_ids, document_ids = get_ltor_masks_and_position_ids(
            tokens, self.eod, self.reset_position_ids, self.reset_attention_mask,
            self.eod_mask_loss,
        )
        sample = {
            "tokens": tokens,
            "labels": labels,
            "loss_mask": loss_mask,
            "position_ids": position_ids,
        }
        if document_ids is not None:
            sample["document_ids"] = document_ids
        return sample


class MockIndexedDataset:
    """Deterministic documents standing in for an IndexedDataset (--mock-data).

    Document i has 1..max_document_length consecutive ids (start, start+1, ... wrapping below
    the eod) from a random start, then the eod; the start and length come from a generator
    seeded by (seed, i), so any rank can recompute any document. Like Megatron's mock data
    the sequences are learnable (next id = this id + 1), so the loss of a test run falls well
    below ln(vocab) and runs compared against each other follow a real trajectory.
    """

    def __init__(
        self, num_documents: int, vocab_size: int, eod: int, seed: int,
        max_document_length: int = 1024,
    ) -> None:
        self.vocab_size = int(vocab_size)
        self.eod = int(eod)
        self.seed = int(seed)
        rng = np.random.RandomState(seed)
        self.sizes = rng.randint(2, max_document_length + 2, size=num_documents).astype(np.int32)

    def __len__(self) -> int:
        return self.sizes.size

    def get(self, index: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        size = int(self.sizes[index])
        rng = np.random.RandomState((self.seed * 1_000_003 + index) % 2**32)
        # Ids avoid the eod so that documents end exactly where the eod says.
        high = max(self.eod, 1) if 0 < self.eod < self.vocab_size else self.vocab_size
        start = rng.randint(0, high)
        document = np.append((start + np.arange(size - 1)) % high, self.eod)
        if length is None:
            length = size - offset
        return document[offset : offset + length]


def default_cache_dir(prefix: str, data_cache_path: Optional[str]) -> str:
    if data_cache_path:
        return data_cache_path
    return os.path.join(os.path.dirname(os.path.abspath(prefix)), "cache", "GPTDataset_indices")


def dataset_description(prefix: str) -> Dict:
    """What identifies a dataset file in the cache key (its path and index size)."""
    idx_path = index_file_path(prefix)
    return {"prefix": os.path.abspath(prefix), "idx_bytes": os.path.getsize(idx_path)}


__all__ = [
    "GPTDataset",
    "MockIndexedDataset",
    "IndexedDataset",
    "document_ids_and_position_ids",
    "get_ltor_masks_and_position_ids",
]
