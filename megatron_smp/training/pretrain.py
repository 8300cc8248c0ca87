"""The pretraining driver: `pretrain(...)` parses and validates the flags once, builds a
`Trainer` (training/trainer.py: parallel state, model, optimizer, scheduler, checkpoints),
the data, and runs Megatron's loop over it (`Trainer.train`, training/loop.py: log lines,
evaluations, saves, exits).

Entry scripts (pretrain_gpt.py, pretrain_llama.py) define three functions and call it:

    model_provider(configs, state, pre_process=True, post_process=True, **stage) -> nn.Module
    train_valid_test_datasets_provider(train_val_test_num_samples, configs, tokenizer)
        -> (train_ds, valid_ds, test_ds)
    forward_step(data_iterator, model) -> (output_tensor, loss_func)
"""
from __future__ import annotations

import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import torch

from megatron_smp.config import Configs
from megatron_smp.training.arguments import parse_args, validate_configs
from megatron_smp.training.logging import TrainingLogger, set_logging_level
from megatron_smp.training.loop import TrainingData, TrainingResult
from megatron_smp.training.result_validation import ReplayIterator
from megatron_smp.training.run_control import data_worker_init_fn
from megatron_smp.training.trainer import Trainer
# Re-exported: callers import them from here (the loop's helpers before the Trainer).
from megatron_smp.training.trainer import build_model_chunks, empty_unused_memory  # noqa: F401
from megatron_smp.training.wandb_logger import init_wandb
from megatron_smp.checkpointing.loop import model_vocab_size
from megatron_smp.cli import run_entry


def _cyclic(loader) -> Iterator:
    while True:
        for batch in loader:
            yield batch


def dataset_num_samples(training, global_batch_size: int) -> List[int]:
    """[train, valid, test] samples the datasets must provide (tools/prepare_cache.py asks
    the same). `training.train_iters` is the run's length after --train-samples."""
    # Megatron sizes the validation set for every evaluation of the run (one with
    # --skip-train); a different size reshuffles it, so it is matched exactly.
    eval_runs = 1 if training.skip_train else training.train_iters // training.eval_interval + 1
    return [
        training.train_samples or training.train_iters * global_batch_size,
        eval_runs * training.eval_iters * global_batch_size,
        training.eval_iters * global_batch_size,
    ]


def _report_memory(configs: Configs, model_provider: Callable) -> None:
    """--report-memory: rank 0 prints the planner's per-rank table. Runs before the process
    group exists (the planner counts inside a fake one); the other ranks go on to wait for
    rank 0 in the rendezvous."""
    from megatron_smp.parallel_state import launcher_rank, launcher_world_size
    from megatron_smp.training.memory_planner import check_model_provider, estimate_memory

    check_model_provider(model_provider)  # on every rank, before any collective
    if launcher_rank() != 0:
        return
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    report = estimate_memory(configs, launcher_world_size(), model_provider, device_type)
    print(report.table(), flush=True)


def build_configs(argv: Optional[Sequence[str]] = None,
                  extra_args_provider: Optional[Callable] = None,
                  args_defaults: Optional[Dict[str, Any]] = None,
                  model_provider: Optional[Callable] = None):
    """(configs, tokenizer): the flags parsed and validated once, with the tokenizer's
    vocabulary (--report-memory's table too, given the `model_provider`)."""
    from megatron_smp.data import build_tokenizer

    configs = parse_args(argv, extra_args_provider, args_defaults)
    set_logging_level(configs.training)
    # The tokenizer is local work (no collective): build it first, so the one validation
    # below sees the real vocabulary, and a bad configuration fails on every rank before the
    # first collective.
    tokenizer = build_tokenizer(configs.data)
    configs.model.vocab_size = model_vocab_size(configs.model.vocab_size, tokenizer.vocab_size)
    validate_configs(configs)
    if configs.training.report_memory and model_provider is not None:
        _report_memory(configs, model_provider)
    return configs, tokenizer


def training_logger(trainer: Trainer) -> TrainingLogger:
    """The run's log lines and scalars (TensorBoard, wandb), written by the last rank (the
    last pipeline stage's, as in Megatron)."""
    configs, state = trainer.configs, trainer.state
    is_logging_rank = state.rank == state.world_size - 1
    wandb = (init_wandb(configs.training, configs.checkpoint.save, configs.to_dict())
             if is_logging_rank else None)
    return TrainingLogger(is_logging_rank, configs.training, state.device, wandb=wandb,
                          world_size=state.world_size)


def _build_data(trainer: Trainer, provider: Callable, tokenizer) -> TrainingData:
    from megatron_smp.data import build_pretraining_data_loader

    configs, state, training = trainer.configs, trainer.state, trainer.configs.training
    num_samples = dataset_num_samples(training, trainer.batch_sizes.global_batch_size)
    # --fault-tolerance: each replica group reads its shard; the groups' steps together
    # consume group-size x --global-batch-size samples.
    dp_rank, dp_size, groups = state.dp_rank, state.dp_size, 1
    if trainer.replicas is not None:
        dp_rank, dp_size = trainer.replicas.data_slot(dp_rank, dp_size)
        groups = trainer.replicas.group_size
        num_samples = [n * groups for n in num_samples]
    train_ds, valid_ds, test_ds = provider(num_samples, configs, tokenizer)

    def loader(dataset, consumed):
        if dataset is None:
            return None
        return build_pretraining_data_loader(
            dataset, consumed * groups, training.micro_batch_size, dp_rank, dp_size,
            configs.data.num_workers, worker_init_fn=data_worker_init_fn(training),
        )

    def train_iterator():
        train = iter(loader(train_ds, trainer.progress.consumed_train_samples))
        if trainer.resilience is not None:
            train = trainer.resilience.data(train)  # the watchdog tells a rank waiting for data
        if trainer.validator is not None and trainer.validator.mode == "validate_results":
            train = ReplayIterator(train)  # an iteration can be rerun on its batches
        return train

    train = train_iterator()
    # --eval-iters 0 evaluates nothing (Megatron's do_valid / do_test): its splits are not
    # read, and may hold less than one sample.
    evaluating = training.eval_iters > 0
    valid_loader = loader(valid_ds, 0) if evaluating else None
    data = TrainingData(train, _cyclic(valid_loader) if valid_loader is not None else None,
                        loader(test_ds, 0) if evaluating else None, (train_ds, valid_ds, test_ds))
    if trainer.replicas is not None:
        def recovered():  # the group took its peers' iteration: read on from there
            data.train = train_iterator()
            return data.train
        trainer.replicas.on_recovered = recovered
    return data


def _report_packing(datasets, logger: TrainingLogger) -> None:
    """--sft packs conversations: report what the packing pays for padding."""
    for split, dataset in zip(("train", "validation", "test"), datasets):
        if getattr(dataset, "efficiency", None) is not None:
            logger.print(f" > --sft {split}: {dataset.sequence_ids.size} conversations in "
                         f"{len(dataset.packs)} packs, packing efficiency "
                         f"{dataset.efficiency:.4f} (tokens used / tokens paid)")


def pretrain(
    train_valid_test_datasets_provider: Callable,
    model_provider: Callable,
    forward_step_func: Optional[Callable] = None,
    extra_args_provider: Optional[Callable] = None,
    args_defaults: Optional[Dict[str, Any]] = None,
    argv: Optional[Sequence[str]] = None,
    run_hook: Optional[Callable[[Trainer], None]] = None,
    loss_fn: Optional[Callable] = None,
) -> TrainingResult:
    """Parse flags, build everything, train, evaluate; returns the losses (on every rank).
    Each microbatch runs through Megatron's `forward_step_func(data_iterator, model)` or,
    instead, `loss_fn(output, batch) -> (loss, metrics)` (the Trainer's forward step: the
    batch on the device, split for context parallelism, the model run without labels).
    `run_hook(trainer)` is called once the model, optimizer and checkpoint are in place,
    before the datasets are built (a post-training mode's setup, e.g. DPO's reference)."""
    start_time = time.time()  # the origin of --exit-duration-in-mins
    configs, tokenizer = build_configs(argv, extra_args_provider, args_defaults, model_provider)

    def run() -> TrainingResult:
        trainer = Trainer.build(configs, model_provider, start_time)
        try:
            if configs.checkpoint.load or configs.checkpoint.pretrained_checkpoint:
                trainer.load()
            if trainer.replicas is not None:
                trainer.replicas.join()  # a late group takes the live groups' iteration first
            if run_hook is not None:
                run_hook(trainer)
            data = _build_data(trainer, train_valid_test_datasets_provider, tokenizer)
            logger = training_logger(trainer)
            _report_packing(data.datasets, logger)
            return trainer.train(data, logger, start_time, forward_step=forward_step_func,
                                 loss_fn=loss_fn)
        except BaseException:
            if trainer.resilience is not None:  # its monitor thread ends with the run
                trainer.resilience.close(failed=True)
            for chunk in trainer.model:  # the failed run's memory can be freed (in process)
                getattr(chunk, "remove_hooks", lambda: None)()
            raise

    resilience = configs.resilience
    if not resilience.inprocess_restart:
        return run()
    from megatron_smp.resilience import RunController

    return RunController(resilience.inprocess_max_iterations,
                         resilience.inprocess_empty_cuda_cache).run(run)


def main(entry: Callable[[], Any]) -> None:
    """Run an entry script's `pretrain(...)`: a configuration error ends as one clear message
    (printed by rank 0) and exit status 2 on every rank (see megatron_smp.cli)."""
    run_entry(entry)
