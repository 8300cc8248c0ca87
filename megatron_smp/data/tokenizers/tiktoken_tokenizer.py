"""Megatron-LM's TikTokenizer: a tiktoken BPE over a JSON vocabulary, special tokens first.

The vocabulary file is a JSON list of {"rank": i, "token_bytes": base64, "token_str": ...}
with rank i at position i (the first 256 being the single bytes). Ids 0 .. N-1 are the N
special tokens (the named ones, then <SPECIAL_i> fillers), and token rank r is id N + r, for
`vocab_size - N` ranks. `eod` is the id of "</s>". The `tiktoken` package is optional: it is
imported only when this tokenizer is built.
"""
from __future__ import annotations

import base64
import json
import os
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from megatron_smp.data.tokenizers.base import MegatronTokenizer

PATTERNS = {
    "v1": r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    "v2": (
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
        r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
        r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ),
}
DEFAULT_VOCAB_SIZE = 2**17
# The named special tokens megatron-core requires (and its default list); Megatron's
# --legacy-tokenizer class requires only the first three.
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>"]
LEGACY_SPECIAL_TOKENS = SPECIAL_TOKENS[:3]


def _config_error(message: str):
    from megatron_smp.config import ConfigError

    return ConfigError(message)


def load_ranks(path: str, max_ranks: int) -> Dict[bytes, int]:
    """The first `max_ranks` entries of a Megatron TikTokenizer JSON vocabulary: bytes -> rank."""
    if not path or not os.path.isfile(path) or not path.endswith(".json"):
        raise _config_error(
            f"--tokenizer-model {path!r}: TikTokenizer needs its JSON vocabulary file "
            "(a list of {rank, token_bytes, token_str})"
        )
    with open(path, "r", encoding="utf-8") as handle:
        vocabulary = json.load(handle)
    ranks: Dict[bytes, int] = {}
    for i, entry in enumerate(vocabulary[:max_ranks] if isinstance(vocabulary, list) else [None]):
        if not isinstance(entry, dict) or set(entry) != {"rank", "token_bytes", "token_str"} \
                or entry["rank"] != i:
            raise _config_error(f"--tokenizer-model {path}: entry {i} is not "
                                f"{{'rank': {i}, 'token_bytes': ..., 'token_str': ...}}")
        token = base64.b64decode(entry["token_bytes"])
        if i < 256 and token != bytes([i]):
            raise _config_error(f"--tokenizer-model {path}: rank {i} must be the byte {i}")
        ranks[token] = i
    if len(ranks) != len(vocabulary[:max_ranks]):
        raise _config_error(f"--tokenizer-model {path}: repeated token bytes")
    return ranks


class TikTokenizer(MegatronTokenizer):
    """Megatron's TikTokenizer (megatron-core's by default, the --legacy-tokenizer one with
    `legacy=True`: three required special tokens and special-token text encoded as text)."""

    def __init__(
        self,
        path: str,
        pattern: Optional[str] = None,
        vocab_size: Optional[int] = None,
        num_special_tokens: int = 1000,
        special_tokens: Optional[Sequence[str]] = None,
        legacy: bool = False,
    ) -> None:
        try:
            import tiktoken
        except ImportError:
            raise _config_error(
                "--tokenizer-type TikTokenizer needs the tiktoken package: "
                "pip install 'megatron_smp[tiktoken]' (or pip install tiktoken)"
            ) from None
        if pattern is None and legacy:
            raise _config_error("--tokenizer-type TikTokenizer with --legacy-tokenizer needs "
                                "--tiktoken-pattern v1|v2")
        pattern = pattern or "v2"  # megatron-core's default
        if pattern not in PATTERNS:
            raise _config_error(f"--tiktoken-pattern {pattern!r}: use v1 or v2")
        required = LEGACY_SPECIAL_TOKENS if legacy else SPECIAL_TOKENS
        special_tokens = list(special_tokens) if special_tokens else list(required)
        vocab_size = int(vocab_size or DEFAULT_VOCAB_SIZE)
        if len(set(special_tokens)) != len(special_tokens):
            raise _config_error(f"--tokenizer-special-tokens {special_tokens}: repeated tokens")
        if not set(required) <= set(special_tokens):
            raise _config_error(f"--tokenizer-special-tokens must include {required}")
        if not len(special_tokens) <= num_special_tokens < vocab_size:
            raise _config_error(
                f"--tiktoken-num-special-tokens {num_special_tokens} must be at least the "
                f"{len(special_tokens)} special tokens and below --vocab-size {vocab_size}"
            )
        special_tokens += [f"<SPECIAL_{i}>" for i in range(len(special_tokens),
                                                            num_special_tokens)]
        ranks = load_ranks(path, vocab_size - num_special_tokens)
        if len(ranks) != vocab_size - num_special_tokens:
            raise _config_error(
                f"--tokenizer-model {path} has {len(ranks)} tokens; with "
                f"--tiktoken-num-special-tokens {num_special_tokens}, --vocab-size must be "
                f"at most {len(ranks) + num_special_tokens} (it is {vocab_size}; default "
                f"{DEFAULT_VOCAB_SIZE})"
            )
        self._legacy = legacy
        self._vocab_size = vocab_size
        self._special_ids = {token: i for i, token in enumerate(special_tokens)}
        self._eos = self._special_ids["</s>"]
        self._bos = self._special_ids["<s>"]
        self._pad = self._special_ids.get("<pad>", self._eos)
        self.model = tiktoken.Encoding(
            name=Path(path).parent.name,
            pat_str=PATTERNS[pattern],
            mergeable_ranks={token: rank + num_special_tokens for token, rank in ranks.items()},
            special_tokens=self._special_ids,
        )

    def tokenize(self, text: str) -> List[int]:
        if self._legacy:
            return self.model.encode_ordinary(text)
        return self.model.encode(text, allowed_special="all")

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.model.decode([int(token) for token in ids])

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod(self) -> int:
        return self._eos

    @property
    def eos(self) -> int:
        return self._eos

    @property
    def bos(self) -> int:
        return self._bos

    @property
    def pad(self) -> int:
        return self._pad
