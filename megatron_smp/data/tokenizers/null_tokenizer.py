"""NullTokenizer: text is already space-separated token ids (Megatron-LM's `_NullTokenizer`)."""
from __future__ import annotations

from typing import List, Sequence

from megatron_smp.data.tokenizers.base import MegatronTokenizer


class NullTokenizer(MegatronTokenizer):
    """Ids `0 .. vocab_size-1` come from the text; `eod` is the extra id `vocab_size`."""

    def __init__(self, vocab_size: int) -> None:
        self._vocab_size_without_eod = int(vocab_size)

    def tokenize(self, text: str) -> List[int]:
        ids = [int(piece) for piece in text.split()]
        for token in ids:
            if not 0 <= token <= self._vocab_size_without_eod:
                raise ValueError(
                    f"NullTokenizer: id {token} outside [0, {self._vocab_size_without_eod}] "
                    "(--vocab-size)"
                )
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(token)) for token in ids)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size_without_eod + 1

    @property
    def eod(self) -> int:
        return self._vocab_size_without_eod
