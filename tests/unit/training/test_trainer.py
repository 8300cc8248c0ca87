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
    """The example's label-smoothed loss falls, and TP=2 and PP=2 (through the 1F1B schedule)
    follow the one-process trajectory."""
    reference, = run_distributed(_example, 1, args=([],), timeout=300)
    assert len(reference) == 6 and reference[-1] < reference[0] - 0.3, reference
    for flags in ("--tensor-model-parallel-size 2", "--pipeline-model-parallel-size 2"):
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


def _count_validations(rank, world_size, argv):
    """How often each config's checks run while a run is configured and built."""
    import pretrain_gpt
    from megatron_smp import config
    from megatron_smp.training import Trainer, build_configs

    counts = {}
    for cls in (config.ParallelConfig, config.TransformerConfig, config.OptimizerConfig):
        def counted(self, *args, _check=cls._check, _name=cls.__name__, **kwargs):
            counts[_name] = counts.get(_name, 0) + 1
            return _check(self, *args, **kwargs)
        cls._check = counted
    configs, _ = build_configs(argv)
    Trainer.build(configs, pretrain_gpt.model_provider)
    return counts


def test_each_config_is_validated_once():
    """validate_configs checks each config; build_parallel_state, GPTModel (each pipeline
    chunk) and get_megatron_optimizer find it validated."""
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from trainer_custom_loss import FLAGS

    argv = FLAGS + ["--pipeline-model-parallel-size", "2", "--num-layers", "4",
                    "--num-layers-per-virtual-pipeline-stage", "1"]
    for counts in run_distributed(_count_validations, 2, args=(argv,), timeout=300):
        assert counts == {"ParallelConfig": 1, "TransformerConfig": 1, "OptimizerConfig": 1}
