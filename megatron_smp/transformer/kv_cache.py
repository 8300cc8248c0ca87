"""The seam between the attention layers and an inference key/value cache.

Inference runs the training model on a step's new tokens only, all requests' tokens flattened
into one sequence of T tokens (`[T, 1, h]` activations, batch 1), and hands the layers a
`KVCacheContext` where training hands them an attention mask. The layers compute their
projections, norms and RoPE as in training, then give the cache their new keys/values and
queries: the cache stores the keys/values and returns each query's attention over its own
request's cached tokens. Recurrent mixers (Mamba-2, Gated DeltaNet) keep no keys: they
hand the cache a step function over their projected rows, and the cache runs it request group
by group with each request's recurrent state (conv state + SSM / delta-rule state), which it
keeps in a fixed-size slot per request. The engine that implements the context lives in
`megatron_smp.inference`; the layers only know this interface.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence, Tuple

import torch


class KVCacheContext:
    """One inference step's view of the cache, passed through the layers as attention_mask."""

    def attend(self, layer_number: int, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, scale: Optional[float] = None,
               window_size: Optional[Tuple[int, int]] = None,
               sinks: Optional[torch.Tensor] = None,
               alibi_slopes: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Store this layer's new key/value [T, 1, ng, d] (value [T, 1, ng, dv]) and attend:
        query [T, 1, nh, d] -> context [T, 1, nh, dv] (causal within each request, over the
        keys `window_size` allows, with sinks and ALiBi as the training attention has them)."""
        raise NotImplementedError

    def attend_latent(self, layer_number: int, query: torch.Tensor, latent: torch.Tensor,
                      latent_dim: int, scale: float) -> torch.Tensor:
        """Multi-latent attention with absorbed up-projections: store latent [T, r + pos]
        (the normed kv latent, then the rotated positional key) and attend with
        query [T, nh, r + pos] (q_nope absorbed into the latent space, then q_pos) over the
        cached latents as keys and their first `latent_dim` channels as values
        -> [T, nh, latent_dim]."""
        raise NotImplementedError

    def recurrent(self, layer_number: int, inputs: Sequence[torch.Tensor],
                  step: Callable) -> Tuple[torch.Tensor, ...]:
        """Run a recurrent mixer over the step's rows: `inputs` [T, ...] each (the step's
        flattened tokens) -> outputs [T, ...] (padding rows zero). The cache calls
        `step(rows, lengths, states)` once per group of requests with rows [n, L, ...] (each
        request's new tokens, right-padded to the group's longest), lengths [n] (its real
        tokens; padding must leave the state as it is) and states (the layer's state tensors
        [n, ...], zero for a request's first tokens); step returns (outputs [n, L, ...],
        new states [n, ...]), which the cache keeps for the next step."""
        raise NotImplementedError


__all__ = ["KVCacheContext"]
