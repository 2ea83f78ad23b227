"""Benchmark records: a reduced (--quick) run never replaces the full-scale results the README quotes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import bench.comm
import bench.records
from bench.records import Record, results_name, write_records


def test_quick_runs_write_their_own_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(bench.records, "RESULTS_DIR", tmp_path)
    record = Record(name="x", value=2.0, unit="s", peer="y", peer_value=1.0, ratio=2.0, config={})
    monkeypatch.setattr(bench.comm, "_traffic_records", lambda *a, **k: [record])
    monkeypatch.setattr(bench.comm, "_timing_records", lambda *a, **k: [])
    monkeypatch.setattr(bench.comm, "_default_layout_record", lambda *a, **k: record)
    monkeypatch.setattr(bench.comm, "_segment_norms_record", lambda *a, **k: record)
    monkeypatch.setattr(bench.comm, "_bytes_moved_record", lambda *a, **k: record)  # 336M elements otherwise
    bench.comm.main(["--quick"])
    bench.comm.main(["--numel", "4096"])  # any reduced size is a quick run too
    assert sorted(p.name for p in tmp_path.glob("*.json")) == ["comm_quick.json"]
    bench.comm.main([])
    assert sorted(p.name for p in tmp_path.glob("*.json")) == ["comm.json", "comm_quick.json"]
    assert json.loads((tmp_path / "comm.json").read_text())[0]["name"] == "x"


def test_the_segment_norms_record_times_both_norms():
    record = bench.comm._segment_norms_record(200_000, repeats=2)
    assert record.name == "segment_l1_norms_ns_per_element"
    assert record.value > 0 and record.peer_value > 0 and record.config["two_norm_ns_per_element"] > 0
    assert record.config["rows"] == 200_000 // bench.comm.NORM_ROW_LENGTH


def test_the_bytes_moved_records_time_the_call_against_a_copy():
    plain = bench.comm._bytes_moved_record(200_000, repeats=1)
    default = bench.comm._bytes_moved_record(bench.comm.QUICK_NUMEL, repeats=1, default_layout=True)
    assert plain.name == "compression_bytes_moved_n2" and plain.peer_value == 8.0
    assert default.name == "compression_bytes_moved_default_layout_n2"
    assert "per_column" in default.config["layout"]
    for record in (plain, default):
        assert record.value > 0 and record.config["ns_per_worker_element"] > 0
        assert record.config["copy_GB_per_s"] > 0 and record.config["threads"] == 1


def test_results_name_and_atomic_write(tmp_path: Path):
    assert results_name("optim", quick=True) == "optim_quick"
    assert results_name("optim", quick=False) == "optim"
    path = write_records("optim_quick", [], out_dir=tmp_path)
    assert path == tmp_path / "optim_quick.json" and json.loads(path.read_text()) == []
    assert not list(tmp_path.glob("*.tmp"))
    # readable as a plain open() would have made it (the temp file was 0600)
    umask = os.umask(0o022)
    try:
        assert write_records("comm", [], out_dir=tmp_path).stat().st_mode & 0o777 == 0o644
    finally:
        os.umask(umask)


def test_an_unchanged_record_keeps_the_machine_that_made_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    def on(cpu: str) -> None:
        monkeypatch.setattr("bench.records.machine_info", lambda: {"cpu_model": cpu, "time": cpu})

    def record(value: float) -> Record:
        return Record("final_loss_ratio", value, "x", peer="lamb", peer_value=2.0, config={"seeds": (1, 2)})

    on("first")
    write_records("fidelity", [record(2.1), record(3.0)], out_dir=tmp_path, quiet=True)
    on("second")  # the same runs again: both records as they were, one new
    renamed = Record("other", 1.0, "x")
    path = write_records("fidelity", [record(2.1), renamed], out_dir=tmp_path, quiet=True)
    machines = [entry["config"]["machine"]["cpu_model"] for entry in json.loads(path.read_text())]
    assert machines == ["first", "second"]
    path = write_records("fidelity", [record(2.2)], out_dir=tmp_path, quiet=True)  # a new figure: made here
    assert json.loads(path.read_text())[0]["config"]["machine"]["cpu_model"] == "second"
