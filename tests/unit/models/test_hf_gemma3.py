"""Gemma 3 (Gemma3ForCausalLM): exact state-dict and config round trips, HF's logits through
smp.transform at TP=1 and TP=2 (+SP) with several documents packed in a row, each Gemma
feature visible in the logits, clear errors for the HF settings we do not support, and
convert.py HF -> framework (TP=2) -> HF tensor-exact."""
import warnings

import pytest
import torch

import megatron_smp as smp
from megatron_smp.config import ConfigError
from megatron_smp.models.hf import config_to_hf, get_adapter
from megatron_smp.models.sharding import merge_state_dicts, shard_state_dict
from megatron_smp.testing import run_distributed

warnings.filterwarnings("ignore", message=".*")
BATCH, SEQ = 2, 16
# Three documents in each row: position ids restart at each one.
DOCUMENTS = (5, 4, 7)
# Gemma 3's per-layer-type RoPE as the 4B-27B models have it (linear x8 on the full layers),
# with thetas small enough that SEQ positions turn every frequency.
ROPE = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e5},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e3}}


def build_gemma3(seed=0, **overrides):
    """A small random Gemma3ForCausalLM: 7 layers in Gemma's 5:1 sliding/full pattern
    (sliding window 5 < SEQ), GQA 4/2 heads of dim 20 (hidden 48), odd vocabulary,
    query_pre_attn_scalar 24 (not the head dim), final logit soft-capping, tied embeddings,
    and every (1 + w) norm weight moved off HF's zero init."""
    import transformers as tf

    fields = dict(vocab_size=1003, hidden_size=48, intermediate_size=40, head_dim=20,
                  num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=7,
                  sliding_window=5, max_position_embeddings=64, query_pre_attn_scalar=24,
                  final_logit_softcapping=6.0, initializer_range=0.1,
                  rope_parameters={k: dict(v) for k, v in ROPE.items()})
    fields.update(overrides)
    torch.manual_seed(seed)
    model = tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**fields)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.5 * torch.randn_like(param))
    return model


def _ids(vocab_size):
    return torch.randint(0, vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))


def _packed():
    """position_ids [b, s] restarting per document, and the document ids [b, s]."""
    positions = torch.cat([torch.arange(n) for n in DOCUMENTS]).expand(BATCH, SEQ)
    documents = torch.cat([torch.full((n,), i) for i, n in enumerate(DOCUMENTS)])
    return positions.contiguous(), documents.expand(BATCH, SEQ).contiguous()


def _config_diff(config):
    return {k: v for k, v in config.to_diff_dict().items() if k != "transformers_version"}


def test_round_trips_are_exact():
    hf = build_gemma3()
    adapter = get_adapter(hf)
    config = adapter.config_from_hf(hf.config)
    assert config.window_layer_pattern() == [1, 1, 1, 1, 1, 0, 1]
    assert (config.window_size, config.window_attn_skip_freq) == ((4, 0), 6)
    assert (config.rotary_base, config.rotary_seq_len_interpolation_factor,
            config.local_rotary_base) == (1e5, 8.0, 1e3)
    assert (config.sandwich_norm, config.apply_embedding_scaling, config.qk_layernorm,
            config.layernorm_zero_centered_gamma, config.activation) == (
        True, True, True, True, "gelu_tanh")
    assert config.softmax_scale == 24 ** -0.5 and config.final_logit_softcapping == 6.0
    hf_sd = hf.state_dict()
    full = adapter.from_hf(hf_sd, config)
    back = adapter.to_hf(full, config)
    assert back.keys() == hf_sd.keys()
    assert all(torch.equal(back[k], hf_sd[k]) for k in hf_sd)
    assert adapter.config_from_hf(config_to_hf(config, "gemma3_text")) == config
    assert _config_diff(config_to_hf(config, "gemma3_text")) == _config_diff(hf.config)
    shards = [shard_state_dict(full, config, 2, r) for r in range(2)]
    merged = merge_state_dicts(shards, config)
    assert merged.keys() == full.keys() and all(torch.equal(merged[k], full[k]) for k in full)
    # Trained without --apply-layernorm-1p (norm weights w, not 1 + w): HF gets w - 1.
    plain = config.replace(layernorm_zero_centered_gamma=False)
    plain_sd = adapter.from_hf(hf_sd, plain)
    name = "decoder.layers.0.post_mlp_layernorm.weight"
    assert torch.equal(plain_sd[name], full[name] + 1)
    assert all(torch.allclose(v, hf_sd[k], rtol=0, atol=1e-6)  # (w + 1) - 1 rounds
               for k, v in adapter.to_hf(plain_sd, plain).items())


def test_transform_tp1_matches_hf_logits_and_each_feature_counts():
    smp.init({"random_seed": 3})
    hf = build_gemma3()
    ids = _ids(hf.config.vocab_size)
    positions, documents = _packed()
    model = smp.transform(hf)
    with torch.no_grad():
        expected = hf(ids).logits
        assert (model(ids).logits - expected).abs().max() < 2e-4
        # HF's loss (over the soft-capped logits) through the HF contract.
        assert abs(model(ids, labels=ids).loss - hf(ids, labels=ids).loss) < 1e-5
        # Packed rows: HF attends within each document (position ids restart, no mask), and
        # so does the transformed model (padding-free batches read as HF reads them), as our
        # GPTModel does with document ids.
        packed_hf = hf(ids, position_ids=positions, use_cache=False).logits
        packed = model(ids, position_ids=positions, use_cache=False).logits
        assert (packed - packed_hf).abs().max() < 2e-4
        by_documents = model.module(ids, position_ids=positions, document_ids=documents)
        assert (by_documents[..., :hf.config.vocab_size] - packed_hf).abs().max() < 2e-4
        assert (packed_hf - expected).abs().max() > 1e-2  # the documents are separate
    # Each Gemma feature is in the logits.
    for override in ({"local_rotary_base": None}, {"rotary_seq_len_interpolation_factor": None},
                     {"apply_embedding_scaling": False}, {"softmax_scale": None},
                     {"window_attn_skip_freq": None}, {"final_logit_softcapping": None}):
        changed = smp.transform(hf, config=override)
        with torch.no_grad():
            assert (changed(ids).logits - expected).abs().max() > 1e-3, override
    with torch.no_grad():
        norm = model.module.decoder.layers[5].post_mlp_layernorm.weight
        norm.add_(1.0)
        assert (model(ids).logits - expected).abs().max() > 1e-3


def test_gemma3_1b_shape_without_softcapping_matches_hf():
    """The published 1B's settings: window pattern 6, global theta 1e6 without scaling, no
    soft-capping, query_pre_attn_scalar = head_dim; and an untied head."""
    smp.init({"random_seed": 3})
    rope = {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    hf = build_gemma3(final_logit_softcapping=None, query_pre_attn_scalar=20,
                      rope_parameters=rope, tie_word_embeddings=False, num_hidden_layers=6)
    config = get_adapter(hf).config_from_hf(hf.config)
    assert config.final_logit_softcapping is None and config.untie_embeddings_and_output_weights
    ids = _ids(hf.config.vocab_size)
    with torch.no_grad():
        assert (smp.transform(hf)(ids).logits - hf(ids).logits).abs().max() < 2e-4


@pytest.mark.parametrize("full", [
    {"rope_type": "yarn", "factor": 8.0, "rope_theta": 1e5, "beta_fast": 32.0, "beta_slow": 1.0,
     "original_max_position_embeddings": 8},
    {"rope_type": "llama3", "factor": 4.0, "rope_theta": 1e5, "low_freq_factor": 1.0,
     "high_freq_factor": 4.0, "original_max_position_embeddings": 8},
], ids=["yarn", "llama3"])
def test_full_layers_take_other_scaled_ropes(full):
    smp.init({"random_seed": 3})
    hf = build_gemma3(rope_parameters={"full_attention": dict(full),
                                       "sliding_attention": dict(ROPE["sliding_attention"])})
    config = get_adapter(hf).config_from_hf(hf.config)
    assert config.local_rotary_base == 1e3
    assert get_adapter(hf).config_from_hf(config_to_hf(config, "gemma3_text")) == config
    ids = _ids(hf.config.vocab_size)
    with torch.no_grad():
        assert (smp.transform(hf)(ids).logits - hf(ids).logits).abs().max() < 2e-4


@pytest.mark.parametrize("field,value,message", [
    ("attn_logit_softcapping", 50.0, "attn_logit_softcapping=50.0"),
    ("use_bidirectional_attention", True, "use_bidirectional_attention=True"),
    ("hidden_activation", "gelu", "hidden_activation='gelu'"),
    ("attention_bias", True, "attention_bias=True"),
    ("sliding_window", None, "sliding_window=None with sliding_attention layers"),
    ("rope_parameters", {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "linear", "factor": 2.0,
                                               "rope_theta": 1e4}},
     "sliding_attention"),
])
def test_unsupported_hf_settings_are_named(field, value, message):
    import transformers as tf

    hf_config = tf.Gemma3TextConfig(num_hidden_layers=2, hidden_size=48, head_dim=20,
                                    num_attention_heads=4, num_key_value_heads=2,
                                    layer_types=["sliding_attention", "full_attention"],
                                    **{field: value})
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        get_adapter("gemma3_text").config_from_hf(hf_config)


def test_export_needs_the_gemma_numerics():
    config = get_adapter("gemma3_text").config_from_hf(build_gemma3().config)
    with pytest.raises(ConfigError, match="not a Gemma 3 model.*--sandwich-norm"):
        config_to_hf(config.replace(sandwich_norm=False), "gemma3_text")
    with pytest.raises(ConfigError, match="--softmax-scale 0.3: .*integer query_pre_attn_scalar"):
        config_to_hf(config.replace(softmax_scale=0.3), "gemma3_text")


def _parallel_worker(rank, world_size):
    import numpy as np

    smp.init({"tensor_parallel_degree": 2})
    hf = build_gemma3()
    ids = _ids(hf.config.vocab_size)
    positions, _ = _packed()
    model = smp.transform(hf, config={"sequence_parallel": True})
    with torch.no_grad():
        error = (model(ids).logits - hf(ids).logits).abs().max().item()
        packed = model(ids, position_ids=positions, use_cache=False).logits
        packed_error = (packed - hf(ids, position_ids=positions, use_cache=False).logits
                        ).abs().max().item()
    state = {k: np.asarray(v.detach()) for k, v in model.module.state_dict().items()}
    return error, packed_error, smp.state.tp_rank, state


def test_transform_tp2_sp_matches_hf_logits_and_shards_merge_to_hf():
    results = run_distributed(_parallel_worker, 2, timeout=300)
    for error, packed_error, _, _ in results:
        assert error < 2e-4 and packed_error < 2e-4, (error, packed_error)
    hf = build_gemma3()
    adapter = get_adapter(hf)
    config = adapter.config_from_hf(hf.config)
    shards = [{k: torch.from_numpy(v) for k, v in r[3].items()}
              for r in sorted(results, key=lambda r: r[2])]
    back = adapter.to_hf(merge_state_dicts(shards, config), config)
    expected = hf.state_dict()
    assert back.keys() == expected.keys()
    assert all(torch.equal(back[k], expected[k]) for k in expected)


def test_convert_hf_to_tp2_and_back_is_exact(tmp_path):
    import transformers

    from tests.unit.tools.test_convert import _config_json, _convert_ok

    hf = build_gemma3()
    hf.save_pretrained(tmp_path / "hf")
    _convert_ok("gemma3", "hf", "megatron_smp", tmp_path / "hf", tmp_path / "smp",
                "--target-tensor-parallel-size", "2")
    _convert_ok("gemma3", "megatron_smp", "hf", tmp_path / "smp", tmp_path / "hf2")
    assert _config_json(tmp_path / "hf2") == _config_json(tmp_path / "hf")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf2").state_dict()
    expected = hf.state_dict()
    assert back.keys() == expected.keys()
    assert all(torch.equal(back[k], expected[k]) for k in expected)


def test_megatron_args_record_gemma_and_its_export_is_refused(tmp_path):
    """--ckpt-format torch's Megatron-layout copy records the Gemma fields in its args (our
    reader restores them); an export for Megatron-LM, which has no such settings, is an
    error naming them."""
    from megatron_smp.checkpointing.megatron_lm import args_from_config, config_fields_from_args
    from tests.unit.tools.test_convert import _convert, _convert_ok

    hf = build_gemma3()
    config = get_adapter(hf).config_from_hf(hf.config)
    fields = config_fields_from_args(vars(args_from_config(config, 2, 1, 0)))
    for name in ("sandwich_norm", "apply_embedding_scaling", "local_rotary_base",
                 "final_logit_softcapping", "softmax_scale", "activation", "gated_linear_unit",
                 "rotary_seq_len_interpolation_factor", "window_attn_skip_freq"):
        assert fields[name] == getattr(config, name), name
    hf.save_pretrained(tmp_path / "hf")
    _convert_ok("gemma3", "hf", "megatron_smp", tmp_path / "hf", tmp_path / "smp")
    status, stderr = _convert("gemma3", "megatron_smp", "megatron", tmp_path / "smp",
                              tmp_path / "megatron")
    assert status == 2 and "Megatron-LM has no --sandwich-norm, --apply-embedding-scaling, " \
        "--local-rotary-base, --final-logit-softcapping, --geglu" in stderr, stderr


def test_convert_reads_the_language_model_of_the_multimodal_gemma3(tmp_path):
    """Gemma 3 4B-27B are Gemma3ForConditionalGeneration (a vision tower, a projector and the
    language model): convert.py reads the language model (the vision tensors left out, said
    so), and the export is the Gemma3ForCausalLM with its weights and its text logits."""
    import contextlib
    import io

    import transformers as tf

    from tests.unit.tools.test_convert import _convert_ok
    from tools.checkpoint.convert import main as convert_main

    text = dict(vocab_size=1003, hidden_size=48, intermediate_size=40, head_dim=20,
                num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3,
                sliding_window=5, max_position_embeddings=64, query_pre_attn_scalar=24,
                rope_parameters={k: dict(v) for k, v in ROPE.items()})
    vision = dict(hidden_size=32, intermediate_size=37, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14)
    torch.manual_seed(0)
    multimodal = tf.Gemma3ForConditionalGeneration(tf.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4)).eval()
    with torch.no_grad():
        for name, param in multimodal.named_parameters():
            if "norm" in name:
                param.add_(0.5 * torch.randn_like(param))
    multimodal.save_pretrained(tmp_path / "hf")
    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        assert convert_main(["--model-type", "gemma3", "--loader", "hf", "--saver",
                             "megatron_smp", "--load-dir", str(tmp_path / "hf"), "--save-dir",
                             str(tmp_path / "smp"), "--target-tensor-parallel-size", "2"]) == 0
    assert "converting the language model of Gemma3ForConditionalGeneration" in said.getvalue()
    _convert_ok("gemma3", "megatron_smp", "hf", tmp_path / "smp", tmp_path / "text")
    exported = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "text").eval()
    assert type(exported).__name__ == "Gemma3ForCausalLM"
    language = multimodal.model.language_model.state_dict()
    assert all(torch.equal(tensor, language[name[len("model."):]])
               for name, tensor in exported.state_dict().items() if name != "lm_head.weight")
    ids = _ids(1003)
    with torch.no_grad():
        assert torch.equal(exported(ids).logits, multimodal(input_ids=ids).logits)
    # transform takes the causal LM only: the multimodal model's vision inputs have no home.
    smp.init({"random_seed": 3})
    with pytest.raises(ConfigError, match="no Hugging Face adapter for "
                                          "'Gemma3ForConditionalGeneration'"):
        smp.transform(multimodal)
