"""SMP v2's `load` on top of torch.distributed.checkpoint: in place, resharding, checked."""
from __future__ import annotations

import os
from collections import defaultdict
from typing import Any, Dict, List, Optional, Union

import torch
import torch.distributed as dist
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from megatron_smp.checkpointing.engine.agreement import (
    global_ranks,
    group_size_and_rank,
    is_distributed,
    raise_if_any_rank_failed,
)
from megatron_smp.checkpointing.engine.saver import reject_s3
from megatron_smp.checkpointing.engine.storage import (
    gc_paused,
    CheckpointError,
    SafeFileSystemReader,
    SafeLoadPlanner,
    validate_data_files,
)
from megatron_smp.config.errors import format_listing


def _top_level(key: str) -> str:
    return key.split(".", 1)[0]


def _local_key_report(state_dict: Dict[str, Any], metadata: Metadata) -> Dict[str, Any]:
    flat, _ = flatten_state_dict(state_dict)
    missing, mismatched = [], []
    for key, obj in flat.items():
        md = metadata.state_dict_metadata.get(key)
        if md is None:
            missing.append(key)
        elif isinstance(obj, torch.Tensor):
            if isinstance(md, BytesStorageMetadata):
                mismatched.append(f"{key}: checkpoint holds a non-tensor value, model a tensor")
            elif isinstance(md, TensorStorageMetadata) and md.size != obj.size():
                mismatched.append(
                    f"{key}: checkpoint shape {list(md.size)} vs model shape {list(obj.size())}"
                )
        elif isinstance(md, TensorStorageMetadata):
            mismatched.append(
                f"{key}: checkpoint holds a tensor of shape {list(md.size)}, model a "
                f"{type(obj).__name__}"
            )
    return {"keys": sorted(flat), "missing": missing, "mismatched": mismatched}


def check_keys_against_checkpoint(
    state_dict: Dict[str, Any],
    metadata: Metadata,
    checkpoint_id,
    process_group: Optional[dist.ProcessGroup] = None,
) -> None:
    """Collective: all-gather every rank's keys and raise on all ranks if they do not match.

    Mismatches are: keys a rank asks for that the checkpoint lacks, tensors whose global shape
    differs, and keys the checkpoint holds under a top-level entry that is being loaded (say
    `model`) that no rank asks for. Top-level entries nobody loads (e.g. `optimizer` when
    skipping it) are ignored. Pipeline stages ask for different keys, hence the union.
    """
    report = _local_key_report(state_dict, metadata)
    size, _ = group_size_and_rank(process_group)
    reports = [report]
    if is_distributed():
        reports = [None] * size
        dist.all_gather_object(reports, report, group=process_group)
    ranks = global_ranks(process_group)
    requested = set()
    missing, mismatched = defaultdict(list), defaultdict(list)
    for rank, rep in zip(ranks, reports):
        requested.update(rep["keys"])
        for key in rep["missing"]:
            missing[key].append(rank)
        for line in rep["mismatched"]:
            mismatched[line].append(rank)
    loaded_tops = {_top_level(k) for k in requested}
    unexpected = sorted(
        key
        for key in metadata.state_dict_metadata
        if _top_level(key) in loaded_tops and key not in requested
    )
    if not (missing or mismatched or unexpected):
        return
    parts = [f"checkpoint {checkpoint_id} does not match the state dict being loaded"]
    if missing:
        parts.append(
            "missing from the checkpoint: "
            + format_listing([f"{k} (ranks {r})" for k, r in sorted(missing.items())])
        )
    if mismatched:
        parts.append(
            "different shape or type: "
            + format_listing([f"{line} (ranks {r})" for line, r in sorted(mismatched.items())])
        )
    if unexpected:
        parts.append("in the checkpoint but loaded by no rank: " + format_listing(unexpected))
    parts.append("was it saved from a different model configuration?")
    raise CheckpointError("; ".join(parts))


def read_checkpoint_metadata(
    checkpoint_id, storage_reader=None, process_group: Optional[dist.ProcessGroup] = None
) -> Metadata:
    """Collective: every rank reads and validates the metadata; any failure raises on all."""
    metadata, error = None, None
    try:
        reader = storage_reader or SafeFileSystemReader(os.fspath(checkpoint_id))
        metadata = reader.read_metadata()
        if isinstance(reader, SafeFileSystemReader):
            validate_data_files(os.fspath(reader.path), metadata)
    except Exception as caught:
        error = caught
    raise_if_any_rank_failed(error, process_group, f"reading checkpoint {checkpoint_id}")
    return metadata


def load(
    state_dict: Dict[str, Any],
    *,
    checkpoint_id: Union[str, os.PathLike, None] = None,
    storage_reader=None,
    planner=None,
    process_group: Optional[dist.ProcessGroup] = None,
    check_keys_matched: bool = True,
    coordinator_rank: int = 0,
    s3_region: Optional[str] = None,
    s3client_config=None,
    metadata: Optional[Metadata] = None,
) -> None:
    """Load `checkpoint_id` into `state_dict` in place; collective over `process_group`.

    Tensors (and `ShardedTensorView` chunks) are filled in place, resharded from whatever
    layout saved them; non-tensor values are replaced in `state_dict`. Every file is checked
    first (metadata readable, data files present and long enough), then with
    `check_keys_matched` the keys and global shapes (see `check_keys_against_checkpoint`).
    `metadata`: the checkpoint's metadata as `read_checkpoint_metadata` returned it (read and
    checked once per load by a caller that needed it before); read here otherwise.
    """
    reject_s3(s3_region, s3client_config)
    if storage_reader is None:
        if checkpoint_id is None:
            raise CheckpointError("load needs checkpoint_id (a directory) or a storage_reader")
        storage_reader = SafeFileSystemReader(os.fspath(checkpoint_id))
    elif checkpoint_id is not None:
        storage_reader.reset(checkpoint_id)
    if metadata is None:
        metadata = read_checkpoint_metadata(checkpoint_id, storage_reader, process_group)
    if isinstance(storage_reader, SafeFileSystemReader):
        storage_reader.use_metadata(metadata)  # DCP's own read_metadata() returns it
    if check_keys_matched:
        check_keys_against_checkpoint(state_dict, metadata, checkpoint_id, process_group)
    try:
        with gc_paused():
            _load_state_dict(
                state_dict,
                storage_reader=storage_reader,
                process_group=process_group,
                coordinator_rank=coordinator_rank,
                no_dist=not is_distributed(),
                planner=planner or SafeLoadPlanner(),
            )
    except CheckpointException as error:
        failures = getattr(error, "failures", {}) or {}
        first = next(iter(failures.values()), error)
        if isinstance(first, tuple):  # DCP stores (exception, stack summary)
            first = first[0]
        if isinstance(first, CheckpointError):
            raise CheckpointError(str(first)) from error
        raise CheckpointError(
            f"loading checkpoint {checkpoint_id} failed on rank(s) {sorted(failures)}: "
            f"{type(first).__name__}: {first}"
        ) from error
