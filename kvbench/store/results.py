"""Result rows (the ★ columns), provenance, atomic writes and the results store.

The store is a directory of Parquet files, `<results_dir>/rows/<run_id>.parquet`, one per run, each rewritten
atomically after every example, so an interrupted sweep loses at most the example in flight and a rerun of the
same command picks up the rows already there (keyed by `config_hash` + `example_id`).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import json
import os
import platform
import re
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd

import kvbench
from kvbench import KvbenchError

if TYPE_CHECKING:
    import torch

SCHEMA_VERSION = 1
KEY_COLUMNS = ("config_hash", "example_id", "timestamp")  # what the store needs of a file to read it as rows


class StoreFault(KvbenchError):
    """Writing the store or the run directory failed mid-run (disk full, read-only, not a directory): the message
    says what happened and how many rows are safe; its text ends in "rerun to resume" (the CLI adds the command).
    Exit 3: the input was good, rerunning the same command completes the run."""

    exit_code = 3
    resumable = True


_FAULTS = {  # errno → what happened, in words, and what frees it
    errno.ENOSPC: ("disk full", "free disk space"),
    errno.EDQUOT: ("disk quota exceeded", "free space under your quota"),
    errno.EROFS: ("read-only file system", "make it writable"),
    errno.EACCES: ("permission denied", "make it writable"),
    errno.EPERM: ("operation not permitted", "make it writable"),
    errno.ENOTDIR: ("a part of the path is a file, not a directory", "remove or rename that file"),
    errno.EEXIST: ("it is a file, not a directory", "remove or rename that file"),
    errno.EISDIR: ("it is a directory, not a file", "remove or rename that directory"),
}


def fault_text(error: OSError, path: str | Path | None = None) -> tuple[str, str]:
    """("disk full (No space left on device) at PATH", "free disk space"): an OSError as a user reads it."""
    what, remedy = _FAULTS.get(error.errno or -1, (error.strerror or type(error).__name__, "fix it"))
    where = path or error.filename
    reason = os.strerror(error.errno) if error.errno else error.strerror  # pyarrow's strerror is a sentence
    detail = f" ({reason})" if reason and reason.lower() != what else ""
    return f"{what}{detail}" + (f" at {where}" if where else ""), remedy


COLUMNS = [  # ★ contract: DESIGN.md "Result rows"
    "run_id",
    "timestamp",
    "git_sha",
    "config_hash",
    "kvbench_version",
    "torch_version",
    "transformers_version",
    "device_name",
    "model",
    "task",
    "subset",
    "example_id",
    "context_tokens",
    "new_tokens",
    "method",
    "budget",
    "method_params",
    "query_aware",
    "score",
    "metric",
    "prediction",
    "answers",
    "kv_bytes",
    "kv_bytes_full",
    "kv_ratio",
    "peak_mem_bytes",
    "prefill_s",
    "decode_s",
    "decode_ms_per_token",
    "seed",
]


@functools.cache
def git_sha() -> str:
    root = Path(kvbench.__file__).resolve().parent.parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True)
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True, text=True
        ).stdout.strip()
        return sha.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


@functools.cache
def code_fingerprint() -> str:
    """sha256 (16 hex) of the kvbench sources that ran: the package, its methods and kernels (every .py file).
    Unlike git_sha it sees uncommitted edits and works from a pip install; reused rows with another fingerprint
    were computed by different code (the run says so)."""
    import importlib

    digest = hashlib.sha256()
    for package in ("kvbench", "kvbench.methods", "kvbench.kernels"):
        for directory in map(Path, importlib.import_module(package).__path__):
            for source in sorted(directory.rglob("*.py")):
                if "__pycache__" in source.parts:
                    continue
                digest.update(f"{package}/{source.relative_to(directory).as_posix()}\0".encode())
                digest.update(source.read_bytes())
    return digest.hexdigest()[:16]


_FILE_DIGESTS: dict[tuple[str, int, int], str] = {}  # (path, size, mtime_ns) → sha256: multiruns hash a file once


def data_digests(files) -> list[tuple[str, str]]:
    """The data a task reads, as the configuration hash keys it: (file name, sha256 of its content) per file, sorted.
    Where the files live (a venv's site-packages, a data folder) is not part of it: the same data in another
    checkout, venv or machine gives the same key, so a store shared by several of them reuses its rows."""
    return sorted((Path(path).name, file_digest(path)) for path in files)


def file_digest(path: Path) -> str:
    """sha256 of a data file's content (the key of reused rows includes it: an edited file is recomputed)."""
    path = Path(path)
    try:
        stat = path.stat()
        key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
        if key not in _FILE_DIGESTS:
            digest = hashlib.sha256()
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    digest.update(block)
            _FILE_DIGESTS[key] = digest.hexdigest()
        return _FILE_DIGESTS[key]
    except OSError as error:
        raise KvbenchError(f"cannot read data file {path} ({error.strerror}); fix its path") from None


def device_name(device: torch.device) -> str:
    import torch  # here, not at the top: kvbench.report.build and kvbench.report.gate read rows without torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return f"cpu: {line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    except OSError:
        pass
    return f"cpu: {platform.processor() or platform.machine()} ({os.cpu_count()} cores)"


def provenance(device: torch.device) -> dict:
    import torch
    import transformers

    return {
        "git_sha": git_sha(),
        "code_fingerprint": code_fingerprint(),
        "kvbench_version": kvbench.__version__,
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "device_name": device_name(device),
        "schema_version": SCHEMA_VERSION,
    }


def config_hash(payload: dict) -> str:
    """Stable short hash of everything that determines a configuration's result on an example."""
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]


HOST = socket.gethostname()
TEMPORARY = re.compile(r"^\.(?P<name>.+)\.(?P<pid>\d+)@(?P<host>.+?)\.[^.]+\.tmp$")  # write_atomic's names
# the rows files this process's ResultStores write: an interrupted run counts their rows on disk to tell the user
# what is safe (a count kept beside the write would miss a signal landing between the rename and the count)
SAVING: set[Path] = set()


def saved_rows() -> int:
    """Rows the files in SAVING hold now (Parquet footers only)."""
    import pyarrow.parquet as pq

    return sum(pq.read_metadata(path).num_rows for path in SAVING if path.exists())


def write_atomic(path: Path, write) -> None:
    """Write via a temporary file in the same directory, then rename: readers never see half a file (a failed
    write — disk full, a signal — leaves the previous version and no temporary file). The temporary file is named
    after this process (`.NAME.<pid>@<host>.<random>.tmp`), so what a SIGKILL leaves is swept by the next process
    (`sweep_temporaries`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = ""
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.{os.getpid()}@{HOST}.", suffix=".tmp")
        os.close(fd)
        write(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; results are meant to be shared
        os.replace(tmp, path)
    except OSError as error:
        error.filename = str(path)  # the file the user knows, not the temporary one
        raise
    finally:
        if tmp and os.path.exists(tmp):
            os.unlink(tmp)


def sweep_temporaries(folder: Path) -> int:
    """Remove the temporary files of write_atomic left in `folder` by processes of this host that no longer run
    (SIGKILL, a power cut); the number removed. Files of live processes and of other hosts stay."""
    from kvbench.store.claims import _process_start

    removed = 0
    for tmp in folder.glob(".*.tmp") if folder.is_dir() else []:
        match = TEMPORARY.match(tmp.name)
        if match and match["host"] == HOST and _process_start(int(match["pid"])) is None:
            with contextlib.suppress(OSError):
                tmp.unlink()
                removed += 1
    return removed


def write_rows(rows: pd.DataFrame, path: Path) -> None:
    write_atomic(path, lambda tmp: rows.to_parquet(tmp, index=False))


def write_csv(frame: pd.DataFrame, path: Path) -> None:
    write_atomic(path, lambda tmp: frame.to_csv(tmp, index=False))


def check_writable(directory: Path, key: str = "results_dir") -> None:
    """Before any work: `directory` exists (or is created) and takes a file; else one line naming `key`'s fix."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".write-probe")
        os.close(fd)
        os.unlink(probe)
    except OSError as error:
        what, remedy = fault_text(error, directory)
        raise KvbenchError(f"cannot write to {directory}: {what}; {remedy}, or choose another {key}=PATH") from None


def _read_or_skip(path: Path) -> pd.DataFrame | None:
    """One Parquet file of the store; an unreadable one (truncated by a crash) or a foreign one (a Parquet file
    kvbench did not write: no config_hash/example_id/timestamp) is skipped with one warning naming it, so that it
    blocks no later run and no reader."""
    try:
        frame = pd.read_parquet(path)
    except Exception as error:  # pyarrow raises several types for a damaged file
        kind, reason = "unreadable", (str(error).strip().splitlines() or [type(error).__name__])[0]
    else:
        missing = [c for c in KEY_COLUMNS if c not in frame.columns]
        if not missing or not len(frame):
            return frame
        kind, reason = "foreign", f"not kvbench result rows: no column {', '.join(missing)}"
    print(
        f"[kvbench] warning: skipping {kind} results file {path} ({reason}); move it out of the store to silence this",
        file=sys.stderr,
    )
    return None


def read_rows(path: Path) -> pd.DataFrame:
    """All rows under `path` (a Parquet file, a run directory or a store), newest first per configuration."""
    path = Path(path)
    files = (
        [path]
        if path.is_file()
        else sorted(f for f in path.rglob("*.parquet") if not f.name.endswith(".diagnose.parquet"))
    )  # side tables
    frames = [f for f in map(_read_or_skip, files) if f is not None and len(f)]
    if not frames:
        return pd.DataFrame(columns=COLUMNS)
    rows = pd.concat(frames, ignore_index=True)
    return rows.sort_values("timestamp", ascending=False).drop_duplicates(["config_hash", "example_id"])


class ResultStore:
    def __init__(self, results_dir: str | Path):
        self.root = Path(results_dir).expanduser()  # `~/store` is the home's store, never a folder named `~`
        self.rows_dir = self.root / "rows"
        with contextlib.suppress(OSError):
            sweep_temporaries(self.rows_dir)

    def existing(self) -> dict[tuple[str, str], dict]:
        """(config_hash, example_id) → row, for every row already in the store."""
        if not self.rows_dir.exists():
            return {}
        rows = read_rows(self.rows_dir)
        return {(r["config_hash"], r["example_id"]): r for r in rows.to_dict("records")}

    def versions(self) -> dict[Path, tuple[int, int]]:
        """(mtime_ns, size) of every row file: what a process has seen of the store so far."""
        seen = {}
        for path in self.rows_dir.glob("*.parquet") if self.rows_dir.exists() else []:
            if path.name.endswith(".diagnose.parquet"):
                continue
            try:
                stat = path.stat()
            except FileNotFoundError:
                continue
            seen[path] = (stat.st_mtime_ns, stat.st_size)
        return seen

    def rows_since(self, seen: dict[Path, tuple[int, int]], own: Path) -> list[dict]:
        """Rows of the files other processes wrote or rewrote since `seen` (updated in place)."""
        rows: list[dict] = []
        for path, version in self.versions().items():
            if path == own or seen.get(path) == version:
                continue
            seen[path] = version
            frame = _read_or_skip(path)
            if frame is not None:
                rows.extend(frame.to_dict("records"))
        return rows

    def save_run(self, run_id: str, rows: list[dict]) -> Path:
        path = self.rows_dir / f"{run_id}.parquet"
        SAVING.add(path)  # before the write: whatever lands on disk is counted
        write_rows(pd.DataFrame(rows), path)
        return path
