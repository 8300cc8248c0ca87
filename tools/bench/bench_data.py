"""Data-pipeline benchmark: preprocessing throughput and index-building time.

    .venv/bin/python tools/bench/bench_data.py [--documents 1000000]

Reports tools/preprocess_data.py throughput on the bundled corpus (SentencePiece, 4k vocab)
with 1 and 2 workers, and the time to build the document/sample/shuffle indices of a GPT
dataset over 1e6 documents (and to reload them from the cache).
"""
from __future__ import annotations

import argparse
import gzip
import os
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tools"))

import preprocess_data  # noqa: E402
import train_tokenizer  # noqa: E402

from megatron_smp.data.gpt_dataset import GPTDataset  # noqa: E402
from megatron_smp.data.indexed_dataset import IndexedDataset, write_index  # noqa: E402

CORPUS = os.path.join(REPO, "data", "corpus", "kjv.jsonl.gz")


def bench_preprocessing(workdir: str, repeats: int, copies: int) -> None:
    model = train_tokenizer.train(CORPUS, os.path.join(workdir, "tok"), vocab_size=4000)
    # A few copies of the corpus, so the pool's start-up does not dominate.
    source = os.path.join(workdir, "corpus.jsonl")
    with gzip.open(CORPUS, "rb") as handle:
        text = handle.read()
    with open(source, "wb") as handle:
        for _ in range(copies):
            handle.write(text)
    for workers in (1, 2):
        best = None
        for _ in range(repeats):
            args = preprocess_data.get_args([
                "--input", source, "--output-prefix", os.path.join(workdir, f"w{workers}"),
                "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", model,
                "--append-eod", "--workers", str(workers), "--log-interval", "100000000",
            ])
            summary = preprocess_data.preprocess(args, log=open(os.devnull, "w"))
            if best is None or summary["mb_per_s"] > best["mb_per_s"]:
                best = summary
        print(
            f"preprocess  workers={workers}: {best['mb_per_s']:6.2f} MB/s  "
            f"{best['docs_per_s']:8.1f} docs/s  ({best['documents']} docs, "
            f"{best['tokens']} tokens, {best['seconds']:.2f} s, best of {repeats})"
        )


def bench_indices(workdir: str, num_documents: int, seq_length: int) -> None:
    rng = np.random.RandomState(0)
    # Index-only dataset: the .bin is never read while indices are built.
    sizes = rng.randint(16, 2048, size=num_documents).astype(np.int32)
    prefix = os.path.join(workdir, "big")
    write_index(prefix + ".idx", np.uint16, sizes, np.arange(num_documents + 1))
    with open(prefix + ".bin", "wb") as handle:
        handle.truncate(int(sizes.astype(np.int64).sum()) * 2)  # sparse file
    dataset = IndexedDataset(prefix)
    tokens = int(sizes.astype(np.int64).sum())
    num_samples = tokens // seq_length  # about one epoch
    cache = os.path.join(workdir, "cache")
    start = time.perf_counter()
    built = GPTDataset(dataset, np.arange(num_documents), num_samples, seq_length, 1234, 0,
                       cache_dir=cache)
    build_seconds = time.perf_counter() - start
    start = time.perf_counter()
    GPTDataset(dataset, np.arange(num_documents), num_samples, seq_length, 1234, 0,
               cache_dir=cache)
    load_seconds = time.perf_counter() - start
    print(
        f"indices     {num_documents:.0e} documents, {tokens / 1e9:.2f}B tokens, "
        f"{len(built)} samples of {seq_length}: built and cached in {build_seconds:.2f} s, "
        f"loaded from cache in {load_seconds * 1000:.0f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--documents", type=int, default=1_000_000)
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--corpus-copies", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_data_") as workdir:
        bench_preprocessing(workdir, args.repeats, args.corpus_copies)
        bench_indices(workdir, args.documents, args.seq_length)


if __name__ == "__main__":
    main()
