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
