"""Fixtures shared by the SLURM tests (test_slurm.py, test_slurm_two_node.py)."""
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """GPT-2 BPE files, a SentencePiece model and a corpus preprocessed with each (for the
    SLURM tests, one and two nodes: made once per session)."""
    import gzip
    import itertools
    import json

    import sentencepiece as spm
    from tokenizers import ByteLevelBPETokenizer

    directory = tmp_path_factory.mktemp("slurm_corpus")
    with gzip.open(os.path.join(REPO, "data/corpus/kjv.jsonl.gz"), "rt") as handle:
        texts = [json.loads(line)["text"] for line in itertools.islice(handle, 300)]
    jsonl = directory / "corpus.jsonl"
    jsonl.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(texts, vocab_size=600, special_tokens=["<|endoftext|>"],
                            show_progress=False)
    bpe.save_model(str(directory))
    spm.SentencePieceTrainer.train(sentence_iterator=iter(texts), vocab_size=600,
                                   model_prefix=str(directory / "sp"), minloglevel=2)
    tokenizers = {
        "gpt": ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file",
                str(directory / "vocab.json"), "--merge-file", str(directory / "merges.txt")],
        "llama": ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model",
                  str(directory / "sp.model")],
    }
    for name, flags in tokenizers.items():
        subprocess.run([sys.executable, os.path.join(REPO, "tools/preprocess_data.py"),
                        "--input", str(jsonl), "--json-keys", "text", "--output-prefix",
                        str(directory / name), "--append-eod", "--workers", "1"] + flags,
                       check=True, capture_output=True, timeout=300)
    return {
        "gpt": {"DATA_PATH": str(directory / "gpt_text_document"),
                "VOCAB": str(directory / "vocab.json"), "MERGES": str(directory / "merges.txt")},
        "llama": {"DATA_PATH": str(directory / "llama_text_document"),
                  "TOKENIZER_MODEL": str(directory / "sp.model")},
    }
