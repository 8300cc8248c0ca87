"""tools/checkpoint/convert.py and the SMP v1 translate functions: exact HF -> framework -> HF
round trips through the CLI, the on-disk contract of converted checkpoints, clear errors, and
a converted model fine-tuned by pretrain at TP=2 whose HF export gives the framework's logits."""
import contextlib
import io
import json
import os
import warnings

import pytest
import torch

from megatron_smp.config import ConfigError
from megatron_smp.models import hf as hf_adapters
from megatron_smp.testing import run_distributed
from tests.unit.models.test_hf_adapters import build_hf
from tools.checkpoint.convert import main

warnings.filterwarnings("ignore", message=".*")
# --model-type -> the test model family (llama31: Llama with Llama 3.1 RoPE scaling).
MODEL_TYPES = {"gpt2": "gpt2", "gptneox": "gpt_neox", "gptj": "gptj", "llama": "llama",
               "mistral": "mistral", "mixtral": "mixtral", "qwen2_moe": "qwen2_moe", "qwen2": "qwen2",
               "qwen3_moe": "qwen3_moe", "llama:llama31": "llama31"}
# config.json entries that are bookkeeping, not the model.
_BOOKKEEPING = ("transformers_version",)


def _convert(model_type, loader, saver, load_dir, save_dir, *extra):
    argv = ["--model-type", model_type, "--loader", loader, "--saver", saver,
            "--load-dir", str(load_dir), "--save-dir", str(save_dir), *extra]
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        status = main(argv)
    return status, stderr.getvalue()


def _convert_ok(*args):
    status, stderr = _convert(*args)
    assert status == 0, stderr


def _config_json(path):
    with open(os.path.join(path, "config.json")) as f:
        return {k: v for k, v in json.load(f).items() if k not in _BOOKKEEPING}


@pytest.mark.parametrize("model_type", sorted(MODEL_TYPES))
def test_hf_to_framework_to_hf_is_exact(model_type, tmp_path):
    import transformers

    from megatron_smp.checkpointing.engine import read_dcp_metadata

    family = MODEL_TYPES[model_type]
    model_type = model_type.split(":")[0]
    source = build_hf(family)  # vocab 1003 / 1000: padded to 1024 inside the framework
    source.save_pretrained(tmp_path / "hf")
    _convert_ok(model_type, "hf", "megatron_smp", tmp_path / "hf", tmp_path / "smp",
                "--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size", "2")
    _convert_ok(model_type, "megatron_smp", "hf", tmp_path / "smp", tmp_path / "hf2")

    # The framework checkpoint: iteration 0, model only, global names and shapes, trimmed vocab.
    assert (tmp_path / "smp" / "latest_checkpointed_iteration.txt").read_text().strip() == "0"
    iter_dir = tmp_path / "smp" / "iter_0000000"
    common = json.loads((iter_dir / "common.json").read_text())
    config = hf_adapters.get_adapter(source).config_from_hf(source.config)
    saved_model = common["config"]["model"]
    for name in ("num_layers", "hidden_size", "num_query_groups", "vocab_size", "rotary_percent",
                 "parallel_residual", "untie_embeddings_and_output_weights"):
        assert saved_model[name] == getattr(config, name), name
    assert saved_model["window_size"] == ([4, 0] if family == "mistral" else None)
    assert common["config"]["conversion"]["target_layout"] == {
        "tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2}
    keys = read_dcp_metadata(str(iter_dir)).state_dict_metadata
    assert {k.split(".")[0] for k in keys} == {"model"}
    vocab = keys["model.embedding.word_embeddings.weight"].size
    assert list(vocab) == [config.vocab_size, config.hidden_size]
    assert ("model.output_layer.weight" in keys) == config.untie_embeddings_and_output_weights
    assert "model.decoder.layers.1.self_attention.linear_qkv.weight" in keys

    # Back in HF: every tensor and every config field equal to the source.
    assert _config_json(tmp_path / "hf2") == _config_json(tmp_path / "hf")
    result = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf2")
    expected, actual = source.state_dict(), result.state_dict()
    assert expected.keys() == actual.keys()
    for name in expected:
        assert torch.equal(expected[name], actual[name]), name


def test_errors_are_clear(tmp_path):
    from safetensors.torch import load_file, save_file

    source = build_hf("llama")
    source.save_pretrained(tmp_path / "hf")
    status, stderr = _convert("mixtral", "hf", "megatron_smp", tmp_path / "hf", tmp_path / "x")
    assert status == 2 and "'llama' model but --model-type is mixtral" in stderr
    status, stderr = _convert("gpt2", "hf", "megatron_smp", tmp_path / "hf", tmp_path / "x")
    assert status == 2 and "'llama' model but --model-type is gpt2" in stderr
    status, stderr = _convert("llama", "hf", "megatron_smp", tmp_path / "hf", tmp_path / "x",
                              "--target-tensor-parallel-size", "3")
    assert status == 2 and "--target-tensor-parallel-size 3 does not divide" in stderr
    status, stderr = _convert("llama", "hf", "megatron_smp", tmp_path / "hf", tmp_path / "x",
                              "--target-pipeline-parallel-size", "4")
    assert status == 2 and "does not divide num_layers (2)" in stderr
    assert not (tmp_path / "x").exists()  # nothing written by a failed conversion
    status, stderr = _convert("llama", "hf", "megatron_smp", tmp_path / "hf", tmp_path / "hf")
    assert status == 2 and "must differ" in stderr

    # A tensor missing and one too many: both named.
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    weights = load_file(tmp_path / "hf" / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    weights["model.layers.1.mlp.extra.weight"] = torch.zeros(3)
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    status, stderr = _convert("llama", "hf", "megatron_smp", broken, tmp_path / "y")
    assert status == 2
    assert "model.layers.1.mlp.up_proj.weight: missing" in stderr
    assert "model.layers.1.mlp.extra.weight: unexpected" in stderr

    # A framework checkpoint read as the wrong family, and a non-empty save directory.
    _convert_ok("llama", "hf", "megatron_smp", tmp_path / "hf", tmp_path / "smp")
    status, stderr = _convert("gptneox", "megatron_smp", "hf", tmp_path / "smp", tmp_path / "z")
    assert status == 2 and "not a gptneox" in stderr
    status, stderr = _convert("llama", "megatron_smp", "hf", tmp_path / "smp", tmp_path / "hf")
    assert status == 2 and "not empty" in stderr


@pytest.mark.parametrize("family", ["gpt2", "gpt_neox", "llama", "mistral"])
def test_our_layout_translate_functions_round_trip(family):
    name = family.replace("_", "")
    to_hf = getattr(hf_adapters, f"translate_smp_state_dict_to_hf_{name}")
    to_smp = getattr(hf_adapters, f"translate_hf_state_dict_to_smp_{name}")
    source = build_hf(family)
    hf_sd = source.state_dict()
    full = to_smp(hf_sd, config=source.config)
    config = hf_adapters.get_adapter(source).config_from_hf(source.config)
    assert full["embedding.word_embeddings.weight"].shape[0] == config.padded_vocab_size(1)
    back = to_hf(full, config=config)
    assert back.keys() == hf_sd.keys()
    assert all(torch.equal(back[k], hf_sd[k]) for k in hf_sd)
    if family == "gpt_neox":  # shapes read from the tensors: no config needed
        inferred = to_smp(hf_sd)
        assert inferred["embedding.word_embeddings.weight"].shape[0] == config.vocab_size
        again = to_hf(inferred)
        assert all(torch.equal(again[k], hf_sd[k]) for k in hf_sd)
    else:
        with pytest.raises(ConfigError, match="number of attention heads"):
            to_smp(hf_sd)


PROBE_SEED = 5
SEQ = 16


def _finetune_tp2(rank, world_size, load_dir, save_dir, vocab_size, model_argv=None):
    """pretrain_llama from the converted checkpoint at TP=2 for 5 iterations; the full logits
    of a fixed batch from the trained model, taken when it is saved. `model_argv` replaces the
    Llama model flags (and pretrain_llama's defaults by pretrain_gpt's)."""
    from megatron_smp.models.gpt import gather_full_logits
    from megatron_smp.checkpointing import loop as checkpointing
    from megatron_smp.training import pretrain
    from pretrain_gpt import forward_step, model_provider, train_valid_test_datasets_provider
    from pretrain_llama import LLAMA_DEFAULTS

    tokens = torch.randint(0, vocab_size, (2, SEQ),
                           generator=torch.Generator().manual_seed(PROBE_SEED))
    probe = {}
    save = checkpointing.save

    def save_and_probe(run):
        save(run)
        model = run.model[0]
        model.eval()
        with torch.no_grad():
            logits = model(tokens)
        probe["logits"] = gather_full_logits(logits, run.state, vocab_size).numpy().copy()

    checkpointing.save = save_and_probe
    llama = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --group-query-attention "
             "--num-query-groups 2 --ffn-hidden-size 96 --max-position-embeddings 32 "
             "--norm-epsilon 1e-6 --rotary-base 500000")
    argv = ((model_argv or llama) + " --seq-length 16 --micro-batch-size 2 "
            "--global-batch-size 2 --train-iters 5 --lr 1e-3 --log-interval 5 --mock-data "
            f"--tokenizer-type NullTokenizer --vocab-size {vocab_size - 1} "
            "--tensor-model-parallel-size 2 --finetune").split()
    argv += ["--load", load_dir, "--save", save_dir]
    defaults = LLAMA_DEFAULTS if model_argv is None else {}
    with contextlib.redirect_stdout(io.StringIO()):
        result = pretrain(train_valid_test_datasets_provider, model_provider, forward_step,
                          args_defaults=defaults, argv=argv)
    return {"losses": [v["lm loss"] for v in result.train_losses.values()], **probe}


def test_converted_model_finetunes_at_tp2_and_exports_to_hf(tmp_path):
    import transformers

    source = build_hf("llama")
    source.save_pretrained(tmp_path / "hf")
    _convert_ok("llama", "hf", "megatron_smp", tmp_path / "hf", tmp_path / "smp")
    vocab_size = source.config.vocab_size
    results = run_distributed(_finetune_tp2, 2, args=(str(tmp_path / "smp"),
                              str(tmp_path / "trained"), vocab_size))
    losses = results[0]["losses"]
    assert len(losses) == 5 and all(torch.isfinite(torch.tensor(losses)))
    _convert_ok("llama", "megatron_smp", "hf", tmp_path / "trained", tmp_path / "hf_trained")

    trained = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf_trained").eval()
    before, after = source.state_dict(), trained.state_dict()
    assert not torch.equal(before["model.layers.0.mlp.up_proj.weight"],
                           after["model.layers.0.mlp.up_proj.weight"])  # it did train
    tokens = torch.randint(0, vocab_size, (2, SEQ),
                           generator=torch.Generator().manual_seed(PROBE_SEED))
    with torch.no_grad():
        hf_logits = trained(tokens).logits
    for rank in (0, 1):
        framework_logits = torch.from_numpy(results[rank]["logits"])
        assert framework_logits.shape == hf_logits.shape
        diff = (framework_logits - hf_logits).abs().max().item()
        print(f"rank {rank}: max |framework - HF| logits = {diff:.3g}")
        assert diff < 1e-4
