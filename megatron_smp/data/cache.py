"""Build index arrays once (rank 0), cache them as .npy files, and let other ranks load them.

Waiting ranks poll instead of sitting in a barrier: a build of hundreds of millions of samples
may take longer than the collective timeout (--distributed-timeout-minutes), and a barrier
would time out. Rank 0 says it has finished (or failed) through a key in the process group's
store; the others poll that key (every 0.1 s, backing off to 5 s), and rank 1 of the group
logs a progress line every `PROGRESS_SECONDS` (at WARNING, so that it shows by default).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from typing import Callable, Dict, Mapping, Optional, Sequence

import numpy as np

logger = logging.getLogger(__name__)

POLL_SECONDS = 0.1
MAX_POLL_SECONDS = 5.0
PROGRESS_SECONDS = 30.0
PREPARE_HINT = "build them first with tools/prepare_cache.py and the same flags"


def description_hash(description: Dict) -> str:
    text = json.dumps(description, sort_keys=True, default=str)
    return hashlib.md5(text.encode("utf-8")).hexdigest()


def cache_paths(cache_dir: str, description: Dict, names: Sequence[str]) -> Dict[str, str]:
    """`{name: path}` of the .npy files holding `names` for this description."""
    key = description_hash(description)
    return {name: os.path.join(cache_dir, f"{key}-{name}.npy") for name in names}


def _distributed(group):
    """(rank in group, global rank of the group's rank 0, store) or None without a group."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch is a dependency
        return None
    if not (dist.is_available() and dist.is_initialized()):
        return None
    from torch.distributed import distributed_c10d

    builder = dist.get_global_rank(group, 0) if group is not None else 0
    return dist.get_rank(group), builder, distributed_c10d._get_default_store()


def _load(paths: Mapping[str, str]) -> Dict[str, np.ndarray]:
    return {name: np.load(path, mmap_mode="r", allow_pickle=False) for name, path in paths.items()}


class DeferredArrays(Mapping):
    """The cached arrays, memory-mapped at the first access to any of them
    (--dataloader-defer-npy-index-mmap): building thousands of datasets opens no .npy file."""

    def __init__(self, paths: Mapping[str, str]) -> None:
        self.paths = dict(paths)
        self._arrays: Optional[Dict[str, np.ndarray]] = None

    @property
    def loaded(self) -> bool:
        return self._arrays is not None

    def __getitem__(self, name: str) -> np.ndarray:
        if self._arrays is None:
            self._arrays = _load(self.paths)
        return self._arrays[name]

    def __iter__(self):
        return iter(self.paths)

    def __getstate__(self):
        # A data loader worker maps the files itself, rather than receiving copies.
        return {"paths": self.paths, "_arrays": None}

    def __len__(self) -> int:
        return len(self.paths)


def _write(cache_dir, description, paths, arrays) -> None:
    try:
        os.makedirs(cache_dir, exist_ok=True)
        key = description_hash(description)
        with open(os.path.join(cache_dir, f"{key}-description.json"), "w") as handle:
            json.dump(description, handle, indent=2, sort_keys=True, default=str)
        for name, path in paths.items():
            tmp_path = f"{path}.{os.getpid()}.tmp.npy"
            np.save(tmp_path, arrays[name], allow_pickle=False)
            os.replace(tmp_path, path)  # readers never see a partial file
    except OSError as error:
        logger.warning("cannot write the index cache in %s (%s); kept in memory", cache_dir, error)


def build_or_load_cached(
    cache_dir: Optional[str],
    description: Dict,
    names: Sequence[str],
    build: Callable[[], Dict[str, np.ndarray]],
    group=None,
    fast_load: bool = False,
    defer_mmap: bool = False,
) -> Mapping[str, np.ndarray]:
    """Return the arrays `names` that `build()` makes for this `description`.

    Cached as `{cache_dir}/{hash}-{name}.npy`. Files already there are memory-mapped by every
    rank at once, with no waiting. Otherwise rank 0 of `group` (the default group if
    torch.distributed is initialized) builds and saves them while the other ranks of `group`
    poll the store for its word, with no collective, so no build is too long for them; every
    rank of `group` must call this. A rank that cannot see the files when rank 0 is done (node-local
    cache directories) builds the same arrays itself: the build is deterministic.
    `cache_dir=None` disables the cache (every rank builds).

    `fast_load` (--dataloader-fast-cache-load) and `defer_mmap`
    (--dataloader-defer-npy-index-mmap) require the files to exist (tools/prepare_cache.py
    makes them) and raise ConfigError otherwise; `defer_mmap` returns a DeferredArrays that
    maps them at first access.
    """
    if cache_dir is None:
        return build()
    paths = cache_paths(cache_dir, description, names)

    def cached() -> bool:
        return all(os.path.isfile(path) for path in paths.values())

    if fast_load or defer_mmap:
        missing = [path for path in paths.values() if not os.path.isfile(path)]
        if missing:
            from megatron_smp.config import ConfigError

            flag = "--dataloader-fast-cache-load" if fast_load else (
                "--dataloader-defer-npy-index-mmap")
            raise ConfigError(
                f"{flag} loads prepared index caches, but {missing[0]} (the "
                f"{description.get('split', '')} {description.get('class', '')} indices) is "
                f"not in --data-cache-path {cache_dir}; {PREPARE_HINT}, or drop {flag}"
            )
        return DeferredArrays(paths) if defer_mmap else _load(paths)
    distributed = _distributed(group)
    if distributed is None or distributed[0] == 0:
        if cached():
            arrays = _load(paths)
        else:
            try:
                arrays = build()
            except BaseException as error:
                if distributed is not None:
                    _announce(distributed, paths, f"error: {type(error).__name__}: {error}")
                raise
            _write(cache_dir, description, paths, arrays)
        if distributed is not None:
            # Also when the files were there: a rank that cannot see them must not wait on.
            _announce(distributed, paths, "done")
        return arrays
    if cached():
        return _load(paths)
    status = _wait_for_builder(distributed, paths, description)
    if status == "done" and cached():
        return _load(paths)
    if status == "done":
        logger.info("the index cache of rank %d is not visible here (%s); building it on this "
                    "rank", distributed[1], cache_dir)
        return build()
    raise RuntimeError(f"rank {distributed[1]} failed to build the dataset indices: {status}")


def _store_key(distributed, paths: Mapping[str, str]) -> str:
    first = os.path.basename(next(iter(paths.values())))
    return f"megatron_smp/data_cache/{distributed[1]}/{first}"


def _announce(distributed, paths, status: str) -> None:
    distributed[2].set(_store_key(distributed, paths), status)


def _wait_for_builder(distributed, paths, description) -> str:
    """Poll the store until the builder posts its status; never a collective, so no timeout.

    Polls back off from POLL_SECONDS to MAX_POLL_SECONDS: a thousand waiting ranks then ask
    the store a few hundred times a second at most, and the file system not at all.
    """
    key = _store_key(distributed, paths)
    store = distributed[2]
    start = last_report = time.monotonic()
    interval = POLL_SECONDS
    while True:
        if store.check([key]):
            return store.get(key).decode()
        now = time.monotonic()
        if now - last_report >= PROGRESS_SECONDS:
            last_report = now
            # Shown without logging configured (WARNING) by one waiting rank, not by all.
            logger.log(
                logging.WARNING if distributed[0] == 1 else logging.INFO,
                "waiting for rank %d to build the %s %s indices in %s (%.0f s so far)",
                distributed[1], description.get("split", ""), description.get("class", ""),
                os.path.dirname(next(iter(paths.values()))), now - start,
            )
        time.sleep(interval)
        interval = min(interval * 1.5, MAX_POLL_SECONDS)
