"""Any Hugging Face tokenizer saved in a local directory (`--tokenizer-model DIR`)."""
from __future__ import annotations

import os
from typing import List, Sequence

from megatron_smp.data.tokenizers.base import MegatronTokenizer


class HuggingFaceTokenizer(MegatronTokenizer):
    """`include_special_tokens`: ids as `tokenizer(text).input_ids` (with the bos / template
    tokens the tokenizer adds: Megatron's --legacy-tokenizer or
    --tokenizer-hf-include-special-tokens); without, the text's own tokens only, as
    megatron-core's default tokenizer gives them."""

    def __init__(self, path: str, include_special_tokens: bool = True) -> None:
        self.include_special_tokens = include_special_tokens
        if not os.path.isdir(path):
            from megatron_smp.config import ConfigError

            raise ConfigError(
                f"--tokenizer-model: {path} is not a directory; HuggingFaceTokenizer loads a "
                "local directory written by save_pretrained (nothing is downloaded)"
            )
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        eod = self.tokenizer.eos_token_id
        self._eod = eod if eod is not None else self.tokenizer.sep_token_id
        if self._eod is None:
            from megatron_smp.config import ConfigError

            raise ConfigError(f"--tokenizer-model: the tokenizer in {path} has no eos token")

    def tokenize(self, text: str) -> List[int]:
        if self.include_special_tokens:
            return self.tokenizer(text).input_ids
        return self.tokenizer.convert_tokens_to_ids(self.tokenizer.tokenize(text))

    def token_to_id(self, token: str):
        return self.tokenizer.get_vocab().get(token)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode([int(token) for token in ids])

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def pad(self) -> int:
        pad = self.tokenizer.pad_token_id
        return self._eod if pad is None else pad

    @property
    def bos(self) -> int:
        bos = self.tokenizer.bos_token_id
        return -1 if bos is None else bos
