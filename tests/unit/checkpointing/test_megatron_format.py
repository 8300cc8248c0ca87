"""Megatron-LM checkpoints through tools/checkpoint/convert.py, on real megatron-core 0.16.1
checkpoints (tests/fixtures/megatron, made by its make_fixtures.py): their logits after
conversion equal megatron-core's own forward; ours -> megatron -> ours is exact."""
import argparse
import datetime
import os
import shutil

import pytest
import torch

from megatron_smp.checkpointing.megatron_format import (
    OpaqueMegatronValue,
    find_megatron_checkpoint,
    read_args,
    safe_load,
)
from megatron_smp.config import ConfigError
from megatron_smp.training.checkpointing import check_key_mismatch
from tools.checkpoint.convert import main
from tools.checkpoint.smp_format import read_smp_checkpoint

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
                        "fixtures", "megatron")
MODEL_TYPES = {"gpt_torch_dist": "gpt2", "llama_torch_dist": "llama",
               "llama_legacy_tp2": "llama"}
VOCAB = 100


def _convert(model_type, loader, saver, load_dir, save_dir, *extra):
    argv = ["--model-type", model_type, "--loader", loader, "--saver", saver,
            "--load-dir", str(load_dir), "--save-dir", str(save_dir), *extra]
    assert main(argv) == 0, argv


def _hf_logits(hf_dir, tokens):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(tokens).logits


@pytest.mark.parametrize("fixture", sorted(MODEL_TYPES))
def test_converted_to_hf_logits_equal_megatron_core_forward(fixture, tmp_path):
    _convert(MODEL_TYPES[fixture], "megatron", "hf", os.path.join(FIXTURES, fixture),
             tmp_path / "hf")
    reference = torch.load(os.path.join(FIXTURES, fixture, "reference.pt"))
    logits = _hf_logits(tmp_path / "hf", reference["tokens"])
    # megatron-core's logits cover the padded vocabulary; the tokenizer's 100 ids are first.
    assert (logits - reference["logits"][..., :VOCAB]).abs().max().item() < 1e-5


@pytest.mark.parametrize("fixture,tp,pp", [("gpt_torch_dist", 2, 2),
                                           ("llama_legacy_tp2", 2, 2),
                                           ("llama_torch_dist", 1, 2)])
def test_ours_to_megatron_and_back_is_exact(fixture, tp, pp, tmp_path):
    model_type = MODEL_TYPES[fixture]
    _convert(model_type, "megatron", "megatron_smp", os.path.join(FIXTURES, fixture),
             tmp_path / "ours")
    _convert(model_type, "megatron_smp", "megatron", tmp_path / "ours", tmp_path / "megatron",
             "--target-tensor-parallel-size", str(tp), "--target-pipeline-parallel-size",
             str(pp))
    written = find_megatron_checkpoint(str(tmp_path / "megatron"))
    assert written.ckpt_format == "torch"
    assert sorted(written.rank_dirs) == [(t, p, 0) for t in range(tp) for p in range(pp)]
    assert read_args(written)["tensor_model_parallel_size"] == tp
    _convert(model_type, "megatron", "megatron_smp", tmp_path / "megatron", tmp_path / "back")
    family = "gpt2" if model_type == "gpt2" else "llama"
    config, first, _ = read_smp_checkpoint(str(tmp_path / "ours"), family, model_type)
    config_back, back, _ = read_smp_checkpoint(str(tmp_path / "back"), family, model_type)
    assert config_back == config
    assert sorted(back) == sorted(first)
    for name in first:
        assert torch.equal(back[name], first[name]), name


def _without_args(tmp_path):
    """The Llama torch_dist fixture as a checkpoint saved without args."""
    target = tmp_path / "no_args"
    shutil.copytree(os.path.join(FIXTURES, "llama_torch_dist"), target)
    common_path = target / "iter_0000010" / "common.pt"
    common = safe_load(str(common_path))
    del common["args"]
    torch.save(common, common_path)
    return target


def test_checkpoint_without_args_takes_the_shape_from_flags(tmp_path, capsys):
    load_dir = _without_args(tmp_path)
    argv = ["--model-type", "llama", "--loader", "megatron", "--saver", "hf", "--load-dir",
            str(load_dir), "--save-dir", str(tmp_path / "hf")]
    assert main(argv) == 1
    assert "saved without args: pass the model's --num-attention-heads" in capsys.readouterr().err
    _convert("llama", "megatron", "hf", load_dir, tmp_path / "hf2", "--num-attention-heads",
             "4", "--group-query-attention", "--num-query-groups", "2", "--swiglu",
             "--vocab-size", str(VOCAB), "--max-position-embeddings", "32")
    reference = torch.load(os.path.join(FIXTURES, "llama_torch_dist", "reference.pt"))
    logits = _hf_logits(tmp_path / "hf2", reference["tokens"])
    assert (logits - reference["logits"][..., :VOCAB]).abs().max().item() < 1e-5


def test_flags_contradicting_the_saved_args_are_an_error(tmp_path, capsys):
    argv = ["--model-type", "llama", "--loader", "megatron", "--saver", "megatron_smp",
            "--load-dir", os.path.join(FIXTURES, "llama_torch_dist"), "--save-dir",
            str(tmp_path / "out"), "--num-attention-heads", "8"]
    assert main(argv) == 1
    assert "--num-attention-heads 8 (checkpoint: 4)" in capsys.readouterr().err


def test_restricted_unpickling(tmp_path):
    # Real args carry megatron's enums: read as inert values.
    args = read_args(find_megatron_checkpoint(os.path.join(FIXTURES, "gpt_torch_dist")))
    assert isinstance(args["attention_backend"], OpaqueMegatronValue)
    assert args["num_attention_heads"] == 4 and args["padded_vocab_size"] == 128
    # Any other class is refused before unpickling, naming it.
    path = str(tmp_path / "evil.pt")
    torch.save({"args": argparse.Namespace(when=datetime.datetime(2020, 1, 1))}, path)
    with pytest.raises(ConfigError, match=r"datetime\.datetime"):
        safe_load(path)


@pytest.mark.parametrize("strictness,raises,warnings", [
    ("assume_ok_unexpected", "lacks tensors the model has", 0),
    ("raise_unexpected", "lacks tensors the model has", 0),
    ("raise_all", "lacks tensors the model has", 0),
    ("log_unexpected", None, 1),
    ("return_unexpected", None, 1),
    ("log_all", None, 2),
    ("return_all", None, 2),
    ("ignore_all", None, 0),
])
def test_dist_ckpt_strictness(strictness, raises, warnings):
    """Megatron's meaning: "unexpected" = in the model, not in the checkpoint (keeps its
    initial value unless that raises); "missing" = in the checkpoint, not in the model."""
    unexpected, missing = ["a.weight"], ["b.weight"]
    if raises:
        with pytest.raises(ConfigError, match=raises):
            check_key_mismatch(strictness, unexpected, missing, "ckpt")
    else:
        assert len(check_key_mismatch(strictness, unexpected, missing, "ckpt")) == warnings
    # Only checkpoint-side extras: raise_all alone refuses them.
    if strictness == "raise_all":
        with pytest.raises(ConfigError, match="holds tensors the model lacks"):
            check_key_mismatch(strictness, [], missing, "ckpt")
    else:
        assert len(check_key_mismatch(strictness, [], missing, "ckpt")) == (
            1 if strictness in ("log_all", "return_all") else 0)


def test_fully_reshardable_optimizer_needs_torch_dist():
    from megatron_smp.training.arguments import parse_args, validate_configs

    base = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 16 "
            "--micro-batch-size 1 --global-batch-size 1 --train-iters 1 --mock-data "
            "--tokenizer-type NullTokenizer --vocab-size 99 --lr 1e-3 "
            "--dist-ckpt-optim-fully-reshardable").split()
    validate_configs(parse_args(base))
    with pytest.raises(ConfigError, match="--dist-ckpt-optim-fully-reshardable.*torch_dist"):
        validate_configs(parse_args(base + ["--ckpt-format", "torch"]))


def test_moe_checkpoint_reads_megatron_core_tensors_exactly(tmp_path):
    """Mixtral-style torch_dist (experts stacked [layers, experts, ...] in DCP) -> ours: every
    tensor equals megatron-core's own state dict under the same name (vocab rows trimmed)."""
    fixture = os.path.join(FIXTURES, "mixtral_torch_dist")
    _convert("mixtral", "megatron", "megatron_smp", fixture, tmp_path / "ours")
    _, model, _ = read_smp_checkpoint(str(tmp_path / "ours"), "mixtral", "mixtral")
    reference = torch.load(os.path.join(fixture, "reference.pt"))["state_dict"]
    renamed = {name.replace("self_attention.linear_qkv.layer_norm_weight",
                            "input_layernorm.weight"): t for name, t in reference.items()}
    assert sorted(model) == sorted(renamed)
    for name, tensor in model.items():
        assert torch.equal(tensor, renamed[name][: tensor.shape[0]]), name
    _convert("mixtral", "megatron_smp", "megatron", tmp_path / "ours", tmp_path / "back",
             "--target-tensor-parallel-size", "2")
    _convert("mixtral", "megatron", "megatron_smp", tmp_path / "back", tmp_path / "again")
    _, again, _ = read_smp_checkpoint(str(tmp_path / "again"), "mixtral", "mixtral")
    assert all(torch.equal(again[name], model[name]) for name in model)


@pytest.mark.parametrize("ours", [False, True])
def test_use_checkpoint_args_takes_the_model_shape(ours, tmp_path):
    """--use-checkpoint-args: the model flags give way to the checkpoint's (Megatron's pickled
    args, or our common.json), for every shape and function field."""
    from megatron_smp.training.arguments import parse_args

    load = os.path.join(FIXTURES, "llama_torch_dist")
    if ours:
        _convert("llama", "megatron", "megatron_smp", load, tmp_path / "ours")
        load = str(tmp_path / "ours")
    wrong = ("--num-layers 3 --hidden-size 32 --num-attention-heads 2 --seq-length 16 "
             "--micro-batch-size 1 --global-batch-size 1 --train-iters 1 --mock-data "
             "--tokenizer-type NullTokenizer --vocab-size 99 --lr 1e-3 --load").split() + [load]
    model = parse_args(wrong + ["--use-checkpoint-args"]).model
    expected = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                "num_query_groups": 2, "ffn_hidden_size": 128, "normalization": "RMSNorm",
                "gated_linear_unit": True, "activation": "silu", "add_bias_linear": False,
                "position_embedding_type": "rope", "untie_embeddings_and_output_weights": True,
                "max_position_embeddings": 32}
    assert {k: getattr(model, k) for k in expected} == expected
    with pytest.raises(ConfigError, match="--use-checkpoint-args.*add --load"):
        parse_args(wrong[:-2] + ["--use-checkpoint-args"])


def test_deepseek_router_args_round_trip():
    """Megatron args carry the DeepSeek-V3 router settings both ways (a sigmoid, biased,
    group-limited checkpoint never loads as a softmax router)."""
    from megatron_smp.checkpointing.megatron_format import (
        args_from_config, config_fields_from_args)
    from megatron_smp.models.llama import llama_config

    config = llama_config(num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=10,
                          num_moe_experts=8, moe_router_topk=4,
                          moe_router_score_function="sigmoid",
                          moe_router_enable_expert_bias=True, moe_router_num_groups=4,
                          moe_router_group_topk=2, moe_router_topk_scaling_factor=2.5)
    fields = config_fields_from_args(vars(args_from_config(config, 1, 1, 0)))
    for name in ("moe_router_score_function", "moe_router_enable_expert_bias",
                 "moe_router_num_groups", "moe_router_group_topk",
                 "moe_router_topk_scaling_factor"):
        assert fields[name] == getattr(config, name), name
