"""Read and write megatron_smp checkpoints as the training loop does (`--load DIR --finetune`).

On disk: `{dir}/iter_{iteration:07d}/` + `latest_checkpointed_iteration.txt`, written by
`megatron_smp.checkpointing.save_checkpoint` in the "torch_dist" (DCP) format. The state dict
is `{"model": {name: tensor}}` with GPTModel parameter names (global layer indices), global
TP=1 shapes and vocabulary tables of exactly `vocab_size` rows; common.json's
`config["model"]` holds the TransformerConfig. DCP stores global tensors, so a checkpoint
written here at world size 1 loads at any TP/PP/DP layout.

A converted checkpoint is model-only (no "optimizer", no RNG states) at iteration 0: the model
has taken no step in this framework. (Megatron's HF loaders say 1 because their tracker reads
0 as "release"; ours has no such case.) `config["conversion"]` records where it came from,
the source HF config and the intended target layout.
"""
from __future__ import annotations

import json
import os
from typing import Any, Dict, Mapping, Optional, Tuple

import torch

from megatron_smp.checkpointing import (
    COMMON_FILENAME,
    CheckpointError,
    checkpoint_dir,
    load_checkpoint,
    read_tracker,
    save_checkpoint,
)
from megatron_smp.config import ConfigError, TransformerConfig
from megatron_smp.checkpointing import engine as dcp
from megatron_smp.checkpointing.engine import read_dcp_metadata
from megatron_smp.checkpointing.engine.storage import HookedSavePlanner
from megatron_smp.checkpointing.iterations import read_saved_checkpoint
from tools.checkpoint.common import (
    check_family,
    compare_state_dicts,
    config_from_json,
    config_to_json,
    framework_shapes,
    listing,
    world_one_state,
)
from tools.checkpoint.streaming import Producer, check_digests, group_of, groups, meta_like

MODEL_KEY = "model"
CONVERTED_ITERATION = 0


def _read_common(load_dir: str,
                 iteration: Optional[int] = None) -> Tuple[int, str, Dict[str, Any]]:
    iteration = read_tracker(load_dir) if iteration is None else iteration
    path = checkpoint_dir(load_dir, iteration)
    common_path = os.path.join(path, COMMON_FILENAME)
    if not os.path.isfile(common_path):
        raise CheckpointError(f"{common_path} is missing: {path} is not a complete checkpoint")
    with open(common_path) as f:
        try:
            common = json.load(f)
        except ValueError as error:
            raise CheckpointError(f"{common_path} is corrupted: {error}") from error
    model_fields = (common.get("config") or {}).get(MODEL_KEY)
    if not isinstance(model_fields, dict):
        raise CheckpointError(
            f"{common_path} has no config['model'] (the TransformerConfig): the model shape is "
            "unknown. Save with save_checkpoint(..., config={'model': ...})"
        )
    return iteration, path, common


def _saved_tensors(path: str, common: Mapping[str, Any], config: TransformerConfig,
                   expected: Mapping[str, torch.Size]) -> Dict[str, torch.dtype]:
    """Check the saved "model" entries against the expected names/shapes; their dtypes."""
    if common.get("ckpt_format") != "torch_dist":
        # "torch" files hold per-rank pieces; load_checkpoint checks them (world size 1 only).
        return {name: config.params_dtype for name in expected}
    saved = {}
    for key, info in read_dcp_metadata(path).state_dict_metadata.items():
        if key.startswith(MODEL_KEY + "."):
            saved[key[len(MODEL_KEY) + 1:]] = info
    problems = [f"{k}: missing" for k in sorted(set(expected) - set(saved))]
    problems += [f"{k}: unexpected" for k in sorted(set(saved) - set(expected))]
    for name in sorted(set(saved) & set(expected)):
        size = getattr(saved[name], "size", None)
        if size is None:
            problems.append(f"{name}: not a tensor")
        elif torch.Size(size) != expected[name]:
            problems.append(f"{name}: shape {list(size)}, the model config says "
                            f"{list(expected[name])}")
    if problems:
        raise CheckpointError(
            f"{path} does not hold the model its common.json describes (global shapes, vocab "
            f"tables of vocab_size={config.vocab_size} rows): {listing(problems)}"
        )
    return {name: saved[name].properties.dtype for name in expected}


def _adapter_shapes(path: str, common: Mapping[str, Any]) -> Dict[str, torch.Size]:
    """Global shapes of the LoRA adapter tensors (`*.lora.lora_A/B`) a --lora-rank run saved
    beside the base weights; {} for a checkpoint without them."""
    if common.get("ckpt_format") != "torch_dist":
        return {}
    return {key[len(MODEL_KEY) + 1:]: torch.Size(info.size)
            for key, info in read_dcp_metadata(path).state_dict_metadata.items()
            if key.startswith(MODEL_KEY + ".") and ".lora.lora_" in key}


def read_smp_checkpoint(load_dir: str, family: str, model_type: str,
                        pretrained: Optional[str] = None, iteration: Optional[int] = None):
    """-> (TransformerConfig, {name: global tensor}, common.json dict). A LoRA run's
    checkpoint also gives its adapters (`*.lora.lora_A` [r, in], `*.lora.lora_B` [out, r]);
    a small one (adapters only) gives them over its base model, read from `pretrained` when
    given, else from the base it records."""
    from megatron_smp.checkpointing.loop import recorded_lora_base, resolve_lora_base

    iteration, path, common = _read_common(load_dir, iteration)
    config = config_from_json(common["config"][MODEL_KEY], os.path.join(path, COMMON_FILENAME))
    check_family(config, family, model_type)
    if recorded_lora_base(path) is not None or pretrained:
        base_dir, base_iteration = resolve_lora_base(path, pretrained)
        _, model, _ = read_smp_checkpoint(base_dir, family, model_type,
                                          iteration=base_iteration)
        model = {name: tensor for name, tensor in model.items() if ".lora.lora_" not in name}
        shapes = {name: tensor.shape for name, tensor in model.items()}
        if shapes != dict(framework_shapes(family, config)):
            raise CheckpointError(f"the base model {base_dir} (iteration {base_iteration}) "
                                  f"does not fit the model of {path}")
        adapters = _adapter_shapes(path, common)
        dtypes = _saved_tensors(path, common, config, adapters)
        loaded = {name: torch.empty(shape, dtype=dtypes[name])
                  for name, shape in adapters.items()}
        with world_one_state() as state:
            load_checkpoint({MODEL_KEY: loaded}, load_dir, state, iteration, load_rng=False)
        model.update(loaded)
        return config, model, common
    expected = dict(framework_shapes(family, config))
    expected.update(_adapter_shapes(path, common))
    dtypes = _saved_tensors(path, common, config, expected)
    model = {name: torch.empty(shape, dtype=dtypes[name]) for name, shape in expected.items()}
    with world_one_state() as state:
        load_checkpoint({MODEL_KEY: model}, load_dir, state, iteration, load_rng=False)
    return config, model, common


def write_smp_checkpoint(save_dir: str, config: TransformerConfig,
                         model: Mapping[str, torch.Tensor], conversion: Dict[str, Any],
                         iteration: Optional[int] = None) -> None:
    """`write_smp_checkpoint_streaming` of tensors held in memory (left as they are)."""
    stream = ({name: model[name] for name in names} for names in groups(model))
    write_smp_checkpoint_streaming(save_dir, config, meta_like(model), Producer(stream),
                                   conversion, iteration, owned=False)


class _ProducingPlanner(HookedSavePlanner):
    """Writes each "model" tensor as `produce(name)` computes it, when the writer reaches it:
    the state dict planned holds meta tensors only. DCP's file writer keeps every tensor it
    wrote referenced until the file is complete (torch's `_write_files_from_queue`), so each
    is handed over in memory of its own (copied when it views a larger storage or one handed
    over before), which is released -- its storage resized to nothing -- when the writer asks
    for the next one (the serial loader writes one item at a time)."""

    def __init__(self, produce, owned: bool = True) -> None:
        super().__init__()
        self.produce = produce
        self.owned = owned  # False: the tensors are the caller's, always copied
        self.last: Optional[torch.Tensor] = None
        self.storages = set()

    def release(self) -> None:
        if self.last is not None:
            # Its memory is freed now: a later allocation may get the same address.
            self.storages.discard(self.last.untyped_storage().data_ptr())
            self.last.untyped_storage().resize_(0)
            self.last = None

    def resolve_data(self, write_item):
        fqn = write_item.index.fqn
        if not fqn.startswith(MODEL_KEY + "."):
            return super().resolve_data(write_item)
        self.release()
        tensor = self.produce(fqn[len(MODEL_KEY) + 1:]).contiguous()
        storage = tensor.untyped_storage()
        if not self.owned or storage.nbytes() != tensor.numel() * tensor.element_size() or \
                not storage.resizable() or storage.data_ptr() in self.storages:
            tensor = tensor.clone()
        self.storages.add(tensor.untyped_storage().data_ptr())
        self.last = tensor
        return super().transform_object(write_item, tensor)


def write_smp_checkpoint_streaming(save_dir: str, config: TransformerConfig,
                                   meta: Mapping[str, torch.Tensor], producer: Producer,
                                   conversion: Dict[str, Any],
                                   iteration: Optional[int] = None, owned: bool = True) -> None:
    """Save the tensors `producer` computes (names, shapes and dtypes of `meta`) as a
    model-only checkpoint, each written as it comes; then re-read it one tensor at a time and
    compare each with the digest of what was written. `owned`: the produced tensors are this
    writer's to free once written (else each is copied first)."""
    iteration = CONVERTED_ITERATION if iteration is None else iteration
    metadata = {MODEL_KEY: config_to_json(config), "conversion": conversion}
    order = sorted(meta, key=lambda name: (group_of(name), name))
    planner = _ProducingPlanner(producer, owned)
    with world_one_state() as state:
        save_checkpoint(iteration, {MODEL_KEY: {k: meta[k] for k in order}}, save_dir, state,
                        config=metadata, save_rng=False, planner=planner)
        planner.release()
        producer.drain()
        if producer.held:
            raise ConfigError(f"the conversion produced tensors the model does not have: "
                              f"{listing(sorted(producer.held))}")
        saved = read_saved_checkpoint(save_dir, state, iteration)
        where = f"re-reading {checkpoint_dir(save_dir, iteration)}"
        for name in order:
            tensor = torch.empty(meta[name].shape, dtype=meta[name].dtype)
            dcp.load({MODEL_KEY: {name: tensor}}, checkpoint_id=saved.path,
                     metadata=saved.metadata, check_keys_matched=False)
            check_digests({name: producer.produced[name]}, {name: tensor}, where)
    with open(os.path.join(checkpoint_dir(save_dir, iteration), COMMON_FILENAME)) as f:
        saved_config = config_from_json(json.load(f)["config"][MODEL_KEY], save_dir)
    if saved_config != config:
        raise ConfigError(f"verification failed: {save_dir}'s common.json model config differs")


def open_smp_checkpoint(load_dir: str, family: str, model_type: str):
    """(TransformerConfig, common.json dict, {name: meta tensor}, read(names) -> tensors) of a
    "torch_dist" checkpoint, read a group of tensors at a time; None for what
    `read_smp_checkpoint` reads whole (a LoRA run's checkpoint, whose adapters are merged
    into the base; the "torch" format's per-rank files)."""
    from megatron_smp.checkpointing.loop import recorded_lora_base

    iteration, path, common = _read_common(load_dir)
    config = config_from_json(common["config"][MODEL_KEY], os.path.join(path, COMMON_FILENAME))
    check_family(config, family, model_type)
    if (common.get("ckpt_format") != "torch_dist" or recorded_lora_base(path) is not None
            or _adapter_shapes(path, common)):
        return None
    expected = dict(framework_shapes(family, config))
    dtypes = _saved_tensors(path, common, config, expected)
    meta = {name: torch.empty(shape, dtype=dtypes[name], device="meta")
            for name, shape in expected.items()}
    metadata = dcp.read_checkpoint_metadata(path)

    def read(names):
        tensors = {name: torch.empty(meta[name].shape, dtype=meta[name].dtype)
                   for name in names}
        dcp.load({MODEL_KEY: tensors}, checkpoint_id=path, metadata=metadata,
                  check_keys_matched=False)
        return tensors

    return config, common, meta, read
