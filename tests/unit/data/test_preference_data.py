"""tools/preprocess_sft_data.py --preference: TRL's preference layouts (prompt string, prompt
messages, "messages" as the prompt, implicit prompt) become chosen / rejected document pairs
with the loss on the responses only; packed whole, pair p at documents 2p and 2p + 1."""
import json
import os

import numpy as np
import pytest

from tests.unit.data.sft_common import ROOT, make_chat_tokenizer, preprocess_sft_data

PREFERENCE = os.path.join(ROOT, "data", "chat", "tiny_preference.jsonl")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    with open(PREFERENCE) as handle:
        records = [json.loads(line) for line in handle]
    return make_chat_tokenizer(str(tmp_path_factory.mktemp("pref_tok")), records)


def _preprocess(tokenizer_dir, directory, records, *extra):
    source = os.path.join(directory, "pairs.jsonl")
    with open(source, "w") as handle:
        handle.write("".join(json.dumps(r) + "\n" for r in records))
    prefix = os.path.join(directory, "pairs")
    preprocess_sft_data.preprocess(preprocess_sft_data.get_args(
        ["--input", source, "--output-prefix", prefix, "--tokenizer-model", tokenizer_dir,
         "--preference", *extra]))
    return prefix + "_text_document"


def test_every_trl_layout_gives_the_same_pair(tokenizer_dir, tmp_path):
    from transformers import AutoTokenizer

    from megatron_smp.data.indexed_dataset import IndexedDataset

    system = {"role": "system", "content": "Be brief."}
    user = {"role": "user", "content": "What is 2 + 2?"}
    turn = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}, user]
    good, bad = ({"role": "assistant", "content": text} for text in ("4.", "5."))
    records = [
        {"prompt": "What is 2 + 2?", "chosen": "4.", "rejected": "5."},
        {"prompt": [user], "chosen": [good], "rejected": [bad]},
        {"messages": [system, user], "chosen": "4.", "rejected": "5."},
        {"chosen": turn + [good], "rejected": turn + [bad]},  # implicit prompt, two turns
    ]
    prefix = _preprocess(tokenizer_dir, str(tmp_path), records)
    tokens, masks = IndexedDataset(prefix), IndexedDataset(prefix + "_loss_mask")
    assert len(tokens) == 2 * len(records)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    for number in range(len(records)):
        for side, answer in enumerate(("4.", "5.")):
            ids, mask = tokens.get(2 * number + side), masks.get(2 * number + side)
            # Only the last assistant turn is trained on (not "Hello!" of the prompt).
            assert tokenizer.decode(ids[mask == 1]) == answer + "<|im_end|>"
        # The same prompt tokens on both sides.
        chosen, rejected = tokens.get(2 * number), tokens.get(2 * number + 1)
        first = int(np.argmax(masks.get(2 * number)))
        assert np.array_equal(chosen[:first], rejected[:first])
    # The string and the message-list layouts render the same conversation.
    assert np.array_equal(tokens.get(0), tokens.get(2))


def test_bad_preference_lines_are_clear_errors(tokenizer_dir, tmp_path):
    for record, match in (({"prompt": "x", "chosen": "y"}, "expected .*TRL's preference"),
                          ({"prompt": "x", "chosen": 3, "rejected": "y"},
                           "\"chosen\" must be a string"),
                          ({"prompt": "x", "chosen": [{"role": "user", "content": "y"}],
                            "rejected": "z"}, "the chosen response has no assistant turn")):
        with pytest.raises(preprocess_sft_data.BadInputError, match=match):
            _preprocess(tokenizer_dir, str(tmp_path), [record])
    with pytest.raises(preprocess_sft_data.BadInputError, match="the pair has .* positions"):
        _preprocess(tokenizer_dir, str(tmp_path),
                    [{"prompt": "x " * 40, "chosen": "y", "rejected": "z"}], "--seq-length", "50")


def test_pairs_are_packed_whole(tokenizer_dir, tmp_path):
    """The bundled set: every pack holds whole pairs, chosen then rejected, each a document
    with its positions restarting at 0 and loss on its response only."""
    from megatron_smp.data.sft_dataset import build_sft_splits
    from megatron_smp.data.dataset_builder import SPLIT_NAMES, split_range

    source = os.path.join(str(tmp_path), "bundled")
    prefix = source + "_text_document"
    preprocess_sft_data.preprocess(preprocess_sft_data.get_args(
        ["--input", PREFERENCE, "--output-prefix", source, "--tokenizer-model", tokenizer_dir,
         "--preference", "--seq-length", "128"]))
    train, _, _ = build_sft_splits(prefix, [(0.0, 1.0), None, None], [None, None, None], 128,
                                   7, 0, split_range, SPLIT_NAMES, group_size=2)
    assert train.sequence_ids.size == 76
    pairs = 0
    for index in range(len(train)):
        sample = train[index]
        documents = sample["document_ids"].numpy()
        mask = sample["loss_mask"].numpy()
        # Every sequence has its response; a trailing padding document has none.
        trained = [mask[documents == d].sum() > 0 for d in range(documents.max() + 1)]
        count = sum(trained)
        assert count % 2 == 0 and all(trained[:count])  # whole pairs, in front
        for document in range(count):
            assert sample["position_ids"].numpy()[documents == document][0] == 0
        pairs += count // 2
    assert pairs == 76
