"""Read Megatron-LM checkpoints (torch_dist or legacy torch) and write the legacy format.

The model shape comes from the checkpoint's pickled `args` when it has them. A checkpoint
saved without them gets what the tensors show (layers, hidden size, FFN size, learned
positions, biases, LayerNorm vs RMSNorm, tied output) and the rest from Megatron's flags given
to convert.py (`--num-attention-heads`, `--num-query-groups`, `--swiglu`, `--vocab-size`,
...); a flag that contradicts the checkpoint's args is an error.
"""
from __future__ import annotations

import argparse
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import torch

from megatron_smp.checkpointing.megatron_lm import (
    config_fields_from_args,
    describe,
    find_megatron_checkpoint,
    read_args,
    open_model,
    save_legacy_checkpoint_streaming,
    trim_vocab_rows,
)
from megatron_smp.config import ConfigError, TransformerConfig
from tools.checkpoint.common import (
    check_family,
    framework_shapes,
    listing,
)
from tools.checkpoint.streaming import check_digests, digest, groups, meta_like

# Megatron shape flags convert.py accepts for checkpoints saved without args: flag -> type.
SHAPE_FLAGS = {
    "num_layers": int, "hidden_size": int, "ffn_hidden_size": int, "num_attention_heads": int,
    "num_query_groups": int, "kv_channels": int, "max_position_embeddings": int,
    "vocab_size": int, "normalization": str, "norm_epsilon": float,
    "position_embedding_type": str, "rotary_base": float, "make_vocab_size_divisible_by": int,
    "num_experts": int, "moe_router_topk": int, "moe_ffn_hidden_size": int,
}
SWITCHES = ("swiglu", "group_query_attention", "untie_embeddings_and_output_weights",
            "disable_bias_linear", "add_qkv_bias", "squared_relu")


def add_shape_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "model shape (Megatron flags) for a --loader megatron checkpoint saved without args")
    for name, kind in SHAPE_FLAGS.items():
        group.add_argument("--" + name.replace("_", "-"), type=kind, default=None)
    for name in SWITCHES:
        group.add_argument("--" + name.replace("_", "-"), action="store_true", default=None)


def _given_args(cli: argparse.Namespace) -> Dict[str, Any]:
    """The shape flags the user gave, as Megatron args."""
    given = {name: getattr(cli, name, None) for name in (*SHAPE_FLAGS, *SWITCHES)}
    given = {k: v for k, v in given.items() if v is not None}
    if given.pop("disable_bias_linear", False):
        given["add_bias_linear"] = False
    return given


def _inferred_args(model: Mapping[str, torch.Tensor]) -> Dict[str, Any]:
    """Megatron args that the tensors themselves show."""
    layers = {int(k.split(".")[2]) for k in model if k.startswith("decoder.layers.")}
    word = model["embedding.word_embeddings.weight"]
    inferred: Dict[str, Any] = {
        "num_layers": len(layers), "hidden_size": word.shape[1],
        "add_bias_linear": "decoder.layers.0.self_attention.linear_proj.bias" in model,
        "normalization": ("LayerNorm" if "decoder.final_layernorm.bias" in model
                          else "RMSNorm"),
        "untie_embeddings_and_output_weights": "output_layer.weight" in model,
    }
    fc2 = model.get("decoder.layers.0.mlp.linear_fc2.weight")
    if fc2 is not None:
        inferred["ffn_hidden_size"] = fc2.shape[1]
    if "embedding.position_embeddings.weight" in model:
        inferred["position_embedding_type"] = "learned_absolute"
        inferred["max_position_embeddings"] = model["embedding.position_embeddings.weight"].shape[0]
    else:
        inferred["position_embedding_type"] = "rope"
    return inferred


def _resolve_args(saved: Optional[Dict[str, Any]], given: Dict[str, Any],
                  model: Mapping[str, torch.Tensor], where: str) -> Dict[str, Any]:
    if saved is not None:
        conflicts = [f"--{k.replace('_', '-')} {v!r} (checkpoint: {saved[k]!r})"
                     for k, v in given.items() if saved.get(k) is not None and saved[k] != v]
        if conflicts:
            raise ConfigError(f"{where} was saved with args that differ from the flags: "
                              f"{listing(conflicts)}; drop those flags")
        return {**given, **{k: v for k, v in saved.items() if v is not None}}
    args = {**_inferred_args(model), **given}
    if "num_attention_heads" not in args:
        raise ConfigError(
            f"{where} was saved without args: pass the model's --num-attention-heads (and "
            "--group-query-attention --num-query-groups, --swiglu, --vocab-size, "
            "--max-position-embeddings as it was trained)")
    if args.get("num_query_groups") and args["num_query_groups"] != args["num_attention_heads"]:
        args["group_query_attention"] = True
    args.setdefault("max_position_embeddings", args.get("seq_length") or 4096)
    args.setdefault("swiglu", False)
    return args


def read_megatron_checkpoint(load_dir: str, family: str, model_type: str,
                             cli: argparse.Namespace) -> Tuple[TransformerConfig,
                                                               Dict[str, torch.Tensor], int]:
    """-> (TransformerConfig, {name: global tensor} in checkpoint form, iteration)."""
    config, meta, read, iteration = open_megatron_checkpoint(load_dir, family, model_type, cli)
    return config, read(list(meta)), iteration


def open_megatron_checkpoint(load_dir: str, family: str, model_type: str,
                             cli: argparse.Namespace
                             ) -> Tuple[TransformerConfig, Dict[str, torch.Tensor],
                                        Callable[[List[str]], Dict[str, torch.Tensor]], int]:
    """-> (TransformerConfig, {name: meta tensor} in checkpoint form, read(names) -> those
    tensors, iteration): the shape from the checkpoint's metadata and args alone, the tensors
    read when asked for (`open_model`: a torch_dist checkpoint one layer's region at a time,
    a legacy one's memory-mapped rank files)."""
    checkpoint = find_megatron_checkpoint(load_dir, prefer_ours=False)
    if checkpoint is None:
        raise ConfigError(
            f"--load-dir {load_dir} holds no Megatron-LM checkpoint (latest_checkpointed_"
            "iteration.txt naming an iter_* directory with metadata.json or mp_rank_*/"
            f"{'model_optim_rng.pt'})")
    where = describe(checkpoint)
    saved = read_args(checkpoint)
    given = _given_args(cli)
    # Tying and a gated MLP decide how the tensors are read: settle them first.
    # Without args, an output layer stored apart from the embedding means untied.
    untie = saved.get("untie_embeddings_and_output_weights") if saved else True
    swiglu = (saved or given).get("swiglu", False)
    gated = swiglu or (saved or given).get("quick_geglu", False)  # gpt-oss's gated MLP
    probe = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, vocab_size=8,
                              max_position_embeddings=8, gated_linear_unit=bool(gated),
                              activation="silu" if swiglu else "gelu",
                              untie_embeddings_and_output_weights=bool(untie),
                              num_moe_experts=(saved or given).get("num_experts"),
                              # which tensors are split over TP (MLA's heads, MTP's eh_proj)
                              multi_latent_attention=bool(
                                  (saved or given).get("multi_latent_attention")),
                              mtp_num_layers=(saved or given).get("mtp_num_layers"))
    source = open_model(checkpoint, probe)
    stored = source.meta
    args = _resolve_args(saved, given, stored, where)
    fields = config_fields_from_args(args)
    fields.setdefault("vocab_size", stored["embedding.word_embeddings.weight"].shape[0])
    fields["params_dtype"] = stored["embedding.word_embeddings.weight"].dtype
    try:
        config = TransformerConfig(**fields)
    except (TypeError, ValueError) as error:
        raise ConfigError(f"{where}: its model shape is incomplete or invalid ({error}); give "
                          "the missing Megatron flags") from error
    check_family(config, family, model_type)
    model = trim_vocab_rows(stored, config.vocab_size, where)
    expected = framework_shapes(family, config)
    problems = [f"{k}: missing" for k in sorted(set(expected) - set(model))]
    problems += [f"{k}: unexpected" for k in sorted(set(model) - set(expected))]
    problems += [f"{k}: shape {list(model[k].shape)}, the model config says {list(v)}"
                 for k, v in expected.items() if k in model and model[k].shape != v]
    if problems:
        raise ConfigError(f"{where} does not hold the {model_type} its args / flags describe: "
                          f"{listing(problems)}")

    def read(names: List[str]) -> Dict[str, torch.Tensor]:
        return source.read(names, rows=config.vocab_size)  # Megatron's padding rows dropped

    return config, model, read, checkpoint.iteration


# TransformerConfig fields Megatron-LM has no flag for (GPT-J's), with the value Megatron's
# model always has: a model that differs could not be rebuilt from the written args.
_NO_MEGATRON_FLAG = {"parallel_residual_shared_norm": False, "add_attention_bias": True,
                     "add_output_layer_bias": False}


def write_megatron_checkpoint(save_dir: str, config: TransformerConfig,
                              model: Mapping[str, torch.Tensor], tp: int, pp: int,
                              iteration: Optional[int]) -> None:
    """`write_megatron_checkpoint_streaming` of tensors held in memory."""
    write_megatron_checkpoint_streaming(save_dir, config, meta_like(model),
                                        lambda names: {k: model[k] for k in names}, tp, pp,
                                        iteration)


def write_megatron_checkpoint_streaming(save_dir: str, config: TransformerConfig,
                                        meta: Mapping[str, torch.Tensor],
                                        read: Callable[[List[str]], Dict[str, torch.Tensor]],
                                        tp: int, pp: int, iteration: Optional[int]) -> None:
    """Write the tensors `read(names)` gives (those of `meta`, checkpoint form) as Megatron-LM's
    legacy format at TP=`tp`, PP=`pp`, one group (a layer, or a tensor outside the layers) at
    a time (`save_legacy_checkpoint_streaming`); then read it back through the Megatron-LM
    loader a group at a time and compare each tensor with the digest of what was written."""
    unexpressible = [f"{name}={getattr(config, name)!r}" for name, megatron in
                     _NO_MEGATRON_FLAG.items() if getattr(config, name) != megatron]
    if unexpressible:
        raise ConfigError(
            f"--saver megatron: Megatron-LM's GPT model has no {', '.join(unexpressible)} "
            "(GPT-J's shared norm, unbiased attention and LM-head bias); write --saver hf or "
            "--saver megatron_smp instead"
        )
    # Megatron's tracker reads 0 as no checkpoint; a converted model is "iteration 1".
    iteration = iteration or 1
    name_groups = groups(meta)
    written: Dict[str, str] = {}

    def read_and_digest(names: List[str]) -> Dict[str, torch.Tensor]:
        tensors = read(names)
        written.update({name: digest(tensor) for name, tensor in tensors.items()})
        return tensors

    save_legacy_checkpoint_streaming(save_dir, iteration, config, meta, read_and_digest,
                                     name_groups, tp, pp)
    checkpoint = find_megatron_checkpoint(save_dir)
    where = f"re-reading {describe(checkpoint)}"
    source = open_model(checkpoint, config)
    stored = trim_vocab_rows(source.meta, config.vocab_size, save_dir)
    problems = [f"{k}: missing" for k in sorted(set(meta) - set(stored))]
    problems += [f"{k}: unexpected" for k in sorted(set(stored) - set(meta))]
    if problems:
        raise ConfigError(f"verification failed, {where}: {listing(problems)}")
    for names in name_groups:
        tensors = source.read(names, rows=config.vocab_size)
        check_digests({name: written[name] for name in names}, tensors, where)
        del tensors
    saved = config_fields_from_args(read_args(checkpoint))
    differing = [k for k, v in saved.items() if getattr(config, k) != v]
    if differing:
        raise ConfigError(f"verification failed: the args written to {save_dir} differ in "
                          f"{listing(differing)}")


__all__ = ["add_shape_arguments", "read_megatron_checkpoint", "open_megatron_checkpoint",
           "write_megatron_checkpoint", "write_megatron_checkpoint_streaming", "SHAPE_FLAGS",
           "SWITCHES"]
