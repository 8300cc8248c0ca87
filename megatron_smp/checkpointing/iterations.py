"""Iteration checkpoints on disk: layout, publishing, resuming (on top of `engine`).

    {save_dir}/latest_checkpointed_iteration.txt      the last complete iteration
    {save_dir}/iter_0000100/                          a complete checkpoint
        common.json                                   iteration, layout, config (JSON)
        .metadata, __0_0.distcp, __1_0.distcp ...     "torch_dist": DCP, every rank its shards
        rank_00000.pt, rank_00001.pt ...              "torch": one torch.save file per rank
    {save_dir}/iter_0000200.incomplete/               a save in progress (or killed): ignored

A save writes into `iter_N.incomplete`; only after every rank has finished (for an async save:
in the finalize step, after the collective agreement) does rank 0 rename it to `iter_N` and
then replace the tracker file atomically (write, fsync, os.replace, fsync the directory). A
crash at any point leaves the tracker naming a complete checkpoint, and the loader never looks
at `.incomplete` directories.

With a retain interval (Megatron's --save-retain-interval), publishing iteration N also
deletes the checkpoint the tracker named before it, P, unless P is a multiple of the interval
(or P == N, or P is 0, or `iter_P` is a symbolic link): the newest checkpoint and every
retained one stay. The deletion starts only after the tracker names N, so what a resume loads
is never the directory being deleted; it runs on a background thread of rank 0
(`wait_for_deletions` joins it).
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import threading
import warnings
from typing import Any, Callable, Dict, List, Optional, Union

import torch
import torch.distributed as dist

from megatron_smp.checkpointing.rng import (
    get_rng_state,
    rng_state_from_bytes,
    rng_state_to_bytes,
    set_rng_state,
)
from megatron_smp.checkpointing import engine as dcp
from megatron_smp.checkpointing.engine.agreement import is_distributed, raise_if_any_rank_failed
from megatron_smp.checkpointing.engine.async_queue import DEFAULT_ASYNC_QUEUE, AsyncCallsQueue
from megatron_smp.checkpointing.engine.sharded_tensor import ShardedTensorView
from megatron_smp.config.errors import format_listing
from megatron_smp.checkpointing.engine.saver import (
    check_state_dict,
    schedule_staged_write,
)
from megatron_smp.checkpointing.engine.storage import (
    CheckpointError,
    HookedSavePlanner,
    maybe_test_write_delay,
)

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
COMMON_FILENAME = "common.json"
STAGING_SUFFIX = ".incomplete"
# A complete checkpoint of the same iteration moved aside while its replacement is renamed in.
REPLACED_SUFFIX = ".replaced"
RNG_KEY = "rng_state"
FORMAT_VERSION = 1
CHECKPOINT_FORMATS = ("torch_dist", "torch")


def checkpoint_dir(save_dir: str, iteration: int) -> str:
    return os.path.join(save_dir, f"iter_{iteration:07d}")


def tracker_path(save_dir: str) -> str:
    return os.path.join(save_dir, TRACKER_FILENAME)


def _rank_key(rank: int) -> str:
    return f"rank_{rank:05d}"


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_atomically(path: str, text: str) -> None:
    """Replace `path` by `text` so that a reader sees the old or the new content, never half."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))


def _agreed(fn: Callable[[], Any], what: str) -> Any:
    """Run `fn` on every rank; if it raised anywhere, raise on every rank (collective)."""
    result, error = None, None
    try:
        result = fn()
    except Exception as caught:
        error = caught
    raise_if_any_rank_failed(error, None, what)
    return result


def _json_default(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    if isinstance(obj, (torch.dtype, torch.device, os.PathLike)):
        return str(obj)
    if isinstance(obj, (set, frozenset, tuple)):
        return list(obj)
    raise TypeError(f"{type(obj).__name__} is not JSON-serialisable")


def _layout(state) -> Dict[str, Any]:
    return {
        "world_size": state.world_size,
        "parallel_sizes": dict(state.sizes),
        "expert_model_parallel_size": state.ep_size,
    }


def _common_metadata(iteration: int, state, ckpt_format: str, config: Any) -> str:
    common = {
        "format_version": FORMAT_VERSION,
        "ckpt_format": ckpt_format,
        "iteration": iteration,
        **_layout(state),
        "torch_version": torch.__version__,
        "config": config,
    }
    return json.dumps(common, default=_json_default, indent=1, sort_keys=True)


# -- saving -----------------------------------------------------------------------------------


def save_checkpoint(
    iteration: int,
    state_dict: Union[Dict[str, Any], Callable[[], Dict[str, Any]]],
    save_dir: str,
    state,
    async_save: bool = False,
    finalize_fn: Optional[Callable[[], None]] = None,
    *,
    config: Any = None,
    ckpt_format: str = "torch_dist",
    save_rng: bool = True,
    queue: Optional[AsyncCallsQueue] = None,
    stage_in_background: bool = False,
    extra_files: Optional[Dict[str, Any]] = None,
    fully_parallel: bool = True,
    writer_backend: Optional[str] = "gloo",
    retain_interval: Optional[int] = None,
    planner=None,
) -> None:
    """Save `state_dict` (or what the callable returns) as iteration `iteration`; collective.

    Tensors may be plain (replicated: written once), `ShardedTensorView`s, DTensors; other
    values plain data. With `async_save`, returns after copying tensors to CPU memory; the
    checkpoint becomes current -- and `finalize_fn` runs -- in a later
    `maybe_finalize_async_calls` (same `queue`) once every rank has finished writing.
    `stage_in_background` (with `async_save`): return before that copy, which then runs on the
    writer thread; the tensors must not be modified until `queue.wait_for_staging()` returns.
    `config` (dataclasses, dicts, plain values) is stored as JSON in common.json.
    `extra_files` ("torch" format): {path relative to the iteration directory: object} this
    rank also torch.saves there, staged and published with the checkpoint.
    `fully_parallel` ("torch_dist"): a tensor several ranks hold (replicated) is written by
    the rank with the least to write so far; False: always by the lowest of them (Megatron's
    --no-ckpt-fully-parallel-save). `writer_backend`: that of the process group the
    asynchronous "torch_dist" writer uses (None: the default backend's). `retain_interval`:
    once published, the tracker's previous checkpoint is deleted unless its iteration is a
    multiple of it (see the module docstring). `planner` ("torch_dist", synchronous): a
    `HookedSavePlanner` of the caller's, e.g. one whose `resolve_data` computes each tensor
    as it is written (the checkpoint converter's).
    """
    if callable(state_dict):
        state_dict = state_dict()
    save_dir = os.fspath(save_dir)
    final_dir = checkpoint_dir(save_dir, iteration)
    staging_dir = final_dir + STAGING_SUFFIX
    queue = queue if queue is not None else DEFAULT_ASYNC_QUEUE

    # Collective: no rank writes before rank 0 has made a clean staging directory.
    _agreed(lambda: _prepare_staging(iteration, state_dict, save_dir, state, ckpt_format,
                                     config, extra_files),
            f"preparing checkpoint {staging_dir}")

    full_state_dict = dict(state_dict)
    if save_rng:
        full_state_dict[RNG_KEY] = {_rank_key(state.rank): rng_state_to_bytes(get_rng_state())}
    finalize_fns = [lambda: _publish(save_dir, iteration, state, retain_interval)]
    if finalize_fn is not None:
        finalize_fns.append(finalize_fn)

    if ckpt_format == "torch_dist":
        if planner is not None and async_save:
            raise CheckpointError("save_checkpoint: a planner of the caller's is for synchronous "
                                  "saves")
        planner = planner or HookedSavePlanner(dedup_save_to_lowest_rank=not fully_parallel)
        if async_save:
            dcp.async_save(
                full_state_dict, checkpoint_id=staging_dir, queue=queue, planner=planner,
                finalize_fns=finalize_fns, stage_in_background=stage_in_background,
                writer_backend=writer_backend,
            )
            return
        dcp.save(full_state_dict, checkpoint_id=staging_dir, planner=planner)
    elif _write_torch_files(full_state_dict, staging_dir, state, extra_files, async_save,
                            queue, stage_in_background, finalize_fns):
        return
    for fn in finalize_fns:
        fn()


def _prepare_staging(iteration, state_dict, save_dir: str, state, ckpt_format: str, config,
                     extra_files) -> None:
    """Check what is saved, then (rank 0) a clean staging directory with common.json."""
    if ckpt_format not in CHECKPOINT_FORMATS:
        raise CheckpointError(
            f"--ckpt-format {ckpt_format!r} is not supported; use one of {CHECKPOINT_FORMATS}"
        )
    if extra_files and ckpt_format != "torch":
        raise CheckpointError("extra_files are written with ckpt_format='torch' only")
    if not isinstance(iteration, int) or iteration < 0:
        raise CheckpointError(f"iteration must be a non-negative int, got {iteration!r}")
    check_state_dict(state_dict)
    if RNG_KEY in state_dict:
        raise CheckpointError(f"state dict key {RNG_KEY!r} is reserved for the RNG states")
    common = _common_metadata(iteration, state, ckpt_format, config)
    if state.rank == 0:
        staging_dir = checkpoint_dir(save_dir, iteration) + STAGING_SUFFIX
        os.makedirs(save_dir, exist_ok=True)
        if os.path.exists(staging_dir):  # left by a killed save of this iteration
            shutil.rmtree(staging_dir)
        os.makedirs(staging_dir)
        write_file_atomically(os.path.join(staging_dir, COMMON_FILENAME), common)


def _write_torch_files(full_state_dict, staging_dir: str, state, extra_files, async_save: bool,
                       queue, stage_in_background: bool, finalize_fns) -> bool:
    """The "torch" format's per-rank file (and `extra_files`); True when the write was
    scheduled asynchronously (finalised later), False when it is done."""
    path = os.path.join(staging_dir, f"{_rank_key(state.rank)}.pt")
    files = {path: full_state_dict}
    files.update({os.path.join(staging_dir, name): value
                  for name, value in (extra_files or {}).items()})
    payload = _torch_payload(files)
    if async_save:
        schedule_staged_write(
            payload,
            lambda staged: _torch_save_files(staged),
            queue,
            stage_in_background=stage_in_background,
            finalize_fns=finalize_fns,
            description=f"asynchronous save of {path}",
        )
        return True
    _agreed(lambda: _torch_save_files(payload), f"saving {staging_dir}")
    return False


def prepare_async_staging(
    state_dict: Dict[str, Any], ckpt_format: str = "torch_dist",
    queue: Optional[AsyncCallsQueue] = None,
) -> None:
    """Warm the CPU memory later asynchronous "torch_dist" saves of a state dict shaped like
    `state_dict` stage into (see `engine.prepare_staging`); local, in the
    background. A no-op for the "torch" format, whose staged payload is shaped per file."""
    if ckpt_format == "torch_dist":
        dcp.prepare_staging(state_dict, queue if queue is not None else DEFAULT_ASYNC_QUEUE)


def _torch_payload(value: Any) -> Any:
    # "torch" format: a ShardedTensorView is stored as the list of its local chunks.
    if isinstance(value, dict):
        return {k: _torch_payload(v) for k, v in value.items()}
    if isinstance(value, ShardedTensorView):
        return [t.detach() for t in value.local_tensors()]
    if isinstance(value, torch.Tensor):
        return value.detach()
    return value


def _torch_save_files(files: Dict[str, Any]) -> None:
    for path, payload in files.items():
        os.makedirs(os.path.dirname(path), exist_ok=True)
        _torch_save(payload, path)


def _torch_save(payload: Any, path: str) -> None:
    with open(path, "wb") as f:
        maybe_test_write_delay()
        torch.save(payload, f)
        f.flush()
        os.fsync(f.fileno())


def _publish(save_dir: str, iteration: int, state,
             retain_interval: Optional[int] = None) -> None:
    """Collective, after every rank finished writing: rename into place, then the tracker;
    then (with `retain_interval`) the tracker's previous checkpoint is deleted unless kept."""
    final_dir = checkpoint_dir(save_dir, iteration)

    def rename() -> None:
        if state.rank != 0:
            return
        previous = _tracked_iteration(save_dir) if retain_interval else None
        replaced = final_dir + REPLACED_SUFFIX
        if os.path.exists(final_dir):
            if os.path.exists(replaced):
                shutil.rmtree(replaced)
            os.rename(final_dir, replaced)
        os.rename(final_dir + STAGING_SUFFIX, final_dir)
        _fsync_dir(save_dir)
        write_file_atomically(tracker_path(save_dir), f"{iteration}\n")
        if os.path.exists(replaced):
            shutil.rmtree(replaced)
        if previous is not None and superseded(previous, iteration, retain_interval):
            _delete_in_background(checkpoint_dir(save_dir, previous))

    _agreed(rename, f"publishing checkpoint {final_dir}")


def superseded(previous: int, iteration: int, retain_interval: int) -> bool:
    """Whether publishing `iteration` deletes the checkpoint of `previous`, the tracker's
    before it (Megatron-LM's --save-retain-interval rule)."""
    return previous > 0 and previous != iteration and previous % retain_interval != 0


def _tracked_iteration(save_dir: str) -> Optional[int]:
    """The tracker's iteration, None when there is none (or it names no iteration)."""
    try:
        with open(tracker_path(save_dir)) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


_DELETIONS: List[threading.Thread] = []


def _delete_in_background(directory: str) -> None:
    """Remove a superseded checkpoint on a thread (a symbolic link is left alone, as in
    Megatron-LM); a failure is reported, never raised: the checkpoint only stays."""
    if os.path.islink(directory) or not os.path.isdir(directory):
        return

    def delete() -> None:
        try:
            shutil.rmtree(directory)
        except OSError as error:
            warnings.warn(f"could not delete superseded checkpoint {directory}: {error}")

    _DELETIONS[:] = [thread for thread in _DELETIONS if thread.is_alive()]
    thread = threading.Thread(target=delete, name="checkpoint-retention", daemon=True)
    thread.start()
    _DELETIONS.append(thread)


def wait_for_deletions() -> None:
    """Join the deletions of superseded checkpoints (local; a no-op off rank 0)."""
    while _DELETIONS:
        _DELETIONS.pop().join()


# -- loading ----------------------------------------------------------------------------------


def read_tracker(load_dir: str) -> int:
    """The iteration named by `load_dir`'s tracker file (errors name the path)."""
    if not os.path.isdir(load_dir):
        raise CheckpointError(f"--load directory {load_dir} does not exist")
    path = tracker_path(load_dir)
    if not os.path.isfile(path):
        found = complete_iterations(load_dir)
        hint = f"complete checkpoints there: {found}; pass one as iteration" if found else (
            "it holds no complete checkpoint"
        )
        raise CheckpointError(f"{path} does not exist ({hint})")
    with open(path) as f:
        text = f.read().strip()
    try:
        return int(text)
    except ValueError:
        raise CheckpointError(f"{path} holds {text[:40]!r}, not an iteration number") from None


def complete_iterations(load_dir: str) -> List[int]:
    """Iterations with a published directory (staging directories are never listed)."""
    iterations = []
    for name in os.listdir(load_dir):
        if name.startswith("iter_") and name[5:].isdigit():
            if os.path.isfile(os.path.join(load_dir, name, COMMON_FILENAME)):
                iterations.append(int(name[5:]))
    return sorted(iterations)


def _find_checkpoint(load_dir: str, iteration: Optional[int]):
    if iteration is None:
        iteration = read_tracker(load_dir)
    elif not os.path.isdir(load_dir):
        raise CheckpointError(f"--load directory {load_dir} does not exist")
    path = checkpoint_dir(load_dir, iteration)
    if not os.path.isdir(path) and os.path.isdir(path + REPLACED_SUFFIX):
        # Killed between moving the old copy aside and renaming the new one in.
        path = path + REPLACED_SUFFIX
    common_path = os.path.join(path, COMMON_FILENAME)
    if not os.path.isfile(common_path):
        raise CheckpointError(
            f"{path} is not a complete checkpoint ({COMMON_FILENAME} missing); complete ones in "
            f"{load_dir}: {complete_iterations(load_dir)}"
        )
    try:
        with open(common_path) as f:
            common = json.load(f)
        fmt = common["ckpt_format"]
    except (ValueError, KeyError, TypeError) as error:
        raise CheckpointError(f"{common_path} is corrupted: {error}") from error
    if fmt not in CHECKPOINT_FORMATS:
        raise CheckpointError(f"{common_path}: unknown ckpt_format {fmt!r}")
    return iteration, path, common


@dataclasses.dataclass(frozen=True)
class SavedCheckpoint:
    """One checkpoint on disk, read once per load and passed down: its directory and
    iteration, common.json's content and (for "torch_dist") the DCP metadata."""

    load_dir: str
    iteration: int
    path: str
    common: Dict[str, Any]
    metadata: Any = None  # torch.distributed.checkpoint Metadata, "torch_dist" only

    @property
    def ckpt_format(self) -> str:
        return self.common["ckpt_format"]

    @property
    def config(self) -> Dict[str, Any]:
        """The configs saved with the checkpoint ({} when none were)."""
        config = self.common.get("config")
        return config if isinstance(config, dict) else {}

    def rank_file(self, rank: int) -> str:
        """A "torch"-format checkpoint's file of `rank`."""
        return os.path.join(self.path, f"{_rank_key(rank)}.pt")


def read_saved_checkpoint(load_dir: str, state, iteration: Optional[int] = None
                          ) -> SavedCheckpoint:
    """Find iteration `iteration` (default: the tracker's) of `load_dir` and read what
    describes it (collective; errors are raised on every rank)."""
    load_dir = os.fspath(load_dir)
    if is_distributed():
        # Rank 0's view decides, should a shared file system show ranks different trackers.
        if iteration is None:
            iteration = _agreed(lambda: read_tracker(load_dir),
                                f"finding a checkpoint in {load_dir}")
        box = [iteration]
        dist.broadcast_object_list(box, src=0)
        iteration = box[0]
    iteration, path, common = _agreed(
        lambda: _find_checkpoint(load_dir, iteration), f"finding a checkpoint in {load_dir}")
    metadata = (dcp.read_checkpoint_metadata(path) if common["ckpt_format"] == "torch_dist"
                else None)
    return SavedCheckpoint(load_dir, iteration, path, common, metadata)


def load_checkpoint(
    state_dict_template: Dict[str, Any],
    load_dir: str,
    state,
    iteration: Optional[int] = None,
    *,
    load_rng: bool = True,
    saved: Optional[SavedCheckpoint] = None,
) -> int:
    """Load iteration `iteration` (default: the tracker's) into the template; returns it.

    Collective. Tensors are filled in place (resharded for "torch_dist"); other values are
    replaced in the template. The RNG states are restored when the layout (world size and
    parallel sizes) is the one that saved them, else left alone with a warning. `saved`:
    the checkpoint as `read_saved_checkpoint` read it (then `load_dir` and `iteration` are
    its own), so that nothing describing it is read twice.
    """
    if saved is None:
        saved = read_saved_checkpoint(load_dir, state, iteration)
    path, common = saved.path, saved.common
    saved_layout = {k: common.get(k) for k in _layout(state)}
    same_layout = saved_layout == _layout(state)
    restore_rng = load_rng and same_layout
    if load_rng and not same_layout and state.rank == 0:
        warnings.warn(
            f"{path} was saved with layout {saved_layout}, now {_layout(state)}: RNG states are "
            "not restored"
        )
    template = dict(state_dict_template)
    if restore_rng:
        template[RNG_KEY] = {_rank_key(state.rank): b""}

    if saved.ckpt_format == "torch_dist":
        dcp.load(template, checkpoint_id=path, metadata=saved.metadata)
    else:
        if not same_layout:
            raise CheckpointError(
                f"{path} is in the 'torch' format, saved with layout {saved_layout}; it cannot be "
                f"loaded at {_layout(state)}. Load it at the saving layout, or save with "
                "--ckpt-format torch_dist, which reshards"
            )
        file = saved.rank_file(state.rank)
        _agreed(lambda: _torch_load_into(template, file), f"loading {path}")

    for key in state_dict_template:
        state_dict_template[key] = template[key]
    if restore_rng:
        set_rng_state(rng_state_from_bytes(template[RNG_KEY][_rank_key(state.rank)]))
    return saved.iteration


def _torch_load_into(template: Dict[str, Any], file: str) -> None:
    if not os.path.isfile(file):
        raise CheckpointError(f"{file} is missing: the checkpoint is incomplete")
    try:
        payload = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as error:
        raise CheckpointError(
            f"{file} is truncated or corrupted ({type(error).__name__}: {error}); "
            "load an earlier iteration"
        ) from error
    problems: List[str] = []
    _match_into(template, payload, "", problems, apply=False)
    if problems:
        raise CheckpointError(
            f"{file} does not match the state dict being loaded: {format_listing(problems)}; "
            "was it saved from a different model configuration?"
        )
    _match_into(template, payload, "", problems, apply=True)


def _match_into(
    template: Dict[str, Any], saved: Any, prefix: str, problems: List[str], apply: bool
) -> None:
    """Check (apply=False) or copy (apply=True) `saved` into `template`, in place."""
    if not isinstance(saved, dict):
        kind = type(saved).__name__
        problems.append(f"{prefix or '<root>'}: checkpoint holds a {kind}, not a dict")
        return
    for key in saved:
        # As for DCP: top-level entries not being loaded (optimizer, rng_state) are skipped.
        if key not in template and prefix:
            problems.append(f"{prefix}{key}: in the checkpoint, not in the model")
    for key, target in template.items():
        name = f"{prefix}{key}"
        if key not in saved:
            problems.append(f"{name}: missing from the checkpoint")
            continue
        value = saved[key]
        if isinstance(target, dict):
            _match_into(target, value, name + ".", problems, apply)
        elif isinstance(target, ShardedTensorView):
            locals_ = target.local_tensors()
            saved_shapes = _chunk_shapes(value)
            if saved_shapes != [list(t.shape) for t in locals_]:
                problems.append(
                    f"{name}: checkpoint chunks {saved_shapes} vs model chunks "
                    f"{[list(t.shape) for t in locals_]}"
                )
                continue
            if apply:
                with torch.no_grad():
                    for dst, src in zip(locals_, value):
                        dst.copy_(src)
        elif isinstance(target, torch.Tensor):
            if not isinstance(value, torch.Tensor) or value.shape != target.shape:
                shape = (
                    list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                )
                problems.append(
                    f"{name}: checkpoint shape {shape} vs model shape {list(target.shape)}"
                )
                continue
            if apply:
                with torch.no_grad():
                    target.copy_(value)
        elif apply:
            template[key] = value


def _chunk_shapes(value: Any) -> Any:
    """Shapes of a "torch"-format ShardedTensorView entry (a list of tensors), else its type."""
    if isinstance(value, list) and all(isinstance(t, torch.Tensor) for t in value):
        return [list(t.shape) for t in value]
    return type(value).__name__
