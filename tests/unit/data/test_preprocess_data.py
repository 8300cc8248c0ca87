import json
import os
import sys

import numpy as np
import pytest

from megatron_smp.data.indexed_dataset import IndexedDataset

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
sys.path.insert(0, os.path.join(REPO, "tools"))

import preprocess_data  # noqa: E402


def run(tmp_path, lines, *extra, workers=1):
    source = tmp_path / "input.jsonl"
    source.write_text("\n".join(lines) + "\n")
    args = preprocess_data.get_args(
        [
            "--input", str(source), "--output-prefix", str(tmp_path / "out"),
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "50", "--append-eod",
            "--workers", str(workers), *extra,
        ]
    )
    return preprocess_data.preprocess(args, log=open(os.devnull, "w"))


def test_documents_and_keys_round_trip(tmp_path):
    lines = [json.dumps({"text": f"{i} {i + 1} {i + 2}", "title": str(i)}) for i in range(40)]
    summary = run(tmp_path, lines, "--json-keys", "text", "title")
    assert summary["documents"] == 40 and summary["skipped"] == 0
    text = IndexedDataset(str(tmp_path / "out_text_document"))
    title = IndexedDataset(str(tmp_path / "out_title_document"))
    assert text.dtype == np.uint16  # Megatron's choice for a vocabulary under 65500
    for i in range(40):
        assert text[i].tolist() == [i, i + 1, i + 2, 50]  # eod of NullTokenizer(50) is 50
        assert title[i].tolist() == [i, 50]


def test_two_workers_write_the_same_files(tmp_path):
    lines = [
        json.dumps({"text": " ".join(str(j % 50) for j in range(i % 17 + 1))}) for i in range(300)
    ]
    run(tmp_path, lines, workers=1)
    one = [(tmp_path / f"out_text_document{s}").read_bytes() for s in (".bin", ".idx")]
    run(tmp_path, lines, workers=2)
    two = [(tmp_path / f"out_text_document{s}").read_bytes() for s in (".bin", ".idx")]
    assert one == two


BAD_LINES = [
    json.dumps({"text": "1 2"}),
    "{not json",
    json.dumps({"body": "3 4"}),
    json.dumps({"text": "   "}),
    json.dumps({"text": "5 6"}),
]


def test_bad_lines_fail_with_line_numbers_and_leave_nothing(tmp_path):
    with pytest.raises(preprocess_data.BadInputError, match=r"input.jsonl:2: not valid JSON"):
        run(tmp_path, BAD_LINES)
    assert not (tmp_path / "out_text_document.bin").exists()
    assert not (tmp_path / "out_text_document.idx").exists()
    with pytest.raises(preprocess_data.BadInputError, match=r":3: missing key 'text'"):
        run(tmp_path, [BAD_LINES[0], "", BAD_LINES[2]])  # blank lines still count
    with pytest.raises(preprocess_data.BadInputError, match=r":1: empty document"):
        run(tmp_path, [BAD_LINES[3]], workers=2)


def test_skip_bad_lines_reports_each(tmp_path, capsys):
    source = tmp_path / "input.jsonl"
    source.write_text("\n".join(BAD_LINES) + "\n")
    code = preprocess_data.main(
        ["--input", str(source), "--output-prefix", str(tmp_path / "out"),
         "--tokenizer-type", "NullTokenizer", "--vocab-size", "50", "--skip-bad-lines"]
    )
    err = capsys.readouterr().err
    assert code == 0
    for number in (2, 3, 4):
        assert f"input.jsonl:{number}:" in err
    assert "2 documents" in err and "3 lines skipped" in err and "MB/s" in err
    dataset = IndexedDataset(str(tmp_path / "out_text_document"))
    assert [dataset[i].tolist() for i in range(len(dataset))] == [[1, 2], [5, 6]]
    code = preprocess_data.main(
        ["--input", str(source), "--output-prefix", str(tmp_path / "out2"),
         "--tokenizer-type", "NullTokenizer", "--vocab-size", "50"]
    )
    assert code == 1 and "input.jsonl:2: not valid JSON" in capsys.readouterr().err


def _outputs(prefix):
    return [open(f"{prefix}_text_document{s}", "rb").read() for s in (".bin", ".idx")]


def _lines(count):
    return [json.dumps({"text": " ".join(str((i * 7 + j) % 50) for j in range(i % 13 + 1))})
            for i in range(count)]


def test_partitions_merge_in_megatron_order(tmp_path):
    lines = _lines(103)
    (tmp_path / "input.jsonl").write_text("\n".join(lines) + "\n")
    base = ["--input", str(tmp_path / "input.jsonl"), "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "50", "--append-eod"]
    assert preprocess_data.main(base + ["--output-prefix", str(tmp_path / "one")]) == 0
    # Contiguous parts: the merged dataset is byte for byte the one-partition run.
    assert preprocess_data.main(base + ["--output-prefix", str(tmp_path / "seq"),
                                        "--partitions", "3", "--workers", "3",
                                        "--keep-sequential-samples"]) == 0
    assert _outputs(tmp_path / "seq") == _outputs(tmp_path / "one")
    # Megatron's default deals lines in turn: part p holds lines p, p+3, ...; merged in order.
    assert preprocess_data.main(base + ["--output-prefix", str(tmp_path / "dealt"),
                                        "--partitions", "3", "--workers", "3"]) == 0
    one = IndexedDataset(str(tmp_path / "one_text_document"))
    dealt = IndexedDataset(str(tmp_path / "dealt_text_document"))
    order = [i for part in range(3) for i in range(part, 103, 3)]
    assert len(dealt) == 103
    assert [dealt[k].tolist() for k in range(103)] == [one[i].tolist() for i in order]
    assert not [name for name in os.listdir(tmp_path) if name.startswith(".partitions")]


def test_partitions_report_bad_lines_and_check_workers(tmp_path, capsys):
    (tmp_path / "input.jsonl").write_text("\n".join(_lines(10) + ["{not json"]) + "\n")
    argv = ["--input", str(tmp_path / "input.jsonl"), "--output-prefix", str(tmp_path / "o"),
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "50", "--partitions", "2",
            "--workers", "2"]
    assert preprocess_data.main(argv) == 1
    assert "not valid JSON" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        preprocess_data.get_args(argv[:-1] + ["3"])  # 3 workers over 2 partitions


MEGATRON_OUTPUT = os.path.join(REPO, "tests", "fixtures", "data_megatron", "preprocessed")


def test_keep_newlines_keeps_megatrons_output(tmp_path):
    """Megatron's --keep-newlines only changes its sentence splitter (core_v0.16.1
    tools/preprocess_data.py: `if self.args.split_sentences: ... if self.args.keep_newlines`),
    so without --split-sentences its output is its default one: ours with the flag equals that
    fixture byte for byte, on a corpus whose documents hold 61 newlines."""
    corpus = os.path.join(MEGATRON_OUTPUT, "corpus.jsonl")
    with open(corpus) as handle:
        assert sum(json.loads(line)["text"].count("\n") for line in handle) == 61
    assert preprocess_data.main([
        "--input", corpus, "--output-prefix", str(tmp_path / "ours"),
        "--tokenizer-type", "SentencePieceTokenizer", "--append-eod", "--keep-newlines",
        "--tokenizer-model", os.path.join(MEGATRON_OUTPUT, "tok.model")]) == 0
    assert _outputs(tmp_path / "ours") == _outputs(os.path.join(MEGATRON_OUTPUT,
                                                                "megatron_default"))


@pytest.mark.parametrize("name, extra", [
    ("default", []),
    ("legacy", ["--legacy-tokenizer"]),
    ("partitions3", ["--workers", "3", "--partitions", "3"]),
])
def test_sentencepiece_output_equals_megatrons_preprocess(tmp_path, name, extra):
    """Byte-identical to Megatron-LM's tools/preprocess_data.py (see the fixture's README):
    the model's </s> as eod by default, Megatron's appended <EOD> (and special-token text)
    with --legacy-tokenizer, and the order of a 3-partition run."""
    assert preprocess_data.main([
        "--input", os.path.join(MEGATRON_OUTPUT, "corpus.jsonl"),
        "--output-prefix", str(tmp_path / "ours"), "--tokenizer-type", "SentencePieceTokenizer",
        "--tokenizer-model", os.path.join(MEGATRON_OUTPUT, "tok.model"), "--append-eod",
        *extra]) == 0
    assert _outputs(tmp_path / "ours") == _outputs(os.path.join(MEGATRON_OUTPUT,
                                                                f"megatron_{name}"))
