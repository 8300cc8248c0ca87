"""Megatron-LM checkpoints through tools/checkpoint/convert.py, on real megatron-core 0.16.1
checkpoints (tests/fixtures/megatron, made by its make_fixtures.py): their logits after
conversion equal megatron-core's own forward; ours -> megatron -> ours is exact."""
import argparse
import datetime
import os
import shutil

import pytest
import torch

from megatron_smp.checkpointing.megatron_lm import (
    OpaqueMegatronValue,
    config_fields_from_args,
    find_megatron_checkpoint,
    read_args,
    safe_load,
)
from megatron_smp.checkpointing.engine.storage import CheckpointError
from megatron_smp.config import ConfigError
from megatron_smp.checkpointing.loop import check_key_mismatch
from tools.checkpoint.convert import main
from tools.checkpoint.smp_format import read_smp_checkpoint

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
                        "fixtures", "megatron")
# *_0192: written by megatron-core 0.19.2 (its torch_dist keeps the common state in the DCP
# files: no common.pt).
MODEL_TYPES = {"gpt_torch_dist": "gpt2", "llama_torch_dist": "llama",
               "llama_legacy_tp2": "llama", "llama_torch_dist_0192": "llama",
               "llama_legacy_tp2_0192": "llama"}
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
    assert main(argv) == 2
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
    assert main(argv) == 2
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


@pytest.mark.parametrize("ours,fixture", [(False, "llama_torch_dist"), (True, "llama_torch_dist"),
                                          (False, "llama_torch_dist_0192")])
def test_use_checkpoint_args_takes_the_model_shape(ours, fixture, tmp_path):
    """--use-checkpoint-args: the model comes from the checkpoint (Megatron's pickled args --
    in common.pt, or in megatron-core 0.19's DCP files -- or our common.json), for every
    shape and function field. As in Megatron-LM, a function flag on the command line gives
    way to the checkpoint's value (with a warning); a weight shape that contradicts it is a
    clear error naming both values (Megatron-LM keeps such a flag and fails to load)."""
    from megatron_smp.training.arguments import parse_args

    load = os.path.join(FIXTURES, fixture)
    if ours:
        _convert("llama", "megatron", "megatron_smp", load, tmp_path / "ours")
        load = str(tmp_path / "ours")
    run = ("--seq-length 16 --micro-batch-size 1 --global-batch-size 1 --train-iters 1 "
           "--mock-data --tokenizer-type NullTokenizer --vocab-size 99 --lr 1e-3 "
           "--use-checkpoint-args --load").split() + [load]
    other_function = "--normalization LayerNorm --position-embedding-type learned_absolute"
    with pytest.warns(UserWarning, match=r"--normalization \(normalization='LayerNorm'\) "
                      r"gives way to the checkpoint's 'RMSNorm'"):
        model = parse_args(other_function.split() + ["--num-layers", "2"] + run).model
    expected = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                "num_query_groups": 2, "ffn_hidden_size": 128, "normalization": "RMSNorm",
                "gated_linear_unit": True, "activation": "silu", "add_bias_linear": False,
                "position_embedding_type": "rope", "untie_embeddings_and_output_weights": True,
                "max_position_embeddings": 32}
    assert {k: getattr(model, k) for k in expected} == expected
    wrong_shape = "--num-layers 3 --hidden-size 64 --num-attention-heads 2".split()
    with pytest.raises(ConfigError, match=r"--num-layers gives num_layers=3, the checkpoint 2; "
                       r"--num-attention-heads gives num_attention_heads=2, the checkpoint 4"):
        parse_args(wrong_shape + run)
    with pytest.raises(ConfigError, match="--use-checkpoint-args.*add --load"):
        parse_args(run[:-2] + ["--use-checkpoint-args"])


def test_deepseek_router_args_round_trip():
    """Megatron args carry the DeepSeek-V3 router settings both ways (a sigmoid, biased,
    group-limited checkpoint never loads as a softmax router)."""
    from megatron_smp.checkpointing.megatron_lm import (
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


def test_deepseek_checkpoint_reads_megatron_core_tensors_exactly(tmp_path):
    """DeepSeek-V3-style torch_dist made by megatron-core 0.16.1 (MLA with latent norms and
    YaRN, a dense first layer, sigmoid experts with expert bias, a shared expert, one MTP
    layer) -> ours: the config its args give, and every tensor (the expert biases included)
    equal to megatron-core's under megatron-core's names (0.16.1's
    mtp.layers.0.transformer_layer is our mtp_model_layer); ours -> Megatron legacy at TP=2
    -> ours is exact, and names the MTP layer as 0.16.1 does."""
    fixture = os.path.join(FIXTURES, "deepseek_torch_dist")
    checkpoint = find_megatron_checkpoint(fixture)
    fields = config_fields_from_args(read_args(checkpoint))
    assert {k: fields[k] for k in ("multi_latent_attention", "q_lora_rank", "kv_lora_rank",
                                   "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
                                   "qk_layernorm", "position_embedding_type",
                                   "yarn_rotary_scaling_factor", "yarn_mscale_all_dim",
                                   "moe_layer_freq", "moe_shared_expert_intermediate_size",
                                   "moe_router_enable_expert_bias", "mtp_num_layers")} == dict(
        multi_latent_attention=True, q_lora_rank=24, kv_lora_rank=20, qk_head_dim=12,
        qk_pos_emb_head_dim=8, v_head_dim=10, qk_layernorm=True,
        position_embedding_type="yarn", yarn_rotary_scaling_factor=4.0, yarn_mscale_all_dim=0.7,
        moe_layer_freq=[0, 1], moe_shared_expert_intermediate_size=32,
        moe_router_enable_expert_bias=True, mtp_num_layers=1)
    _convert("deepseek_v3", "megatron", "megatron_smp", fixture, tmp_path / "ours")
    _, model, _ = read_smp_checkpoint(str(tmp_path / "ours"), "deepseek_v3", "deepseek_v3")
    reference = torch.load(os.path.join(fixture, "reference.pt"))["state_dict"]
    renamed = {name.replace(".transformer_layer.", ".mtp_model_layer."): t
               for name, t in reference.items()}
    assert sorted(model) == sorted(renamed)
    for name, tensor in model.items():
        assert torch.equal(tensor, renamed[name][: tensor.shape[0]]), name
    assert model["decoder.layers.1.mlp.router.expert_bias"].abs().max() > 0
    _convert("deepseek_v3", "megatron_smp", "megatron", tmp_path / "ours", tmp_path / "back",
             "--target-tensor-parallel-size", "2")
    rank0 = torch.load(tmp_path / "back" / "iter_0000010" / "mp_rank_00" / "model_optim_rng.pt",
                       weights_only=False)["model"]
    assert "mtp.layers.0.transformer_layer.mlp.router.expert_bias" in rank0
    _convert("deepseek_v3", "megatron", "megatron_smp", tmp_path / "back", tmp_path / "again")
    _, again, _ = read_smp_checkpoint(str(tmp_path / "again"), "deepseek_v3", "deepseek_v3")
    assert sorted(again) == sorted(model)
    assert all(torch.equal(again[name], model[name]) for name in model)


def test_transformer_engine_mla_and_mtp_names_map_to_ours():
    """megatron-core's Transformer-Engine spec fuses MLA's latent norms into the
    up-projections; the MTP inner layer is 0.16's transformer_layer or main's mtp_model_layer."""
    from megatron_smp.checkpointing.megatron_lm import _megatron_name, _our_name

    assert _our_name("decoder.layers.3.self_attention.linear_q_up_proj.layer_norm_weight") == \
        "decoder.layers.3.self_attention.q_layernorm.weight"
    assert _our_name("mtp.layers.0.transformer_layer.self_attention.linear_kv_up_proj."
                     "layer_norm_weight") == \
        "mtp.layers.0.mtp_model_layer.self_attention.kv_layernorm.weight"
    assert _our_name("mtp.layers.1.mtp_model_layer.self_attention.linear_qkv."
                     "layer_norm_weight") == "mtp.layers.1.mtp_model_layer.input_layernorm.weight"
    assert _our_name("mtp.layers.0.eh_proj._extra_state") is None
    assert _megatron_name("mtp.layers.0.mtp_model_layer.mlp.router.expert_bias") == \
        "mtp.layers.0.transformer_layer.mlp.router.expert_bias"


def test_megatron_core_019_common_state_is_read_safely_and_tensor_exact(tmp_path):
    """megatron-core 0.19.2's torch_dist: args, iteration and version come from the DCP item
    common_state (raw bytes, restricted unpickling); every tensor equals its state dict."""
    from megatron_smp.checkpointing.megatron_lm import _common_state, _read_dcp_bytes

    fixture = os.path.join(FIXTURES, "llama_torch_dist_0192")
    checkpoint = find_megatron_checkpoint(fixture)
    assert not os.path.exists(os.path.join(checkpoint.path, "common.pt"))
    common = _common_state(checkpoint)
    assert (common["iteration"], common["checkpoint_version"]) == (10, 3.0)
    assert read_args(checkpoint)["num_query_groups"] == 2
    # Bytes holding a global outside the allowed plain data are refused, never executed.
    import io
    import pickle

    evil = io.BytesIO()
    torch.save([{"args": pickle.loads(pickle.dumps(os.getcwd))}], evil)
    with pytest.raises(CheckpointError, match="not plain data"):
        safe_load("common_state", evil.getvalue())
    assert _read_dcp_bytes(checkpoint.path, "no/such_item") is None

    _convert("llama", "megatron", "megatron_smp", fixture, tmp_path / "ours")
    _, model, _ = read_smp_checkpoint(str(tmp_path / "ours"), "llama", "llama")
    reference = torch.load(os.path.join(fixture, "reference.pt"))["state_dict"]
    renamed = {name.replace("self_attention.linear_qkv.layer_norm_weight",
                            "input_layernorm.weight")
               .replace("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"): t
               for name, t in reference.items() if "_extra_state" not in name}
    assert sorted(model) == sorted(renamed)
    for name, tensor in model.items():
        assert torch.equal(tensor, renamed[name][: tensor.shape[0]]), name
