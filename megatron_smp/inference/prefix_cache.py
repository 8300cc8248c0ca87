"""Prefix caching: the full-attention KV blocks of a prompt prefix, shared by the requests
that start with it (`--inference-dynamic-batching-prefix-caching`, Megatron-LM's flag).

A block that a prompt fills completely is known by a hash chained over the prompt up to its
end (sha256 of the previous block's hash and this block's token ids), so equal hashes mean
equal tokens at equal positions, hence equal keys and values in every layer. A new request
takes the blocks of its longest hashed prefix (never its last prompt token: the step needs
that token's logits) and computes only the rest of its prompt; blocks are reference-counted.
A block is hashed when the step that computes its last token is planned (with chunked
prefill, a prompt's blocks one chunk at a time): within a step every layer writes the step's
keys before any query reads, so a request admitted in the same step may already share them,
and no request reads a block whose keys are still to come.

When the last request holding a hashed block leaves, the eviction policy decides
(`--inference-dynamic-batching-prefix-caching-eviction-policy`, Megatron-LM's choices):
`ref_zero` frees it at once (prefixes are shared by requests that overlap in time), `lru`
keeps it cached until a new block is needed and no free one is left, evicting the least
recently used first (prefixes are shared across requests that come one after another too).
Sliding-window rings and recurrent states are overwritten as a request goes on, so prefix
caching needs a model whose layers all keep full attention.
"""
from __future__ import annotations

import collections
import hashlib
from typing import Dict, List, Sequence

from megatron_smp.config import ConfigError
from megatron_smp.inference.kv_cache import BlockAllocator, blocks_for

EVICTION_POLICIES = ("ref_zero", "lru")


def block_hashes(prompt: Sequence[int], block_size: int) -> List[bytes]:
    """The chained hashes of the prompt's full blocks (one per block of `block_size`)."""
    hashes, previous = [], b""
    for start in range(0, len(prompt) - block_size + 1, block_size):
        digest = hashlib.sha256(previous)
        digest.update(",".join(map(str, prompt[start:start + block_size])).encode())
        previous = digest.digest()
        hashes.append(previous)
    return hashes


class PrefixCachingAllocator(BlockAllocator):
    """The full-attention blocks with prefix sharing: `allocate` / `free` / `num_free` as a
    `BlockAllocator` (num_free counts cached blocks nobody holds, which `lru` may evict),
    plus `admit` for a request's whole block table. Counts: `prompt_tokens` (admitted),
    `cached_tokens` (of those, read from shared blocks instead of computed)."""

    def __init__(self, num_blocks: int, block_size: int, eviction_policy: str = "ref_zero"):
        if eviction_policy not in EVICTION_POLICIES:
            raise ConfigError("--inference-dynamic-batching-prefix-caching-eviction-policy "
                              f"must be one of {EVICTION_POLICIES}, got {eviction_policy!r}")
        super().__init__(num_blocks)
        self.block_size = block_size
        self.eviction_policy = eviction_policy
        self.references: Dict[int, int] = {}
        self.block_of: Dict[bytes, int] = {}
        self.hash_of: Dict[int, bytes] = {}
        self.unused: "collections.OrderedDict[int, None]" = collections.OrderedDict()  # lru
        self.prompt_tokens = 0
        self.cached_tokens = 0

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self.unused)

    @property
    def num_cached(self) -> int:
        """Hashed blocks (held or kept by `lru`)."""
        return len(self.block_of)

    @property
    def num_held(self) -> int:
        """Distinct blocks running requests hold."""
        return len(self.references)

    def _forget(self, block: int) -> None:
        digest = self.hash_of.pop(block, None)
        if digest is not None:
            del self.block_of[digest]

    def allocate(self, count: int) -> List[int]:
        if count > self.num_free:
            raise RuntimeError(f"KV cache: {count} blocks asked, {self.num_free} free")
        fresh = super().allocate(min(count, len(self._free)))
        while len(fresh) < count:  # evict the least recently used cached blocks
            block, _ = self.unused.popitem(last=False)
            self._forget(block)
            fresh.append(block)
        for block in fresh:
            self.references[block] = 1
        return fresh

    def free(self, blocks: Sequence[int]) -> None:
        released = []
        for block in blocks:
            self.references[block] -= 1
            if self.references[block] > 0:
                continue
            del self.references[block]
            if block in self.hash_of and self.eviction_policy == "lru":
                self.unused[block] = None  # most recently used last
            else:
                self._forget(block)
                released.append(block)
        super().free(released)

    def admit(self, prompt: Sequence[int], total_tokens: int, share: bool = True):
        """The block table for a request of `prompt` and `total_tokens` in all, or None when
        it does not fit yet: (table, tokens already cached). `share=False` (a request that
        wants every prompt token's log-prob) computes its whole prompt."""
        hashes = block_hashes(prompt, self.block_size)
        hits: List[int] = []
        if share:
            for digest in hashes[: (len(prompt) - 1) // self.block_size]:
                block = self.block_of.get(digest)
                if block is None:
                    break
                hits.append(block)
        needed = blocks_for(total_tokens, self.block_size) - len(hits)
        if needed > self.num_free - sum(1 for b in hits if b in self.unused):
            return None
        for block in hits:
            self.unused.pop(block, None)
            self.references[block] = self.references.get(block, 0) + 1
        table = hits + self.allocate(needed)
        cached = len(hits) * self.block_size
        self.prompt_tokens += len(prompt)
        self.cached_tokens += cached
        return table, cached

    def register(self, prompt: Sequence[int], table: Sequence[int], computed: int) -> None:
        """Hash the request's full blocks within the first `computed` prompt tokens (those
        whose keys are in the cache, or written by the step being planned), so that later
        requests share them; a block already known under its hash stays as it is."""
        for index, digest in enumerate(block_hashes(prompt[:computed], self.block_size)):
            if digest not in self.block_of and table[index] not in self.hash_of:
                self.block_of[digest] = table[index]
                self.hash_of[table[index]] = digest


__all__ = ["EVICTION_POLICIES", "PrefixCachingAllocator", "block_hashes"]
