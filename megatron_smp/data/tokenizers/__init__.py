"""Tokenizers behind one interface (`MegatronTokenizer`) and `build_tokenizer(DataConfig)`."""
from __future__ import annotations

from megatron_smp.data.tokenizers.base import MegatronTokenizer
from megatron_smp.data.tokenizers.gpt2_bpe_tokenizer import GPT2BPETokenizer
from megatron_smp.data.tokenizers.huggingface_tokenizer import HuggingFaceTokenizer
from megatron_smp.data.tokenizers.null_tokenizer import NullTokenizer
from megatron_smp.data.tokenizers.sentencepiece_tokenizer import (
    GPTSentencePieceTokenizer,
    Llama2Tokenizer,
    SentencePieceTokenizer,
)

TOKENIZER_TYPES = (
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "Llama2Tokenizer",
    "HuggingFaceTokenizer",
    "GPT2BPETokenizer",
    "NullTokenizer",
    "TikTokenizer",
)


_SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")


def build_tokenizer(data_config) -> MegatronTokenizer:
    """Build the tokenizer `data_config.tokenizer_type` names (a DataConfig or argparse args).

    As in Megatron-LM, `legacy_tokenizer` (--legacy-tokenizer) picks megatron/training's
    tokenizer classes; without it, megatron-core's, which differ for SentencePiece (eod)
    and Hugging Face tokenizers (no bos / template tokens unless
    `tokenizer_hf_include_special_tokens`).
    """
    from megatron_smp.config import ConfigError

    kind = data_config.tokenizer_type
    model = getattr(data_config, "tokenizer_model", None)

    def need_model() -> str:
        if not model:
            raise ConfigError(f"--tokenizer-type {kind} needs --tokenizer-model")
        return model

    if kind in _SENTENCEPIECE_TYPES and not getattr(data_config, "legacy_tokenizer", False):
        # megatron-core's tokenizers (Megatron's default): every SentencePiece type is the
        # model's pieces as they are, eod = the model's eos, no bos added.
        return GPTSentencePieceTokenizer(need_model())
    if kind == "SentencePieceTokenizer":
        return SentencePieceTokenizer(need_model(), getattr(data_config, "vocab_extra_ids", 0))
    if kind == "GPTSentencePieceTokenizer":
        return GPTSentencePieceTokenizer(need_model())
    if kind == "Llama2Tokenizer":
        return Llama2Tokenizer(need_model())
    if kind == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(need_model(), include_special_tokens=bool(
            getattr(data_config, "legacy_tokenizer", False)
            or getattr(data_config, "tokenizer_hf_include_special_tokens", False)))
    if kind == "GPT2BPETokenizer":
        return GPT2BPETokenizer(data_config.vocab_file, data_config.merge_file)
    special_tokens = getattr(data_config, "tokenizer_special_tokens", None)
    if special_tokens and kind != "TikTokenizer":
        raise ConfigError(f"--tiktoken-special-tokens is only read by --tokenizer-type "
                          f"TikTokenizer, not {kind}; drop it")
    if kind == "TikTokenizer":
        from megatron_smp.data.tokenizers.tiktoken_tokenizer import TikTokenizer

        # --tiktoken-pattern and --tiktoken-num-special-tokens are read here only: with
        # another --tokenizer-type Megatron ignores them too (its llama3 script passes
        # --tiktoken-pattern v2 with NullTokenizer).
        return TikTokenizer(
            need_model(),
            pattern=getattr(data_config, "tiktoken_pattern", None),
            vocab_size=getattr(data_config, "vocab_size", None),
            num_special_tokens=int(getattr(data_config, "tiktoken_num_special_tokens", 1000)),
            special_tokens=special_tokens,
            legacy=bool(getattr(data_config, "legacy_tokenizer", False)),
        )
    if kind == "NullTokenizer":
        vocab_size = getattr(data_config, "vocab_size", None)
        if vocab_size is None or int(vocab_size) < 1:
            raise ConfigError("--tokenizer-type NullTokenizer needs --vocab-size N (N >= 1)")
        return NullTokenizer(int(vocab_size))
    raise ConfigError(
        f"--tokenizer-type {kind!r} is not supported; use one of {', '.join(TOKENIZER_TYPES)}"
    )


__all__ = [
    "MegatronTokenizer",
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "Llama2Tokenizer",
    "HuggingFaceTokenizer",
    "GPT2BPETokenizer",
    "NullTokenizer",
    "TOKENIZER_TYPES",
    "build_tokenizer",
]
