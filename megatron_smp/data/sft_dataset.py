"""Supervised fine-tuning samples: whole conversations packed into fixed-length sequences.

Data layout (written by tools/preprocess_sft_data.py): `PREFIX.bin/.idx` holds the token ids,
one document per conversation; `PREFIX_loss_mask.bin/.idx` is a parallel uint8 indexed
dataset of the same sizes, 1 where a token was written by the assistant (the only tokens
that are trained on), 0 for the prompt, the system text and the template's markup.

A conversation of n tokens gives n - 1 (input, label) positions. Conversations are packed
whole, never split, several per sequence (best-fit decreasing); each one attends only to
itself and its positions restart at 0 (the document mask of --reset-attention-mask, shared
through `document_ids_and_position_ids`). Padding comes only at the end of a pack (and
under context parallelism at the end of each conversation, up to a multiple of 2 x CP, so
that each splits evenly over the CP ranks) and is never trained on.

Preference data (`tools/preprocess_sft_data.py --preference`) stores each pair as two
consecutive documents, chosen then rejected: with `group_size=2` a pair is packed whole, so
within a packed row documents 2p and 2p + 1 are pair p's (what `post_training.dpo` reads).
"""
from __future__ import annotations

import bisect
import logging
from typing import Dict, List, Optional

import numpy as np
import torch

from megatron_smp.config import ConfigError
from megatron_smp.data.gpt_dataset import document_ids_and_position_ids
from megatron_smp.data.indexed_dataset import IndexedDataset

logger = logging.getLogger(__name__)

LOSS_MASK_SUFFIX = "_loss_mask"


def loss_mask_prefix(prefix: str) -> str:
    """The prefix of the loss-mask dataset that accompanies the token dataset `prefix`."""
    return prefix + LOSS_MASK_SUFFIX


def pack_best_fit(lengths, capacity: int) -> List[List[int]]:
    """Best-fit decreasing bin packing: lists of indices into `lengths`, each list's lengths
    summing to at most `capacity`. Deterministic (ties keep the original order)."""
    if len(lengths) and int(max(lengths)) > capacity:
        raise ValueError(f"a length of {int(max(lengths))} does not fit a pack of {capacity}")
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    packs: List[List[int]] = []
    # (free space, pack number) kept sorted: the fullest pack that still fits wins.
    free: List[tuple] = []
    for i in order:
        length = int(lengths[i])
        slot = bisect.bisect_left(free, (length, -1))
        if slot < len(free):
            space, pack = free.pop(slot)
            packs[pack].append(i)
            bisect.insort(free, (space - length, pack))
        else:
            packs.append([i])
            bisect.insort(free, (capacity - length, len(packs) - 1))
    return packs


def packing_efficiency(lengths, packs, capacity: int) -> float:
    """Tokens used / tokens paid for: sum of conversation positions over packs x capacity."""
    used = sum(int(lengths[i]) for pack in packs for i in pack)
    return used / float(max(len(packs), 1) * capacity)


class SFTDataset(torch.utils.data.Dataset):
    """Packed conversations of one split.

    `indexed_dataset` / `mask_dataset`: the token and loss-mask datasets (same sizes);
    `sequence_ids`: the units of this split (conversations, or with `group_size` g the
    documents g*u ... g*u + g - 1 of unit u, packed together: preference pairs);
    `num_samples`: how many packed samples to serve (None: one epoch of packs); later epochs
    visit the packs in a new order. Items are the GPTDataset dict: tokens, labels,
    loss_mask, position_ids [s] and document_ids [s] (the conversation of each position:
    `transformer.packed`); with `token_values` {name: flat array over every document's
    n - 1 label positions, in document order} also those, packed like the labels (0 on
    padding).
    """

    def __init__(
        self,
        indexed_dataset,
        mask_dataset,
        sequence_ids: np.ndarray,
        num_samples: Optional[int],
        seq_length: int,
        seed: int,
        pad: int,
        split_name: str = "train",
        source: str = "",
        pad_to_multiple: int = 1,
        group_size: int = 1,
        token_values: Optional[Dict[str, np.ndarray]] = None,
    ) -> None:
        self.indexed_dataset = indexed_dataset
        self.group_size = int(group_size)
        self.token_values = dict(token_values or {})
        self.mask_dataset = mask_dataset
        self.sequence_ids = np.asarray(sequence_ids, dtype=np.int64)
        self.seq_length = int(seq_length)
        self.seed = int(seed)
        self.pad = int(pad)
        self.split_name = split_name
        sizes = np.asarray(indexed_dataset.sizes)
        if not np.array_equal(sizes, np.asarray(mask_dataset.sizes)):
            raise ConfigError(
                f"--sft: {source}{LOSS_MASK_SUFFIX} does not match {source} (different "
                "conversation lengths); write both with tools/preprocess_sft_data.py"
            )
        # Label positions before each document in the flat `token_values` arrays.
        self.value_offsets = np.concatenate([[0], np.cumsum(sizes.astype(np.int64) - 1)])
        documents = (self.sequence_ids[:, None] * self.group_size
                     + np.arange(self.group_size)[None, :])  # [units, group_size]
        self.documents = documents
        document_lengths = sizes[documents].astype(np.int64) - 1
        # Under context parallelism each conversation takes a multiple of 2 x CP positions
        # (loss-masked padding at its end) so that it splits evenly over the CP ranks.
        self.pad_to_multiple = int(pad_to_multiple)
        self.document_slots = (-(-document_lengths // self.pad_to_multiple)
                               * self.pad_to_multiple)
        self.lengths = document_lengths.sum(axis=1)
        self.slot_lengths = self.document_slots.sum(axis=1)
        too_long = np.nonzero(self.slot_lengths > self.seq_length)[0]
        if too_long.size:
            first = int(documents[too_long[0], 0])
            padded = (f" (padded to a multiple of {self.pad_to_multiple} = 2 x "
                      "--context-parallel-size)" if self.pad_to_multiple > 1 else "")
            raise ConfigError(
                f"--sft: conversation {first} of {source} has {int(sizes[first])} tokens{padded}"
                f", more than --seq-length {self.seq_length} + 1 ({too_long.size} such); raise "
                "--seq-length or drop them (tools/preprocess_sft_data.py --seq-length)"
            )
        if self.sequence_ids.size == 0 or int(self.lengths.max()) < 1:
            raise ConfigError(f"--sft: the {split_name} split of {source} has no conversation "
                              "of two tokens or more")
        self.packs = pack_best_fit(self.slot_lengths, self.seq_length)
        self.efficiency = packing_efficiency(self.lengths, self.packs, self.seq_length)
        self.num_samples = len(self.packs) if num_samples is None else int(num_samples)
        logger.info(
            "SFT %s split: %d conversations in %d packs of %d tokens, packing efficiency "
            "%.4f", split_name, self.sequence_ids.size, len(self.packs), self.seq_length,
            self.efficiency,
        )

    def __len__(self) -> int:
        return self.num_samples

    def _pack_of(self, index: int) -> List[int]:
        epoch, within = divmod(int(index), len(self.packs))
        order = np.random.RandomState((self.seed + epoch) % 2**32).permutation(len(self.packs))
        return self.packs[int(order[within])]

    def __getitem__(self, index: int) -> Dict[str, torch.Tensor]:
        s = self.seq_length
        tokens = np.full(s, self.pad, dtype=np.int64)
        labels = np.full(s, self.pad, dtype=np.int64)
        loss_mask = np.zeros(s, dtype=np.float32)
        values = {name: np.zeros(s, dtype=flat.dtype) for name, flat in self.token_values.items()}
        starts, position = [], 0
        for local in self._pack_of(index):
            for sequence, slot in zip(self.documents[local], self.document_slots[local]):
                sequence = int(sequence)
                ids = np.asarray(self.indexed_dataset.get(sequence), dtype=np.int64)
                mask = np.asarray(self.mask_dataset.get(sequence), dtype=np.float32)
                n = ids.size - 1
                starts.append(position)
                tokens[position:position + n] = ids[:-1]
                labels[position:position + n] = ids[1:]
                loss_mask[position:position + n] = mask[1:]
                offset = int(self.value_offsets[sequence])
                for name, flat in self.token_values.items():
                    values[name][position:position + n] = flat[offset:offset + n]
                position += int(slot)
        if position < s:
            # The padding is a document of its own, so that it attends to nothing real.
            starts.append(position)
        position_ids, document_ids = document_ids_and_position_ids(starts, s, True, True)
        return {
            "tokens": torch.from_numpy(tokens),
            "labels": torch.from_numpy(labels),
            "loss_mask": torch.from_numpy(loss_mask),
            "position_ids": position_ids,
            "document_ids": document_ids,
            **{name: torch.from_numpy(value) for name, value in values.items()},
        }


def build_sft_splits(prefix: str, matrix, num_samples, seq_length: int, seed: int, pad: int,
                     split_range, split_names, mmap: bool = True, pad_to_multiple: int = 1,
                     group_size: int = 1, token_values=None):
    """One SFTDataset per split of `prefix` (None where `matrix` has no split); the splits
    cut the conversations (the units of `group_size` documents) by --split as GPT data is
    cut by sequences."""
    import os

    mask_prefix = loss_mask_prefix(prefix)
    for suffix in (".idx", ".bin"):
        if not os.path.isfile(mask_prefix + suffix):
            raise ConfigError(
                f"--sft: {mask_prefix}{suffix} not found; --sft data needs the loss mask that "
                "tools/preprocess_sft_data.py writes beside the tokens"
            )
    indexed = IndexedDataset(prefix, mmap=mmap)
    masks = IndexedDataset(mask_prefix, mmap=mmap)
    if len(indexed) % group_size:
        raise ConfigError(f"{prefix}: {len(indexed)} documents do not form groups of "
                          f"{group_size} (preference data holds a chosen and a rejected "
                          "document per pair: tools/preprocess_sft_data.py --preference)")
    datasets = []
    for i, bookends in enumerate(matrix):
        units = len(indexed) // group_size
        begin, end = split_range(bookends, units) if bookends is not None else (0, 0)
        if end <= begin:
            datasets.append(None)
            continue
        datasets.append(SFTDataset(
            indexed, masks, np.arange(begin, end), num_samples[i], seq_length, seed, pad,
            split_names[i], source=prefix, pad_to_multiple=pad_to_multiple,
            group_size=group_size, token_values=token_values,
        ))
    return datasets


__all__ = ["SFTDataset", "build_sft_splits", "loss_mask_prefix", "pack_best_fit",
           "packing_efficiency"]
