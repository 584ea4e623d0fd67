"""I/O faults of a run, one test per class: the disk fills or goes read-only mid-run (one line: what happened, the
rows that are safe, rerun to resume; exit 3), a store, claims folder or run directory that cannot be one (one line
naming the key, exit 2, before any work). After each fault nothing is half-written and a rerun completes the run
with no row computed twice."""

from __future__ import annotations

import errno
import os

import pandas as pd
import pytest

from kvbench import KvbenchError
from kvbench.run.runner import run
from kvbench.store.results import ResultStore, StoreFault, write_atomic
from tests.conftest import compose_config, tiny_overrides


def every_stored_row(store) -> pd.DataFrame:
    return pd.concat([pd.read_parquet(f) for f in sorted((store / "rows").glob("*.parquet"))], ignore_index=True)


def leftovers(tmp_path) -> list:
    """Temporary files and claims a fault must not leave behind."""
    return [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp") or (p.is_file() and "claims" in p.parts)]


def fail_third_save(monkeypatch, code: int) -> None:
    """The store's third save (third example) fails with `code`: ENOSPC for real (pyarrow writes to /dev/full, which
    the kernel answers with ENOSPC), the others injected (a read-only remount cannot be made without root/mounts)."""
    real = ResultStore.save_run
    calls = {"n": 0}

    def save_run(self, run_id, rows):
        calls["n"] += 1
        if calls["n"] != 3:
            return real(self, run_id, rows)
        path = self.rows_dir / f"{run_id}.parquet"
        if code == errno.ENOSPC and os.path.exists("/dev/full"):
            write_atomic(path, lambda tmp: pd.DataFrame(rows).to_parquet("/dev/full"))
        raise OSError(code, os.strerror(code), str(path))

    monkeypatch.setattr(ResultStore, "save_run", save_run)


@pytest.mark.parametrize(
    "code, what", [(errno.ENOSPC, "disk full"), (errno.EROFS, "read-only file system"), (errno.EACCES, "permission")]
)
def test_a_store_write_failing_mid_run_keeps_every_saved_row_and_the_rerun_completes(tmp_path, monkeypatch, code, what):
    fail_third_save(monkeypatch, code)
    with pytest.raises(StoreFault) as fault:
        run(compose_config(*tiny_overrides(tmp_path)), tmp_path / "a")
    line = str(fault.value)
    assert "\n" not in line and fault.value.exit_code == 3
    assert line.startswith(what) and "the 4 rows this run computed before are safe" in line, line
    assert line.endswith("then rerun to resume") and str(tmp_path / "store" / "rows") in line
    assert leftovers(tmp_path) == []  # no temporary file, no claim left behind
    assert len(every_stored_row(tmp_path / "store")) == 4  # the two examples saved before: intact, readable
    monkeypatch.undo()
    rows = run(compose_config(*tiny_overrides(tmp_path)), tmp_path / "b")
    assert len(rows) == 8 and rows["reused"].sum() == 4
    stored = every_stored_row(tmp_path / "store")
    assert len(stored) == 8 and not stored.duplicated(["config_hash", "example_id"]).any()


def test_a_failing_run_directory_write_says_every_row_is_in_the_store(tmp_path, monkeypatch):
    import kvbench.run.runner as runner

    def full(frame, path):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(runner, "write_rows", full)
    with pytest.raises(StoreFault, match=r"^disk full .* while writing the run's outputs in .*: all 8 rows are safe"):
        run(compose_config(*tiny_overrides(tmp_path)), tmp_path / "a")
    monkeypatch.undo()
    assert run(compose_config(*tiny_overrides(tmp_path)), tmp_path / "b")["reused"].all()


@pytest.mark.parametrize(
    "make, key",
    [
        (lambda t: (t / "store").write_text("x"), "results_dir"),  # the store is a file
        (lambda t: ((t / "store").mkdir(), (t / "store" / "claims").write_text("x")), "results_dir"),  # claims
        (lambda t: ((t / "store").mkdir(), (t / "store" / "rows").write_text("x")), "results_dir"),  # rows
        (lambda t: (t / "out").write_text("x"), "hydra.run.dir"),  # the run directory
    ],
    ids=["store", "claims", "rows", "run-dir"],
)
def test_a_folder_that_is_a_file_is_refused_before_any_work(tmp_path, make, key):
    make(tmp_path)
    with pytest.raises(KvbenchError) as refused:
        run(compose_config(*tiny_overrides(tmp_path)), tmp_path / "out")
    assert refused.value.exit_code == 2 and "\n" not in str(refused.value)
    assert "a file, not a directory" in str(refused.value) and f"choose another {key}=PATH" in str(refused.value)
    assert not list(tmp_path.rglob("*.parquet"))


def test_a_read_only_store_is_refused_before_any_work(tmp_path, monkeypatch):
    import tempfile

    real = tempfile.mkstemp

    def read_only(*args, dir=None, **kwargs):  # what a read-only mount answers (EROFS even for root)
        if dir is not None and "store" in str(dir):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(dir))
        return real(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    with pytest.raises(KvbenchError, match=r"read-only file system at .*store.*make it writable, or choose another "):
        run(compose_config(*tiny_overrides(tmp_path)), tmp_path / "out")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a chmod 555 folder: the EROFS test above covers it")
def test_a_write_protected_store_is_refused_before_any_work(tmp_path):
    (tmp_path / "store").mkdir()
    (tmp_path / "store").chmod(0o555)
    try:
        with pytest.raises(KvbenchError, match=r"permission denied .*choose another results_dir=PATH"):
            run(compose_config(*tiny_overrides(tmp_path)), tmp_path / "out")
    finally:
        (tmp_path / "store").chmod(0o755)


@pytest.mark.parametrize("kind", ["file", "under-a-file", "read-only"])
def test_a_hydra_run_dir_that_cannot_be_created_is_one_line_exit_2(tmp_path, monkeypatch, capsys, kind):
    import tempfile

    from kvbench.__main__ import RunDirCheck

    (tmp_path / "f").write_text("x")
    target = {"file": tmp_path / "f", "under-a-file": tmp_path / "f" / "run", "read-only": tmp_path / "ro" / "run"}
    if kind == "read-only":
        monkeypatch.setattr(tempfile, "mkstemp", lambda **k: (_ for _ in ()).throw(OSError(errno.EROFS, "Read-only")))
    with pytest.raises(SystemExit) as exited:
        RunDirCheck._check(str(target[kind]), "hydra.run.dir")
    err = capsys.readouterr().err.strip()
    assert exited.value.code == 2 and "\n" not in err and err.endswith("choose another hydra.run.dir=PATH")
    assert ("read-only file system" if kind == "read-only" else f"{tmp_path / 'f'} is a file") in err
    monkeypatch.undo()
    RunDirCheck._check(str(tmp_path / "new" / "run"), "hydra.run.dir")  # creatable: passes, creates nothing
    assert not (tmp_path / "new").exists()


def test_a_fault_line_ends_in_the_command_that_resumes(monkeypatch):
    from kvbench.__main__ import message

    monkeypatch.setattr("sys.argv", ["kvbench", "model=tiny-random", "grid.method=[snapkv,h2o]"])
    line = message(
        StoreFault("disk full at /s/rows/r.parquet: the 4 rows ... are safe; free disk space, then rerun to resume")
    )
    assert line.endswith("then rerun to resume: python -m kvbench model=tiny-random 'grid.method=[snapkv,h2o]'")
    assert message(KvbenchError("limit=0 must be ≥ 1")) == "limit=0 must be ≥ 1"  # bad input: no resume command
