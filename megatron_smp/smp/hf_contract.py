"""The Hugging Face causal-LM calling contract, in one place: which forward keywords a
transformed model honours, HF's label shift and ignore index, its mean loss, the padding mask,
and HF's output object. `transform`'s model, conversion checks and tests all use these.

HF's loss (transformers' `ForCausalLMLoss`): labels are shifted left by one (position i is
scored on labels[i + 1], the last position on nothing), positions whose shifted label is -100
are ignored, and the loss is the sum over the rest divided by their count (or by
`num_items_in_batch` when given, as HF's Trainer does under gradient accumulation).
"""
from __future__ import annotations

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
    "output_router_logits": ((None, False), "router logits are not returned; the "
                             "load-balancing loss is added inside the MoE layers"),
    "token_type_ids": (None, "token type embeddings are not part of the transformed model"),
    "head_mask": (None, "head masks are not supported"),
    "logits_to_keep": ((0,), "pass return_logits=True for the full logits"),
}

REJECTION_HINT = ("use the Hugging Face model itself for generation/inspection (the transformed "
                  "weights convert back with the translators, see hf_state_dict())")


def check_forward_keywords(extra: Dict[str, Any]) -> None:
    """ConfigError for a keyword the transformed model cannot honour (any value but the
    one meaning "not used"), or one HF's causal LMs do not take at all."""
    for name, value in extra.items():
        if name not in UNSUPPORTED_FORWARD_KEYWORDS:
            raise ConfigError(
                f"transformed model forward: unknown keyword {name!r}; it takes input_ids, "
                "attention_mask, position_ids, labels, shift_labels, num_items_in_batch, "
                "return_dict and return_logits"
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
    at all, -> None (the fused causal path). A 4-D bool mask passes through."""
    if attention_mask is None:
        return None
    if attention_mask.dim() == 4:
        if attention_mask.dtype != torch.bool:
            raise ConfigError(
                "transformed model forward: a 4-D attention_mask must be bool (True = masked); "
                "pass HF's [batch, seq] padding mask instead"
            )
        return attention_mask
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


def causal_lm_output(loss: Optional[torch.Tensor], logits: Optional[torch.Tensor],
                     return_dict: bool, moe: bool = False):
    """HF's output object (`CausalLMOutputWithPast`, `MoeCausalLMOutputWithPast` for MoE
    models): `.loss`, `.logits`, `out["loss"]`; with return_dict=False HF's tuple (the
    fields that are not None, in order)."""
    from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

    kind = MoeCausalLMOutputWithPast if moe else CausalLMOutputWithPast
    output = kind(loss=loss, logits=logits)
    return output if return_dict else output.to_tuple()


__all__ = ["IGNORE_INDEX", "UNSUPPORTED_FORWARD_KEYWORDS", "check_forward_keywords",
           "shift_labels", "targets_and_keep", "causal_lm_loss", "padding_to_attention_mask",
           "causal_lm_output"]
