"""The interface every tokenizer implements, as the data pipeline and training use it."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import List, Sequence


class MegatronTokenizer(ABC):
    """`tokenize(str) -> ids`, `detokenize(ids) -> str`, `eod`, `pad`, `vocab_size`.

    `vocab_size` counts every id the tokenizer can emit (special tokens included); the model
    pads it further to a multiple of make_vocab_size_divisible_by x TP.
    """

    @abstractmethod
    def tokenize(self, text: str) -> List[int]:
        ...

    @abstractmethod
    def detokenize(self, ids: Sequence[int]) -> str:
        ...

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        ...

    @property
    @abstractmethod
    def eod(self) -> int:
        ...

    @property
    def pad(self) -> int:
        return self.eod

    @property
    def bos(self) -> int:
        return -1

    @property
    def eos(self) -> int:
        return self.eod

    def token_to_id(self, token: str):
        """The id of a (special) token of the vocabulary, or None (--fim-data's tokens)."""
        return None
