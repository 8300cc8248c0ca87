"""pretrain_gpt.py --sft (and LoRA): packed conversations train the same at DP=2 (FSDP2), PP=2,
TP=2+SP and CP=2 as in one process, on the bundled tiny chat set; LoRA trains only its adapters,
starts from a base checkpoint and resumes exactly."""
import pytest
import torch

from megatron_smp.testing import run_distributed
from tests.unit.data.sft_common import make_chat_tokenizer, make_sft_data, tiny_chat_records

ITERS = 6


def _train(rank, world_size, argv, pad_like_context_parallel=None):
    """Losses per iteration; `pad_like_context_parallel`: pad the conversations as a run at
    that --context-parallel-size does (the reference of a CP run packs the same way)."""
    import pretrain_gpt
    from megatron_smp.data import build_train_valid_test_datasets
    from megatron_smp.training import pretrain

    provider = pretrain_gpt.train_valid_test_datasets_provider
    if pad_like_context_parallel:
        def provider(num_samples, configs, tokenizer):
            return build_train_valid_test_datasets(
                configs.data, configs.training.seq_length, configs.training.seed, num_samples,
                tokenizer, context_parallel_size=pad_like_context_parallel)

    result = pretrain(provider, pretrain_gpt.model_provider, pretrain_gpt.forward_step,
                      argv=argv)
    return [result.train_losses[i]["lm loss"] for i in sorted(result.train_losses)]


def _train_logged(rank, world_size, argv):
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        losses = _train(rank, world_size, argv)
    return losses, out.getvalue()


@pytest.fixture(scope="module")
def sft_argv(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("sft_run"))
    records = tiny_chat_records()
    tokenizer = make_chat_tokenizer(directory, records)
    prefix = make_sft_data(tokenizer, directory, records)
    return (
        f"--sft --data-path {prefix} --split 90,10,0 --tokenizer-type HuggingFaceTokenizer "
        f"--tokenizer-model {tokenizer} --num-layers 2 --hidden-size 64 "
        "--num-attention-heads 4 --seq-length 96 --max-position-embeddings 96 "
        f"--micro-batch-size 2 --global-batch-size 4 --train-iters {ITERS} --hidden-dropout 0 "
        "--attention-dropout 0 --lr 1e-3 --log-interval 1 --eval-interval 100 "
        "--eval-iters 1 --seed 7"
    ).split()


def test_sft_layouts_match_single_process(sft_argv):
    """Packed conversations at DP=2 under FSDP2, PP=2, TP=2+SP and CP=2 (each conversation
    split over the CP ranks the load-balanced way; the reference packs them padded alike)
    give the single process's losses."""
    reference, log = run_distributed(_train_logged, 1, args=(sft_argv,), timeout=300)[0]
    assert " > --sft train: 86 conversations in " in log and "packing efficiency 0." in log
    assert len(reference) == ITERS and reference[-1] < reference[0]
    padded = run_distributed(_train, 1, args=(sft_argv, 2), timeout=300)[0]
    assert padded != pytest.approx(reference, rel=1e-5)  # other packs: a real check below
    for flags, expected in (
            ("--use-torch-fsdp2", reference),
            ("--pipeline-model-parallel-size 2", reference),
            ("--tensor-model-parallel-size 2 --sequence-parallel", reference),
            ("--context-parallel-size 2 --cp-comm-type all_gather", padded)):
        for losses in run_distributed(_train, 2, args=(sft_argv + flags.split(),), timeout=300):
            assert losses == pytest.approx(expected, rel=1e-5), (flags, losses, expected)


def test_sft_refuses_ring_context_parallel_and_mock_data(sft_argv):
    from megatron_smp.config import ConfigError
    from megatron_smp.data import build_train_valid_test_datasets
    from megatron_smp.training.arguments import parse_args, validate_configs

    configs = parse_args(sft_argv + ["--context-parallel-size", "2"])
    configs.model.vocab_size = 400  # the tokenizer's, as pretrain sets it before validating
    with pytest.raises(ConfigError, match="--sft with --context-parallel-size 2 needs "
                                          "--cp-comm-type all_gather"):
        validate_configs(configs, world_size=2)
    configs = parse_args(sft_argv + ["--eod-mask-loss"])
    configs.model.vocab_size = 400
    with pytest.raises(ConfigError, match="--sft with --eod-mask-loss: .* drop it"):
        validate_configs(configs, world_size=1)
    configs = parse_args(sft_argv)
    configs.data.mock_data = True
    with pytest.raises(ConfigError, match="--sft .* --mock-data"):
        build_train_valid_test_datasets(configs.data, 96, 7, [8, 1, 0], None)


LLAMA = ("--normalization RMSNorm --swiglu --position-embedding-type rope "
         "--untie-embeddings-and-output-weights --disable-bias-linear "
         "--group-query-attention --num-query-groups 2").split()
LORA = "--lora-rank 4 --lora-alpha 8 --lr 1e-2".split()


def _train_lora(rank, world_size, argv):
    """Losses, and the bytes of optimizer state next to the adapters' bytes (this rank)."""
    import megatron_smp.optimizer as optimizer_module

    built = {}
    original = optimizer_module.get_megatron_optimizer

    def capture(config, chunks, state, *args, **kwargs):
        built["optimizer"] = original(config, chunks, state, *args, **kwargs)
        built["adapter_bytes"] = sum(p.numel() * p.element_size() for c in chunks
                                     for p in c.parameters() if p.requires_grad)
        built["trainable"] = sorted({n.split(".lora.")[-1] for c in chunks
                                     for n, p in c.named_parameters() if p.requires_grad})
        return built["optimizer"]

    optimizer_module.get_megatron_optimizer = capture
    losses = _train(rank, world_size, argv)
    state_bytes = sum(value.numel() * value.element_size()
                      for per_param in built["optimizer"].optimizer.state.values()
                      for value in per_param.values()
                      if isinstance(value, torch.Tensor) and value.dim() > 0)
    return losses, state_bytes, built["adapter_bytes"], built["trainable"]


def test_lora_sft_layouts_match_and_only_adapters_train(sft_argv):
    argv = sft_argv + LLAMA + LORA
    (reference, state_bytes, adapter_bytes, trainable), = run_distributed(
        _train_lora, 1, args=(argv,), timeout=300)
    assert reference[-1] < reference[0] - 0.1, reference
    assert trainable == ["lora_A", "lora_B"]
    # Adam: exp_avg and exp_avg_sq of the adapters only, nothing for the frozen base.
    assert state_bytes == 2 * adapter_bytes
    for flags in ("--tensor-model-parallel-size 2 --sequence-parallel",
                  "--use-distributed-optimizer"):
        results = run_distributed(_train_lora, 2, args=(argv + flags.split(),), timeout=300)
        for losses, _, _, _ in results:
            assert losses == pytest.approx(reference, rel=1e-5), (flags, losses, reference)
        if flags == "--use-distributed-optimizer":  # the state is split over the 2 ranks
            assert sum(r[1] for r in results) == state_bytes


def test_lora_finetunes_from_a_base_checkpoint(sft_argv, tmp_path):
    """--finetune --load of a checkpoint without adapters: the base loads, the adapters start
    at B = 0, so the first loss is the base model's (that of a full fine-tune from it)."""
    base = sft_argv + LLAMA + ["--train-iters", "2", "--save", str(tmp_path / "base")]
    run_distributed(_train, 1, args=(base,), timeout=300)
    load = ["--load", str(tmp_path / "base"), "--finetune", "--train-iters", "3"]
    full = run_distributed(_train, 1, args=(sft_argv + LLAMA + load,), timeout=300)[0]
    lora = run_distributed(_train, 1, args=(sft_argv + LLAMA + LORA + load,), timeout=300)[0]
    assert lora[0] == pytest.approx(full[0], rel=1e-6)
    assert lora[1] != pytest.approx(full[1], rel=1e-6)


def test_lora_resume_mid_run_is_exact(sft_argv, tmp_path):
    argv = sft_argv + LLAMA + LORA + ["--train-iters", "4", "--save", str(tmp_path / "ckpt")]
    whole = run_distributed(_train, 1, args=(argv,), timeout=300)[0]
    # Stopped after iteration 2 (--exit-interval saves), then resumed to the end.
    run_distributed(_train, 1, args=(argv + ["--exit-interval", "2"],), timeout=300)
    resumed = run_distributed(_train, 1, args=(argv + ["--load", str(tmp_path / "ckpt")],),
                              timeout=300)[0]
    assert resumed == whole[2:]
