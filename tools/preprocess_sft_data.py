"""Tokenise chat JSON lines for --sft: tokens plus a loss mask on the assistant's tokens.

    python tools/preprocess_sft_data.py --input chats.jsonl --output-prefix data/chat \
        --tokenizer-model hf_tokenizer_dir --seq-length 2048

Each line is a conversation, `{"messages": [{"role": "user", "content": ...},
{"role": "assistant", "content": ...}, ...]}`, or a prompt/response pair `{"prompt": ...,
"response": ...}` (a user turn and an assistant turn). The tokenizer directory's own chat
template (`chat_template` of its tokenizer_config.json or chat_template.jinja) renders the
conversation, or `--sft-tokenizer-prompt-format chatml|llama3` a named one.

Writes `{prefix}_text_document.bin/.idx` (token ids, one document per conversation) and
`{prefix}_text_document_loss_mask.bin/.idx` (uint8, same sizes: 1 on the tokens of the
assistant's turns, as the template renders them, 0 elsewhere). Train with
`--sft --data-path {prefix}_text_document`.

An assistant turn's tokens are those whose text lies between the rendering of the
conversation before that turn (with the generation prompt) and the rendering through it
(less trailing whitespace);
the template must render a conversation's beginning as a prefix of the whole (all common
chat templates do), else the line is refused.

`--preference` reads preference pairs in TRL's layouts instead: `{"prompt", "chosen",
"rejected"}` with strings (a user turn, then one assistant turn each) or message lists (the
prompt's turns, then the chosen / rejected assistant turns), `{"messages", "chosen",
"rejected"}` (the prompt as "messages"), or `{"chosen", "rejected"}` conversations that share
their prompt turns (TRL's implicit prompt). Each pair becomes two consecutive documents,
prompt + chosen then prompt + rejected, with the loss mask on the chosen / rejected turns
only (not on earlier assistant turns of the prompt); `--seq-length` then bounds the pair
(the two are packed together). Train with `train_dpo.py --data-path {prefix}_text_document`.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import List, Optional, Tuple

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_smp.cli import run_entry  # noqa: E402

from megatron_smp.data.indexed_dataset import (  # noqa: E402
    IndexedDatasetBuilder,
    data_file_path,
    index_file_path,
    optimal_dtype,
)
from megatron_smp.data.sft_dataset import loss_mask_prefix  # noqa: E402


class BadInputError(Exception):
    pass


# Named chat templates (--sft-tokenizer-prompt-format) for tokenizers that carry none, or to
# override theirs. The special markers are text to the template: a tokenizer that has them as
# special tokens encodes them as one token each.
PROMPT_FORMATS = {
    "chatml": (
        "{% for message in messages %}"
        "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    ),
    "llama3": (
        "{{ '<|begin_of_text|>' }}"
        "{% for message in messages %}"
        "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + "
        "message['content'] | trim + '<|eot_id|>' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}"
        "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
    ),
}


def load_chat_tokenizer(path: str, prompt_format: Optional[str] = None):
    """The HF fast tokenizer of directory `path` with its own chat template, or the named
    `prompt_format` (PROMPT_FORMATS)."""
    if not path or not os.path.isdir(path):
        raise BadInputError(f"--tokenizer-model {path}: not a Hugging Face tokenizer directory")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if prompt_format is not None:
        tokenizer.chat_template = PROMPT_FORMATS[prompt_format]
    if not getattr(tokenizer, "chat_template", None):
        raise BadInputError(
            f"--tokenizer-model {path}: the tokenizer has no chat template (no chat_template "
            "in tokenizer_config.json, no chat_template.jinja); add one to the directory or "
            f"name one with --sft-tokenizer-prompt-format ({', '.join(PROMPT_FORMATS)})"
        )
    if not getattr(tokenizer, "is_fast", False):
        raise BadInputError(f"--tokenizer-model {path}: a fast tokenizer (tokenizer.json) is "
                            "needed to map the template's text to tokens")
    return tokenizer


def conversation_of(record, line_number: int) -> List[dict]:
    """The messages of one JSON record (chat or prompt/response)."""
    if isinstance(record, dict) and isinstance(record.get("messages"), list):
        messages = record["messages"]
    elif isinstance(record, dict) and "prompt" in record and "response" in record:
        messages = [{"role": "user", "content": record["prompt"]},
                    {"role": "assistant", "content": record["response"]}]
    else:
        raise BadInputError(f"line {line_number}: expected {{\"messages\": [...]}} or "
                            "{\"prompt\": ..., \"response\": ...}")
    for message in messages:
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            raise BadInputError(f"line {line_number}: every message needs a string role and "
                                "content")
    if not any(m["role"] == "assistant" for m in messages):
        raise BadInputError(f"line {line_number}: no assistant turn, nothing to train on")
    return messages


def encode_conversation(tokenizer, messages: List[dict], line_number: int = 0,
                        first_trained_turn: int = 0) -> Tuple[np.ndarray, np.ndarray]:
    """(token ids, loss mask) of one conversation rendered by the tokenizer's chat template;
    the mask is 1 on the tokens of the assistant turns from `first_trained_turn` on."""
    def render(upto, generation_prompt=False):
        return tokenizer.apply_chat_template(
            messages[:upto], tokenize=False, add_generation_prompt=generation_prompt
        )

    text = render(len(messages))
    spans = []
    for k, message in enumerate(messages):
        if message["role"] != "assistant" or k < first_trained_turn:
            continue
        before, through = render(k, generation_prompt=True), render(k + 1)
        if not (text.startswith(through) and through.startswith(before)):
            raise BadInputError(
                f"line {line_number}: the chat template does not render the conversation's "
                "beginning as a prefix of the whole, so the assistant's tokens cannot be found"
            )
        # Whitespace after the turn (ChatML's newline after <|im_end|>) is layout between
        # turns, not the assistant's output: templates with {% generation %} leave it out too.
        spans.append((len(before), len(through.rstrip())))
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = np.asarray(encoded["input_ids"], dtype=np.int64)
    mask = np.zeros(ids.size, dtype=np.uint8)
    for t, (start, end) in enumerate(encoded["offset_mapping"]):
        # A token belongs to the turn its first character lies in.
        if end > start and any(a <= start < b for a, b in spans):
            mask[t] = 1
    return ids, mask


def _messages(value, role: str, field: str, line_number: int) -> List[dict]:
    """A TRL preference field: a string (one turn of `role`) or a list of messages."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, list) and all(isinstance(m, dict) for m in value):
        return value
    raise BadInputError(f"line {line_number}: \"{field}\" must be a string or a list of "
                        "messages")


def preference_of(record, line_number: int) -> Tuple[List[dict], List[dict], int]:
    """(chosen conversation, rejected conversation, number of prompt turns) of one TRL
    preference record."""
    if not (isinstance(record, dict) and "chosen" in record and "rejected" in record):
        raise BadInputError(f"line {line_number}: expected {{\"prompt\" or \"messages\", "
                            "\"chosen\", \"rejected\"}} (TRL's preference layout)")
    prompt_field = "prompt" if "prompt" in record else "messages" if "messages" in record \
        else None
    if prompt_field is None:
        # TRL's implicit prompt: whole conversations; the prompt is their shared beginning.
        chosen = _messages(record["chosen"], "assistant", "chosen", line_number)
        rejected = _messages(record["rejected"], "assistant", "rejected", line_number)
        shared = 0
        while (shared < min(len(chosen), len(rejected)) - 1
               and chosen[shared] == rejected[shared]):
            shared += 1
        prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
    else:
        prompt = _messages(record[prompt_field], "user", prompt_field, line_number)
        chosen = _messages(record["chosen"], "assistant", "chosen", line_number)
        rejected = _messages(record["rejected"], "assistant", "rejected", line_number)
    for name, turns in (("chosen", chosen), ("rejected", rejected)):
        if not any(isinstance(m, dict) and m.get("role") == "assistant" for m in turns):
            raise BadInputError(f"line {line_number}: the {name} response has no assistant "
                                "turn, nothing to compare")
    # conversation_of checks every message's role and content.
    return (conversation_of({"messages": prompt + chosen}, line_number),
            conversation_of({"messages": prompt + rejected}, line_number), len(prompt))


def get_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", required=True, help="chat JSON lines file")
    parser.add_argument("--output-prefix", required=True)
    parser.add_argument("--tokenizer-model", required=True,
                        help="Hugging Face tokenizer directory with a chat template")
    parser.add_argument("--sft-tokenizer-prompt-format", choices=sorted(PROMPT_FORMATS),
                        default=None,
                        help="render with this named chat template instead of the "
                             "tokenizer's own (Megatron's flag name)")
    parser.add_argument("--seq-length", type=int, default=None,
                        help="refuse conversations longer than --seq-length + 1 tokens "
                             "(the training --seq-length); with --preference, pairs whose "
                             "two sequences do not fit --seq-length together")
    parser.add_argument("--preference", action="store_true",
                        help="preference pairs (TRL's layouts) for DPO: chosen and rejected "
                             "as two consecutive documents, the loss on their responses")
    return parser.parse_args(argv)


def preprocess(args: argparse.Namespace) -> dict:
    """Write the token and loss-mask datasets; returns counts."""
    tokenizer = load_chat_tokenizer(args.tokenizer_model,
                                    getattr(args, "sft_tokenizer_prompt_format", None))
    prefix = f"{args.output_prefix}_text_document"
    mask_prefix = loss_mask_prefix(prefix)
    tokens_out = IndexedDatasetBuilder(data_file_path(prefix), optimal_dtype(len(tokenizer)))
    masks_out = IndexedDatasetBuilder(data_file_path(mask_prefix), np.uint8)
    counts = {"conversations": 0, "tokens": 0, "assistant_tokens": 0}
    try:
        with open(args.input, "r", encoding="utf-8") as handle:
            for line_number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError as error:
                    raise BadInputError(f"line {line_number}: not JSON ({error})") from None
                if getattr(args, "preference", False):
                    chosen, rejected, prompt_turns = preference_of(record, line_number)
                    documents = [encode_conversation(tokenizer, messages, line_number,
                                                     prompt_turns)
                                 for messages in (chosen, rejected)]
                    positions = sum(ids.size - 1 for ids, _ in documents)
                    if args.seq_length is not None and positions > args.seq_length:
                        raise BadInputError(
                            f"line {line_number}: the pair has {positions} positions (chosen "
                            "and rejected, n - 1 each), more than --seq-length "
                            f"{args.seq_length}; shorten it or raise --seq-length")
                    if any(int(mask[1:].sum()) == 0 for _, mask in documents):
                        raise BadInputError(f"line {line_number}: a response renders to no "
                                            "tokens")
                else:
                    documents = [encode_conversation(
                        tokenizer, conversation_of(record, line_number), line_number)]
                    if args.seq_length is not None and documents[0][0].size > args.seq_length + 1:
                        raise BadInputError(
                            f"line {line_number}: the conversation has {documents[0][0].size} "
                            f"tokens, more than --seq-length {args.seq_length} + 1; shorten "
                            "it or raise --seq-length"
                        )
                for ids, mask in documents:
                    tokens_out.add_document(ids)
                    masks_out.add_document(mask)
                    counts["conversations"] += 1
                    counts["tokens"] += int(ids.size)
                    counts["assistant_tokens"] += int(mask.sum())
    except BaseException:
        tokens_out.discard()
        masks_out.discard()
        raise
    if counts["conversations"] == 0:
        tokens_out.discard()
        masks_out.discard()
        raise BadInputError(f"--input {args.input}: no conversations")
    tokens_out.finalize(index_file_path(prefix))
    masks_out.finalize(index_file_path(mask_prefix))
    return counts


def main(argv: Optional[List[str]] = None) -> int:
    args = get_args(argv)
    try:
        counts = preprocess(args)
    except BadInputError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    what = (f"{counts['conversations'] // 2} preference pairs" if args.preference
            else f"{counts['conversations']} conversations")
    print(f"{what}, {counts['tokens']} tokens, {counts['assistant_tokens']} trained on "
          "(assistant)")
    return 0


if __name__ == "__main__":
    sys.exit(run_entry(main))
