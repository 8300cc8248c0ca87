import gzip
import json
import os
import sys

import pytest

from megatron_smp.config import ConfigError, DataConfig
from megatron_smp.data.tokenizers import build_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
sys.path.insert(0, os.path.join(REPO, "tools"))

SAMPLES = [
    "In the beginning God created the heaven and the earth.",
    "  Leading spaces,\ttabs\tand\nnew lines\n\nstay put.  ",
    "Numbers 1234567890 and symbols: <>&%$#@!~`^*()[]{}",
    "Unicode: naïve café, Ελληνικά, 日本語, emoji 🎉",
]


def corpus_lines():
    with gzip.open(os.path.join(REPO, "data", "corpus", "kjv.jsonl.gz"), "rt") as handle:
        for index, line in enumerate(handle):
            if index == 150:
                break
            yield json.loads(line)["text"]


@pytest.fixture(scope="module")
def sentencepiece_model(tmp_path_factory):
    import train_tokenizer

    directory = tmp_path_factory.mktemp("sp")
    corpus = directory / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in corpus_lines()))
    return train_tokenizer.train(
        str(corpus), str(directory / "tok"), vocab_size=600, model_type="bpe"
    )


@pytest.mark.parametrize(
    "kind", ["SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer"]
)
@pytest.mark.parametrize("legacy", [False, True])
def test_sentencepiece_round_trip(sentencepiece_model, kind, legacy):
    tokenizer = build_tokenizer(
        DataConfig(tokenizer_type=kind, tokenizer_model=sentencepiece_model,
                   legacy_tokenizer=legacy)
    )
    for text in SAMPLES:
        ids = tokenizer.tokenize(text)
        assert all(0 <= i < tokenizer.vocab_size for i in ids)
        if kind == "Llama2Tokenizer" and legacy:
            assert ids[0] == tokenizer.bos
            ids = ids[1:]
        assert tokenizer.detokenize(ids) == text


def test_sentencepiece_megatron_special_ids(sentencepiece_model):
    # Megatron's default (megatron-core) SentencePiece tokenizers: the model's pieces, eod =
    # its eos </s>, for all three types.
    for kind in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer"):
        default = build_tokenizer(DataConfig(tokenizer_type=kind,
                                             tokenizer_model=sentencepiece_model))
        assert (default.vocab_size, default.eod) == (600, 2), kind
        assert default.tokenize("a b")[0] != default.bos
    tokenizer = build_tokenizer(
        DataConfig(tokenizer_type="SentencePieceTokenizer", tokenizer_model=sentencepiece_model,
                   legacy_tokenizer=True)
    )
    # Megatron-LM appends <CLS>, <SEP>, <EOD>, <MASK> after the 600 pieces; the model has its
    # own <pad>, <s>, </s>.
    assert tokenizer.vocab_size == 604
    assert tokenizer.eod == 602
    assert tokenizer.pad == 3
    a, b = tokenizer.tokenize("a"), tokenizer.tokenize("b")
    assert tokenizer.tokenize("a<EOD>b") == a + [602] + b
    gpt = build_tokenizer(
        DataConfig(tokenizer_type="GPTSentencePieceTokenizer", tokenizer_model=sentencepiece_model,
                   legacy_tokenizer=True)
    )
    assert (gpt.vocab_size, gpt.eod) == (600, 2)


def test_null_tokenizer():
    tokenizer = build_tokenizer(DataConfig(tokenizer_type="NullTokenizer", vocab_size=100))
    assert tokenizer.tokenize("3 14 15 92") == [3, 14, 15, 92]
    assert tokenizer.detokenize([3, 14, 15, 92]) == "3 14 15 92"
    assert (tokenizer.vocab_size, tokenizer.eod) == (101, 100)
    with pytest.raises(ValueError, match="outside"):
        tokenizer.tokenize("7 1000")


@pytest.fixture(scope="module")
def byte_level_bpe(tmp_path_factory):
    from tokenizers import ByteLevelBPETokenizer

    directory = tmp_path_factory.mktemp("bpe")
    trainer = ByteLevelBPETokenizer()
    trainer.train_from_iterator(
        list(corpus_lines()), vocab_size=800, special_tokens=["<|endoftext|>"], show_progress=False
    )
    trainer.save_model(str(directory))
    return trainer, str(directory)


def test_gpt2_bpe_round_trip_and_ids(byte_level_bpe):
    trainer, directory = byte_level_bpe
    tokenizer = build_tokenizer(
        DataConfig(
            tokenizer_type="GPT2BPETokenizer",
            vocab_file=os.path.join(directory, "vocab.json"),
            merge_file=os.path.join(directory, "merges.txt"),
        )
    )
    assert tokenizer.eod == 0 and tokenizer.vocab_size == 800
    for text in SAMPLES:
        ids = tokenizer.tokenize(text)
        assert ids == trainer.encode(text).ids
        assert tokenizer.detokenize(ids) == text


def test_huggingface_tokenizer_from_local_directory(byte_level_bpe, tmp_path):
    from transformers import PreTrainedTokenizerFast

    trainer, _ = byte_level_bpe
    PreTrainedTokenizerFast(tokenizer_object=trainer._tokenizer, eos_token="<|endoftext|>") \
        .save_pretrained(str(tmp_path / "hf"))
    tokenizer = build_tokenizer(
        DataConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "hf"))
    )
    assert tokenizer.eod == 0 and tokenizer.vocab_size == 800
    for text in SAMPLES:
        assert tokenizer.detokenize(tokenizer.tokenize(text)) == text


def test_build_tokenizer_errors_name_the_flag(tmp_path):
    with pytest.raises(ConfigError, match="--tokenizer-type 'Nope'"):
        build_tokenizer(DataConfig(tokenizer_type="Nope"))
    with pytest.raises(ConfigError, match="needs --tokenizer-model"):
        build_tokenizer(DataConfig(tokenizer_type="SentencePieceTokenizer"))
    with pytest.raises(ConfigError, match="--tokenizer-model: .*missing.model not found"):
        build_tokenizer(
            DataConfig(tokenizer_type="SentencePieceTokenizer",
                       tokenizer_model=str(tmp_path / "missing.model"))
        )
    with pytest.raises(ConfigError, match="--vocab-file"):
        build_tokenizer(DataConfig(tokenizer_type="GPT2BPETokenizer"))
    with pytest.raises(ConfigError, match="--vocab-size"):
        build_tokenizer(DataConfig(tokenizer_type="NullTokenizer"))


@pytest.mark.parametrize("legacy, eod", [(False, 2), (True, 602)])
def test_eod_mask_loss_masks_every_eod_of_preprocessed_data(sentencepiece_model, tmp_path,
                                                            legacy, eod):
    """Data preprocessed the Megatron way (--append-eod) ends each document with the eod the
    training tokenizer masks: the model's eos by default, the appended <EOD> with
    --legacy-tokenizer."""
    import preprocess_data

    from megatron_smp.data import build_train_valid_test_datasets

    corpus = tmp_path / "corpus.jsonl"
    lines = list(corpus_lines())[:40]
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
    argv = ["--input", str(corpus), "--output-prefix", str(tmp_path / "out"),
            "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model",
            sentencepiece_model, "--append-eod"] + (["--legacy-tokenizer"] if legacy else [])
    assert preprocess_data.main(argv) == 0
    data_config = DataConfig(
        data_path=[str(tmp_path / "out_text_document")], split="1,0,0", eod_mask_loss=True,
        tokenizer_type="SentencePieceTokenizer", tokenizer_model=sentencepiece_model,
        legacy_tokenizer=legacy, data_cache_path=str(tmp_path / "cache"),
    )
    tokenizer = build_tokenizer(data_config)
    assert tokenizer.eod == eod
    train, _, _ = build_train_valid_test_datasets(data_config, 64, 1, [None], tokenizer)
    eods = masked = 0
    for i in range(len(train)):
        sample = train[i]
        eods += int((sample["tokens"] == eod).sum())
        masked += int((sample["loss_mask"] == 0).sum())
    assert eods >= len(lines) // 2 and masked == eods


def test_huggingface_special_tokens_follow_megatrons_default(byte_level_bpe, tmp_path):
    """megatron-core's default Hugging Face tokenizer gives the text's tokens only; the bos a
    Llama-style template adds comes with --legacy-tokenizer or
    --tokenizer-hf-include-special-tokens."""
    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    trainer, _ = byte_level_bpe
    backend = Tokenizer.from_str(trainer._tokenizer.to_str())  # a copy: the fixture is shared
    backend.add_special_tokens(["<s>"])
    bos = backend.token_to_id("<s>")
    backend.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>",
                            eos_token="<|endoftext|>").save_pretrained(str(tmp_path / "hf"))
    settings = dict(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "hf"))
    text = SAMPLES[0]
    plain = build_tokenizer(DataConfig(**settings)).tokenize(text)
    assert plain == trainer.encode(text).ids and bos not in plain
    for flag in ("legacy_tokenizer", "tokenizer_hf_include_special_tokens"):
        assert build_tokenizer(DataConfig(**settings, **{flag: True})).tokenize(text) == \
            [bos] + plain
