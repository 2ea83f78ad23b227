"""`make finetune` without CKPT: the most recent pretraining run (finetune/latest.py)."""

from __future__ import annotations

import os
from pathlib import Path

from finetune.latest import latest_run, main


def _checkpoint(run: Path, step: int, mtime: int, *, complete: bool = True, hf: bool = True) -> Path:
    folder = run / "checkpoints" / f"step-{step:08d}"
    folder.mkdir(parents=True)
    if hf:
        (folder / "hf").mkdir()
        (folder / "hf" / "config.json").write_text("{}")
    if complete:
        (folder / "COMPLETE").write_text(f"{step}\n")
        os.utime(folder / "COMPLETE", ns=(mtime, mtime))
    return folder


def test_the_run_whose_newest_checkpoint_was_completed_last(tmp_path: Path):
    _checkpoint(tmp_path / "older", 10, 1_000)
    newest = _checkpoint(tmp_path / "newer", 20, 2_000)
    _checkpoint(tmp_path / "unfinished", 30, 3_000, complete=False)  # no COMPLETE marker: never taken
    _checkpoint(tmp_path / "no-export", 40, 4_000, hf=False)  # nothing to fine-tune
    (tmp_path / "not-a-run").mkdir()
    assert latest_run(tmp_path) == (tmp_path / "newer", newest)


def test_cli_prints_the_run_and_says_which(tmp_path: Path, capsys):
    _checkpoint(tmp_path / "only", 5, 1_000)
    assert main([str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == str(tmp_path / "only")
    assert "using the most recent run" in err and "step-00000005" in err


def test_no_run_is_one_line_naming_the_folder_and_the_way_out(tmp_path: Path, capsys):
    assert main([str(tmp_path / "missing")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1
    assert str(tmp_path / "missing") in err and "CKPT=" in err
