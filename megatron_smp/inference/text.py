"""Text in and out of the engine: one interface over our tokenizers (`MegatronTokenizer`:
tokenize / detokenize / eod) and Hugging Face's (encode / decode / eos_token_id), chat
templates, and stop strings.
"""
from __future__ import annotations

import os
from typing import List, Optional, Sequence

from megatron_smp.config import ConfigError


class TextCodec:
    """`encode(text)`, `decode(ids)`, `token_text(id)`, `eos_id`, `chat(messages)`.

    `chat_template`: a Jinja template (or a file holding one) used instead of the
    tokenizer's own (`--chat-template`)."""

    def __init__(self, tokenizer, chat_template: Optional[str] = None) -> None:
        self.tokenizer = tokenizer
        self.hf = getattr(tokenizer, "tokenizer", None) if hasattr(tokenizer, "detokenize") \
            else tokenizer
        if chat_template is not None and os.path.isfile(chat_template):
            with open(chat_template) as handle:
                chat_template = handle.read()
        self.chat_template = chat_template

    def encode(self, text: str) -> List[int]:
        if hasattr(self.tokenizer, "tokenize") and hasattr(self.tokenizer, "detokenize"):
            return list(self.tokenizer.tokenize(text))
        return list(self.tokenizer.encode(text))

    def decode(self, ids: Sequence[int]) -> str:
        if hasattr(self.tokenizer, "detokenize"):
            return self.tokenizer.detokenize(list(ids))
        return self.tokenizer.decode(list(ids))

    def token_text(self, token: int) -> str:
        return self.decode([token])

    @property
    def eos_id(self) -> Optional[int]:
        if hasattr(self.tokenizer, "eod"):
            return self.tokenizer.eod
        return getattr(self.tokenizer, "eos_token_id", None)

    @property
    def bos_id(self) -> Optional[int]:
        bos = getattr(self.tokenizer, "bos", None)
        if bos is None:
            bos = getattr(self.tokenizer, "bos_token_id", None)
        return None if bos is None or bos < 0 else bos

    def chat(self, messages: List[dict]) -> List[int]:
        """Prompt ids of a conversation: the chat template rendered with the generation
        prompt, then tokenized as it is (the template writes its own special tokens)."""
        template = self.chat_template
        if self.hf is None or not hasattr(self.hf, "apply_chat_template") or (
                template is None and not getattr(self.hf, "chat_template", None)):
            raise ConfigError("chat completions need a chat template: the tokenizer has none; "
                              "start the server with --chat-template FILE")
        text = self.hf.apply_chat_template(messages, chat_template=template, tokenize=False,
                                           add_generation_prompt=True)
        return list(self.hf.encode(text, add_special_tokens=False))

    def output_text(self, prompt: Sequence[int], output: Sequence[int]) -> str:
        """The text the output adds to the prompt: decoded after it, so the spaces and
        merged characters a tokenizer writes from the context (SentencePiece's leading
        space) come out as they will read."""
        before = self.decode(prompt)
        whole = self.decode(list(prompt) + list(output))
        return whole[len(before):] if whole.startswith(before) else self.decode(output)

    def find_stop(self, prompt: Sequence[int], output: Sequence[int],
                  stops: Sequence[str]) -> Optional[str]:
        """The stop string that occurs first in the output's text, or None."""
        if not stops:
            return None
        text = self.output_text(prompt, output)
        found = [(text.find(s), s) for s in stops if s and s in text]
        return min(found)[1] if found else None

    def completion_text(self, request) -> str:
        """A request's output text, cut before the stop string that ended it (OpenAI's)."""
        text = self.output_text(request.prompt, request.output)
        if request.stop_string:
            text = text[: text.find(request.stop_string)]
        return text

    def stop_checker(self, request) -> Optional[str]:
        return self.find_stop(request.prompt, request.output, request.params.stop)


__all__ = ["TextCodec"]
