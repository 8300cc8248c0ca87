"""Megatron-LM checkpoints (megatron-core 0.16 - 0.19 `GPTModel`): read either format, write
legacy.

    {dir}/latest_checkpointed_iteration.txt      "10" (or "release": {dir}/release/)
    {dir}/iter_0000010/                          "torch_dist" (megatron-core dist_checkpointing)
        metadata.json, common.pt                 backends; args, iteration, ... (pickled; from
                                                 megatron-core 0.17 on, the DCP bytes item
                                                 common_state instead of common.pt)
        .metadata, __0_0.distcp ...              DCP; layers stacked: decoder.layers.<name>
                                                 [num_layers, ...], TE norm names
    {dir}/iter_0000010/mp_rank_00[_000]/model_optim_rng.pt    legacy "torch": one file per
                                                 TP[, PP] rank, {args, iteration, model, ...}
                                                 with stage-local layer numbers and TP shards

megatron-core's parameter names are ours, except the Transformer-Engine spec's fused norms
(`linear_qkv.layer_norm_weight` is our `input_layernorm.weight`, `linear_fc1.layer_norm_weight`
our `pre_mlp_layernorm.weight`) and the `_extra_state` entries (FP8 metadata, skipped). The
layouts are ours too: QKV rows per query group [q heads of the group; k; v], SwiGLU fc1 as
[gate; up] globally and [gate_r; up_r] per TP shard (partition stride 2). The vocabulary
tables keep Megatron's padding: `read_model` returns them with their stored rows.

`args` (an argparse.Namespace) is unpickled with `torch.load(weights_only=True)`: Namespace,
plain types, torch's own safe globals and numpy's RNG state arrays are allowed; megatron's own
enums (e.g. `AttnBackend`) become inert `OpaqueMegatronValue`s; anything else is an error.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
import warnings
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner

from megatron_smp.checkpointing.iterations import TRACKER_FILENAME
from megatron_smp.config import TransformerConfig
from megatron_smp.checkpointing.engine.storage import CheckpointError, SafeFileSystemReader
from megatron_smp.models.sharding import (
    VOCAB_PARALLEL_SUFFIXES,
    default_layout,
    merge_state_dicts,
    partition_of,
    shard_state_dict,
)

METADATA_FILENAME = "metadata.json"
COMMON_PT_FILENAME = "common.pt"
LEGACY_FILENAME = "model_optim_rng.pt"
CHECKPOINT_VERSION = 3.0
_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_MTP_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.mtp_model_layer\.(.*)$")
_MTP_INNER = re.compile(r"^(mtp\.layers\.\d+\.)transformer_layer\.")
_MTP_OURS = re.compile(r"^(mtp\.layers\.\d+\.)mtp_model_layer\.")
_PER_LAYER = re.compile(r"^(decoder\.layers\.\d+\.|mtp\.layers\.\d+\.(?:transformer_layer|"
                        r"mtp_model_layer)\.)(.*)$")
# Transformer Engine's fused-norm names -> ours (the local spec's names).
_TE_NAMES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    # Multi-latent attention with --qk-layernorm: the latent norms fused into the up-projections.
    "self_attention.linear_q_up_proj.layer_norm_weight": "self_attention.q_layernorm.weight",
    "self_attention.linear_q_up_proj.layer_norm_bias": "self_attention.q_layernorm.bias",
    "self_attention.linear_kv_up_proj.layer_norm_weight": "self_attention.kv_layernorm.weight",
    "self_attention.linear_kv_up_proj.layer_norm_bias": "self_attention.kv_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
}
# DCP names of the (non-grouped-GEMM) experts' weights, stacked [layers, experts, ...].
_STACKED_EXPERTS = ("mlp.experts.experts.", "mlp.experts.local_experts.")
_NUMPY_GLOBALS = (
    "numpy.core.multiarray._reconstruct", "numpy._core.multiarray._reconstruct",
    "numpy.ndarray", "numpy.dtype", "numpy.dtypes.UInt32DType", "numpy.dtypes.Int64DType",
    "numpy.dtypes.Float64DType", "numpy.core.multiarray.scalar", "numpy._core.multiarray.scalar",
)


@dataclasses.dataclass
class MegatronCheckpoint:
    """Where a Megatron-LM checkpoint is and what its directory says."""

    path: str  # the iteration directory
    iteration: int
    ckpt_format: str  # "torch_dist" | "torch"
    rank_dirs: Dict[Tuple[int, int, int], str]  # legacy: (tp, pp, ep) rank -> its directory


class OpaqueMegatronValue:
    """Stands for an object of megatron's own classes in pickled args (never executed)."""

    def __init__(self, *args):
        self.args = args

    def __setstate__(self, state):
        self.state = state

    def __repr__(self) -> str:
        return f"OpaqueMegatronValue{self.args}"


# -- finding ----------------------------------------------------------------------------------


def _tracker_iteration(load_dir: str) -> Optional[Tuple[int, str]]:
    path = os.path.join(load_dir, TRACKER_FILENAME)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        text = f.read().strip()
    if text == "release":
        return 0, os.path.join(load_dir, "release")
    try:
        iteration = int(text)
    except ValueError as error:
        raise CheckpointError(f"{path} holds {text!r}, not an iteration number") from error
    return iteration, os.path.join(load_dir, f"iter_{iteration:07d}")


def find_megatron_checkpoint(load_dir: str, prefer_ours: bool = True
                             ) -> Optional[MegatronCheckpoint]:
    """The Megatron-LM checkpoint the tracker of `load_dir` names, or None when `load_dir`
    holds none (no tracker, or -- with `prefer_ours` -- a megatron_smp checkpoint, whose
    "torch"-format saves also hold the model in Megatron's legacy layout)."""
    found = _tracker_iteration(load_dir)
    if found is None or not os.path.isdir(found[1]):
        return None
    iteration, path = found
    if prefer_ours and os.path.isfile(os.path.join(path, "common.json")):
        return None  # ours (its --ckpt-format torch saves hold the legacy layout too)
    if os.path.isfile(os.path.join(path, METADATA_FILENAME)):
        return MegatronCheckpoint(path, iteration, "torch_dist", {})
    rank_dirs = {}
    for name in os.listdir(path):
        match = _RANK_DIR.match(name)
        if match and os.path.isfile(os.path.join(path, name, LEGACY_FILENAME)):
            tp, pp, ep = (int(g) if g else 0 for g in match.groups())
            rank_dirs[(tp, pp, ep)] = os.path.join(path, name)
    if rank_dirs:
        return MegatronCheckpoint(path, iteration, "torch", rank_dirs)
    return None


# -- restricted unpickling --------------------------------------------------------------------


def safe_load(path: str, data: Optional[bytes] = None, mmap: bool = False) -> Any:
    """torch.load with weights_only=True, allowing argparse.Namespace, numpy RNG arrays and
    (as OpaqueMegatronValue) megatron's own classes; another global is a CheckpointError.
    With `data`, those bytes are read (`path` then only names them in errors). `mmap`: the
    file is memory-mapped, its tensors read from it only when touched (`load_mapped`)."""
    import io

    def source():
        return io.BytesIO(data) if data is not None else path

    try:
        needed = torch.serialization.get_unsafe_globals_in_checkpoint(source())
    except (RuntimeError, OSError, ValueError) as error:
        raise CheckpointError(f"{path} is not a readable torch file: {error}") from error
    allowed: List[Any] = [argparse.Namespace]
    refused = []
    for name in needed:
        if name == "argparse.Namespace":
            continue
        if name.startswith("megatron."):
            allowed.append((OpaqueMegatronValue, name))
        elif name in _NUMPY_GLOBALS:
            import importlib

            module, _, attr = name.rpartition(".")
            allowed.append(getattr(importlib.import_module(module), attr))
        else:
            refused.append(name)
    if refused:
        raise CheckpointError(
            f"{path} pickles objects that are not plain data ({', '.join(refused)}); it is not "
            "loaded, since unpickling them could run arbitrary code. Re-save it without them"
        )
    with torch.serialization.safe_globals(allowed):
        try:
            if mmap and data is None:
                return load_mapped(path)
            return torch.load(source(), map_location="cpu", weights_only=True)
        except Exception as error:  # pickle errors come in many types
            raise CheckpointError(f"{path} cannot be read: {error}") from error


# The files `load_mapped` mapped: only pages of their mappings are ever released.
_MAPPED_FILES: set = set()


def load_mapped(path: str) -> Any:
    """torch.load(weights_only=True) of a torch.save file with its tensors memory-mapped
    (`mmap=True`): only the pickle is read now, each tensor's bytes when it is touched, so
    what a file holds besides the model (optimizer state) is never read. A file in the
    format before torch 1.6 (not a zip archive) cannot be mapped and is read whole."""
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as error:
        if "mmap" not in str(error):
            raise
        return torch.load(path, map_location="cpu", weights_only=True)
    _MAPPED_FILES.add(os.path.realpath(path))
    return loaded


def _mapped_ranges() -> Optional[List[Tuple[int, int]]]:
    """The address ranges of the current mappings of files `load_mapped` mapped; None where
    /proc/self/maps cannot be read (not Linux)."""
    try:
        with open("/proc/self/maps") as handle:
            mapped = []
            for line in handle:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[5].rstrip("\n") in _MAPPED_FILES:
                    low, high = (int(x, 16) for x in parts[0].split("-"))
                    mapped.append((low, high))
    except OSError:
        return None
    return mapped


def _release(begin: int, end: int, mapped: List[Tuple[int, int]]) -> None:
    """madvise(MADV_DONTNEED) the pages of [begin, end) when they lie in one of `mapped`."""
    import ctypes

    page = os.sysconf("SC_PAGE_SIZE")
    begin &= ~(page - 1)
    end = -(-end // page) * page
    if begin < end and any(low <= begin and end <= high for low, high in mapped):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
        except OSError:  # not glibc: the pages stay until the mapping is closed
            return
        libc.madvise(ctypes.c_void_p(begin), ctypes.c_size_t(end - begin), 4)  # DONTNEED


def release_pages(tensors) -> None:
    """Give back the memory of what was read of tensors `load_mapped` mapped: their pages
    leave the process (madvise MADV_DONTNEED; read from the file again if touched again),
    which would otherwise keep every page read until the mapping is closed. Only pages that
    lie in a current mapping of such a file are released; other tensors are left alone."""
    if not _MAPPED_FILES:
        return
    mapped = _mapped_ranges()
    if mapped is None:
        return
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.nbytes():
            _release(storage.data_ptr(), storage.data_ptr() + storage.nbytes(), mapped)


def release_mapped_files() -> None:
    """Give back every page of the files `load_mapped` mapped that is still in this process
    (madvise MADV_DONTNEED of their whole mappings). Released ranges do not stay released:
    the kernel maps a faulting page's neighbours that are in the page cache too (fault-around,
    readahead), so reading one piece maps pages of the piece before it, already released, and
    of the tensors around it. Called once a reader is done with a group of tensors, so what
    stays mapped cannot grow with the number of groups read. The mapped tensors are only read
    from, never written: their pages are the file's, read again if touched again."""
    mapped = _mapped_ranges() if _MAPPED_FILES else None
    for low, high in mapped or ():
        _release(low, high, [(low, high)])


# The piece `copy_into` copies before releasing the pages it read.
_PIECE = 1 << 20


def copy_into(target: torch.Tensor, source: torch.Tensor) -> None:
    """target.copy_(source) for contiguous tensors of the same dtype and size; a `source` in a
    file `load_mapped` mapped is copied a piece at a time, each piece's pages released once
    copied, so that the copy and all the pages read are not in memory together."""
    mapped = _mapped_ranges() if _MAPPED_FILES else None
    if not mapped or not source.is_contiguous() or not target.is_contiguous():
        target.copy_(source)
        return
    flat_source = source.reshape(-1).view(torch.uint8)
    flat_target = target.reshape(-1).view(torch.uint8)
    for start in range(0, flat_source.numel(), _PIECE):
        end = min(start + _PIECE, flat_source.numel())
        flat_target[start:end].copy_(flat_source[start:end])
        _release(flat_source.data_ptr() + start, flat_source.data_ptr() + end, mapped)


def _read_dcp_bytes(checkpoint_path: str, key: str) -> Optional[bytes]:
    """The raw bytes DCP stores under `key` (a bytes item), or None when it holds none.

    torch's default load planner unpickles bytes items with `torch.load(weights_only=False)`,
    which could run code from the file: this planner keeps the bytes, for `safe_load`."""
    import io

    import torch.distributed.checkpoint as torch_dcp
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    class _RawBytesPlanner(torch_dcp.DefaultLoadPlanner):
        def load_bytes(self, read_item, value):
            self.state_dict[read_item.dest_index.fqn].write(value.read())

    reader = torch_dcp.FileSystemReader(checkpoint_path)
    try:
        metadata = reader.read_metadata()
    except Exception as error:
        raise CheckpointError(f"{checkpoint_path}/.metadata cannot be read: {error}") from error
    if not isinstance(metadata.state_dict_metadata.get(key), BytesStorageMetadata):
        return None
    holder = {key: io.BytesIO()}
    torch_dcp.load(holder, storage_reader=reader, planner=_RawBytesPlanner(), no_dist=True)
    return holder[key].getvalue()


# megatron-core >= 0.17 keeps the common state (args, iteration, checkpoint version) inside
# the DCP files as this one bytes item: a torch.save of [common dict] (its ShardedObject).
_COMMON_STATE_KEY = "common_state/shard_0_1"


def _common_state(checkpoint: MegatronCheckpoint) -> Dict[str, Any]:
    """common.pt (torch_dist up to megatron-core 0.16), the DCP item `common_state` (0.17 and
    later), or the first rank's file without its tensors' use (legacy)."""
    if checkpoint.ckpt_format == "torch_dist":
        path = os.path.join(checkpoint.path, COMMON_PT_FILENAME)
        if os.path.isfile(path):
            return safe_load(path)
        data = _read_dcp_bytes(checkpoint.path, _COMMON_STATE_KEY)
        if data is None:
            raise CheckpointError(
                f"{checkpoint.path} has neither common.pt (megatron-core <= 0.16) nor the "
                f"'{_COMMON_STATE_KEY}' item of megatron-core >= 0.17: it is incomplete")
        where = f"{checkpoint.path} ({_COMMON_STATE_KEY})"
        common = safe_load(where, data)
        if isinstance(common, (list, tuple)) and len(common) == 1:
            common = common[0]
        if not isinstance(common, dict):
            raise CheckpointError(f"{where} holds {type(common).__name__}, not the common dict")
        return common
    first = checkpoint.rank_dirs[min(checkpoint.rank_dirs)]
    # Memory-mapped: the tensors (model, optimizer state) are not read, only the pickle.
    return safe_load(os.path.join(first, LEGACY_FILENAME), mmap=True)


def read_args(checkpoint: MegatronCheckpoint) -> Optional[Dict[str, Any]]:
    """The checkpoint's Megatron args as a dict, or None when it was saved without them."""
    args = _common_state(checkpoint).get("args")
    return None if args is None else dict(vars(args))


# -- model shape from Megatron args -----------------------------------------------------------

# Megatron arg -> TransformerConfig field, taken as is when present and not None.
_SAME_MEANING = {
    "num_layers": "num_layers", "hidden_size": "hidden_size",
    "num_attention_heads": "num_attention_heads", "kv_channels": "kv_channels",
    "ffn_hidden_size": "ffn_hidden_size", "max_position_embeddings": "max_position_embeddings",
    "normalization": "normalization", "norm_epsilon": "layernorm_epsilon",
    "rotary_base": "rotary_base", "rotary_percent": "rotary_percent",
    "rotary_interleaved": "rotary_interleaved", "qk_layernorm": "qk_layernorm",
    "apply_layernorm_1p": "layernorm_zero_centered_gamma", "add_bias_linear": "add_bias_linear",
    "add_qkv_bias": "add_qkv_bias",
    "untie_embeddings_and_output_weights": "untie_embeddings_and_output_weights",
    "make_vocab_size_divisible_by": "make_vocab_size_divisible_by",
    "num_experts": "num_moe_experts", "moe_router_topk": "moe_router_topk",
    "moe_ffn_hidden_size": "moe_ffn_hidden_size",
    "use_rope_scaling": "use_rope_scaling", "rope_scaling_factor": "rope_scaling_factor",
    # YaRN: Megatron's flags without the yarn_ prefix fill its config's yarn_* fields.
    "rotary_scaling_factor": "yarn_rotary_scaling_factor",
    "yarn_original_max_position_embeddings": "yarn_original_max_position_embeddings",
    "yarn_beta_fast": "yarn_beta_fast", "yarn_beta_slow": "yarn_beta_slow",
    "mscale": "yarn_mscale", "mscale_all_dim": "yarn_mscale_all_dim",
    "yarn_correction_range_round_to_int": "yarn_correction_range_round_to_int",
    # gpt-oss: sinks, per-layer windows, the clamped GLU's offset and limit.
    "softmax_type": "softmax_type", "window_size": "window_size",
    "window_attn_skip_freq": "window_attn_skip_freq", "glu_linear_offset": "glu_linear_offset",
    "activation_func_clamp_value": "activation_func_clamp_value",
    # DeepSeek-V3 routing; the expert bias is the router's `expert_bias` in both layouts.
    "moe_router_score_function": "moe_router_score_function",
    "moe_router_enable_expert_bias": "moe_router_enable_expert_bias",
    "moe_router_num_groups": "moe_router_num_groups",
    "moe_router_group_topk": "moe_router_group_topk",
    "moe_router_topk_scaling_factor": "moe_router_topk_scaling_factor",
    "moe_router_bias_update_rate": "moe_router_bias_update_rate",
    "moe_router_load_balancing_type": "moe_router_load_balancing_type",
    "moe_aux_loss_coeff": "moe_aux_loss_coeff", "moe_router_dtype": "moe_router_dtype",
    "moe_shared_expert_intermediate_size": "moe_shared_expert_intermediate_size",
    "moe_layer_freq": "moe_layer_freq",
    # Multi-latent attention (megatron-core's names: linear_q_down_proj, linear_q_up_proj,
    # linear_kv_down_proj, linear_kv_up_proj, q_layernorm, kv_layernorm) and MTP.
    "multi_latent_attention": "multi_latent_attention", "q_lora_rank": "q_lora_rank",
    "kv_lora_rank": "kv_lora_rank", "qk_head_dim": "qk_head_dim",
    "qk_pos_emb_head_dim": "qk_pos_emb_head_dim", "v_head_dim": "v_head_dim",
    "mtp_num_layers": "mtp_num_layers", "mtp_loss_scaling_factor": "mtp_loss_scaling_factor",
    # Gemma 3: Megatron-LM main's linear RoPE scaling and its TransformerConfig.softmax_scale
    # (taken from args by field name), then ours, which Megatron-LM has not (GEMMA_ONLY_ARGS).
    "rotary_seq_len_interpolation_factor": "rotary_seq_len_interpolation_factor",
    "softmax_scale": "softmax_scale",
    "sandwich_norm": "sandwich_norm", "apply_embedding_scaling": "apply_embedding_scaling",
    "local_rotary_base": "local_rotary_base",
    "final_logit_softcapping": "final_logit_softcapping",
    # Hybrid stacks (Megatron-LM main's args carry its TransformerConfig's names).
    "hybrid_layer_pattern": "hybrid_layer_pattern", "mamba_state_dim": "mamba_state_dim",
    "mamba_head_dim": "mamba_head_dim", "mamba_num_groups": "mamba_num_groups",
    "mamba_num_heads": "mamba_num_heads", "linear_attention_freq": "linear_attention_freq",
    "experimental_attention_variant": "experimental_attention_variant",
    "linear_conv_kernel_dim": "linear_conv_kernel_dim",
    "linear_key_head_dim": "linear_key_head_dim",
    "linear_value_head_dim": "linear_value_head_dim",
    "linear_num_key_heads": "linear_num_key_heads",
    "linear_num_value_heads": "linear_num_value_heads",
}
# Args recorded for our reader that Megatron-LM would ignore (building another model).
GEMMA_ONLY_ARGS = ("sandwich_norm", "apply_embedding_scaling", "local_rotary_base",
                   "final_logit_softcapping", "geglu")
# Megatron's Llama 3.x scaling has these fixed (RotaryEmbedding._apply_scaling's defaults).
_MEGATRON_LLAMA3_FIXED = {"rope_scaling_low_freq_factor": 1.0,
                          "rope_scaling_high_freq_factor": 4.0,
                          "rope_scaling_original_max_position_embeddings": 8192}
# Megatron args that change the model in ways this reader does not map: refused when set.
_UNMAPPED = ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage",
             "virtual_pipeline_model_parallel_size", "moe_grouped_gemm")


def config_fields_from_args(args: Mapping[str, Any]) -> Dict[str, Any]:
    """TransformerConfig fields that Megatron `args` fix (only those it sets)."""
    unmapped = [f"--{n.replace('_', '-')}={args[n]!r}" for n in _UNMAPPED if args.get(n)]
    if unmapped:
        raise CheckpointError(
            f"the Megatron checkpoint was trained with {', '.join(unmapped)}, which its reader "
            "does not map; convert it with Megatron-LM's tools to a plain layout first"
        )
    fields = {ours: args[theirs] for theirs, ours in _SAME_MEANING.items()
              if args.get(theirs) is not None}
    if args.get("hybrid_override_pattern") and "hybrid_layer_pattern" not in fields:
        fields["hybrid_layer_pattern"] = args["hybrid_override_pattern"]  # its older spelling
    if "num_attention_heads" in fields:
        grouped = args.get("group_query_attention") and args.get("num_query_groups")
        fields["num_query_groups"] = (args["num_query_groups"] if grouped
                                      else fields["num_attention_heads"])
    if args.get("swiglu"):
        fields.update(gated_linear_unit=True, activation="silu")
    elif args.get("quick_geglu"):
        fields.update(gated_linear_unit=True, activation="quick_gelu")
    elif args.get("geglu"):
        fields.update(gated_linear_unit=True, activation="gelu_tanh")
    elif args.get("squared_relu"):
        fields.update(gated_linear_unit=False, activation="squared_relu")
    elif args.get("openai_gelu"):  # GPT-2's tanh approximation (HF's gelu_new)
        fields.update(gated_linear_unit=False, activation="gelu_tanh")
    elif "swiglu" in args:
        fields.update(gated_linear_unit=False, activation="gelu")
    position = args.get("position_embedding_type")
    if args.get("use_rotary_position_embeddings"):
        position = "rope"
    if args.get("multi_latent_attention") and args.get("qk_head_dim") is not None:
        # MLA heads have no kv_channels; ours (and the HF adapter's) is the q/k head width.
        fields["kv_channels"] = args["qk_head_dim"] + args.get("qk_pos_emb_head_dim", 64)
    if (args.get("multi_latent_attention") and position == "rope"
            and args.get("rope_type") != "rope"):
        position = "yarn"  # Megatron's MLA takes YaRN unless --rope-type rope
    if position is not None:
        fields["position_embedding_type"] = position
    if args.get("vocab_size"):
        fields["vocab_size"] = args["vocab_size"]
    if args.get("bf16"):
        fields["params_dtype"] = torch.bfloat16
    elif args.get("fp16"):
        fields["params_dtype"] = torch.float16
    return fields


def args_from_config(config: TransformerConfig, tp: int, pp: int,
                     iteration: int) -> argparse.Namespace:
    """Megatron args describing `config` (what its --use-checkpoint-args and ours read)."""
    if config.use_rope_scaling:
        differing = [f"{name}={getattr(config, name)}" for name, value in
                     _MEGATRON_LLAMA3_FIXED.items() if getattr(config, name) != value]
        if differing:
            raise CheckpointError(
                f"Megatron-LM's Llama 3.x RoPE scaling has low/high frequency factors 1/4 and "
                f"an original context of 8192 built in; this model has {', '.join(differing)}:"
                " save it in our format (or HF) instead"
            )
    args = {theirs: getattr(config, ours) for theirs, ours in _SAME_MEANING.items()}
    if config.multi_latent_attention and config.position_embedding_type == "yarn":
        args["rope_type"] = "yarn"
    elif config.multi_latent_attention:
        args["rope_type"] = "rope"
    args.update(
        num_query_groups=config.num_query_groups,
        group_query_attention=config.num_query_groups != config.num_attention_heads,
        swiglu=config.gated_linear_unit and config.activation == "silu",
        quick_geglu=config.gated_linear_unit and config.activation == "quick_gelu",
        geglu=config.gated_linear_unit and config.activation == "gelu_tanh",
        squared_relu=config.activation == "squared_relu",
        openai_gelu=not config.gated_linear_unit and config.activation == "gelu_tanh",
        position_embedding_type=config.position_embedding_type,
        use_rotary_position_embeddings=config.position_embedding_type == "rope",
        vocab_size=config.vocab_size, padded_vocab_size=config.padded_vocab_size(tp),
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        bf16=config.params_dtype == torch.bfloat16, fp16=config.params_dtype == torch.float16,
        params_dtype=config.params_dtype, ckpt_format="torch", iteration=iteration,
        seq_length=config.max_position_embeddings,
    )
    return argparse.Namespace(**args)


# -- reading the model ------------------------------------------------------------------------


def _our_name(name: str) -> Optional[str]:
    """Megatron name (per layer) -> ours; None for entries that hold no weights. The MTP
    layers' inner layer is megatron-core 0.16's `transformer_layer`, main's `mtp_model_layer`
    (ours)."""
    if name.endswith("_extra_state") or "._extra_state" in name:
        return None
    name = _MTP_INNER.sub(r"\1mtp_model_layer.", name)
    match = _LAYER.match(name) or _MTP_LAYER.match(name)
    if match and match.group(2) in _TE_NAMES:
        return f"{name[:match.start(2)]}{_TE_NAMES[match.group(2)]}"
    return name


def _megatron_name(name: str) -> str:
    """Ours -> megatron-core 0.16.1's (the MTP layers' inner layer is `transformer_layer`)."""
    return _MTP_OURS.sub(r"\1transformer_layer.", name)


class TorchDistSource:
    """The tensors of a torch_dist checkpoint under our names (per layer, per expert), read
    on demand: `meta` ({name: meta tensor}) from the metadata alone, `read(names)` loads only
    the regions those names occupy -- one layer's slice of megatron-core's tensors stacked
    [layers, ...] or [layers, experts, ...], not the whole stack."""

    def __init__(self, checkpoint: MegatronCheckpoint) -> None:
        import torch.distributed.checkpoint as torch_dcp
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.reader_path = checkpoint.path
        reader = torch_dcp.FileSystemReader(checkpoint.path)
        try:
            self.metadata = reader.read_metadata()
        except Exception as error:
            raise CheckpointError(f"{checkpoint.path}/.metadata cannot be read: {error}"
                                  ) from error
        # name -> (key, leading indices of the region read, index of the name in the region)
        self.where: Dict[str, Tuple[str, Tuple[int, ...], Tuple[int, ...]]] = {}
        self.meta: Dict[str, torch.Tensor] = {}
        for key, info in self.metadata.state_dict_metadata.items():
            if not isinstance(info, TensorStorageMetadata) or "_extra_state" in key:
                continue
            size, dtype = tuple(info.size), info.properties.dtype
            per_layer = _PER_LAYER.match(key)
            if per_layer is not None:
                # Layers of different kinds (dense first layers, MoE ones, MTP) are stored one
                # by one; each MoE layer's experts stacked [experts, ...].
                prefix, rest = per_layer.groups()
                expert_prefix = next((p for p in _STACKED_EXPERTS if rest.startswith(p)), None)
                if expert_prefix is not None:
                    tail = rest[len(expert_prefix):]
                    for expert in range(size[0]):
                        self._add(_our_name(f"{prefix}mlp.experts.local_experts.{expert}.{tail}"),
                                  key, (), (expert,), size[1:], dtype)
                    continue
                self._add(_our_name(key), key, (), (), size, dtype)
                continue
            if key.startswith("decoder.layers."):
                rest = key[len("decoder.layers."):]
                # megatron-core stacks the experts too: [layers, experts, ...].
                expert_prefix = next((p for p in _STACKED_EXPERTS if rest.startswith(p)), None)
                for layer in range(size[0]):  # megatron-core stacks the layers
                    if expert_prefix is not None:
                        tail = rest[len(expert_prefix):]
                        for expert in range(size[1]):
                            self._add(f"decoder.layers.{layer}.mlp.experts.local_experts."
                                      f"{expert}.{tail}", key, (layer,), (0, expert), size[2:],
                                      dtype)
                    else:
                        self._add(_our_name(f"decoder.layers.{layer}.{rest}"), key, (layer,),
                                  (0,), size[1:], dtype)
            else:
                self._add(_our_name(key), key, (), (), size, dtype)

    def _add(self, name, key, region, index, shape, dtype) -> None:
        if name is not None:
            self.where[name] = (key, region, index)
            self.meta[name] = torch.empty(shape, dtype=dtype, device="meta")

    def read(self, names, rows: Optional[int] = None) -> Dict[str, torch.Tensor]:
        """{name: tensor} for `names`, each region loaded once (a region per key per load);
        `rows`: vocab tables cut to that many rows (Megatron's padding rows dropped)."""
        import torch.distributed.checkpoint as torch_dcp

        pending: Dict[str, List[Tuple[int, ...]]] = {}
        for name in names:
            key, region, _ = self.where[name]
            if region not in pending.setdefault(key, []):
                pending[key].append(region)
        loaded: Dict[Tuple[str, Tuple[int, ...]], torch.Tensor] = {}
        while pending:
            regions = {key: todo.pop() for key, todo in pending.items()}
            pending = {key: todo for key, todo in pending.items() if todo}
            holder = {}
            for key, region in regions.items():
                size = self.metadata.state_dict_metadata[key].size
                dtype = self.metadata.state_dict_metadata[key].properties.dtype
                holder[key] = torch.empty((1,) * len(region) + tuple(size[len(region):]),
                                          dtype=dtype)
            # Every rank reads on its own: no collective, whatever the caller's groups (and
            # torch's warning that it assumes so, once per region, is not repeated).
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", "torch.distributed is disabled")
                torch_dcp.load(holder,
                               storage_reader=SafeFileSystemReader(self.reader_path),
                               planner=_RegionPlanner(regions), no_dist=True)
            loaded.update({(key, regions[key]): tensor for key, tensor in holder.items()})
        out = {}
        for name in names:
            key, region, index = self.where[name]
            tensor = loaded[(key, region)]
            tensor = tensor[index].clone() if index else tensor
            if rows is not None and name.endswith(VOCAB_PARALLEL_SUFFIXES) and \
                    tensor.shape[0] > rows:
                tensor = tensor[:rows].clone()
            out[name] = tensor
        return out


class _RegionPlanner(DefaultLoadPlanner):
    """Loads, for each key, the region [i, j, ..., :, ...] of its leading indices `regions`
    gives into a tensor of that region's shape (leading sizes 1)."""

    def __init__(self, regions: Mapping[str, Tuple[int, ...]]) -> None:
        super().__init__()
        self.regions = dict(regions)

    def create_local_plan(self):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        from torch.distributed.checkpoint.planner import LoadPlan
        from torch.distributed.checkpoint.planner_helpers import (
            create_read_items_for_chunk_list,
        )

        items = []
        for key, region in self.regions.items():
            info = self.metadata.state_dict_metadata[key]
            rest = tuple(info.size[len(region):])
            chunk = ChunkStorageMetadata(offsets=torch.Size(region + (0,) * len(rest)),
                                         sizes=torch.Size((1,) * len(region) + rest))
            items += create_read_items_for_chunk_list(key, info, [chunk])
        return LoadPlan(items)

    def lookup_tensor(self, index):
        return self.state_dict[index.fqn]  # the region's own tensor (offsets are within it)


class LegacySource:
    """The tensors of a legacy checkpoint (mp_rank_XX[_YYY]/model_optim_rng.pt per rank)
    under our names, full (TP=1, one stage), read on demand: each rank's file is
    memory-mapped (`load_mapped`), `meta` is the merged shapes, and `read(names)` joins those
    tensors' TP slices, then releases the pages read. `config` gives the SwiGLU layout and
    tying (its vocab size is not used); vocab tables keep the rows stored."""

    def __init__(self, checkpoint: MegatronCheckpoint, config: TransformerConfig) -> None:
        ranks = sorted(checkpoint.rank_dirs)
        tp = 1 + max(r[0] for r in ranks)
        pp = 1 + max(r[1] for r in ranks)
        if max(r[2] for r in ranks) > 0:
            raise CheckpointError(f"{checkpoint.path}: legacy checkpoints with expert "
                                  "parallelism are not read; save it at expert-parallel size 1")
        missing = [f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "")
                   for t in range(tp) for p in range(pp)
                   if (t, p, 0) not in checkpoint.rank_dirs]
        if missing:
            raise CheckpointError(f"{checkpoint.path} lacks {', '.join(missing)}: incomplete")
        self.stages: List[Tuple[List[Dict[str, torch.Tensor]], TransformerConfig]] = []
        self.where: Dict[str, Tuple[int, str]] = {}  # our full name -> (stage, stage's name)
        self.meta: Dict[str, torch.Tensor] = {}
        layer_offset = 0
        for stage in range(pp):
            shards = []
            for rank in range(tp):
                state = safe_load(os.path.join(checkpoint.rank_dirs[(rank, stage, 0)],
                                               LEGACY_FILENAME), mmap=True)
                if "model" not in state:
                    keys = sorted(k for k in state if k.startswith("model"))
                    raise CheckpointError(
                        f"{checkpoint.rank_dirs[(rank, stage, 0)]} has no 'model' entry (found "
                        f"{keys}): virtual pipeline stages are not read")
                shards.append({_our_name(name): t for name, t in state["model"].items()
                               if isinstance(t, torch.Tensor) and _our_name(name) is not None})
            rows = sum(s["embedding.word_embeddings.weight"].shape[0] for s in shards) \
                if "embedding.word_embeddings.weight" in shards[0] else None
            if rows is None and "output_layer.weight" in shards[0]:
                rows = sum(s["output_layer.weight"].shape[0] for s in shards)
            # Vocab tables are merged as stored: padded rows included, none added or cut.
            merge_config = config.replace(vocab_size=rows or config.vocab_size,
                                          make_vocab_size_divisible_by=1)
            merged = merge_state_dicts(
                [{k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in s.items()}
                 for s in shards], merge_config)
            layers = set()
            for local, tensor in merged.items():
                name = local
                match = _LAYER.match(name)
                if match:
                    layers.add(int(match.group(1)))
                    name = (f"decoder.layers.{int(match.group(1)) + layer_offset}."
                            f"{match.group(2)}")
                if (name == "output_layer.weight"
                        and not config.untie_embeddings_and_output_weights):
                    continue  # the last stage's copy of the tied embedding
                self.where[name] = (stage, local)
                self.meta[name] = tensor
            self.stages.append((shards, merge_config))
            layer_offset += len(layers)

    def read(self, names, rows: Optional[int] = None) -> Dict[str, torch.Tensor]:
        """{name: full tensor} for `names`; `rows`: vocab tables cut to that many rows
        (Megatron's padding rows dropped, never copied)."""
        by_stage: Dict[int, Dict[str, str]] = {}
        for name in names:
            stage, local = self.where[name]
            by_stage.setdefault(stage, {})[local] = name
        out = {}
        for stage, wanted in by_stage.items():
            shards, merge_config = self.stages[stage]
            layout = default_layout(merge_config)
            rest = []
            for local, name in wanted.items():
                spec = partition_of(layout, local)
                cut = rows if name.endswith(VOCAB_PARALLEL_SUFFIXES) else None
                if spec is None or len(shards) == 1 or spec[0] == 0:
                    out[name] = self._join_rows(name, [shard[local] for shard in shards],
                                                spec, cut)
                else:
                    rest.append(local)
            if rest:  # split along another dim: the whole result, then a row cut
                subset = [{local: shard[local] for local in rest} for shard in shards]
                merged = merge_state_dicts(subset, merge_config)  # new tensors: cat / clone
                release_pages([t for shard in subset for t in shard.values()])
                for local, tensor in merged.items():
                    if rows is not None and local.endswith(VOCAB_PARALLEL_SUFFIXES):
                        tensor = tensor[:rows].clone()
                    out[wanted[local]] = tensor
        release_mapped_files()
        return out

    def _join_rows(self, name: str, pieces: List[torch.Tensor],
                   spec: Optional[Tuple[int, int]], rows: Optional[int]) -> torch.Tensor:
        """`merge_state_dicts` of one tensor that is replicated, or split along dim 0 (or not
        split: TP=1), without holding its pages and the result together: each rank's rows
        are copied into their place a piece at a time (`copy_into`), in the order
        `join_tensors` gives them (stride pieces, then ranks); `rows`: only the first that
        many rows are copied (a vocab table without Megatron's padding)."""
        shape = self.meta[name].shape
        total = shape[0]
        if rows is not None and shape[0] > rows:
            shape = torch.Size((rows,) + tuple(shape[1:]))
        full = torch.empty(shape, dtype=self.meta[name].dtype)
        if spec is None or len(pieces) == 1:
            copy_into(full, pieces[0][:full.shape[0]] if full.dim() else pieces[0])
            return full
        stride = spec[1]
        blocks = [torch.chunk(piece, stride, dim=0) for piece in pieces]
        row = 0
        for index in range(stride):
            for rank in range(len(pieces)):
                block = blocks[rank][index]
                end = min(row + block.shape[0], full.shape[0])
                if end > row:
                    copy_into(full[row:end], block[:end - row])
                row += block.shape[0]
        if row != total:
            raise CheckpointError(f"{name}: the tensor-parallel slices hold {row} rows, the "
                                  f"merged shape {list(self.meta[name].shape)}")
        return full


def open_model(checkpoint: MegatronCheckpoint, config: TransformerConfig):
    """The checkpoint's model as a source read on demand: `.meta` ({our name: meta tensor},
    full TP=1 shapes, vocab tables with the rows stored) and `.read(names)`. `config` gives
    the SwiGLU layout and tying (its vocab size is not used); a tied output layer is left
    out."""
    if checkpoint.ckpt_format == "torch_dist":
        source = TorchDistSource(checkpoint)
    else:
        source = LegacySource(checkpoint, config)
    if not config.untie_embeddings_and_output_weights:
        source.meta.pop("output_layer.weight", None)
    return source


def read_model(checkpoint: MegatronCheckpoint, config: TransformerConfig
               ) -> Dict[str, torch.Tensor]:
    """Full (TP=1, one stage) state dict with our names; vocab tables with the rows stored.
    `config` gives the SwiGLU layout and tying (its vocab size is not used)."""
    source = open_model(checkpoint, config)
    return source.read(list(source.meta))


def trim_vocab_rows(model: Mapping[str, torch.Tensor], vocab_size: int, where: str
                    ) -> Dict[str, torch.Tensor]:
    """Vocab tables cut to `vocab_size` rows (Megatron's padding rows dropped)."""
    out = dict(model)
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        if name in out:
            if out[name].shape[0] < vocab_size:
                raise CheckpointError(
                    f"{where}: {name} has {out[name].shape[0]} rows, fewer than the vocabulary "
                    f"size {vocab_size}; give the tokenizer / --vocab-size it was trained with")
            out[name] = out[name][:vocab_size].clone()
    return out


def load_megatron_model(load_dir: str, config: TransformerConfig
                        ) -> Tuple[MegatronCheckpoint, Dict[str, torch.Tensor]]:
    """The model of the Megatron checkpoint in `load_dir` in checkpoint form (vocab tables of
    `config.vocab_size` rows), for a model of `config`."""
    checkpoint = find_megatron_checkpoint(load_dir)
    if checkpoint is None:
        raise CheckpointError(f"{load_dir} holds no Megatron-LM checkpoint")
    return checkpoint, trim_vocab_rows(read_model(checkpoint, config), config.vocab_size,
                                       checkpoint.path)


# -- writing the legacy format ----------------------------------------------------------------


def extra_state_names(names: List[str]) -> List[str]:
    """megatron-core's local spec keeps an (empty) `_extra_state` beside each linear layer."""
    out = []
    for name in names:
        for linear in ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2",
                       "linear_q_proj", "linear_q_down_proj", "linear_q_up_proj",
                       "linear_kv_down_proj", "linear_kv_up_proj", "eh_proj"):
            if name.endswith(f".{linear}.weight"):
                out.append(name[: -len("weight")] + "_extra_state")
    if "output_layer.weight" in names:
        out.append("output_layer._extra_state")
    return out


def save_legacy_checkpoint(save_dir: str, iteration: int, config: TransformerConfig,
                           model: Mapping[str, torch.Tensor], tp: int = 1, pp: int = 1,
                           extra: Optional[Dict[str, Any]] = None) -> List[str]:
    """Write `model` (checkpoint form: vocab tables of vocab_size rows) as Megatron-LM's legacy
    "torch" checkpoint at TP=`tp`, PP=`pp`; returns the files written
    (`save_legacy_checkpoint_streaming` of tensors held in memory)."""
    meta = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in model.items()}
    return save_legacy_checkpoint_streaming(
        save_dir, iteration, config, meta, lambda names: {k: model[k] for k in names},
        [[name] for name in model], tp, pp, extra)


def _placements(config: TransformerConfig, names: List[str], pp: int
                ) -> Dict[str, List[Tuple[int, str]]]:
    """Our full name -> [(pipeline stage, stage-local name)] of each copy Megatron-LM keeps:
    layers renumbered within their stage, the embedding on the first stage, the rest on the
    last; the tied embedding again as the last stage's output layer, and beside the MTP
    layers there (PP > 1)."""
    per_stage = config.num_layers // pp
    out: Dict[str, List[Tuple[int, str]]] = {}
    for name in names:
        match = _LAYER.match(name)
        if match:
            layer = int(match.group(1))
            stage = layer // per_stage
            out[name] = [(stage, f"decoder.layers.{layer - stage * per_stage}.{match.group(2)}")]
        elif name.startswith("embedding."):
            out[name] = [(0, name)]
        else:
            out[name] = [(pp - 1, name)]  # output layer, final norm, MTP
    embedding = "embedding.word_embeddings.weight"
    if pp > 1 and embedding in out:
        if not config.untie_embeddings_and_output_weights:
            out[embedding].append((pp - 1, "output_layer.weight"))
        if config.mtp_num_layers:
            out[embedding].append((pp - 1, embedding))
    return out


def save_legacy_checkpoint_streaming(
        save_dir: str, iteration: int, config: TransformerConfig,
        meta: Mapping[str, torch.Tensor],
        read: Callable[[List[str]], Dict[str, torch.Tensor]], name_groups: List[List[str]],
        tp: int = 1, pp: int = 1, extra: Optional[Dict[str, Any]] = None) -> List[str]:
    """Write the tensors `read(names)` gives (those of `meta`, checkpoint form: vocab tables
    of vocab_size rows), asked for a group of `name_groups` at a time, as Megatron-LM's legacy
    "torch" checkpoint at TP=`tp`, PP=`pp`; returns the files written.

    Each rank's file is first written by `torch.save` with every tensor's bytes left empty
    (`torch.serialization.skip_data`, the model's shapes as fake tensors); then each group's
    TP shards are written into their place in the files (their offsets from loading the
    files on the meta device), and each record's CRC-32 set, so the files are those
    `torch.save` would have written. Only a group's tensors and their shards are in memory."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    if config.num_layers % pp:
        raise CheckpointError(f"pipeline size {pp} does not divide num_layers "
                              f"{config.num_layers}")
    path = os.path.join(save_dir, f"iter_{iteration:07d}")
    args = args_from_config(config, tp, pp, iteration)
    lacking = [f"--{name.replace('_', '-')}" for name in GEMMA_ONLY_ARGS
               if getattr(args, name) not in (None, False)]
    if lacking:
        raise CheckpointError(f"Megatron-LM has no {', '.join(lacking)} (Gemma 3's numerics): it "
                              "would load this checkpoint as another model; keep it in "
                              "megatron_smp's format or export it to Hugging Face")
    placements = _placements(config, list(meta), pp)
    fake_mode = FakeTensorMode()
    files: Dict[Tuple[int, int], str] = {}
    # (stage, rank) -> {Megatron's name: (offset of its bytes in the file, bytes)}
    offsets: Dict[Tuple[int, int], Dict[str, Tuple[int, int]]] = {}
    for stage in range(pp):
        stage_meta = {local: meta[name] for name, places in placements.items()
                      for where, local in places if where == stage}
        for rank in range(tp):
            shard = {_megatron_name(name): tensor for name, tensor in
                     shard_state_dict(stage_meta, config, tp, rank).items()}
            with fake_mode:
                model: Dict[str, Any] = {name: torch.empty(t.shape, dtype=t.dtype)
                                         for name, t in shard.items()}
            for name in extra_state_names(list(shard)):
                model[name] = None
            rank_dir = os.path.join(path, f"mp_rank_{rank:02d}" + (f"_{stage:03d}" if pp > 1
                                                                   else ""))
            os.makedirs(rank_dir, exist_ok=True)
            file = os.path.join(rank_dir, LEGACY_FILENAME)
            with torch.serialization.skip_data(materialize_fake_tensors=True):
                torch.save({"args": args, "checkpoint_version": CHECKPOINT_VERSION,
                            "iteration": iteration, "model": model, **(extra or {})}, file)
            with torch.serialization.safe_globals([argparse.Namespace]):
                laid_out = torch.load(file, map_location="meta", weights_only=True)["model"]
            offsets[(stage, rank)] = {
                name: (t.untyped_storage()._checkpoint_offset, t.untyped_storage().nbytes())
                for name, t in laid_out.items() if isinstance(t, torch.Tensor)}
            files[(stage, rank)] = file
    layout = default_layout(config)
    handles = {key: open(file, "r+b") for key, file in files.items()}
    crcs: Dict[Tuple[int, int], Dict[int, int]] = {key: {} for key in files}
    try:
        for names in name_groups:
            tensors = read(list(names))
            for name in names:
                tensor = tensors.pop(name)
                for stage, local in placements[name]:
                    for rank in range(tp):
                        offset, nbytes = offsets[(stage, rank)][_megatron_name(local)]
                        crcs[(stage, rank)][offset] = _write_shard(
                            handles[(stage, rank)], offset, nbytes,
                            _shard_pieces(local, tensor, config, tp, rank, layout), local)
                del tensor  # (nothing else refers to it: it is freed now)
            del tensors
    finally:
        for handle in handles.values():
            handle.close()
    for key, file in files.items():
        _set_zip_crcs(file, crcs[key])
    with open(os.path.join(save_dir, TRACKER_FILENAME), "w") as f:
        f.write(str(iteration))
    return [files[key] for key in sorted(files, key=lambda k: (k[1], k[0]))]


def _shard_pieces(name: str, tensor: torch.Tensor, config: TransformerConfig, tp: int,
                  rank: int, layout) -> List[torch.Tensor]:
    """Tensors whose bytes, one after the other, are those of rank `rank`'s shard of `tensor`
    (`shard_state_dict`). A tensor split along dim 0 (vocab tables, QKV, fc1) gives views of
    its own rows and the zero rows of Megatron's vocab padding, not a padded copy and a
    shard; one split otherwise gives its shard."""
    spec = partition_of(layout, name)
    if spec is None:
        return [tensor]
    dim, stride = spec
    rows = tensor.shape[0] if tensor.dim() else 0
    vocab = name.endswith(VOCAB_PARALLEL_SUFFIXES)
    target = config.padded_vocab_size(tp) if vocab else rows
    if dim != 0 or (vocab and rows != config.vocab_size) or target % (tp * stride):
        return [shard_state_dict({name: tensor}, config, tp, rank)[name]]
    block = target // (tp * stride)
    pieces = []
    for index in range(stride):
        begin = (index * tp + rank) * block
        end = begin + block
        if begin < rows:
            pieces.append(tensor[begin:min(end, rows)])
        if end > max(begin, rows):
            pieces.append(tensor.new_zeros((end - max(begin, rows),) + tuple(tensor.shape[1:])))
    return pieces


def _write_shard(handle, offset: int, nbytes: int, pieces: List[torch.Tensor],
                 name: str) -> int:
    """Write `pieces` one after the other at `offset`, filling the `nbytes` laid out for
    them; their CRC-32."""
    crc = 0
    handle.seek(offset)
    while pieces:
        piece = pieces.pop(0)
        crc = _write_bytes(handle, piece, crc)
        nbytes -= piece.numel() * piece.element_size()
    if nbytes:
        raise CheckpointError(f"{name}: its shard does not fill the bytes laid out for it")
    return crc


def _write_bytes(handle, tensor: torch.Tensor, crc: int) -> int:
    """Write `tensor`'s bytes where `handle` is; the CRC-32 `crc` continued over them."""
    import zlib

    tensor = tensor.detach().contiguous()
    if not tensor.numel():
        return crc
    data = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
    handle.write(data)
    return zlib.crc32(data, crc)


def _set_zip_crcs(path: str, crcs: Mapping[int, int]) -> None:
    """Set the CRC-32 of the zip records whose data starts at the offsets of `crcs` (in their
    local header, data descriptor and central directory entry): `torch.save` under skip_data
    recorded those of the empty space."""
    import struct
    import zipfile

    with zipfile.ZipFile(path) as archive:
        infos = archive.infolist()
        central = archive.start_dir
    with open(path, "r+b") as handle:
        position = central
        for info in infos:
            handle.seek(position)
            entry = handle.read(46)
            if entry[:4] != b"PK\x01\x02":
                raise CheckpointError(f"{path}: unexpected zip central directory")
            name_length, extra_length, comment_length = struct.unpack("<HHH", entry[28:34])
            handle.seek(info.header_offset)
            local = handle.read(30)
            local_name, local_extra = struct.unpack("<HH", local[26:30])
            data = info.header_offset + 30 + local_name + local_extra
            crc = crcs.get(data)
            if crc is not None:
                packed = struct.pack("<I", crc)
                handle.seek(position + 16)
                handle.write(packed)
                handle.seek(info.header_offset + 14)
                handle.write(packed)
                if info.flag_bits & 0x08:  # a data descriptor follows the data
                    handle.seek(data + info.compress_size)
                    signature = handle.read(4)
                    handle.seek(data + info.compress_size + (4 if signature == b"PK\x07\x08"
                                                             else 0))
                    handle.write(packed)
            position += 46 + name_length + extra_length + comment_length
    with zipfile.ZipFile(path) as archive:  # every record's CRC now that of its data
        bad = archive.testzip()
    if bad is not None:
        raise CheckpointError(f"{path}: the record {bad} does not match its CRC-32")


def describe(checkpoint: MegatronCheckpoint) -> str:
    layout = ""
    if checkpoint.ckpt_format == "torch":
        ranks = checkpoint.rank_dirs
        layout = f" at TP={1 + max(r[0] for r in ranks)}, PP={1 + max(r[1] for r in ranks)}"
    return f"Megatron-LM {checkpoint.ckpt_format!r} checkpoint {checkpoint.path}{layout}"


__all__ = [
    "MegatronCheckpoint",
    "OpaqueMegatronValue",
    "find_megatron_checkpoint",
    "safe_load",
    "read_args",
    "config_fields_from_args",
    "args_from_config",
    "read_model",
    "trim_vocab_rows",
    "load_megatron_model",
    "save_legacy_checkpoint",
    "save_legacy_checkpoint_streaming",
    "copy_into",
    "release_pages",
    "release_mapped_files",
    "extra_state_names",
    "describe",
]
