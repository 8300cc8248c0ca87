"""Megatron's TikTokenizer. The expected ids were produced by megatron-core 0.16.1's
TikTokenTokenizer (tiktoken 0.14.0) on the same vocabulary, `num_special_tokens=10`,
`vocab_size=277`."""
import base64
import json
import os
import sys

import numpy as np
import pytest

from megatron_smp.config import ConfigError, DataConfig
from megatron_smp.data.tokenizers import build_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
MERGES = [b"th", b"he", b"the", b" t", b" the", b"ca", b"cat", b" cat", b"in", b"ing", b"tH"]
MEGATRON_CORE_IDS = {
    ("v1", "the cat"): [268, 273],
    ("v1", "The cathing  the\n\ncat<s>x</s>"): [94, 267, 42, 271, 266, 275, 42, 270, 20, 20,
                                                272, 1, 130, 2],
    ("v1", "héllo 123 thething"): [114, 205, 179, 118, 118, 121, 42, 59, 60, 61, 270, 266, 275],
    ("v1", "atH"): [107, 276],
    ("v2", "atH"): [107, 126, 82],  # v2 splits at the case change: no "tH" merge
    ("v2", "the cat"): [268, 273],
}


@pytest.fixture
def vocab_file(tmp_path):
    tokens = [bytes([i]) for i in range(256)] + MERGES
    path = tmp_path / "vocab.json"
    path.write_text(json.dumps([
        {"rank": i, "token_bytes": base64.b64encode(t).decode(), "token_str": t.decode("latin1")}
        for i, t in enumerate(tokens)
    ]))
    return str(path)


def tiktoken_config(vocab_file, **changes):
    settings = dict(tokenizer_type="TikTokenizer", tokenizer_model=vocab_file, vocab_size=277,
                    tiktoken_num_special_tokens=10)
    settings.update(changes)
    return DataConfig(**settings)


def test_ids_equal_megatron_core(vocab_file):
    pytest.importorskip("tiktoken")
    for (pattern, text), expected in MEGATRON_CORE_IDS.items():
        tokenizer = build_tokenizer(tiktoken_config(vocab_file, tiktoken_pattern=pattern))
        assert tokenizer.tokenize(text) == expected, (pattern, text)
        assert tokenizer.detokenize(expected) == text
        assert (tokenizer.eod, tokenizer.vocab_size) == (2, 277)
    # Without --tiktoken-pattern megatron-core uses v2.
    assert build_tokenizer(tiktoken_config(vocab_file)).tokenize("atH") == [107, 126, 82]


def test_legacy_tokenizer_encodes_special_text_as_text(vocab_file):
    pytest.importorskip("tiktoken")
    legacy = build_tokenizer(tiktoken_config(vocab_file, tiktoken_pattern="v1",
                                             legacy_tokenizer=True))
    assert legacy.tokenize("x<s>") == [130, 70, 125, 72]  # "<", "s", ">" as bytes + 10
    assert legacy.eod == 2
    with pytest.raises(ConfigError, match="--tiktoken-pattern"):
        build_tokenizer(tiktoken_config(vocab_file, legacy_tokenizer=True))


def test_vocabulary_and_special_token_errors_name_the_flag(vocab_file):
    pytest.importorskip("tiktoken")
    with pytest.raises(ConfigError, match="--vocab-size must be at most 277"):
        build_tokenizer(tiktoken_config(vocab_file, vocab_size=None))
    with pytest.raises(ConfigError, match="must include"):
        build_tokenizer(tiktoken_config(vocab_file, tokenizer_special_tokens=["<s>", "</s>"]))
    named = build_tokenizer(tiktoken_config(vocab_file, tokenizer_special_tokens=[
        "<s>", "</s>", "<unk>", "<mask>", "<pad>", "<cls>", "<sep>"]))
    assert named.eod == 1 and named.tokenize("</s>") == [1]


def test_missing_tiktoken_is_a_config_error(vocab_file, monkeypatch):
    monkeypatch.setitem(sys.modules, "tiktoken", None)
    with pytest.raises(ConfigError, match=r"pip install 'megatron_smp\[tiktoken\]'"):
        build_tokenizer(tiktoken_config(vocab_file))


def test_flags_and_the_pattern_megatrons_llama3_script_passes(vocab_file, tmp_path):
    from megatron_smp.training.arguments import parse_args

    model = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 16 "
             "--train-iters 10 --micro-batch-size 2 --mock-data").split()
    # Megatron's llama3 example: NullTokenizer with --tiktoken-pattern v2, which only
    # TikTokenizer reads; Megatron ignores it there, and so do we.
    null = parse_args(model + ["--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
                               "--tiktoken-pattern", "v2"]).data
    assert build_tokenizer(null).tokenize("5 6") == [5, 6]
    with pytest.raises(ConfigError, match="--tiktoken-special-tokens is only read"):
        build_tokenizer(parse_args(model + ["--tokenizer-type", "NullTokenizer",
                                            "--vocab-size", "128", "--tiktoken-special-tokens",
                                            "<s>"]).data)
    pytest.importorskip("tiktoken")
    data = parse_args(model + ["--tokenizer-type", "TikTokenizer", "--tokenizer-model",
                               vocab_file, "--vocab-size", "277", "--tiktoken-pattern", "v1",
                               "--tiktoken-num-special-tokens", "10"]).data
    assert build_tokenizer(data).tokenize("atH") == [107, 276]


def test_preprocess_with_tiktokenizer_ends_documents_with_eod(vocab_file, tmp_path):
    pytest.importorskip("tiktoken")
    sys.path.insert(0, os.path.join(REPO, "tools"))
    import preprocess_data

    from megatron_smp.data.indexed_dataset import IndexedDataset

    (tmp_path / "in.jsonl").write_text(
        "".join(json.dumps({"text": t}) + "\n" for t in ("the cat", "atH")))
    assert preprocess_data.main([
        "--input", str(tmp_path / "in.jsonl"), "--output-prefix", str(tmp_path / "out"),
        "--tokenizer-type", "TikTokenizer", "--tokenizer-model", vocab_file,
        "--vocab-size", "277", "--tiktoken-num-special-tokens", "10", "--append-eod"]) == 0
    dataset = IndexedDataset(str(tmp_path / "out_text_document"))
    assert dataset.dtype == np.uint16
    assert [dataset[i].tolist() for i in range(2)] == [[268, 273, 2], [107, 126, 82, 2]]
