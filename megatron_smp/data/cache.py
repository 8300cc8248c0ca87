"""Build index arrays once (rank 0), cache them as .npy files, and let other ranks load them."""
from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import Callable, Dict, Optional, Sequence

import numpy as np

logger = logging.getLogger(__name__)


def description_hash(description: Dict) -> str:
    text = json.dumps(description, sort_keys=True, default=str)
    return hashlib.md5(text.encode("utf-8")).hexdigest()


def _rank_and_barrier(group):
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch is a dependency
        return 0, lambda: None
    if not (dist.is_available() and dist.is_initialized()):
        return 0, lambda: None
    return dist.get_rank(group), lambda: dist.barrier(group=group)


def build_or_load_cached(
    cache_dir: Optional[str],
    description: Dict,
    names: Sequence[str],
    build: Callable[[], Dict[str, np.ndarray]],
    group=None,
) -> Dict[str, np.ndarray]:
    """Return the arrays `names` that `build()` makes for this `description`.

    Rank 0 of `group` (the default group if torch.distributed is initialized) builds and
    saves them under `cache_dir` as `{hash}-{name}.npy`; every rank of `group` must call
    this, the others wait on a barrier and memory-map the files. A rank that cannot see the
    files (node-local cache directory) builds the same arrays itself: the build is
    deterministic. `cache_dir=None` disables the cache.
    """
    rank, barrier = _rank_and_barrier(group)
    key = description_hash(description)
    paths = (
        {name: os.path.join(cache_dir, f"{key}-{name}.npy") for name in names}
        if cache_dir
        else {}
    )

    def cached() -> bool:
        return bool(paths) and all(os.path.isfile(path) for path in paths.values())

    arrays = None
    if rank == 0 and not cached():
        arrays = build()
        if paths:
            try:
                os.makedirs(cache_dir, exist_ok=True)
                with open(os.path.join(cache_dir, f"{key}-description.json"), "w") as handle:
                    json.dump(description, handle, indent=2, sort_keys=True, default=str)
                for name, path in paths.items():
                    tmp_path = f"{path}.{os.getpid()}.tmp.npy"
                    np.save(tmp_path, arrays[name], allow_pickle=False)
                    os.replace(tmp_path, path)  # readers never see a partial file
            except OSError as error:
                logger.warning(
                    "cannot write the index cache in %s (%s); kept in memory", cache_dir, error
                )
    barrier()
    if arrays is not None:
        return arrays
    if cached():
        return {
            name: np.load(path, mmap_mode="r", allow_pickle=False)
            for name, path in paths.items()
        }
    return build()
