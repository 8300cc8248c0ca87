"""Shared by the --sft tests: a ChatML tokenizer trained offline, and preprocessed chats."""
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__)))))
TINY_CHAT = os.path.join(ROOT, "data", "chat", "tiny_chat.jsonl")
sys.path.insert(0, os.path.join(ROOT, "tools"))

import preprocess_sft_data  # noqa: E402

# ChatML; {% generation %} marks what HF's return_assistant_tokens_mask reports, the
# reference our own span finding is checked against.
from make_tiny_llama import CHATML  # noqa: E402


def make_chat_tokenizer(directory, records, vocab_size=400):
    """Byte-level BPE trained on `records` in about a second; saves `directory/with` (ChatML
    template) and `directory/without` (no template)."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    corpus = [json.dumps(r) for r in records] * 2 + ["the quick brown fox jumps"] * 4
    trainer = ByteLevelBPETokenizer()
    trainer.train_from_iterator(corpus, vocab_size=vocab_size, show_progress=False,
                                special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    hf = PreTrainedTokenizerFast(tokenizer_object=trainer._tokenizer, eos_token="<|endoftext|>")
    hf.chat_template = CHATML
    hf.save_pretrained(os.path.join(directory, "with"))
    PreTrainedTokenizerFast(tokenizer_object=trainer._tokenizer, eos_token="<|endoftext|>") \
        .save_pretrained(os.path.join(directory, "without"))
    return os.path.join(directory, "with")


def make_sft_data(tokenizer_dir, directory, records):
    """Preprocess `records` (written as JSON lines); returns the --data-path prefix."""
    source = os.path.join(directory, "chat.jsonl")
    with open(source, "w") as handle:
        handle.write("".join(json.dumps(r) + "\n" for r in records))
    prefix = os.path.join(directory, "chat")
    preprocess_sft_data.preprocess(preprocess_sft_data.get_args([
        "--input", source, "--output-prefix", prefix, "--tokenizer-model", tokenizer_dir,
    ]))
    return prefix + "_text_document"


def tiny_chat_records():
    with open(TINY_CHAT) as handle:
        return [json.loads(line) for line in handle if line.strip()]
