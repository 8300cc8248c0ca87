"""`Trainer` driven directly: a loss function of one's own at several layouts (the example
script), and a load that reads common.json and the DCP metadata once."""
import builtins
import os
import sys

import pytest

from megatron_smp.testing import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
SHORT = ["--train-iters", "6"]


def _example(rank, world_size, argv):
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import trainer_custom_loss

    return trainer_custom_loss.main(SHORT + argv)


def test_custom_loss_example_trains_alike_at_every_layout():
    """The example's label-smoothed loss falls, and PP=2 (through the 1F1B schedule) follows
    the one-process trajectory (TP=2: see the log-probs test)."""
    reference, = run_distributed(_example, 1, args=([],), timeout=300)
    assert len(reference) == 6 and reference[-1] < reference[0] - 0.3, reference
    for flags in ("--pipeline-model-parallel-size 2",):
        for losses in run_distributed(_example, 2, args=(flags.split(),), timeout=300):
            assert losses == pytest.approx(reference, rel=1e-5), (flags, losses)


def _load_counting_opens(rank, world_size, save_dir):
    """Save at iteration 2, then load it back into a fresh Trainer counting the opens."""
    import pretrain_gpt
    from megatron_smp.training import Trainer, build_configs

    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from trainer_custom_loss import FLAGS

    argv = FLAGS + ["--train-iters", "2", "--save", save_dir, "--load", save_dir]
    configs, _ = build_configs(argv)
    trainer = Trainer.build(configs, pretrain_gpt.model_provider)

    def loss_fn(logits, batch):
        loss = logits.float().pow(2).mean()
        return loss, {"lm loss": loss.detach()}

    batches = iter(lambda: {"tokens": __import__("torch").zeros(2, 32, dtype=__import__(
        "torch").long)}, None)
    for _ in range(2):
        trainer.train_step(batches, loss_fn=loss_fn)
    trainer.save()
    trainer.finalize_saves()
    fresh = Trainer.build(build_configs(argv)[0], pretrain_gpt.model_provider)
    opened = []
    original = builtins.open

    def counting_open(file, *args, **kwargs):
        opened.append(os.path.basename(os.fspath(file)) if isinstance(file, (str, os.PathLike))
                      else file)
        return original(file, *args, **kwargs)

    builtins.open = counting_open
    try:
        fresh.load()
    finally:
        builtins.open = original
    return fresh.iteration, opened.count("common.json"), opened.count(".metadata")


def test_load_reads_common_json_and_dcp_metadata_once(tmp_path):
    for iteration, common_opens, metadata_opens in run_distributed(
            _load_counting_opens, 2, args=(str(tmp_path / "ckpt"),), timeout=300):
        assert iteration == 2
        assert (common_opens, metadata_opens) == (1, 1)


def _count_validations_and_logprobs(rank, world_size, argv):
    """How often each config's checks run while a run is configured and built; then
    compute_logprobs at this layout against the log-softmax of the full logits."""
    import torch

    import pretrain_gpt
    from megatron_smp import config
    from megatron_smp.models.gpt import gather_full_logits
    from megatron_smp.training import Trainer, build_configs

    counts = {}
    for cls in (config.ParallelConfig, config.TransformerConfig, config.OptimizerConfig):
        def counted(self, *args, _validate=cls.validate, _name=cls.__name__, **kwargs):
            counts[_name] = counts.get(_name, 0) + 1
            return _validate(self, *args, **kwargs)
        cls.validate = counted
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from trainer_custom_loss import FLAGS

    configs, _ = build_configs(FLAGS + ["--global-batch-size", "2"] + argv)
    trainer = Trainer.build(configs, pretrain_gpt.model_provider)
    vocab_size = configs.model.vocab_size
    tokens = torch.randint(0, 64, (2, 33), generator=torch.Generator().manual_seed(3))
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}
    values, = trainer.compute_logprobs(iter([batch]))
    model = trainer.model[0]
    model.eval()
    with torch.no_grad():
        full = gather_full_logits(model(batch["tokens"]), trainer.state, vocab_size).float()
    expected = torch.log_softmax(full, dim=-1).gather(-1, batch["labels"][..., None])[..., 0]
    return counts, (values - expected).abs().max().item(), tuple(values.shape)


def test_configs_validated_once_and_logprobs_at_tp2():
    """validate_configs checks each config once; build_parallel_state, GPTModel and
    get_megatron_optimizer take it as validated (no second check). compute_logprobs over vocab-parallel logits
    equals the log-softmax of the gathered logits."""
    for counts, error, shape in run_distributed(
            _count_validations_and_logprobs, 2, args=(["--tensor-model-parallel-size", "2"],),
            timeout=300):
        assert counts == {"ParallelConfig": 1, "TransformerConfig": 1, "OptimizerConfig": 1}
        assert shape == (2, 32) and error < 1e-5, error


def _trainer_logprobs(rank, world_size, argv):
    """Trainer.compute_logprobs of two microbatches (the next step's count)."""
    import torch

    import pretrain_gpt
    from megatron_smp.training import Trainer, build_configs

    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from trainer_custom_loss import FLAGS

    trainer = Trainer.build(build_configs(FLAGS + ["--global-batch-size", "4"] + argv)[0],
                            pretrain_gpt.model_provider)
    tokens = torch.randint(0, 64, (4, 33), generator=torch.Generator().manual_seed(3))
    batches = iter([{"tokens": tokens[i:i + 2, :-1], "labels": tokens[i:i + 2, 1:]}
                    for i in (0, 2)])
    return [values.numpy() for values in trainer.compute_logprobs(batches)]


def test_trainer_logprobs_whole_sequences_on_every_stage():
    """At PP=2 both stages get every microbatch's log-probs, equal to one process's."""
    import numpy as np

    single, = run_distributed(_trainer_logprobs, 1, args=([],), timeout=300)
    assert [values.shape for values in single] == [(2, 32), (2, 32)]
    for stage in run_distributed(_trainer_logprobs, 2, args=(
            ["--pipeline-model-parallel-size", "2"],), timeout=300):
        for values, expected in zip(stage, single):
            assert np.abs(values - expected).max() < 1e-5
