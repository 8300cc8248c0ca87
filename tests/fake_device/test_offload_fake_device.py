"""post_training.backend_api offload / onload between two training steps on the fake accelerator:
every storage of the params, grads and optimizer state emptied, the host copies on the CPU,
and training goes on. (Here, beside the harness's own tests, because the fake device must be
registered before this process's autograd engine first runs a backward.)"""
import importlib

from tests.fake_device.harness import pretrain_on_fake_device

ARGV = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--max-position-embeddings 16 --micro-batch-size 2 --global-batch-size 4 "
        "--train-iters 3 --mock-data --tokenizer-type NullTokenizer --vocab-size 128 "
        "--lr 1e-3 --log-interval 100 --eval-interval 100 --eval-iters 0 --seed 7 "
        "--bf16 --use-distributed-optimizer").split()


def test_offload_between_steps_on_the_fake_device(monkeypatch):
    from megatron_smp.post_training.backend_api import offload, onload

    pretrain_module = importlib.import_module("megatron_smp.training.pretrain")
    original = pretrain_module.Trainer.train_step
    seen = []

    def train_step(run, *args, **kwargs):  # run: the Trainer
        out = original(run, *args, **kwargs)
        handle = offload(run.model, run.optimizer)
        params = sum(p.numel() * p.element_size() for c in run.model for p in c.parameters())
        seen.append((handle.nbytes, params,
                     all(t.untyped_storage().nbytes() == 0 for t, _ in handle.pairs),
                     all(h.device.type == "cpu" for _, h in handle.pairs)))
        onload(handle)
        return out

    monkeypatch.setattr(pretrain_module.Trainer, "train_step", train_step)
    # pretrain_on_fake_device wraps train_step itself: it takes the patched one.
    losses = pretrain_on_fake_device("pretrain_gpt", ARGV).losses
    assert len(seen) == 3 and losses[-1] < losses[0]
    for nbytes, params, emptied, on_host in seen:
        # Megatron's 18 bytes a parameter: bf16 params (2), fp32 main grads (4), fp32 main
        # params and Adam's two moments (4 + 4 + 4) = 9x the bf16 params' bytes.
        assert emptied and on_host and nbytes == 9 * params, (nbytes, params)
