"""The store's paths and leftovers: `~` expanded once, temporary files of killed processes swept, claim folders
removed as they empty, an interrupted run saying what the store holds of it; haystack files checked for binary
bytes through their whole length."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvbench import KvbenchError
from kvbench.store import results
from kvbench.store.claims import Claims
from kvbench.store.results import HOST, ResultStore


def test_a_tilde_store_is_the_homes(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    store = ResultStore("~/store")
    store.save_run("r1", [{"a": 1}])
    assert (tmp_path / "home" / "store" / "rows" / "r1.parquet").is_file()
    assert not (tmp_path / "~").exists()  # before: ./~/store/rows/r1.parquet


def test_temporary_files_of_dead_processes_are_swept(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    rows = tmp_path / "rows"
    rows.mkdir()
    left = rows / f".r1.parquet.{dead.stdout.strip()}@{HOST}.abc123.tmp"  # what a SIGKILL mid-write leaves
    mine = rows / f".r2.parquet.{os.getpid()}@{HOST}.def456.tmp"  # a live writer's
    other = rows / ".r3.parquet.1@another-host.example.ghi789.tmp"  # another host's: not ours to judge
    for path in (left, mine, other):
        path.write_bytes(b"")
    ResultStore(tmp_path)
    assert not left.exists() and mine.exists() and other.exists()


def test_claim_folders_go_as_they_empty(tmp_path):
    (tmp_path / "claims" / "stale-config").mkdir(parents=True)  # left by an earlier run
    claims = Claims(tmp_path)
    assert not (tmp_path / "claims" / "stale-config").exists()
    assert claims.try_claim("cfg", "e1") and claims.try_claim("cfg", "e2")
    claims.release([("cfg", "e1")])
    assert (tmp_path / "claims" / "cfg").is_dir()  # e2's claim is still there
    claims.release_all()
    assert list((tmp_path / "claims").iterdir()) == []  # before: one empty folder per configuration


@pytest.mark.parametrize(
    ("rows", "line"),
    [
        (0, "no row was computed before it: rerun the same command to start"),
        (4, "the 4 rows computed so far are in the store: rerun"),
    ],
)
def test_an_interrupted_run_says_what_the_store_holds(monkeypatch, capsys, tmp_path, rows, line):
    import kvbench.__main__ as entry

    def stopped():
        raise KeyboardInterrupt

    monkeypatch.setattr(entry, "_main", stopped)
    monkeypatch.setattr(results, "SAVING", set())
    store = results.ResultStore(tmp_path)
    if rows:
        store.save_run("run", [{"config_hash": "h", "example_id": str(i)} for i in range(rows)])
    results.SAVING.add(store.rows_dir / "never-written.parquet")  # a write the signal beat: counts nothing
    with pytest.raises(SystemExit) as exited:
        entry.main()
    assert exited.value.code == 130 and line in capsys.readouterr().err


def test_binary_after_a_text_start_is_refused(tmp_path):
    from kvbench.tasks.haystack import check_files

    path = tmp_path / "mixed.txt"
    path.write_bytes(b"Plain sentences of text. " * 4000 + b"\x00\x01\xff\xfe" * 1000)  # 100 KB of text first
    with pytest.raises(KvbenchError, match="binary bytes at byte 65,536"):  # before: accepted (first 64 KiB only)
        check_files("task.haystack_files", [str(path)])
    text = tmp_path / "text.txt"
    text.write_text("Écrit en UTF-8, sur plusieurs blocs. " * 5000, encoding="utf-8")  # characters split by blocks
    check_files("task.haystack_files", [str(text)])
