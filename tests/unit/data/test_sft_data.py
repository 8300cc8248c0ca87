"""--sft data: chat preprocessing with a loss mask on assistant tokens, best-fit packing,
and packed sequences that equal the conversations run one at a time."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from megatron_smp.config import ConfigError, ParallelConfig, TransformerConfig
from megatron_smp.data.indexed_dataset import IndexedDataset
from megatron_smp.data.sft_dataset import (
    SFTDataset,
    loss_mask_prefix,
    pack_best_fit,
    packing_efficiency,
)

from tests.unit.data.sft_common import (
    ROOT,
    make_chat_tokenizer,
    make_sft_data,
    preprocess_sft_data,
)

CONVERSATIONS = [
    {"messages": [{"role": "user", "content": "What is two plus two?"},
                  {"role": "assistant", "content": "Four."}]},
    {"messages": [{"role": "system", "content": "You are terse."},
                  {"role": "user", "content": "Name a colour."},
                  {"role": "assistant", "content": "Blue."},
                  {"role": "user", "content": "Another one?"},
                  {"role": "assistant", "content": "Green, and then red."}]},
    {"prompt": "Say hello.", "response": "Hello there, friend."},
    {"messages": [{"role": "user", "content": "Count to three."},
                  {"role": "assistant", "content": "One, two, three."}]},
    {"prompt": "Spell cat.", "response": "C A T"},
    {"messages": [{"role": "user", "content": "Is water wet?"},
                  {"role": "assistant", "content": "Yes, usually."}]},
]


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("chat_tok"))
    make_chat_tokenizer(directory, CONVERSATIONS)
    return directory


@pytest.fixture(scope="module")
def sft_data(chat_tokenizer, tmp_path_factory):
    return make_sft_data(os.path.join(chat_tokenizer, "with"),
                         str(tmp_path_factory.mktemp("sft_data")), CONVERSATIONS)


def test_loss_mask_is_the_templates_assistant_tokens(chat_tokenizer, sft_data):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(os.path.join(chat_tokenizer, "with"))
    tokens, masks = IndexedDataset(sft_data), IndexedDataset(loss_mask_prefix(sft_data))
    assert masks.dtype == np.uint8 and len(tokens) == len(CONVERSATIONS)
    for i, record in enumerate(CONVERSATIONS):
        messages = preprocess_sft_data.conversation_of(record, i + 1)
        reference = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        assert tokens[i].tolist() == reference["input_ids"]
        assert masks[i].tolist() == reference["assistant_masks"], i
        # Only the assistant's words (and its end-of-turn marker) are trained on.
        trained = tokenizer.decode(tokens[i][masks[i] == 1].tolist())
        assistant = "".join(m["content"] + "<|im_end|>" for m in messages
                            if m["role"] == "assistant")
        assert trained == assistant


def test_preprocessing_errors(chat_tokenizer, tmp_path):
    source = tmp_path / "chat.jsonl"
    source.write_text("".join(json.dumps(c) + "\n" for c in CONVERSATIONS))
    base = ["--input", str(source), "--output-prefix", str(tmp_path / "out")]
    without = base + ["--tokenizer-model", os.path.join(chat_tokenizer, "without")]
    with pytest.raises(preprocess_sft_data.BadInputError, match="no chat template"):
        preprocess_sft_data.preprocess(preprocess_sft_data.get_args(without))
    short = base + ["--tokenizer-model", os.path.join(chat_tokenizer, "with"),
                    "--seq-length", "8"]
    with pytest.raises(preprocess_sft_data.BadInputError, match="line 1: .* --seq-length 8"):
        preprocess_sft_data.preprocess(preprocess_sft_data.get_args(short))
    assert not list(tmp_path.glob("out*"))  # nothing half-written is left
    # The command line reports the error and exits non-zero.
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "preprocess_sft_data.py"),
                           *without], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 1 and "no chat template" in proc.stderr


def test_named_prompt_format(chat_tokenizer, sft_data, tmp_path):
    """--sft-tokenizer-prompt-format chatml on a tokenizer without a template gives what the
    tokenizer's own ChatML template gives (tokens and loss mask); llama3 trains on the
    assistant's words and its end-of-turn marker only."""
    source = tmp_path / "chat.jsonl"
    source.write_text("".join(json.dumps(c) + "\n" for c in CONVERSATIONS))
    for name in ("chatml", "llama3"):
        preprocess_sft_data.preprocess(preprocess_sft_data.get_args([
            "--input", str(source), "--output-prefix", str(tmp_path / name),
            "--tokenizer-model", os.path.join(chat_tokenizer, "without"),
            "--sft-tokenizer-prompt-format", name]))
    prefix = str(tmp_path / "chatml_text_document")
    for a, b in ((prefix, sft_data), (loss_mask_prefix(prefix), loss_mask_prefix(sft_data))):
        assert [x.tolist() for x in IndexedDataset(a)] == [x.tolist() for x in IndexedDataset(b)]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(os.path.join(chat_tokenizer, "without"))
    prefix = str(tmp_path / "llama3_text_document")
    tokens, masks = IndexedDataset(prefix), IndexedDataset(loss_mask_prefix(prefix))
    for i, record in enumerate(CONVERSATIONS):
        messages = preprocess_sft_data.conversation_of(record, i + 1)
        assert tokenizer.decode(tokens[i][masks[i] == 1].tolist()) == "".join(
            m["content"] + "<|eot_id|>" for m in messages if m["role"] == "assistant")


def test_best_fit_packing_and_efficiency():
    lengths = [7, 5, 4, 3, 3, 2, 1, 9]
    packs = pack_best_fit(lengths, 10)
    assert sorted(i for pack in packs for i in pack) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in pack) <= 10 for pack in packs)
    assert len(packs) == 4  # 34 tokens need at least 4 packs of 10
    assert packing_efficiency(lengths, packs, 10) == pytest.approx(34 / 40)
    with pytest.raises(ValueError, match="11 does not fit"):
        pack_best_fit([3, 11], 10)


def _dataset(prefix, seq_length, num_samples=None):
    return SFTDataset(IndexedDataset(prefix), IndexedDataset(loss_mask_prefix(prefix)),
                      np.arange(len(CONVERSATIONS)), num_samples, seq_length, seed=3, pad=0,
                      source=prefix)


def test_packed_samples_hold_whole_conversations(sft_data):
    tokens, masks = IndexedDataset(sft_data), IndexedDataset(loss_mask_prefix(sft_data))
    longest = int(max(tokens.sizes))
    dataset = _dataset(sft_data, longest + 20)
    assert len(dataset) == len(dataset.packs) < len(CONVERSATIONS)
    seen = 0
    for index in range(len(dataset)):
        sample = dataset[index]
        starts = (sample["position_ids"] == 0).nonzero(as_tuple=True)[0].tolist()
        document_ids = sample["document_ids"]
        for number, (a, b) in enumerate(zip(starts, starts[1:] + [dataset.seq_length])):
            # Each conversation (and the end padding) is a document of its own.
            assert document_ids[a:b].tolist() == [number] * (b - a)
        for a, b in zip(starts, starts[1:] + [dataset.seq_length]):
            ids = sample["tokens"][a:b].tolist() + [int(sample["labels"][b - 1])]
            matches = [i for i in range(len(tokens)) if tokens[i].tolist() == ids]
            if matches:  # a conversation (not the end padding)
                seen += 1
                assert sample["loss_mask"][a:b].tolist() == masks[matches[0]][1:].tolist()
            else:
                assert sample["loss_mask"][a:b].sum() == 0
    assert seen == len(CONVERSATIONS)
    # More samples than packs: later epochs serve the same packs in another order.
    assert len(_dataset(sft_data, longest + 20, num_samples=7)) == 7


def test_too_long_conversation_is_refused(sft_data):
    with pytest.raises(ConfigError, match="more than --seq-length 8"):
        _dataset(sft_data, 8)


def test_packed_losses_equal_conversations_one_at_a_time(sft_data):
    """Per-token losses of a packed sample (document mask, restarted positions) equal those
    of each conversation run alone, and the masked mean is the hand computation over the
    assistant tokens; gradients agree too."""
    from megatron_smp.models import GPTModel
    from megatron_smp.parallel_state import build_parallel_state
    from megatron_smp.tensor_parallel.random import model_parallel_seed

    tokens = IndexedDataset(sft_data)
    dataset = _dataset(sft_data, int(max(tokens.sizes)) + 20)
    state = build_parallel_state(ParallelConfig())
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                               vocab_size=400, max_position_embeddings=dataset.seq_length,
                               hidden_dropout=0.0, attention_dropout=0.0)
    model_parallel_seed(1234, state)
    model = GPTModel(config, state)
    sample = dataset[0]
    packed = model(sample["tokens"][None], position_ids=sample["position_ids"][None],
                   document_ids=sample["document_ids"][None],
                   labels=sample["labels"][None])[0]
    mask = sample["loss_mask"]
    (packed * mask).sum().div(mask.sum()).backward()
    packed_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    starts = (sample["position_ids"] == 0).nonzero(as_tuple=True)[0].tolist()
    total, count, pieces = 0.0, 0.0, []
    for a, b in zip(starts, starts[1:] + [dataset.seq_length]):
        alone = model(sample["tokens"][None, a:b], labels=sample["labels"][None, a:b])[0]
        assert torch.allclose(alone, packed[a:b], atol=1e-5), (a, b)
        pieces.append((alone * mask[a:b]).sum())
        # The hand computation: cross entropy of the assistant tokens from the logits.
        with torch.no_grad():
            logits = model(sample["tokens"][None, a:b])[0][:, :config.vocab_size]
        hand = torch.nn.functional.cross_entropy(
            logits.float(), sample["labels"][a:b], reduction="none")
        total += float((hand * mask[a:b]).sum())
        count += float(mask[a:b].sum())
    assert count > 0 and len(pieces) >= 2
    assert float((packed * mask).sum().detach() / mask.sum()) == pytest.approx(total / count, abs=1e-5)
    (sum(pieces) / mask.sum()).backward()
    for packed_grad, param in zip(packed_grads, model.parameters()):
        assert torch.allclose(packed_grad, param.grad, atol=1e-6)
