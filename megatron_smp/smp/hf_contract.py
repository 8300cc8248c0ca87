"""The Hugging Face causal-LM calling contract, in one place: which forward keywords a
transformed model honours, HF's label shift and ignore index, its mean loss, the padding mask,
and HF's output object. `transform`'s model, conversion checks and tests all use these.

HF's loss (transformers' `ForCausalLMLoss`): labels are shifted left by one (position i is
scored on labels[i + 1], the last position on nothing), positions whose shifted label is -100
are ignored, and the loss is the sum over the rest divided by their count (or by
`num_items_in_batch` when given, as HF's Trainer does under gradient accumulation).
"""
from __future__ import annotations

import warnings
from typing import Any, Dict, Optional, Tuple

import torch

from megatron_smp.config import ConfigError

IGNORE_INDEX = -100

# Keyword: (the value that means "not used", why it cannot be honoured). A call that passes
# any other value is a ConfigError naming the keyword.
UNSUPPORTED_FORWARD_KEYWORDS: Dict[str, Tuple[Any, str]] = {
    "past_key_values": (None, "there is no key/value cache (training-only model)"),
    "use_cache": ((None, False), "there is no key/value cache (training-only model)"),
    "inputs_embeds": (None, "the embedding is tensor-parallel; pass input_ids"),
    "cache_position": (None, "there is no key/value cache (training-only model)"),
    "output_attentions": ((None, False), "attention runs fused (SDPA); no probabilities "
                          "are formed"),
    "output_hidden_states": ((None, False), "per-layer hidden states are not returned"),
    "output_router_logits": ((None, False), "router logits, and HF's load-balancing term "
                             "in the loss, are not returned; the load-balancing loss is added "
                             "inside the MoE layers (moe_aux_loss_coeff)"),
    "cache": (None, "there is no key/value cache (training-only model)"),
    "token_type_ids": (None, "token type embeddings are not part of the transformed model"),
    "head_mask": (None, "head masks are not supported"),
    "logits_to_keep": ((0,), "pass return_logits=True for the full logits"),
}

REJECTION_HINT = ("use the Hugging Face model itself for generation/inspection (the transformed "
                  "weights convert back with the translators, see hf_state_dict())")


# What the transformed model's forward takes and honours (the error for any other keyword
# lists them).
HONOURED_FORWARD_KEYWORDS = ("input_ids", "attention_mask", "position_ids", "labels",
                             "shift_labels", "num_items_in_batch", "return_dict",
                             "return_logits", "use_cache (None/False)", "cu_seq_lens_q",
                             "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


# Keywords HF's forward takes from the model's config when the call leaves them out.
CONFIG_DEFAULTED_KEYWORDS = ("output_attentions", "output_hidden_states",
                             "output_router_logits")


def check_forward_keywords(extra: Dict[str, Any], hf_config: Any = None) -> None:
    """ConfigError for a keyword the transformed model cannot honour (any value but the
    one meaning "not used"), or one HF's causal LMs do not take at all. With the HF model's
    config, the keywords HF defaults from it are checked as HF resolves them (e.g.
    config.output_router_logits True puts HF's load-balancing term in the loss)."""
    for name in CONFIG_DEFAULTED_KEYWORDS:
        if extra.get(name) is None and getattr(hf_config, name, None):
            unused, why = UNSUPPORTED_FORWARD_KEYWORDS[name]
            raise ConfigError(
                f"transformed model forward: config.{name}=True (HF's default for the "
                f"{name} keyword) is not supported: {why}; set config.{name} = False")
    for name, value in extra.items():
        if name not in UNSUPPORTED_FORWARD_KEYWORDS:
            raise ConfigError(
                f"transformed model forward: unknown keyword {name!r}; it takes "
                f"{', '.join(HONOURED_FORWARD_KEYWORDS)}"
            )
        unused, why = UNSUPPORTED_FORWARD_KEYWORDS[name]
        allowed = unused if isinstance(unused, tuple) else (unused,)
        # A tensor is never the "not used" value (and has no plain truth value).
        is_unused = not torch.is_tensor(value) and any(
            value is a or (a is not None and value is not None and value == a) for a in allowed)
        if not is_unused:
            raise ConfigError(
                f"transformed model forward: {name}={value!r} is not supported: {why}; "
                f"{REJECTION_HINT}"
            )


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """HF's shift: [b, s] labels -> [b, s] targets, position i scored on labels[i + 1] and
    the last position on IGNORE_INDEX."""
    return torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)


def targets_and_keep(shifted: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(targets with ignored positions set to token 0, bool mask of the positions scored):
    the vocab-parallel cross entropy needs a valid id everywhere."""
    keep = shifted != IGNORE_INDEX
    return shifted.masked_fill(~keep, 0), keep


def causal_lm_loss(per_token_loss: torch.Tensor, keep: torch.Tensor,
                   num_items_in_batch: Optional[Any] = None) -> torch.Tensor:
    """HF's reduction: the sum over scored positions over their count (or over
    `num_items_in_batch`). `per_token_loss` and `keep` are [b, s] of the whole sequence."""
    total = torch.where(keep, per_token_loss, torch.zeros_like(per_token_loss)).sum()
    if num_items_in_batch is not None:
        denominator = num_items_in_batch
        if torch.is_tensor(denominator):
            denominator = denominator.to(total.device)
    else:
        denominator = keep.sum()
    return total / denominator


def padding_to_attention_mask(attention_mask: Optional[torch.Tensor], seq_length: int):
    """HF's [b, s] padding mask (1 = token, 0 = padding) -> our bool [b, 1, s, s] mask (True =
    masked: future positions and padded keys), as HF builds it for SDPA. None, or no padding
    at all, -> None (the fused causal path). A 4-D mask is taken as HF hands one to its
    attention: bool True = attend (SDPA's), or additive float (0 = attend, -inf or the dtype's
    minimum = masked; eager's); other additive values are a ConfigError."""
    if attention_mask is None:
        return None
    if attention_mask.dim() == 4:
        if attention_mask.dtype == torch.bool:
            return ~attention_mask
        if attention_mask.is_floating_point():
            masked = attention_mask <= torch.finfo(attention_mask.dtype).min / 2  # -inf too
            if bool((masked | (attention_mask == 0)).all()):
                return masked
        raise ConfigError(
            "transformed model forward: a 4-D attention_mask must be bool (True = attend, as "
            "HF's SDPA masks) or additive float with only 0 and -inf / the dtype's minimum (as "
            f"HF's eager masks), got {attention_mask.dtype} with other values; pass HF's "
            "[batch, seq] padding mask instead"
        )
    if attention_mask.dim() != 2 or attention_mask.shape[1] != seq_length:
        raise ConfigError(
            f"transformed model forward: attention_mask must be [batch, {seq_length}] "
            f"(1 = token, 0 = padding), got shape {tuple(attention_mask.shape)}"
        )
    keep = attention_mask.bool()
    if bool(keep.all()):
        return None
    future = torch.ones(seq_length, seq_length, dtype=torch.bool, device=keep.device).triu(1)
    return future[None, None] | ~keep[:, None, None, :]


# The keywords of padding-free batches beside position_ids: flash attention's varlen arguments
# and the per-token sequence index (`DataCollatorWithFlattening(return_flash_attn_kwargs=True,
# return_seq_idx=True)`, TRL's padding-free collator).
FLASH_VARLEN_KEYWORDS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
PACKING_KEYWORDS = FLASH_VARLEN_KEYWORDS + ("seq_idx",)


def resolve_config_default(name: str, value: Any, hf_config: Any) -> Any:
    """A forward keyword as HF resolves it: the value passed, else the HF config's field of
    that name (`merge_with_config_defaults` for use_cache, the MoE forwards for
    output_router_logits)."""
    return value if value is not None else getattr(hf_config, name, None)


def _boundaries(document_ids: torch.Tensor) -> torch.Tensor:
    """bool [b, s]: True where a document begins (every row's first token, then each change
    of id)."""
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return starts


def _position_boundaries(position_ids: torch.Tensor, shape) -> torch.Tensor:
    """HF's `find_packed_sequence_indices` rule: a new document wherever a position is not
    its predecessor's plus one. [b, s] or [1, s] (broadcast) position ids -> bool [b, s]."""
    position_ids = position_ids.expand(shape)
    starts = torch.ones(shape, dtype=torch.bool, device=position_ids.device)
    starts[:, 1:] = position_ids[:, 1:] - position_ids[:, :-1] != 1
    return starts


def _cu_seq_lens_boundaries(cu_seq_lens: torch.Tensor, shape) -> torch.Tensor:
    """flash attention's cumulative lengths over the flattened [b * s] tokens -> bool [b, s]
    of document starts. ConfigError unless they run from 0 to b * s, strictly increasing,
    with every row's start among them (a document cannot continue into the next row)."""
    b, s = shape
    if cu_seq_lens.dim() != 1 or cu_seq_lens.is_floating_point() or cu_seq_lens.numel() < 2:
        raise ConfigError(
            f"transformed model forward: cu_seq_lens_q/k must be a 1-D integer tensor of "
            f"cumulative document lengths [documents + 1], got {tuple(cu_seq_lens.shape)} "
            f"{cu_seq_lens.dtype}")
    cu = cu_seq_lens.to(torch.long).cpu()
    if int(cu[0]) != 0 or int(cu[-1]) != b * s or bool((cu[1:] <= cu[:-1]).any()):
        raise ConfigError(
            f"transformed model forward: cu_seq_lens_q/k must increase strictly from 0 to the "
            f"batch's {b} x {s} = {b * s} tokens, got {cu.tolist()}")
    starts = torch.zeros(b * s, dtype=torch.bool)
    starts[cu[:-1]] = True
    starts = starts.view(b, s)
    if not bool(starts[:, 0].all()):
        raise ConfigError(
            f"transformed model forward: cu_seq_lens_q/k {cu.tolist()} run a document from one "
            f"row of the batch into the next (every multiple of the sequence length {s} must "
            "be a boundary); pack each row on its own")
    return starts.to(cu_seq_lens.device)


def packed_document_ids(
    shape, attention_mask: Optional[torch.Tensor], position_ids: Optional[torch.Tensor],
    use_cache: Optional[bool], cu_seq_lens_q: Optional[torch.Tensor] = None,
    cu_seq_lens_k: Optional[torch.Tensor] = None, max_length_q: Optional[int] = None,
    max_length_k: Optional[int] = None, seq_idx: Optional[torch.Tensor] = None,
    masks_read_position_ids: bool = True, attn_implementation: Optional[str] = None,
) -> Optional[torch.Tensor]:
    """The documents of a padding-free batch of `shape` (b, s), as HF decides them: document
    ids [b, s] int64 (runs of equal ids) for `GPTModel(document_ids=...)`, or None when every
    row is one sequence (plain causal attention).

    * From position_ids when `attention_mask` is None and no cache is in use (`use_cache`
      resolved False, see `resolve_config_default`): HF's masks
      (`masking_utils.find_packed_sequence_indices`) start a document wherever a position is
      not the previous one plus one. Not for a family whose HF model builds its masks
      without position ids (`masks_read_position_ids` False: the adapter's
      HF_MASKS_READ_POSITION_IDS), as HF does not either; a warning says so. Under a flash
      `attn_implementation` (the HF config's), HF's flash path decides instead: documents
      start where the position is the row's smallest, in a batch of one row only, whatever
      the cache.
    * From flash attention's `cu_seq_lens_q`/`cu_seq_lens_k` with `max_length_q`/`max_length_k`
      (all four, as HF's flash path reads them; cumulative lengths over the flattened b x s
      tokens), and from `seq_idx` [b, s] (each token's sequence index), whatever use_cache
      says. Position ids are not changed by them (HF's positions stay what was passed).
    What cannot be honoured, or boundaries that disagree with each other, is a ConfigError
    naming the keywords.
    """
    shape = tuple(shape)
    given = {name: value for name, value in zip(
        PACKING_KEYWORDS, (cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k, seq_idx))
        if value is not None}
    if given and attention_mask is not None:
        raise ConfigError(
            f"transformed model forward: {', '.join(given)} with an attention_mask: a padding "
            "mask and padding-free document boundaries do not combine (Hugging Face's flash "
            "path would drop the boundaries); pass one or the other")
    found = {}  # source -> bool [b, s] document starts
    flash_given = [name for name in FLASH_VARLEN_KEYWORDS if name in given]
    if flash_given:
        missing = [name for name in FLASH_VARLEN_KEYWORDS if name not in given]
        if missing:
            raise ConfigError(
                f"transformed model forward: {', '.join(flash_given)} without "
                f"{', '.join(missing)}: "
                "flash attention's padding-free arguments come as all four (Hugging Face "
                "ignores a partial set); pass all of them, or none and position_ids")
        if not torch.equal(cu_seq_lens_q.cpu(), cu_seq_lens_k.cpu()):
            raise ConfigError(
                "transformed model forward: cu_seq_lens_q differs from cu_seq_lens_k: queries "
                "and keys of other lengths (a cache or a prefix) are not supported; the "
                "documents of a padding-free batch give both the same lengths")
        starts = _cu_seq_lens_boundaries(cu_seq_lens_q, shape)
        longest = int((cu_seq_lens_q[1:] - cu_seq_lens_q[:-1]).max())
        for name, value in (("max_length_q", max_length_q), ("max_length_k", max_length_k)):
            if int(value) < longest:
                raise ConfigError(
                    f"transformed model forward: {name}={int(value)} is shorter than the "
                    f"longest document of cu_seq_lens ({longest})")
        found["cu_seq_lens_q/k"] = starts
    if seq_idx is not None:
        if tuple(seq_idx.shape) != shape or seq_idx.is_floating_point():
            raise ConfigError(
                f"transformed model forward: seq_idx must be integer ids of input_ids' shape "
                f"{list(shape)} (each token's sequence), got {tuple(seq_idx.shape)} "
                f"{seq_idx.dtype}")
        found["seq_idx"] = _boundaries(seq_idx)
    if position_ids is not None and position_ids.dim() == 1:
        position_ids = position_ids[None]  # HF expands [s] over the batch
    if position_ids is not None and attention_mask is None:
        if position_ids.dim() != 2 or position_ids.shape[1] != shape[1] \
                or position_ids.shape[0] not in (1, shape[0]):
            raise ConfigError(
                f"transformed model forward: position_ids must be [batch, {shape[1]}] (or "
                f"[1, {shape[1]}]), got {tuple(position_ids.shape)}")
        ignored = None  # (why HF does not read documents from them, what would)
        if "flash" in (attn_implementation or ""):
            # HF's flash path: `_is_packed_sequence`, `prepare_fa_kwargs_from_position_ids`.
            starts = position_ids.expand(shape) == position_ids.min()
            starts[:, 0] = True
            if shape[0] > 1:
                ignored = ("Hugging Face's flash attention reads them in a batch of one row "
                           "only", "flatten the batch into one row")
        else:
            starts = _position_boundaries(position_ids, shape)
            if not masks_read_position_ids:
                ignored = ("this family's Hugging Face model builds its attention masks "
                           "without them", "pass cu_seq_lens_q/k with max_length_q/k, or "
                           "seq_idx")
            elif use_cache:
                ignored = ("use_cache resolves to True (the call's or config.use_cache)",
                           "pass use_cache=False")
        if ignored is None and (found or bool(starts[:, 1:].any())):
            found["position_ids"] = starts
        elif ignored is not None and not found and bool(starts[:, 1:].any()):
            warnings.warn(
                f"transformed model forward: position_ids restart inside a row, but "
                f"{ignored[0]}, so, as in Hugging Face, the documents attend to each other; "
                f"{ignored[1]} for padding-free packing")
    if not found:
        return None
    (first_source, starts), *others = found.items()
    for source, other in others:
        if not torch.equal(other.to(starts.device), starts):
            rows, columns = (other.to(starts.device) != starts).nonzero()[0].tolist()
            raise ConfigError(
                f"transformed model forward: {source} and {first_source} put the document "
                f"boundaries in different places (first at row {rows}, token {columns}); "
                "pass boundaries that agree, or only one of them")
    if not bool(starts[:, 1:].any()):
        return None
    return starts.flatten().cumsum(0).view(shape) - 1


def causal_lm_output(loss: Optional[torch.Tensor], logits: Optional[torch.Tensor],
                     return_dict: bool, moe: bool = False):
    """HF's output object (`CausalLMOutputWithPast`, `MoeCausalLMOutputWithPast` for MoE
    models): `.loss`, `.logits`, `out["loss"]`; with return_dict=False HF's tuple (the
    fields that are not None, in order)."""
    from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

    kind = MoeCausalLMOutputWithPast if moe else CausalLMOutputWithPast
    output = kind(loss=loss, logits=logits)
    return output if return_dict else output.to_tuple()


__all__ = ["IGNORE_INDEX", "UNSUPPORTED_FORWARD_KEYWORDS", "HONOURED_FORWARD_KEYWORDS",
           "FLASH_VARLEN_KEYWORDS", "PACKING_KEYWORDS", "check_forward_keywords",
           "resolve_config_default", "packed_document_ids",
           "shift_labels", "targets_and_keep", "causal_lm_loss", "padding_to_attention_mask",
           "causal_lm_output"]
