"""tools/bench/bench_checkpoint.py runs end to end at a tiny size, in both modes (no test ran
the benches, and a bad edit once left --engine referring to names it does not have)."""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "tools", "bench"))
import bench_checkpoint  # noqa: E402


def _run(argv, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["bench_checkpoint.py", "--json", "--repeats", "1",
                                      "--dir", str(tmp_path)] + argv)
    bench_checkpoint.main()
    out = capsys.readouterr().out
    summary = json.loads(out[out.index("{"):out.rindex("}") + 1])
    assert os.listdir(tmp_path) == []  # its checkpoints and raw files are removed
    return summary


def test_training_state_bench_reports_every_figure(tmp_path, monkeypatch, capsys):
    summary = _run(["--layers", "1", "--hidden", "64", "--heads", "4", "--vocab", "128",
                    "--step-seconds", "0.05"], tmp_path, monkeypatch, capsys)
    assert summary["world_size"] == 2 and summary["params"] > 0
    assert summary["checkpoint_mb"] > 0
    for key in ("sync_s", "raw_write_s", "raw_read_s", "fresh_read_s", "load_s",
                "async_total_s", "async_write_s"):
        assert summary[key]["median"] > 0 and summary[key]["mb_s"] > 0, key
    for key in ("save_vs_raw_write", "load_vs_raw_read", "async_blocked_fraction_of_sync"):
        assert summary[key] > 0, key


def test_engine_bench_reports_every_figure(tmp_path, monkeypatch, capsys):
    summary = _run(["--engine", "--total-mb", "2", "--tensors", "2", "--train-seconds", "0.05"],
                   tmp_path, monkeypatch, capsys)
    assert summary["total_mb"] == pytest.approx(2.0, rel=0.05)
    for key in ("sync_s", "async_blocked_s", "async_total_s", "background_blocked_s",
                "load_s", "sync_save_mb_s", "load_mb_s"):
        assert summary[key] > 0, key
