"""The frozen reference model of post-training (DPO's `--dpo-reference frozen`, the KL term of
`train_rl.py`), one mechanism for both:

* with LoRA the reference is the base: the trained model with its adapters off, or a frozen
  copy of its base weights (`build_reference_chunks` + `copy_base_weights`);
* with full fine-tuning it is the run's starting weights: copied at iteration 0, and where
  they came from (the --finetune checkpoint in --load, or the initialisation under --seed)
  recorded in --save (`ReferenceRecord.file_name`), so that a resume rebuilds the copy from
  that record (`frozen_reference`) instead of saving the copy's weights with every run.

What differs between the runs is only how they name the record and their alternatives in
errors (`ReferenceRecord`).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_smp.config import ConfigError
from megatron_smp.distributed.unwrap import unwrap_model


@dataclass(frozen=True)
class ReferenceRecord:
    """How a run type records its reference's starting point and words its errors."""

    file_name: str   # the record, relative to --save / --load
    setting: str     # what asked for the frozen copy, e.g. "--dpo-reference frozen"
    run: str         # the run's name in advice, e.g. "DPO"
    instead: str     # the alternative that needs no rebuild, e.g. "use --dpo-reference precomputed"


def build_reference_chunks(model_provider: Callable, configs, state,
                           seed: Optional[int] = None) -> List[torch.nn.Module]:
    """A frozen copy of the model's structure (this rank's chunks, no DDP, no LoRA, no grads);
    with `seed`, initialised as `Trainer.build` initialises the model under that --seed. The
    generators are left as they were (the policy's training draws do not change)."""
    from megatron_smp.checkpointing.rng import get_rng_state, set_rng_state
    from megatron_smp.tensor_parallel.random import model_parallel_seed

    rng = get_rng_state()
    try:
        if seed is not None:
            model_parallel_seed(seed, state)
        if state.pp_size > 1:
            from megatron_smp.pipeline_parallel.stages import build_pipeline_model_chunks

            chunks = build_pipeline_model_chunks(model_provider, configs, state)
        else:
            chunks = [model_provider(configs, state, pre_process=True, post_process=True)]
    finally:
        set_rng_state(rng)
    for chunk in chunks:
        chunk.to(state.device)
        chunk.requires_grad_(False)
        chunk.eval()
    return chunks


def copy_base_weights(reference: Sequence[torch.nn.Module],
                      model: Sequence[torch.nn.Module]) -> bool:
    """The policy's current weights into the reference chunks (LoRA adapters left out: the
    base; FSDP2 shards gathered). Returns whether the reference held those values already
    (this rank's tensors)."""
    already = True
    for target_chunk, source_chunk in zip(reference, model):
        source = unwrap_model(source_chunk).state_dict()
        with torch.no_grad():
            for name, tensor in target_chunk.state_dict().items():
                value = source[name]
                if hasattr(value, "full_tensor"):
                    value = value.full_tensor()
                already = already and torch.equal(tensor, value)
                tensor.copy_(value)
    return already


def starting_point(configs, record: Optional[ReferenceRecord] = None) -> Dict:
    """Where the weights of a run at iteration 0 came from: the checkpoint in --load it
    started from (--finetune; {"load": dir, "iteration": n}, or {"megatron": dir}), else the
    initialisation under --seed ({"seed": n}); {"unavailable": why} when --save is that
    directory (a resume then names why)."""
    from megatron_smp.checkpointing.iterations import read_tracker, tracker_path
    from megatron_smp.checkpointing.megatron_lm import find_megatron_checkpoint

    record = record or DPO_REFERENCE
    load, save = configs.checkpoint.load, configs.checkpoint.save
    if load and find_megatron_checkpoint(load) is not None:
        return {"megatron": os.path.abspath(load)}
    if load and os.path.isfile(tracker_path(load)):
        iteration = read_tracker(load)
        if save and os.path.abspath(save) == os.path.abspath(load):
            # This run's own saves may replace that checkpoint (the same iteration number).
            return {"unavailable": f"the run started from iteration {iteration} of its own "
                    f"--save directory {os.path.abspath(save)}, which its saves may have "
                    f"replaced; start {record.run} with --save in another directory than "
                    f"--load, or {record.instead}"}
        return {"load": os.path.abspath(load), "iteration": iteration}
    return {"seed": configs.training.seed}


def read_reference_source(load_dir: str, iteration: int, record: ReferenceRecord) -> Dict:
    """The recorded starting point of a full fine-tuning run resumed from `load_dir` (a
    ConfigError naming the file when there is none: the reference cannot be rebuilt)."""
    path = os.path.join(load_dir, record.file_name)
    if not os.path.isfile(path):
        raise ConfigError(
            f"{record.setting}: resuming at iteration {iteration}, but --load has no "
            f"{record.file_name} naming the starting weights the frozen reference is a "
            f"copy of (it is written at the start of a {record.run} run with --save); start "
            f"{record.run} with --finetune from the SFT checkpoint, or {record.instead}")
    with open(path) as handle:
        return json.load(handle)


def write_reference_source(save_dir: Optional[str], source: Dict,
                           record: ReferenceRecord) -> None:
    """Record the reference's starting point in --save (rank 0), for a resume to rebuild it."""
    from megatron_smp.checkpointing.iterations import write_file_atomically

    if not save_dir or (dist.is_initialized() and dist.get_rank() != 0):
        return
    path = os.path.join(save_dir, record.file_name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_file_atomically(path, json.dumps(source, sort_keys=True))


def rebuild_reference(model_provider: Callable, configs, state, source: Dict,
                      iteration: int, record: ReferenceRecord) -> List[torch.nn.Module]:
    """The frozen reference of a resumed full fine-tuning run: the model at its recorded
    starting point, re-initialised under the recorded seed or loaded from the recorded
    checkpoint (collective). A ConfigError on every rank when that source is gone."""
    from megatron_smp.checkpointing.iterations import COMMON_FILENAME, checkpoint_dir
    from megatron_smp.checkpointing.loop import load_model_weights

    what = f"{record.setting}: resuming at iteration {iteration}"
    if "seed" in source:
        return build_reference_chunks(model_provider, configs, state, seed=int(source["seed"]))
    if "load" in source:
        path = checkpoint_dir(source["load"], int(source["iteration"]))
        if not os.path.isfile(os.path.join(path, COMMON_FILENAME)):
            raise ConfigError(
                f"{what}, the reference is the checkpoint the run started from, {path}, which "
                f"is gone; restore it there, or restart and {record.instead}")
        reference = build_reference_chunks(model_provider, configs, state)
        load_model_weights(reference, configs, state, source["load"], int(source["iteration"]))
        return reference
    if "megatron" in source:
        raise ConfigError(
            f"{what}: the run started from the Megatron-LM checkpoint {source['megatron']}, "
            "which is not reloaded as a reference; convert it to ours "
            f"(tools/checkpoint/convert.py) and start from that, or {record.instead}")
    raise ConfigError(f"{what}: {source.get('unavailable', 'no starting point recorded')}")


def frozen_reference(model_provider: Callable, configs, state, model: Sequence[torch.nn.Module],
                     iteration: int, record: ReferenceRecord) -> List[torch.nn.Module]:
    """The frozen copy of a full fine-tuning run's starting weights (this rank's chunks): at
    iteration 0 a copy of `model`, its source recorded in --save; on resume (iteration > 0)
    rebuilt from the record in --load (collective)."""
    if iteration > 0:
        source = read_reference_source(configs.checkpoint.load, iteration, record)
        reference = rebuild_reference(model_provider, configs, state, source, iteration, record)
    else:
        source = starting_point(configs, record)
        seed = source.get("seed") if configs.checkpoint.save else None
        reference = build_reference_chunks(model_provider, configs, state, seed=seed)
        reproduced = copy_base_weights(reference, model)
        if seed is not None:
            # A resume rebuilds the initialisation under --seed: check here that it gives
            # these weights (the ranks agree), else record that it cannot.
            flag = torch.tensor([0.0 if reproduced else 1.0], device=state.device)
            if dist.is_initialized():
                dist.all_reduce(flag)
            if flag.item():
                source = {"unavailable": "the initial weights of this layout are not rebuilt "
                          f"alike from --seed; {record.instead}"}
    write_reference_source(configs.checkpoint.save, source, record)
    return reference


# Where a full fine-tuning DPO run's frozen reference (its starting weights) comes from:
# {"load": dir, "iteration": n} (the checkpoint it started from) or {"seed": n} (the
# initialisation); kept in --save, read back from --load to rebuild the reference on resume.
DPO_REFERENCE = ReferenceRecord("dpo_reference_source.json", "--dpo-reference frozen", "DPO",
                                "use --dpo-reference precomputed")
# The same for train_rl.py's KL term (--grpo-kl-beta > 0) in full fine-tuning.
RL_REFERENCE = ReferenceRecord("rl_state/reference_source.json", "--grpo-kl-beta > 0", "RL",
                               "train LoRA adapters (--lora-rank; the reference is then the "
                               "base) or drop the KL term (--grpo-kl-beta 0)")

__all__ = ["ReferenceRecord", "DPO_REFERENCE", "RL_REFERENCE", "build_reference_chunks",
           "copy_base_weights", "starting_point", "read_reference_source",
           "write_reference_source", "rebuild_reference", "frozen_reference"]
