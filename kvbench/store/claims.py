"""Work claims in the results store, so that concurrent writers compute each row once.

Several processes may share one store: Ray workers, Slurm/submitit jobs on a shared filesystem, two shells. Each
process claims a (config_hash, example_id) before computing it and releases the claim once the rows are saved:

    <results_dir>/claims/<config_hash>/<sha1(example_id)>     created with O_CREAT | O_EXCL (atomic, NFS-safe)

The file holds the owner's host, pid and process start time. A claim is *stale* — and may be taken over — when its
owner is a process on this host that no longer runs, or when it is older than `KVBENCH_CLAIM_TTL_S` (default 2 h:
a job on another host that died). Taking over renames the stale file first, which only one contender can do.
A claim whose owner is alive but stopped (ctrl-Z: state T) is not stale — the process may resume — so a waiting run
names its pid and how to resume or end it (`stopped_owners`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import time
import uuid
from pathlib import Path

CLAIM_TTL_S = float(os.environ.get("KVBENCH_CLAIM_TTL_S", 2 * 3600))
HOST = socket.gethostname()


def _process_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (tells a live pid from a reused one); None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]  # field 22 of stat, counted after the command name
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
            return ""  # alive, start time unknown (no /proc)
        except ProcessLookupError:
            return None
        except PermissionError:
            return ""


def process_state(pid: int) -> str | None:
    """The state letter of a process on this host (R running, S sleeping, T stopped, ...); None if unknown/gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]  # field 3 of stat, the first after the command name
    except (OSError, IndexError):
        return None


def _owner() -> dict:
    return {"host": HOST, "pid": os.getpid(), "start": _process_start(os.getpid()), "time": time.time()}


class Claims:
    """Claims of one process in one store."""

    def __init__(self, store_root: str | Path):
        self.root = Path(store_root).expanduser() / "claims"
        self.held: set[Path] = set()
        self.me = _owner()
        for folder in self.root.iterdir() if self.root.is_dir() else []:  # left by runs before (a SIGKILL)
            _remove_if_empty(folder)

    def _path(self, config_hash: str, example_id: str) -> Path:
        return self.root / config_hash / hashlib.sha1(str(example_id).encode()).hexdigest()

    def try_claim(self, config_hash: str, example_id: str) -> bool:
        """True when this process now holds the claim (new, already ours, or taken over from a dead owner)."""
        path = self._path(config_hash, example_id)
        if path in self.held:
            return True
        for _ in range(3):
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileNotFoundError:  # another process removed the folder as it emptied: make it again
                continue
            except FileExistsError:
                if not self._take_over_if_stale(path):
                    return False
                continue
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump({**self.me, "example_id": str(example_id)}, f)
            except BaseException:  # disk full, a signal: no half-written claim stays behind
                path.unlink(missing_ok=True)
                raise
            self.held.add(path)
            return True
        return False

    def _take_over_if_stale(self, path: Path) -> bool:
        if not is_stale(path):
            return False
        # only one contender's rename succeeds; the others see the file gone and retry the O_EXCL create
        with contextlib.suppress(FileNotFoundError):
            os.rename(path, path.with_name(f"{path.name}.stale-{uuid.uuid4().hex[:8]}"))
        for old in path.parent.glob(f"{path.name}.stale-*"):
            old.unlink(missing_ok=True)
        return True

    def held_elsewhere(self, config_hash: str, example_id: str) -> bool:
        """Another live process holds this claim (its rows will appear in the store when it finishes)."""
        path = self._path(config_hash, example_id)
        return path not in self.held and path.exists() and not is_stale(path)

    def release(self, keys) -> None:
        """Drop the claims on `keys` ((config_hash, example_id) pairs) once their rows are saved."""
        for config_hash, example_id in keys:
            path = self._path(config_hash, example_id)
            if path in self.held:
                path.unlink(missing_ok=True)
                self.held.discard(path)
                _remove_if_empty(path.parent)

    def release_all(self) -> None:
        """Every claim still held (the run ends, fails or is interrupted). Never raises: it runs while another
        error is on its way to the user, and a claim left behind by a dead process is taken over anyway."""
        for path in list(self.held):
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)
            _remove_if_empty(path.parent)
        self.held.clear()

    def stopped_owners(self, keys) -> dict[int, int]:
        """pid → claims held, among `keys`, by processes of this host that are stopped (ctrl-Z, SIGSTOP)."""
        stopped: dict[int, int] = {}
        for config_hash, example_id in keys:
            owner = read_owner(self._path(config_hash, example_id))
            if owner and owner.get("host") == HOST and process_state(int(owner["pid"])) in ("T", "t"):
                stopped[int(owner["pid"])] = stopped.get(int(owner["pid"]), 0) + 1
        return stopped


def _remove_if_empty(folder: Path) -> None:
    """A configuration's claim folder once it holds no claim (another process's claims keep it; a race with a
    process creating a claim there is harmless: its mkdir(exist_ok) runs again before the O_EXCL create)."""
    with contextlib.suppress(OSError):
        folder.rmdir()


def read_owner(path: Path) -> dict | None:
    """The owner record of a claim file; None when it is gone or unreadable."""
    try:
        owner = json.loads(path.read_text())
        return owner if isinstance(owner, dict) and "pid" in owner else None
    except (OSError, ValueError):
        return None


def is_stale(path: Path) -> bool:
    try:
        owner = json.loads(path.read_text())
        age = time.time() - float(owner["time"])
    except FileNotFoundError:
        return False  # released meanwhile: not ours to take over, the caller retries
    except (OSError, ValueError, KeyError, TypeError):  # unreadable: half-written, by a live or a dead process
        try:
            return time.time() - path.stat().st_mtime > 10.0
        except FileNotFoundError:
            return False
    if owner.get("host") == HOST:
        start = _process_start(int(owner["pid"]))
        return start is None or (start != "" and owner.get("start") not in (None, "", start))
    return age > CLAIM_TTL_S
