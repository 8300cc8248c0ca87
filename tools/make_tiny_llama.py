"""Write a small Hugging Face Llama directory (random weights, a byte-level BPE tokenizer
with a ChatML template trained on the given chat files) for trying the fine-tuning scripts
offline:

    python tools/make_tiny_llama.py --output runs/tiny_llama \
        --texts data/chat/tiny_chat.jsonl data/chat/tiny_preference.jsonl

The directory loads with `AutoModelForCausalLM.from_pretrained` / `AutoTokenizer.from_pretrained`
and converts with tools/checkpoint/convert.py --model-type llama --loader hf.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import List, Optional

# ChatML, with {% generation %} marking the assistant's text (HF's assistant-token mask).
CHATML = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}"
    "{% endgeneration %}{{ '\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# The turns' texts back to back, the assistant's followed by the end token: a completion task
# (e.g. "37+45=" -> "82\n") whose RL prompts are the raw user text.
PLAIN = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|endoftext|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] }}{% endif %}"
    "{% endfor %}"
)
TEMPLATES = {"chatml": CHATML, "plain": PLAIN}


def _texts(paths: List[str]) -> List[str]:
    """Every string inside the JSON lines of `paths` (contents, prompts, responses)."""
    out = []

    def walk(value):
        if isinstance(value, str):
            out.append(value)
        elif isinstance(value, list):
            for item in value:
                walk(item)
        elif isinstance(value, dict):
            for item in value.values():
                walk(item)

    for path in paths:
        with open(path, encoding="utf-8") as handle:
            for line in handle:
                if line.strip():
                    walk(json.loads(line))
    return out


def make_tiny_llama(output: str, texts: List[str], vocab_size: int = 512, hidden_size: int = 128,
                    num_layers: int = 4, seed: int = 1234,
                    chat_template: str = "chatml") -> None:
    import torch
    from tokenizers import ByteLevelBPETokenizer
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    trainer = ByteLevelBPETokenizer()
    trainer.train_from_iterator(_texts(texts) * 2, vocab_size=vocab_size, show_progress=False,
                                special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=trainer._tokenizer,
                                        eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = TEMPLATES[chat_template]
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden_size,
                         intermediate_size=2 * hidden_size, num_hidden_layers=num_layers,
                         num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, bos_token_id=0, eos_token_id=0,
                         pad_token_id=0, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(output)
    tokenizer.save_pretrained(output)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", required=True, help="the HF directory to write")
    parser.add_argument("--texts", nargs="+", required=True,
                        help="chat / preference JSON lines the tokenizer is trained on")
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--chat-template", choices=sorted(TEMPLATES), default="chatml",
                        help="chatml: ChatML turns; plain: the turns' texts back to back, "
                             "the assistant's ended by <|endoftext|> (completion tasks)")
    args = parser.parse_args(argv)
    for path in args.texts:
        if not os.path.isfile(path):
            print(f"error: --texts {path}: no such file", file=sys.stderr)
            return 1
    make_tiny_llama(args.output, args.texts, args.vocab_size, args.hidden_size, args.num_layers,
                    args.seed, args.chat_template)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from megatron_smp.cli import run_entry

    sys.exit(run_entry(main))
