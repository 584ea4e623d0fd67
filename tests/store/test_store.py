"""The store under foreign and damaged files, atomic writes under a failing write, claims under faults."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time

import pandas as pd
import pytest

from kvbench.store.claims import Claims, _process_start
from kvbench.store.results import COLUMNS, SCHEMA_VERSION, ResultStore, read_rows, write_atomic

ROW = {
    **dict.fromkeys(COLUMNS, "x"),
    "config_hash": "h",
    "example_id": "e",
    "timestamp": "2026-01-01T00:00:00+00:00",
    "score": 1.0,
    "schema_version": SCHEMA_VERSION,
}


@pytest.mark.parametrize("kind", ["foreign", "truncated"])
def test_a_foreign_or_truncated_file_is_skipped_with_one_warning_naming_it(tmp_path, capsys, kind):
    from kvbench.store.aggregate import load_rows

    store = ResultStore(tmp_path)
    store.save_run("good", [ROW])
    bad = tmp_path / "rows" / "other.parquet"
    if kind == "foreign":  # a Parquet file someone else wrote into the store
        pd.DataFrame({"user": ["a", "b"], "value": [1, 2]}).to_parquet(bad)
    else:
        data = (tmp_path / "rows" / "good.parquet").read_bytes()
        bad.write_bytes(data[: len(data) // 2])
    assert list(store.existing()) == [("h", "e")]  # the runner's reader
    assert len(read_rows(tmp_path)) == 1
    err = capsys.readouterr().err.strip().splitlines()
    word = "foreign" if kind == "foreign" else "unreadable"
    assert len(err) == 2 and all(f"skipping {word} results file {bad} (" in line for line in err), err
    if kind == "foreign":
        assert "not kvbench result rows: no column config_hash, example_id, timestamp" in err[0]
    rows = load_rows([tmp_path])  # what kvbench.report, .check and .guide read: the good file's row, not a KeyError
    assert list(rows["example_id"]) == ["e"] and f"skipping {word} results file {bad}" in capsys.readouterr().err


def test_a_failed_atomic_write_leaves_the_previous_version_and_no_temporary_file(tmp_path):
    target = tmp_path / "rows.parquet"
    write_atomic(target, lambda tmp: pd.DataFrame([ROW]).to_parquet(tmp))
    before = target.read_bytes()

    def half_then_full(tmp):
        with open(tmp, "wb") as f:
            f.write(b"PAR1 half a file")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(OSError) as failed:
        write_atomic(target, half_then_full)
    assert failed.value.filename == str(target)  # named by the file the user knows
    assert target.read_bytes() == before and os.listdir(tmp_path) == ["rows.parquet"]


def test_a_claim_whose_write_fails_is_not_left_half_written(tmp_path, monkeypatch):
    claims = Claims(tmp_path)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(json, "dump", full)
    with pytest.raises(OSError):
        claims.try_claim("h", "e")
    assert not claims._path("h", "e").exists() and not claims.held


def test_releasing_claims_on_a_read_only_store_never_raises(tmp_path, monkeypatch):
    from pathlib import Path

    claims = Claims(tmp_path)
    assert claims.try_claim("h", "e")

    def read_only(self, missing_ok=False):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(Path, "unlink", read_only)
    claims.release_all()  # it runs while the fault that caused it is on its way to the user
    assert not claims.held


def test_a_stopped_owner_is_named_with_its_pid_and_how_to_take_over(tmp_path, capsys):
    from kvbench.run.example_work import ExampleWork

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        owner = Claims(tmp_path)
        owner.me = {
            **owner.me,
            "pid": child.pid,
            "start": _process_start(child.pid),
        }
        assert owner.try_claim("h", "e") and owner.try_claim("h", "f")
        mine = Claims(tmp_path)
        assert mine.stopped_owners([("h", "e")]) == {}  # running: not reported
        child.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 10  # the stop lands asynchronously: on a loaded machine it takes a while
        while not mine.stopped_owners([("h", "e")]) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert mine.stopped_owners([("h", "e"), ("h", "f")]) == {child.pid: 2}
        assert mine.held_elsewhere("h", "e")  # alive: not stale, it may resume
        work = ExampleWork.__new__(ExampleWork)
        work.claims, work.reported = mine, set()
        work.report_stopped([("h", "e"), ("h", "f")])
        work.report_stopped([("h", "e"), ("h", "f")])  # named once, not per poll
        out = capsys.readouterr().out.strip()
        assert out.count("\n") == 0 and f"process {child.pid} on this host holds 2 claim(s)" in out
        assert f"kill -CONT {child.pid}" in out and f"kill -9 {child.pid}" in out
        child.kill()
        child.wait()
        assert not mine.held_elsewhere("h", "e") and mine.try_claim("h", "e")  # ended: taken over at once
    finally:
        child.kill()
        child.wait()
