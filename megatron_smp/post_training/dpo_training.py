"""DPO through the Megatron training loop (`train_dpo.py`): the preference data, the
reference log-probs and the loss function the loop's schedule calls.

* Data: `tools/preprocess_sft_data.py --preference` output, packed whole pairs per row (the
  --sft path with `group_size=2`), cut by --split.
* Reference log-probs (`--dpo-reference`), per token, travel in each batch as `ref_logps`
  [b, s] and are summed per sequence like the policy's:
    precomputed   one forward pass of the starting model over every split before training,
                  kept in --save as dpo_reference_logps.npy (read back from --load);
    frozen        a frozen copy of the starting model (no grads, no optimizer state), run
                  over each global batch before its training forward; full fine-tuning
                  records where the starting weights came from (the --load checkpoint it
                  started from with --finetune, or the --seed initialisation) in --save as
                  dpo_reference_source.json, and a resume rebuilds the copy from it;
    adapters-off  with LoRA: the trained model itself with its adapters switched off.
* The loss (`post_training.dpo`) and TRL's six metrics are reported as [sum, pairs], so the
  log line and TensorBoard show their means over the global batch's pairs.

The loop is `Trainer.train` (through `training.pretrain`); this module plugs into it with
`pretrain(loss_fn=DPORun.loss_fn, run_hook=)`, `Trainer.step_data` (each global batch before
its schedule: the documents per token, the live reference's log-probs) and
`Trainer.metric_keys`.
"""
from __future__ import annotations

import contextlib
import os
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from megatron_smp.config import ConfigError
from megatron_smp.distributed.unwrap import unwrap_model
from megatron_smp.post_training.dpo import (
    LOSS_KEY, LOSS_TYPES, METRICS, REFERENCE_MODES, DPOConfig, dpo_loss_and_metrics, pair_sums,
)
from megatron_smp.post_training.reference import (
    DPO_REFERENCE, build_reference_chunks, copy_base_weights, frozen_reference,
)
from megatron_smp.training.arguments.modes import add_dpo_args  # noqa: F401 (its flags)
from megatron_smp.training.arguments.validation import check_dpo_configs
from megatron_smp.training.logprobs import compute_logprobs, token_log_probs

REF_KEY = "ref_logps"  # per-token reference log-probs [b, s] in a batch
DOCUMENTS_KEY = "token_documents"  # document ids split like the tokens under CP
REFERENCE_FILE = "dpo_reference_logps.npy"




def dpo_config(configs) -> DPOConfig:
    """The run's DPOConfig (`configs.dpo`, parsed once from the --dpo-* flags), checked
    against the run (`validate_configs` does the same; ConfigError naming the flag)."""
    check_dpo_configs(configs)
    return configs.dpo


class DPORun:
    """The DPO mode's state across the loop: hook, dataset provider and forward step."""

    def __init__(self, model_provider: Callable):
        self.model_provider = model_provider
        self.run = None
        self.config: Optional[DPOConfig] = None
        self.reference: Optional[List[torch.nn.Module]] = None

    # -- pretrain(run_hook=) ----------------------------------------------------------------
    def attach(self, run) -> None:
        configs = run.configs
        self.run = run
        self.config = dpo_config(configs)
        run.metric_keys = (LOSS_KEY,) + METRICS
        mode = self.config.reference
        lora = bool(configs.training.lora_rank)
        if mode == "frozen":
            self.reference = self._frozen_reference(run, lora)
        run.step_data = self.step_data

    def _frozen_reference(self, run, lora: bool) -> List[torch.nn.Module]:
        """The frozen copy: with LoRA the base (unchanged by training); with full fine-tuning
        the starting weights, copied at iteration 0 and their source recorded in --save, or
        rebuilt from that record on resume (`reference.frozen_reference`)."""
        configs, state = run.configs, run.state
        if lora:
            reference = build_reference_chunks(self.model_provider, configs, state)
            copy_base_weights(reference, run.model)
            return reference
        return frozen_reference(self.model_provider, configs, state, run.model, run.iteration,
                                DPO_REFERENCE)

    # -- each global batch before its schedule (Trainer.step_data) ---------------------------
    def step_data(self, run, data_iterator, num_microbatches: int):
        """The global batch's microbatches with their documents kept per token (split like
        the tokens under context parallelism) and, with a live reference, its log-probs
        (computed here, before the schedule)."""
        if data_iterator is None:
            return None
        batches = [next(data_iterator) for _ in range(num_microbatches)]
        for batch in batches:
            batch[DOCUMENTS_KEY] = batch["document_ids"].long()
        if REF_KEY in batches[0]:  # precomputed, or a rerun replaying its batches
            return iter(batches)
        keys = ("tokens", "labels", "position_ids", "document_ids")
        whole = {key: torch.cat([b[key] for b in batches]) for key in keys if key in batches[0]}
        if self.config.reference == "adapters-off":
            from megatron_smp.tensor_parallel.lora import adapters_disabled

            model, context = run.model, adapters_disabled([unwrap_model(c) for c in run.model])
        else:
            model, context = self.reference, contextlib.nullcontext()
        training = run.configs.training
        with context:
            logps = compute_logprobs(model, whole, run.state, run.configs.model.vocab_size,
                                     micro_batch_size=training.micro_batch_size,
                                     pipeline_schedule=training.pipeline_schedule)["logprobs"]
        for batch, ref in zip(batches, logps.split(training.micro_batch_size)):
            batch[REF_KEY] = ref
        return iter(batches)

    # -- the dataset provider ----------------------------------------------------------------
    def datasets(self, num_samples, configs, tokenizer):
        from megatron_smp.data import build_train_valid_test_datasets

        def build(token_values=None):
            return build_train_valid_test_datasets(
                configs.data, configs.training.seq_length, configs.training.seed, num_samples,
                tokenizer, context_parallel_size=configs.parallel.context_parallel_size,
                sft_options={"group_size": 2, "token_values": token_values})

        splits = build()
        if self.config.reference != "precomputed":
            return splits
        total = int(next(s for s in splits if s is not None).value_offsets[-1])
        reference = self._load_reference(configs, total)
        if reference is None:
            if self.run.iteration > 0:
                raise ConfigError(
                    f"--dpo-reference precomputed: resuming at iteration {self.run.iteration} "
                    f"but --load has no {REFERENCE_FILE} (written at the start of the run)")
            positions = np.arange(1, total + 1, dtype=np.int64)  # 1-based: 0 is padding
            reference = self._precompute(build({"position": positions}), total)
            self._save_reference(configs, reference)
        return build({REF_KEY: reference})

    def _reference_path(self, directory: Optional[str]) -> Optional[str]:
        return os.path.join(directory, REFERENCE_FILE) if directory else None

    def _load_reference(self, configs, total: int) -> Optional[np.ndarray]:
        path = self._reference_path(configs.checkpoint.load)
        if path is None or not os.path.isfile(path):
            return None
        reference = np.load(path, allow_pickle=False)
        if reference.shape != (total,):
            raise ConfigError(f"{path}: {reference.shape[0]} reference log-probs, the data has "
                              f"{total} label positions; was it written for other data?")
        return reference

    def _save_reference(self, configs, reference: np.ndarray) -> None:
        path = self._reference_path(configs.checkpoint.save)
        if path is None or (dist.is_initialized() and dist.get_rank() != 0):
            return
        os.makedirs(os.path.dirname(path), exist_ok=True)
        np.save(path + ".tmp.npy", reference)
        os.replace(path + ".tmp.npy", path)

    def _precompute(self, splits, total: int) -> np.ndarray:
        """Reference log-probs of every label position of every split's pairs (each pack once;
        the packs are shared out over the data-parallel ranks, which then add them up)."""
        run, state = self.run, self.run.state
        micro = run.configs.training.micro_batch_size
        values = torch.zeros(total, dtype=torch.float32, device=state.device)
        for dataset in splits:
            if dataset is None:
                continue
            count = len(dataset.packs)
            # Every data-parallel rank runs as many microbatches (expert parallelism's
            # all-to-alls span them); a rank past the end repeats its last pack, unused.
            steps = -(-count // (state.dp_size * micro))
            for step in range(steps):
                indices = [(step * state.dp_size * micro + state.dp_rank * micro + i)
                           for i in range(micro)]
                samples = [dataset[min(i, count - 1)] for i in indices]
                batch = {key: torch.stack([s[key] for s in samples])
                         for key in ("tokens", "labels", "position_ids", "document_ids")}
                logps = compute_logprobs(run.model, batch, state, run.configs.model.vocab_size,
                                         micro_batch_size=micro,
                                         pipeline_schedule=run.configs.training.pipeline_schedule
                                         )["logprobs"]
                for index, sample, row in zip(indices, samples, logps):
                    if index >= count:
                        continue
                    position = sample["position"].to(state.device)
                    keep = position > 0
                    values[position[keep] - 1] = row[keep]
        if state.dp_size > 1:
            dist.all_reduce(values, group=state.dp_group)  # one writer per position
        return values.cpu().numpy()

    # -- the loss (the loop runs it through the Trainer's forward step) ---------------------
    def loss_fn(self, logits: torch.Tensor, batch: Dict[str, torch.Tensor]):
        """(loss, reports) of one microbatch from the last stage's logits [b, s, v/tp] and the
        (CP-local) batch with its `ref_logps` and `token_documents`: the shape of
        `loss_fn(output, batch)` that `Trainer.forward_backward(batch_iter, loss_fn)` takes."""
        state = self.run.state
        configs = self.run.configs
        cp_group = state.cp_group if state.cp_size > 1 else None
        seq_length = configs.training.seq_length
        logps, _ = token_log_probs(logits, batch["labels"], state, configs.model.vocab_size)
        documents, mask = batch[DOCUMENTS_KEY], batch["loss_mask"]
        sums, counts = pair_sums(logps, mask, documents, seq_length, cp_group)
        with torch.no_grad():
            ref_sums, _ = pair_sums(batch[REF_KEY].float(), mask, documents, seq_length,
                                    cp_group)
        loss, reports = dpo_loss_and_metrics(sums, ref_sums, counts, self.config)
        # Every CP rank computes the whole loss and back-propagates into its own tokens; DDP
        # averages grads over dp x cp, so the CP ranks' shares are scaled back up.
        return loss * state.cp_size, reports


def train_dpo(model_provider: Callable, args_defaults: Optional[Dict] = None,
              argv: Optional[Sequence[str]] = None):
    """Parse the flags (Megatron's and --dpo-*), then train with DPO through `pretrain`;
    returns its TrainingResult."""
    from megatron_smp.training import pretrain

    defaults = {"sft": True, **(args_defaults or {})}
    # The --dpo-* flags become `configs.dpo`, checked on every rank before anything is built.
    dpo = DPORun(model_provider)
    return pretrain(dpo.datasets, model_provider, loss_fn=dpo.loss_fn,
                    extra_args_provider=add_dpo_args, args_defaults=defaults, argv=argv,
                    run_hook=dpo.attach)


__all__ = ["add_dpo_args", "dpo_config", "DPORun", "train_dpo", "REF_KEY", "REFERENCE_FILE"]
