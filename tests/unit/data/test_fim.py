"""--fim-data (Megatron-LM's GPTFIMDataset): pieces between EODs rearranged by characters into
prefix / suffix / middle with the FIM tokens, PSM or SPM, the sample's length kept."""
import os

import numpy as np
import pytest

from megatron_smp.config import ConfigError, DataConfig
from megatron_smp.data.fim import FIMTransform
from megatron_smp.data.tokenizers import build_tokenizer
from megatron_smp.training.arguments import parse_args

FIM_TOKENS = ["<|endoftext|>", "<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>"]
TEXTS = ["def add(a, b):\n    return a + b\n", "The quick brown fox jumps over the lazy dog."]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from tokenizers import ByteLevelBPETokenizer

    directory = tmp_path_factory.mktemp("fim_bpe")
    trainer = ByteLevelBPETokenizer()
    trainer.train_from_iterator(TEXTS * 20, vocab_size=400, special_tokens=FIM_TOKENS,
                                show_progress=False)
    trainer.save_model(str(directory))
    return build_tokenizer(DataConfig(tokenizer_type="GPT2BPETokenizer",
                                      vocab_file=os.path.join(directory, "vocab.json"),
                                      merge_file=os.path.join(directory, "merges.txt")))


def _pieces(sample, eod):
    cuts = [i for i, token in enumerate(sample) if token == eod]
    return [sample[a + 1:b] for a, b in zip([-1] + cuts, cuts + [len(sample)])]


@pytest.mark.parametrize("spm", [0.0, 1.0])
def test_every_piece_is_rearranged_and_reads_back(tokenizer, spm):
    ids = {token: tokenizer.token_to_id(token) for token in FIM_TOKENS}
    prefix, middle, suffix, pad = (ids[f"<fim_{n}>"] for n in ("prefix", "middle", "suffix",
                                                                "pad"))
    sample = np.array(tokenizer.tokenize(TEXTS[0]) + [tokenizer.eod]
                      + tokenizer.tokenize(TEXTS[1]), dtype=np.int64)
    transform = FIMTransform(tokenizer, DataConfig(fim_data=True, fim_rate=1.0,
                                                   fim_spm_rate=spm), seed=5)
    # Room for the FIM tokens and the re-tokenized cuts (trailing EODs: empty pieces, dropped).
    long = transform(np.concatenate([sample, [tokenizer.eod] * 40]))
    assert long.shape == (sample.shape[0] + 40,) and long.dtype == np.int64
    pieces = _pieces(list(long), tokenizer.eod)[:2]
    for piece, text in zip(pieces, TEXTS):
        piece = [token for token in piece if token != pad]
        assert piece[0] == prefix and piece.count(suffix) == piece.count(middle) == 1
        s, m = piece.index(suffix), piece.index(middle)
        if spm:  # <P> <S> suffix <M> prefix middle: which part is which is lost, the order not
            assert s == 1 and m > s
            assert tokenizer.detokenize(piece[m + 1:]) + tokenizer.detokenize(piece[2:m]) \
                == text
        else:  # <P> prefix <S> suffix <M> middle
            assert s < m
            assert (tokenizer.detokenize(piece[1:s]) + tokenizer.detokenize(piece[m + 1:])
                    + tokenizer.detokenize(piece[s + 1:m])) == text
    # The length is kept: longer results are cut, shorter ones padded with <fim_pad>.
    assert transform(sample).shape == sample.shape
    none = FIMTransform(tokenizer, DataConfig(fim_data=True, fim_rate=0.0), seed=5)
    assert np.array_equal(none(sample), sample)


def test_fim_flags_and_their_errors(tokenizer):
    data = parse_args("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
                      "--train-iters 1 --micro-batch-size 1 --data-path x --fim-data "
                      "--fim-rate 0.3 --fim-spm-rate 0.7 --fim-pad-token <pad>".split()).data
    assert (data.fim_data, data.fim_rate, data.fim_spm_rate, data.fim_pad_token) == (
        True, 0.3, 0.7, "<pad>")
    with pytest.raises(ConfigError, match="--fim-pad-token '<pad>' is not a token"):
        FIMTransform(tokenizer, data, seed=1)


def test_the_gpt_datasets_of_fim_data_are_fim(tokenizer, make_dataset, tmp_path):
    from megatron_smp.data import build_train_valid_test_datasets

    documents = [tokenizer.tokenize(text) + [tokenizer.eod] for text in TEXTS * 10]
    prefix = make_dataset("fim", documents)
    data = DataConfig(data_path=[prefix], data_cache_path=str(tmp_path / "cache"),
                      split="100,0,0", fim_data=True, fim_rate=1.0)
    train, _, _ = build_train_valid_test_datasets(data, 48, 1, [4, 0, 0], tokenizer)
    prefix_id = tokenizer.token_to_id("<fim_prefix>")
    for index in range(4):
        assert prefix_id in train[index]["tokens"].tolist() + train[index]["labels"].tolist()
    plain = DataConfig(data_path=[prefix], data_cache_path=str(tmp_path / "cache"),
                       split="100,0,0")
    assert prefix_id not in build_train_valid_test_datasets(
        plain, 48, 1, [4, 0, 0], tokenizer)[0][0]["tokens"].tolist()
    with pytest.raises(ConfigError, match="--fim-data .* does not take --mock-data"):
        build_train_valid_test_datasets(DataConfig(mock_data=True, fim_data=True), 48, 1,
                                        [4, 0, 0], tokenizer)
