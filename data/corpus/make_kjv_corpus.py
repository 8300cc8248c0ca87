"""Rebuild kjv.jsonl.gz: the King James Bible, one JSON line per chapter.

Source: Debian's `bible-kjv-text` package, read through its `bible` program
(`apt-get install bible-kjv`). Run: python data/corpus/make_kjv_corpus.py
"""
import gzip
import json
import os
import re
import subprocess

VERSE = re.compile(r"^(?P<book>\d?[A-Za-z]+)(?P<chapter>\d+):(?P<verse>\d+) (?P<text>.*)$")


def main() -> None:
    raw = subprocess.run(
        ["bible", "-f", "Gen1:1-Rev22:21"], check=True, capture_output=True, text=True
    ).stdout
    chapters = {}
    for line in raw.splitlines():
        match = VERSE.match(line)
        if match is None:
            raise ValueError(f"unexpected line from bible: {line!r}")
        key = (match["book"], int(match["chapter"]))
        chapters.setdefault(key, []).append(match["text"].strip())
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kjv.jsonl.gz")
    # mtime=0 keeps the archive byte-identical across rebuilds.
    with gzip.GzipFile(out, "wb", compresslevel=9, mtime=0) as handle:
        for (book, chapter), verses in chapters.items():
            record = {"id": f"{book}{chapter}", "text": "\n".join(verses) + "\n"}
            handle.write((json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8"))
    print(f"wrote {out}: {len(chapters)} chapters")


if __name__ == "__main__":
    main()
