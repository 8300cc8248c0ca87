"""pretrain_gpt.py --sft (and LoRA): packed conversations train the same at DP=2 (FSDP2), PP=2,
TP=2+SP and CP=2 as in one process, on the bundled tiny chat set; LoRA trains only its adapters;
an HF Llama fine-tuned with LoRA lowers its validation loss, resumes exactly and exports to
PEFT and to a merged HF model."""
import sys
import types

import pytest
import torch

from megatron_smp.testing import run_distributed
from tests.unit.data.sft_common import (
    ROOT,
    make_chat_tokenizer,
    make_sft_data,
    tiny_chat_records,
)

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
def sft_data(tmp_path_factory):
    """(--data-path prefix, tokenizer directory) of the bundled tiny chat set."""
    directory = str(tmp_path_factory.mktemp("sft_run"))
    records = tiny_chat_records()
    tokenizer = make_chat_tokenizer(directory, records)
    return make_sft_data(tokenizer, directory, records), tokenizer


def _data_flags(prefix, tokenizer):
    return (f"--sft --data-path {prefix} --split 90,10,0 --tokenizer-type HuggingFaceTokenizer "
            f"--tokenizer-model {tokenizer} --seq-length 96").split()


@pytest.fixture(scope="module")
def sft_argv(sft_data):
    return _data_flags(*sft_data) + (
        "--num-layers 2 --hidden-size 64 "
        "--num-attention-heads 4 --max-position-embeddings 96 "
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


def test_lora_sft_layouts_match_and_only_adapters_train(sft_argv, tmp_path):
    """LoRA at TP=2+SP and DP=2 (distributed optimizer) equals one process; only the adapters
    train and have optimizer state. Without a base checkpoint (random init) the run saves the
    whole model; the DP=2 run resumes that whole checkpoint at iteration 3, and its own
    checkpoints are then small ones recording it as their base."""
    import json
    import os

    from megatron_smp.checkpointing import COMMON_FILENAME, checkpoint_dir

    argv = sft_argv + LLAMA + LORA
    whole, small = str(tmp_path / "whole"), str(tmp_path / "small")
    (reference, state_bytes, adapter_bytes, trainable), = run_distributed(
        _train_lora, 1, args=(argv + ["--save", whole, "--save-interval", "3"],), timeout=300)
    assert reference[-1] < reference[0] - 0.1, reference
    assert trainable == ["lora_A", "lora_B"]
    # Adam: exp_avg and exp_avg_sq of the adapters only, nothing for the frozen base.
    assert state_bytes == 2 * adapter_bytes
    with open(os.path.join(whole, "latest_checkpointed_iteration.txt"), "w") as handle:
        handle.write("3")
    for flags, expected in (
            ("--tensor-model-parallel-size 2 --sequence-parallel", reference),
            (f"--use-distributed-optimizer --load {whole} --save {small}", reference[3:])):
        results = run_distributed(_train_lora, 2, args=(argv + flags.split(),), timeout=300)
        for losses, _, _, _ in results:
            assert losses == pytest.approx(expected, rel=1e-5), (flags, losses, expected)
        if "--use-distributed-optimizer" in flags:  # the state is split over the 2 ranks
            assert sum(r[1] for r in results) == state_bytes
    with open(os.path.join(checkpoint_dir(small, ITERS), COMMON_FILENAME)) as handle:
        assert json.load(handle)["config"]["lora_base"] == {"load": whole, "iteration": 3}


def _train_and_validate(rank, world_size, argv):
    """Losses per iteration and the final validation loss."""
    import pretrain_gpt
    from megatron_smp.training import pretrain

    result = pretrain(pretrain_gpt.train_valid_test_datasets_provider,
                      pretrain_gpt.model_provider, pretrain_gpt.forward_step, argv=argv)
    losses = [result.train_losses[i]["lm loss"] for i in sorted(result.train_losses)]
    return losses, result.final_valid_losses.get("lm loss")


def _hf_validation_loss(model, data_flags, samples):
    """The masked mean loss of an HF causal LM over the first `samples` validation packs,
    each conversation run on its own (what --eval-iters evaluates, packed)."""
    from megatron_smp.data import build_train_valid_test_datasets
    from megatron_smp.training.arguments import parse_args

    configs = parse_args(data_flags + ["--num-layers", "1", "--hidden-size", "8",
                                       "--num-attention-heads", "1"])
    # The padding token never counts (loss mask 0), whatever it is.
    _, valid, _ = build_train_valid_test_datasets(configs.data, 96, 7, [None, samples, None],
                                                  tokenizer=types.SimpleNamespace(eod=0))
    total, count = 0.0, 0.0
    with torch.no_grad():
        for index in range(samples):
            sample = valid[index]
            documents = sample["document_ids"]
            for number in documents.unique().tolist():
                span = (documents == number).nonzero().flatten()
                a, b = int(span[0]), int(span[-1]) + 1
                mask = sample["loss_mask"][a:b]
                if mask.sum() == 0:
                    continue
                logits = model(input_ids=sample["tokens"][None, a:b]).logits[0].float()
                losses = torch.nn.functional.cross_entropy(logits, sample["labels"][a:b],
                                                           reduction="none")
                total += float((losses * mask).sum())
                count += float(mask.sum())
    return total / count


def _tensor_bytes(load_dir):
    """{key: bytes} of the tensors in the latest torch_dist checkpoint of `load_dir`."""
    from megatron_smp.checkpointing import checkpoint_dir, read_tracker
    from megatron_smp.checkpointing.engine import read_dcp_metadata

    metadata = read_dcp_metadata(checkpoint_dir(load_dir, read_tracker(load_dir)))
    return {key: torch.Size(info.size).numel() * torch.empty(
                (), dtype=info.properties.dtype).element_size()
            for key, info in metadata.state_dict_metadata.items() if hasattr(info, "size")}


def test_lora_finetunes_an_hf_llama_resumes_and_exports(sft_data, tmp_path):
    """An HF Llama directory, converted, fine-tuned with LoRA on the bundled chats: the base
    run's validation loss is HF's own on the same conversations; fine-tuning lowers it; the
    checkpoints are small (the adapters and their optimizer state; the base recorded); a run
    stopped at iteration 2 resumes exactly (at TP=2 too, from the same small checkpoint);
    convert.py --peft-dir exports an adapter that peft loads onto the HF model, and a merged
    HF model, both giving our validation loss."""
    from peft import PeftModel
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, ROOT)
    from tools.checkpoint import convert

    prefix, tokenizer_dir = sft_data
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(AutoTokenizer.from_pretrained(tokenizer_dir)), hidden_size=64,
        intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=96, tie_word_embeddings=False))
    hf.save_pretrained(str(tmp_path / "hf"))
    assert convert.main(["--model-type", "llama", "--loader", "hf", "--saver", "megatron_smp",
                         "--load-dir", str(tmp_path / "hf"),
                         "--save-dir", str(tmp_path / "base")]) == 0
    data = _data_flags(prefix, tokenizer_dir)
    argv = data + LORA + (
        "--use-checkpoint-args --micro-batch-size 2 --global-batch-size 4 --train-iters 4 "
        "--lr-warmup-iters 0 --log-interval 1 --eval-interval 100 --eval-iters 2 --seed 7 "
        "--hidden-dropout 0 --attention-dropout 0").split()
    from_base = ["--load", str(tmp_path / "base"), "--finetune"]
    _, base_valid = run_distributed(_train_and_validate, 1,
                                    args=(argv + from_base + ["--skip-train"],), timeout=300)[0]
    assert base_valid == pytest.approx(_hf_validation_loss(hf.eval(), data, 8), rel=1e-5)

    whole, valid = run_distributed(_train_and_validate, 1, args=(
        argv + from_base + ["--save", str(tmp_path / "whole")],), timeout=300)[0]
    assert valid < base_valid - 0.05, (valid, base_valid)
    # A small checkpoint: the adapters, their Adam moments (and fp32 copies where kept),
    # nothing of the frozen base.
    small, base_bytes = _tensor_bytes(str(tmp_path / "whole")), _tensor_bytes(
        str(tmp_path / "base"))
    model_keys = [key for key in small if key.startswith("model.")]
    assert model_keys and all(".lora.lora_" in key for key in model_keys), model_keys
    adapter_bytes = sum(small[key] for key in model_keys)
    optimizer_bytes = sum(v for k, v in small.items() if k.startswith("optimizer."))
    assert optimizer_bytes >= 2 * adapter_bytes
    assert sum(small.values()) < 2 * 3 * adapter_bytes
    assert sum(small.values()) * 4 < sum(base_bytes.values()), (small, base_bytes)
    print(f"LoRA checkpoint tensor bytes: small {sum(small.values())} (adapters "
          f"{adapter_bytes}, optimizer {optimizer_bytes}) vs base {sum(base_bytes.values())}")
    # Started as finetune_llama_lora.sh does (--pretrained-checkpoint BASE, --load of a
    # directory without a checkpoint yet), stopped after iteration 2 (--exit-interval saves),
    # then resumed to the end: the base from the one the small checkpoint records, or from
    # --pretrained-checkpoint.
    stop = argv + ["--pretrained-checkpoint", str(tmp_path / "base"), "--load",
                   str(tmp_path / "ckpt"), "--save", str(tmp_path / "ckpt"),
                   "--exit-interval", "2"]
    run_distributed(_train_and_validate, 1, args=(stop,), timeout=300)
    resumed, resumed_valid = run_distributed(_train_and_validate, 1, args=(
        argv + ["--load", str(tmp_path / "ckpt")],), timeout=300)[0]
    assert resumed == whole[2:] and resumed_valid == valid
    for losses, _ in run_distributed(_train_and_validate, 2, args=(
            argv + ["--load", str(tmp_path / "ckpt"), "--pretrained-checkpoint",
                    str(tmp_path / "base"), "--tensor-model-parallel-size", "2"],),
            timeout=300):
        assert losses == pytest.approx(whole[2:], rel=1e-5)
    _check_lora_base_errors(str(tmp_path))

    assert convert.main(["--model-type", "llama", "--loader", "megatron_smp", "--saver", "hf",
                         "--load-dir", str(tmp_path / "whole"),
                         "--save-dir", str(tmp_path / "merged"),
                         "--peft-dir", str(tmp_path / "adapter")]) == 0
    with_adapter = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(
        str(tmp_path / "hf")), str(tmp_path / "adapter")).eval()
    assert _hf_validation_loss(with_adapter, data, 8) == pytest.approx(valid, rel=1e-5)
    merged = LlamaForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
    assert _hf_validation_loss(merged, data, 8) == pytest.approx(valid, rel=1e-5)
    # A checkpoint without adapters has nothing to export.
    assert convert.main(["--model-type", "llama", "--loader", "megatron_smp", "--saver", "hf",
                         "--load-dir", str(tmp_path / "base"),
                         "--save-dir", str(tmp_path / "again"),
                         "--peft-dir", str(tmp_path / "none")]) == 2


def _check_lora_base_errors(root):
    """A small LoRA checkpoint whose base is missing, or named wrongly, is a clear error."""
    import json
    import os
    import shutil

    from megatron_smp.checkpointing import CheckpointError, checkpoint_dir
    from megatron_smp.checkpointing.loop import resolve_lora_base

    path = checkpoint_dir(os.path.join(root, "ckpt"), 2)
    assert resolve_lora_base(path, None) == (os.path.join(root, "base"), 0)
    with pytest.raises(CheckpointError, match="--pretrained-checkpoint .*nowhere holds no"):
        resolve_lora_base(path, os.path.join(root, "nowhere"))
    with pytest.raises(CheckpointError, match="itself a small LoRA checkpoint.*"
                                              "--pretrained-checkpoint DIR"):
        resolve_lora_base(path, os.path.join(root, "whole"))
    moved = os.path.join(root, "moved")
    shutil.copytree(path, moved)
    with open(os.path.join(moved, "common.json")) as handle:
        common = json.load(handle)
    common["config"]["lora_base"]["load"] = os.path.join(root, "gone")
    with open(os.path.join(moved, "common.json"), "w") as handle:
        json.dump(common, handle)
    with pytest.raises(CheckpointError, match="base model .*gone, iteration 0.* is missing: "
                                              "give the base checkpoint with "
                                              "--pretrained-checkpoint DIR"):
        resolve_lora_base(moved, None)
