"""Tokenise JSON lines into Megatron-LM indexed datasets ({prefix}_{key}_document.bin/.idx).

    python tools/preprocess_data.py --input corpus.jsonl[.gz] --json-keys text \
        --output-prefix data/my --tokenizer-type SentencePieceTokenizer \
        --tokenizer-model tok.model --append-eod --workers 2

A line that is not JSON, lacks a key, or holds an empty document stops the run with its
line number (nothing half-written is left behind), or with --skip-bad-lines is reported on
stderr, skipped, and counted in the summary. Nothing is dropped silently.
"""
from __future__ import annotations

import argparse
import copy
import glob
import gzip
import json
import multiprocessing
import os
import queue
import sys
import threading
import time
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_smp.cli import CONFIG_ERROR_STATUS, print_error  # noqa: E402
from megatron_smp.data.indexed_dataset import (  # noqa: E402
    IndexedDataset,
    IndexedDatasetBuilder,
    data_file_path,
    index_file_path,
    optimal_dtype,
)
from megatron_smp.data.tokenizers import TOKENIZER_TYPES, build_tokenizer  # noqa: E402

# (line number, per-key token arrays or None, bytes of the line, error or None)
EncodedLine = Tuple[int, Optional[List[np.ndarray]], int, Optional[str]]


class BadInputError(Exception):
    pass


class Encoder:
    """Turns one input line into token arrays, one per --json-keys key (runs in workers)."""

    tokenizer = None

    def __init__(self, args: argparse.Namespace, dtype=np.int64) -> None:
        self.args = args
        # Arrays travel back from workers already in the on-disk dtype (uint16: 4x fewer bytes).
        self.dtype = dtype

    def initializer(self) -> None:
        Encoder.tokenizer = build_tokenizer(self.args)

    def encode(self, numbered_line: Tuple[int, str]) -> EncodedLine:
        line_number, line = numbered_line
        size = len(line.encode("utf-8"))
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            return line_number, None, size, f"not valid JSON ({error.msg} at column {error.colno})"
        if not isinstance(record, dict):
            kind = type(record).__name__
            return line_number, None, size, f"expected a JSON object, got {kind}"
        arrays = []
        for key in self.args.json_keys:
            if key not in record:
                return line_number, None, size, f"missing key {key!r} (has {sorted(record)[:5]})"
            text = record[key]
            if not isinstance(text, str):
                kind = type(text).__name__
                return line_number, None, size, f"key {key!r} is {kind}, not a string"
            if not text.strip():
                return line_number, None, size, f"empty document under key {key!r}"
            try:
                ids = Encoder.tokenizer.tokenize(text)
            except ValueError as error:
                return line_number, None, size, f"cannot tokenize key {key!r}: {error}"
            if not ids:
                return line_number, None, size, f"key {key!r} tokenizes to no tokens"
            if self.args.append_eod:
                ids = list(ids) + [Encoder.tokenizer.eod]
            arrays.append(np.asarray(ids, dtype=self.dtype))
        return line_number, arrays, size, None


def read_lines(path: str) -> Iterator[Tuple[int, str]]:
    """(1-based line number, line) for every non-blank line; .gz is decompressed."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if line.strip():
                yield line_number, line


def get_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    group = parser.add_argument_group("input data")
    group.add_argument("--input", required=True, help="JSON lines file (.gz accepted)")
    group.add_argument("--json-keys", nargs="+", default=["text"], help="keys to extract")
    group.add_argument("--skip-bad-lines", action="store_true",
                       help="report and skip malformed lines / missing keys / empty documents "
                       "instead of failing")
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    group.add_argument("--tokenizer-model", default=None)
    group.add_argument("--vocab-file", default=None)
    group.add_argument("--merge-file", default=None)
    group.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer only")
    group.add_argument("--vocab-extra-ids", type=int, default=0)
    group.add_argument("--tiktoken-pattern", choices=["v1", "v2"], default=None,
                       help="TikTokenizer's split pattern (megatron-core's default: v2)")
    group.add_argument("--tiktoken-num-special-tokens", type=int, default=1000)
    group.add_argument("--tiktoken-special-tokens", dest="tokenizer_special_tokens", nargs="+",
                       default=None, help="TikTokenizer's named special tokens")
    group.add_argument("--tokenizer-hf-include-special-tokens", action="store_true",
                       help="HuggingFaceTokenizer: keep the bos / template tokens the "
                       "tokenizer adds (Megatron's flag; always so with --legacy-tokenizer)")
    group.add_argument("--legacy-tokenizer", action="store_true",
                       help="megatron/training's tokenizer classes (SentencePieceTokenizer "
                       "appends its own <EOD>, ...) instead of megatron-core's (Megatron's "
                       "default, where SentencePiece's eod is the model's eos)")
    group.add_argument("--append-eod", action="store_true", help="end each document with eod")
    group.add_argument("--keep-newlines", action="store_true",
                       help="Megatron's flag for NLTK sentence splitting, which keeps the "
                       "newlines between sentences; documents are not split into sentences "
                       "here, so newlines are always kept (Megatron's output without "
                       "--split-sentences is the same with or without it)")
    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", required=True)
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1,
                       help="tokenising processes (in all: each partition gets "
                       "workers / partitions)")
    group.add_argument("--partitions", type=int, default=1,
                       help="split the input (a glob with more than one) into N parts "
                       "tokenised in parallel, then merged in part order into one .bin/.idx; "
                       "lines go to the parts in turn (line i to part i %% N), as in Megatron, "
                       "so documents come out grouped by part unless "
                       "--keep-sequential-samples")
    group.add_argument("--keep-sequential-samples", action="store_true",
                       help="with --partitions: give each part a contiguous run of lines, so "
                       "the merged output equals a one-partition run")
    group.add_argument("--log-interval", type=int, default=10000, help="documents between reports")
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error("--workers must be >= 1")
    if args.partitions < 1:
        parser.error("--partitions must be >= 1")
    if args.partitions > 1:
        if args.workers % args.partitions:
            parser.error(f"--workers ({args.workers}) must be a multiple of --partitions "
                         f"({args.partitions}): each partition gets workers / partitions")
        if not input_files(args.input):
            parser.error(f"--input {args.input} matches no file")
    elif not os.path.isfile(args.input):
        parser.error(f"--input {args.input} not found")
    return args


def input_files(pattern: str) -> List[str]:
    """The files an --input glob names, in sorted order (so runs are reproducible)."""
    return sorted(path for path in glob.glob(pattern) if os.path.isfile(path))


def output_prefix(args: argparse.Namespace, key: str) -> str:
    return f"{args.output_prefix}_{key}_document"


def _worker_context():
    """fork when this process has no other thread (it shares the imported modules for free);
    forkserver otherwise: a fork taken while another thread (a test runner's, a notebook's,
    a server's) holds a lock leaves the child waiting on that lock forever."""
    method = "fork" if threading.active_count() == 1 else "forkserver"
    return multiprocessing.get_context(method)


def preprocess(args: argparse.Namespace, log=None) -> Dict[str, float]:
    """Run the conversion; returns counts and throughput. Raises BadInputError on bad input."""
    log = log or sys.stderr
    encoder = Encoder(args)
    encoder.initializer()
    dtype = optimal_dtype(Encoder.tokenizer.vocab_size)
    encoder.dtype = dtype
    directory = os.path.dirname(os.path.abspath(args.output_prefix))
    os.makedirs(directory, exist_ok=True)
    prefixes = {key: output_prefix(args, key) for key in args.json_keys}
    builders = {key: IndexedDatasetBuilder(data_file_path(p), dtype) for key, p in prefixes.items()}

    pool = None
    if args.workers > 1:
        # Workers only tokenise.
        context = _worker_context()
        pool = context.Pool(args.workers, initializer=encoder.initializer)
        encoded = pool.imap(encoder.encode, read_lines(args.input), chunksize=64)
    else:
        encoded = map(encoder.encode, read_lines(args.input))

    start = time.perf_counter()
    documents = tokens = skipped = 0
    total_bytes = 0
    try:
        for line_number, arrays, size, error in encoded:
            total_bytes += size
            if error is not None:
                message = f"{args.input}:{line_number}: {error}"
                if not args.skip_bad_lines:
                    raise BadInputError(
                        message + " (fix the line, or pass --skip-bad-lines to skip such lines)"
                    )
                print(f"skipped {message}", file=log)
                skipped += 1
                continue
            for key, array in zip(args.json_keys, arrays):
                builders[key].add_document(array)
                tokens += array.size
            documents += 1
            if documents % args.log_interval == 0:
                elapsed = time.perf_counter() - start
                print(
                    f"processed {documents} documents ({documents / elapsed:.1f} docs/s, "
                    f"{total_bytes / elapsed / 1e6:.2f} MB/s)",
                    file=log,
                )
    except BaseException:
        for key, builder in builders.items():
            builder.discard()
            if os.path.exists(index_file_path(prefixes[key])):
                os.remove(index_file_path(prefixes[key]))
        raise
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    for key, builder in builders.items():
        builder.finalize(index_file_path(prefixes[key]))
    elapsed = max(time.perf_counter() - start, 1e-9)
    summary = {
        "documents": documents,
        "skipped": skipped,
        "tokens": tokens,
        "bytes": total_bytes,
        "seconds": elapsed,
        "docs_per_s": documents / elapsed,
        "mb_per_s": total_bytes / elapsed / 1e6,
    }
    print(
        f"done: {documents} documents, {tokens} tokens, {skipped} lines skipped, "
        f"{elapsed:.2f} s ({summary['docs_per_s']:.1f} docs/s, {summary['mb_per_s']:.2f} MB/s) -> "
        + ", ".join(prefixes[key] + ".bin/.idx" for key in args.json_keys),
        file=log,
    )
    return summary


def write_partitions(args: argparse.Namespace, directory: str) -> List[str]:
    """Deal the input lines into `args.partitions` files: in turn (Megatron's default) or,
    with --keep-sequential-samples, in contiguous runs of ceil(lines / partitions)."""
    paths = input_files(args.input)
    per_partition = None
    if args.keep_sequential_samples:
        total = sum(1 for path in paths for _ in read_lines(path))
        per_partition = max(-(-total // args.partitions), 1)
    names = [os.path.join(directory, f"partition_{i}.jsonl") for i in range(args.partitions)]
    handles = [open(name, "w", encoding="utf-8") for name in names]
    try:
        count = 0
        for path in paths:
            for _, line in read_lines(path):
                part = count // per_partition if per_partition else count % args.partitions
                handles[part].write(line if line.endswith("\n") else line + "\n")
                count += 1
    finally:
        for handle in handles:
            handle.close()
    return names


def _preprocess_partition(args: argparse.Namespace, results) -> None:
    try:
        with open(os.devnull, "w") as quiet:
            results.put((args.input, preprocess(args, log=quiet), None))
    except BaseException as error:  # reported by the parent, which owns the exit status
        results.put((args.input, None, f"{type(error).__name__}: {error}"))


def preprocess_partitioned(args: argparse.Namespace, log=None) -> Dict[str, float]:
    """--partitions N: tokenise N parts of the input in parallel processes, then merge their
    datasets in part order into `{output_prefix}_{key}_document`."""
    import tempfile

    log = log or sys.stderr
    start = time.perf_counter()
    directory = os.path.dirname(os.path.abspath(args.output_prefix))
    os.makedirs(directory, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory, prefix=".partitions-") as scratch:
        parts = []
        for index, path in enumerate(write_partitions(args, scratch)):
            part = copy.copy(args)
            part.input, part.partitions = path, 1
            part.output_prefix = os.path.join(scratch, f"part_{index}")
            part.workers = args.workers // args.partitions
            parts.append(part)
        context = _worker_context()
        results = context.Queue()
        processes = [context.Process(target=_preprocess_partition, args=(part, results))
                     for part in parts]
        for process in processes:
            process.start()
        outcome = {}
        while len(outcome) < len(processes):
            try:
                name, summary, error = results.get(timeout=1.0)
                outcome[name] = (summary, error)
            except queue.Empty:
                # A part killed outright (out of memory) never reports: stop waiting for it.
                if all(p.exitcode is not None for p in processes) and results.empty():
                    codes = [p.exitcode for p in processes]
                    raise BadInputError(f"a partition process died (exit codes {codes})")
        for process in processes:
            process.join()
        errors = [f"{name}: {error}" for name, (_, error) in outcome.items() if error]
        if errors:
            raise BadInputError("; ".join(errors))
        dtype = None
        for key in args.json_keys:
            sources = [output_prefix(part, key) for part in parts]
            dtype = IndexedDataset(sources[0]).dtype
            builder = IndexedDatasetBuilder(data_file_path(output_prefix(args, key)), dtype)
            for source in sources:
                builder.add_index(source)
            builder.finalize(index_file_path(output_prefix(args, key)))
    summaries = [summary for summary, _ in outcome.values()]
    elapsed = max(time.perf_counter() - start, 1e-9)
    summary = {name: sum(s[name] for s in summaries)
               for name in ("documents", "skipped", "tokens", "bytes")}
    summary.update(seconds=elapsed, docs_per_s=summary["documents"] / elapsed,
                   mb_per_s=summary["bytes"] / elapsed / 1e6)
    print(f"done: {summary['documents']} documents, {summary['tokens']} tokens in "
          f"{args.partitions} partitions, {summary['skipped']} lines skipped, {elapsed:.2f} s",
          file=log)
    return summary


def main(argv: Optional[List[str]] = None) -> int:
    args = get_args(argv)
    try:
        if args.partitions > 1:
            preprocess_partitioned(args)
        else:
            preprocess(args)
    except BadInputError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except ValueError as error:  # ConfigError: a missing tokenizer file and the like
        print_error(str(error))
        return CONFIG_ERROR_STATUS
    return 0


if __name__ == "__main__":
    sys.exit(main())
