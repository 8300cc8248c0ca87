"""Mixes datasets in fixed proportions with Megatron-LM's greedy blending index."""
from __future__ import annotations

from typing import Dict, Optional, Sequence

import torch

from megatron_smp.data.cache import build_or_load_cached
from megatron_smp.data.indices import build_blending_indices


class BlendedDataset(torch.utils.data.Dataset):
    """`size` samples; sample i is sample `dataset_sample_index[i]` of
    `datasets[dataset_index[i]]`. Every prefix of the blend matches `weights` to within one
    sample per dataset."""

    def __init__(
        self,
        datasets: Sequence[torch.utils.data.Dataset],
        weights: Sequence[float],
        size: int,
        cache_dir: Optional[str] = None,
        description: Optional[Dict] = None,
        group=None,
    ) -> None:
        total = float(sum(weights))
        self.datasets = list(datasets)
        self.weights = [float(w) / total for w in weights]
        self.size = int(size)
        full_description = dict(description or {})
        full_description.update(
            {"class": type(self).__name__, "weights": self.weights, "size": self.size}
        )
        arrays = build_or_load_cached(
            cache_dir,
            full_description,
            ("dataset_index", "dataset_sample_index"),
            lambda: dict(
                zip(
                    ("dataset_index", "dataset_sample_index"),
                    build_blending_indices(self.weights, self.size),
                )
            ),
            group=group,
        )
        self.dataset_index = arrays["dataset_index"]
        self.dataset_sample_index = arrays["dataset_sample_index"]

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int):
        dataset = self.datasets[int(self.dataset_index[index])]
        # Components hold at least weight * size samples (plus a margin); the modulo only
        # matters if a component was built shorter by hand.
        return dataset[int(self.dataset_sample_index[index]) % len(dataset)]
