"""SentencePiece tokenizers with Megatron-LM's id assignment.

Megatron's default (megatron-core's tokenizers) is `GPTSentencePieceTokenizer` for every
SentencePiece type; the other two are its `--legacy-tokenizer` classes.
`SentencePieceTokenizer` appends Megatron's special tokens (<CLS>, <SEP>, <EOD>, <MASK>, and
<PAD>/<BOS>/<EOS> when the model has none) after the model's pieces, in Megatron-LM's order, so
ids (and `eod`) in data preprocessed by Megatron-LM mean the same here.
`GPTSentencePieceTokenizer` and `Llama2Tokenizer` use the model's own eos as `eod`.
"""
from __future__ import annotations

import os
from typing import Dict, List, Sequence

from megatron_smp.data.tokenizers.base import MegatronTokenizer


def _load_processor(model_file: str):
    import sentencepiece

    if not os.path.isfile(model_file):
        from megatron_smp.config import ConfigError

        raise ConfigError(
            f"--tokenizer-model: {model_file} not found; train one with tools/train_tokenizer.py"
        )
    return sentencepiece.SentencePieceProcessor(model_file=model_file)


def _piece_or(processor, piece_id: int, fallback: str) -> str:
    if 0 <= piece_id < processor.get_piece_size():
        return processor.id_to_piece(piece_id)
    return fallback


class SentencePieceTokenizer(MegatronTokenizer):
    def __init__(self, model_file: str, vocab_extra_ids: int = 0) -> None:
        self.processor = _load_processor(model_file)
        self._vocab: Dict[str, int] = {
            self.processor.id_to_piece(i): i for i in range(self.processor.get_piece_size())
        }
        self._vocab_size = len(self._vocab)
        self.special_tokens: Dict[str, int] = {}

        def add_special_token(token: str) -> int:
            if token not in self._vocab:
                self._vocab[token] = self._vocab_size
                self._vocab_size += 1
            self.special_tokens[token] = self._vocab[token]
            return self._vocab[token]

        self._cls = add_special_token("<CLS>")
        self._sep = add_special_token("<SEP>")
        self._eod = add_special_token("<EOD>")
        self._mask = add_special_token("<MASK>")
        self._pad = add_special_token(_piece_or(self.processor, self.processor.pad_id(), "<PAD>"))
        self._bos = add_special_token(_piece_or(self.processor, self.processor.bos_id(), "<BOS>"))
        self._eos = add_special_token(_piece_or(self.processor, self.processor.eos_id(), "<EOS>"))
        for i in range(vocab_extra_ids):
            add_special_token(f"<extra_id_{i}>")
        self._special_by_id = {token_id: token for token, token_id in self.special_tokens.items()}

    def tokenize(self, text: str) -> List[int]:
        # Special tokens written literally in the text map to their ids, as in Megatron-LM.
        ids: List[int] = []
        start = 0
        while True:
            found = [(text.find(token, start), token) for token in self.special_tokens]
            found = [(position, token) for position, token in found if position >= 0]
            if not found:
                break
            position, token = min(found)
            ids.extend(self.processor.encode_as_ids(text[start:position]))
            ids.append(self.special_tokens[token])
            start = position + len(token)
        ids.extend(self.processor.encode_as_ids(text[start:]))
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        text, last = "", 0
        ids = [int(token) for token in ids]
        for i, token in enumerate(ids):
            if token in self._special_by_id:
                text += f"{self.processor.decode_ids(ids[last:i])} {self._special_by_id[token]} "
                last = i + 1
        return text + self.processor.decode_ids(ids[last:])

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def pad(self) -> int:
        return self._pad

    @property
    def bos(self) -> int:
        return self._bos

    @property
    def eos(self) -> int:
        return self._eos


class GPTSentencePieceTokenizer(MegatronTokenizer):
    """The model's pieces only; `eod` is the model's eos."""

    def __init__(self, model_file: str) -> None:
        self.processor = _load_processor(model_file)

    def tokenize(self, text: str) -> List[int]:
        return self.processor.encode_as_ids(text)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.processor.decode_ids([int(token) for token in ids])

    @property
    def vocab_size(self) -> int:
        return self.processor.get_piece_size()

    @property
    def eod(self) -> int:
        return self.processor.eos_id()

    @property
    def pad(self) -> int:
        return self.processor.pad_id()

    @property
    def bos(self) -> int:
        return self.processor.bos_id()


class Llama2Tokenizer(GPTSentencePieceTokenizer):
    """As GPTSentencePieceTokenizer, with bos prepended to every document (Llama-2 style)."""

    def tokenize(self, text: str) -> List[int]:
        return [self.processor.bos_id()] + self.processor.encode_as_ids(text)
