"""Mixes datasets in fixed proportions with megatron-core's blending indices."""
from __future__ import annotations

from typing import Dict, Optional, Sequence

import numpy as np
import torch

from megatron_smp.data.cache import build_or_load_cached
from megatron_smp.data.indices import build_blending_indices, build_exhaustive_blending_indices


_COUNT_CHUNK = 1 << 22


class BlendedDataset(torch.utils.data.Dataset):
    """Sample i is sample `dataset_sample_index[i]` of `datasets[dataset_index[i]]`.

    With a `size`, `weights` are proportions and every prefix of the blend matches them to
    within one sample per dataset; with `size=None`, `weights` are whole sample counts and
    dataset d contributes exactly weights[d] samples (megatron-core's two modes).
    """

    def __init__(
        self,
        datasets: Sequence[torch.utils.data.Dataset],
        weights: Sequence[float],
        size: Optional[int],
        split_name: str = "train",
        cache_dir: Optional[str] = None,
        description: Optional[Dict] = None,
        group=None,
        fast_load: bool = False,
        defer_mmap: bool = False,
    ) -> None:
        from megatron_smp.config import ConfigError

        self.datasets = list(datasets)
        if size is not None:
            weights = (np.array(weights, dtype=np.float64) / np.sum(weights)).tolist()
        else:
            weights = [int(w) for w in weights]
        self.weights = weights
        self.size = None if size is None else int(size)
        full_description = dict(description or {})
        full_description.update(
            {
                "class": type(self).__name__,
                "split": split_name,
                "components": [getattr(d, "cache_key", None) for d in self.datasets],
                "weights": self.weights,
                "size": self.size,
            }
        )

        def build() -> Dict[str, np.ndarray]:
            if self.size is None:
                indices = build_exhaustive_blending_indices(self.weights)
            else:
                indices = build_blending_indices(self.weights, self.size)
            return dict(zip(("dataset_index", "dataset_sample_index"), indices))

        # A mapping: with defer_mmap the .npy files are mapped at the first sample read.
        self._arrays = build_or_load_cached(
            cache_dir, full_description, ("dataset_index", "dataset_sample_index"), build,
            group=group, fast_load=fast_load, defer_mmap=defer_mmap,
        )
        if defer_mmap:
            return  # the draws were checked against the datasets when the cache was built
        # In chunks: bincount widens int16 to int64, 4x the array at hundreds of millions.
        drawn = np.zeros(len(self.datasets), dtype=np.int64)
        for start in range(0, len(self), _COUNT_CHUNK):
            drawn += np.bincount(
                self.dataset_index[start:start + _COUNT_CHUNK], minlength=len(self.datasets)
            )
        for number, (dataset, count) in enumerate(zip(self.datasets, drawn)):
            if count > len(dataset):
                raise ConfigError(
                    f"the {split_name} blend draws {count} samples from its dataset number "
                    f"{number}, which has {len(dataset)}; raise --mid-level-dataset-surplus "
                    "(e.g. to 0.05)"
                )

    @property
    def dataset_index(self) -> np.ndarray:
        return self._arrays["dataset_index"]

    @property
    def dataset_sample_index(self) -> np.ndarray:
        return self._arrays["dataset_sample_index"]

    def __len__(self) -> int:
        return self.size if self.size is not None else int(sum(self.weights))

    def __getitem__(self, index: int):
        dataset = self.datasets[int(self.dataset_index[index])]
        return dataset[int(self.dataset_sample_index[index])]
