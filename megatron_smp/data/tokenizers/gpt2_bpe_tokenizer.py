"""GPT-2 byte-level BPE from an OpenAI-style vocab.json (encoder) and merges.txt.

Wraps the `tokenizers` library's BPE model with GPT-2's byte-level pre-tokenizer (the same
regex and byte-to-unicode table as OpenAI's encoder.py), so ids match Megatron-LM's
GPT2BPETokenizer. `<|endoftext|>` is the end-of-document id.
"""
from __future__ import annotations

import json
import os
from typing import List, Sequence

from megatron_smp.data.tokenizers.base import MegatronTokenizer

END_OF_TEXT = "<|endoftext|>"


class GPT2BPETokenizer(MegatronTokenizer):
    def __init__(self, vocab_file: str, merge_file: str) -> None:
        from megatron_smp.config import ConfigError

        for flag, path in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
            if not path or not os.path.isfile(path):
                raise ConfigError(
                    f"{flag}: {path!r} not found; GPT2BPETokenizer needs both --vocab-file "
                    "(vocab.json) and --merge-file (merges.txt)"
                )
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        with open(vocab_file, encoding="utf-8") as handle:
            self.encoder = json.load(handle)
        if END_OF_TEXT not in self.encoder:
            raise ConfigError(f"--vocab-file: {vocab_file} has no {END_OF_TEXT} entry")
        self.tokenizer = Tokenizer(models.BPE.from_file(vocab_file, merge_file))
        self.tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        self.tokenizer.decoder = decoders.ByteLevel()
        self._eod = self.encoder[END_OF_TEXT]

    def token_to_id(self, token: str):
        return self.encoder.get(token)

    def tokenize(self, text: str) -> List[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode([int(token) for token in ids], skip_special_tokens=False)

    @property
    def vocab_size(self) -> int:
        return len(self.encoder)

    @property
    def eod(self) -> int:
        return self._eod
