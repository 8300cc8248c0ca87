"""convert.py --loader smp_v1: the file SMP v1's smp.save({"model_state_dict": sd}, path,
partial=False) wrote, with sd in v1's layout (built in the test from v1's documented key
layout) or already translated to HF's, converts to HF with the source model's logits exactly,
and to our checkpoint and on to HF tensor for tensor; partial checkpoints and a missing HF
config are clear errors."""
import warnings

import pytest
import torch

from tests.unit.models.test_hf_adapters import build_hf
from tests.unit.models.test_smp_v1 import _logits, v1_layout
from megatron_smp.testing import run_distributed
from tests.unit.tools.test_convert import PROBE_SEED, SEQ, _convert, _convert_ok, _finetune_tp2

warnings.filterwarnings("ignore", message=".*")
MODEL_TYPES = {"gpt2": "gpt2", "gpt_neox": "gpt_neox", "gptj": "gptj"}


def _save_v1(tmp_path, family, prefixed, key="model_state_dict"):
    """SMP v1's full checkpoint file and the model's HF config.json beside it. `key`: the
    entry holding the state dict (v1's examples used "model" too; None: the dict itself)."""
    source = build_hf(family)
    state_dict = v1_layout(family, source)
    if prefixed:  # a wrapped model's keys
        state_dict = {"module." + k: v for k, v in state_dict.items()}
    v1_dir = tmp_path / "v1"
    v1_dir.mkdir()
    if key is None:  # smp.save_checkpoint(path, tag, partial=False, translate_if_full=False)
        state_dict["_smp_is_partial"] = False
        torch.save({"epoch": 3}, v1_dir / "user_content_checkpoint.pt")
    torch.save(state_dict if key is None else {key: state_dict}, v1_dir / "checkpoint.pt")
    source.config.save_pretrained(v1_dir)
    return source, v1_dir


def _assert_same_model(source, save_dir):
    import transformers

    result = transformers.AutoModelForCausalLM.from_pretrained(save_dir)
    expected, actual = source.state_dict(), result.state_dict()
    assert expected.keys() == actual.keys()
    assert all(torch.equal(expected[k], actual[k]) for k in expected)
    assert torch.equal(_logits(result.eval()), _logits(source))


@pytest.mark.parametrize("model_type,key", [("gpt2", "model_state_dict"), ("gpt_neox", "model"),
                                            ("gptj", None)])
def test_v1_checkpoint_converts_to_hf_with_identical_logits(model_type, key, tmp_path):
    source, v1_dir = _save_v1(tmp_path, MODEL_TYPES[model_type], prefixed=model_type != "gpt2",
                              key=key)
    # The directory as --load-dir: config.json and user_content_<tag> are not the checkpoint.
    _convert_ok(model_type, "smp_v1", "hf", v1_dir, tmp_path / "hf")
    _assert_same_model(source, tmp_path / "hf")


def test_v1_checkpoint_to_framework_and_translated_files(tmp_path):
    # v1 GPT-J -> our checkpoint -> HF: the same tensors (the directory as --load-dir, the
    # config found beside the file).
    source, v1_dir = _save_v1(tmp_path, "gptj", prefixed=True)
    _convert_ok("gptj", "smp_v1", "megatron_smp", v1_dir, tmp_path / "smp")
    _convert_ok("gptj", "megatron_smp", "hf", tmp_path / "smp", tmp_path / "hf")
    _assert_same_model(source, tmp_path / "hf")

    # pretrain_gpt.py takes GPT-J's whole model with --use-checkpoint-args (no model flags) and
    # trains it at TP=2; the trained model exported to HF gives the framework's logits.
    import transformers

    results = run_distributed(_finetune_tp2, 2, args=(
        str(tmp_path / "smp"), str(tmp_path / "trained"), source.config.vocab_size,
        "--use-checkpoint-args"))
    losses = results[0]["losses"]
    assert len(losses) == 5 and all(torch.isfinite(torch.tensor(losses)))
    _convert_ok("gptj", "megatron_smp", "hf", tmp_path / "trained", tmp_path / "hf_trained")
    trained = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf_trained").eval()
    for name in ("transformer.h.0.ln_1.weight", "lm_head.bias"):  # the shared norm, the bias
        assert not torch.equal(trained.state_dict()[name], source.state_dict()[name]), name
    tokens = torch.randint(0, source.config.vocab_size, (2, SEQ),
                           generator=torch.Generator().manual_seed(PROBE_SEED))
    with torch.no_grad():
        hf_logits = trained(tokens).logits
    for rank in (0, 1):
        assert (torch.from_numpy(results[rank]["logits"]) - hf_logits).abs().max() < 1e-4
    # Loaded with GPT-2-style flags instead, the GPT-J fields are named.
    from megatron_smp.config import TransformerConfig
    from megatron_smp.checkpointing import CheckpointError
    from megatron_smp.checkpointing.loop import check_architecture_matches

    flags = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4,
                              vocab_size=1003, max_position_embeddings=32)
    with pytest.raises(CheckpointError, match="parallel_residual_shared_norm: checkpoint True "
                                              "vs flags False.*add_output_layer_bias"):
        check_architecture_matches(str(tmp_path / "smp" / "iter_0000000"), flags)

    # The migration guide's file: already translated to HF's layout (with v1's mask buffers
    # and NeoX's old embed_out name), the config given by --hf-config.
    neox = build_hf("gpt_neox")
    hf_sd = dict(neox.state_dict())
    hf_sd["embed_out.weight"] = hf_sd.pop("lm_head.weight")
    hf_sd["gpt_neox.layers.0.attention.bias"] = torch.ones(1, 1, 32, 32, dtype=torch.uint8)
    (tmp_path / "guide").mkdir()
    torch.save({"model_state_dict": hf_sd}, tmp_path / "guide" / "checkpoint.pt")
    neox.config.save_pretrained(tmp_path / "neox_config")
    _convert_ok("gpt_neox", "smp_v1", "hf", tmp_path / "guide" / "checkpoint.pt",
                tmp_path / "hf_neox", "--hf-config", str(tmp_path / "neox_config"))
    _assert_same_model(neox, tmp_path / "hf_neox")


def test_v1_custom_gpt2_checkpoint_converts(tmp_path):
    """v1's custom GPT-2 (its blocks replaced by DistributedTransformerLayers) is recognised."""
    from megatron_smp.smp.nn.huggingface.gpt2 import (
        translate_hf_state_dict_to_smdistributed_gpt2_layer,
    )

    source = build_hf("gpt2")
    custom = translate_hf_state_dict_to_smdistributed_gpt2_layer(source.state_dict())
    assert "transformer.h.0.attention.query.weight" in custom  # the layout, tested on its own
    (tmp_path / "v1").mkdir()
    torch.save({"model_state_dict": custom}, tmp_path / "v1" / "checkpoint.pt")
    source.config.save_pretrained(tmp_path / "v1")
    _convert_ok("gpt2", "smp_v1", "hf", tmp_path / "v1", tmp_path / "hf")
    _assert_same_model(source, tmp_path / "hf")


def test_v1_loader_errors_are_clear(tmp_path):
    source, v1_dir = _save_v1(tmp_path, "gpt2", prefixed=False)
    # Partial (per-rank) checkpoints: named, with what to do instead.
    partial = tmp_path / "partial"
    partial.mkdir()
    for tp_rank in (0, 1):
        torch.save({"model_state_dict": {"_smp_is_partial": True}}, partial / f"ckpt_0_{tp_rank}")
    status, stderr = _convert("gpt2", "smp_v1", "hf", partial / "ckpt", tmp_path / "x")
    assert status == 2 and "partial checkpoint" in stderr and "partial=False" in stderr
    status, stderr = _convert("gpt2", "smp_v1", "hf", partial, tmp_path / "x")
    assert status == 2 and "partial checkpoint" in stderr
    # No HF config beside the file and none given.
    (v1_dir / "config.json").unlink()
    status, stderr = _convert("gpt2", "smp_v1", "hf", v1_dir / "checkpoint.pt", tmp_path / "x")
    assert status == 2 and "needs the model's Hugging Face config" in stderr
    # A config of another shape: the mismatching tensor is named.
    small = build_hf("gpt2", n_inner=128).config
    small.save_pretrained(tmp_path / "other")
    status, stderr = _convert("gpt2", "smp_v1", "hf", v1_dir / "checkpoint.pt", tmp_path / "x",
                              "--hf-config", str(tmp_path / "other"))
    assert status == 2 and "transformer.h.0.mlp.c_fc.weight: [64, 256], the config says" in stderr
    status, stderr = _convert("llama", "smp_v1", "hf", v1_dir, tmp_path / "x")
    assert status == 2 and "use gpt2, gpt_neox or gptj" in stderr
    # Megatron-LM cannot build a GPT-J: said before anything is written.
    (tmp_path / "j").mkdir()
    _, gptj_dir = _save_v1(tmp_path / "j", "gptj", prefixed=False)
    status, stderr = _convert("gptj", "smp_v1", "megatron", gptj_dir, tmp_path / "x")
    assert status == 2 and "Megatron-LM's GPT model has no parallel_residual_shared_norm" in stderr
    assert not (tmp_path / "x").exists()
