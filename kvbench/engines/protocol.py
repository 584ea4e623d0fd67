"""The JSON-lines protocol between kvbench and an engine's worker process (standard library only: a worker runs in the
engine's venv, where kvbench is installed without its dependencies).

kvbench's side (`Worker`) starts `<venv>/bin/python -m kvbench.engines.<name>_worker`, writes one request object
per line to its stdin and reads one reply per line from its stdout: `{"ok": true, "result": {...}}` or
`{"ok": false, "error": "one line"}`. The worker's stderr (the engine's own logs) is kept, its last lines only, so
that a worker that dies is named in one KvbenchError line with its exit code and what it last said.

The worker's side (`serve`) moves the process's fd 1 to stderr before the engine loads: C libraries that print to
stdout cannot corrupt the replies, which go to a private copy of the original stdout.

A worker's life is tied to kvbench's: `Worker` starts it in a session (and process group) of its own, which the
engine's own children join, and `serve` asks the kernel for SIGTERM when kvbench's process dies (SIGKILL included);
the worker then kills its group. `Worker.close` ends the group too. A worker left behind would hold the model and
its KV space, re-parented to init.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from kvbench import KvbenchError

STDERR_LINES = 20  # kept from a worker's stderr: what a death message quotes (its last 3)
PARENT_PID = "KVBENCH_WORKER_PARENT"  # the env var that tells a worker which process it lives for
PR_SET_PDEATHSIG = 1  # linux/prctl.h
CHECKOUT = Path(__file__).resolve().parents[2]  # the kvbench tree the worker imports, whatever its venv installed


class Worker:
    """One worker process: `request(op, **fields)` sends a request and returns its reply's result."""

    def __init__(self, python: str | Path, module: str, what: str, env: dict[str, str] | None = None):
        self.what = what  # names the worker in messages: "the llamacpp worker"
        self.command = [str(python), "-m", module]
        if not Path(python).exists():
            raise KvbenchError(f"{what}: {python} does not exist")
        self.stderr: collections.deque[str] = collections.deque(maxlen=STDERR_LINES)
        self.proc = subprocess.Popen(
            self.command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            bufsize=1,
            start_new_session=True,  # its own process group, which the engine's children join: close() ends them all
            env={
                PARENT_PID: str(os.getpid()),
                **os.environ,
                "PYTHONPATH": os.pathsep.join(filter(None, [str(CHECKOUT), os.environ.get("PYTHONPATH")])),
                **(env or {}),
            },
        )
        self._drain = threading.Thread(target=self._read_stderr, daemon=True)
        self._drain.start()

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            if line.strip():
                self.stderr.append(line.rstrip())

    @property
    def pid(self) -> int:
        return self.proc.pid

    def request(self, op: str, **fields) -> dict:
        """Send {"op": op, **fields}; the reply's result, or a KvbenchError naming the error or the death."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except (BrokenPipeError, OSError):
            line = ""
        if not line:
            raise self.died()
        try:
            reply = json.loads(line)
        except json.JSONDecodeError:
            raise KvbenchError(f"{self.what} replied with a line that is not JSON: {line.strip()[:200]!r}") from None
        if not reply.get("ok"):
            raise KvbenchError(f"{self.what}: {reply.get('error', 'failed without a message')}")
        return reply.get("result", {})

    def died(self) -> KvbenchError:
        """The one-line error for a worker that stopped answering: its exit code (and signal) and last stderr."""
        try:
            code = self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.kill()
            code = self.proc.wait()
        self._drain.join(timeout=2)
        return KvbenchError(f"{self.what} died ({describe_exit(code)}){last_words(self.stderr)}")

    def close(self) -> None:
        """Ask the worker to exit; kill it if it does not within 10 s."""
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()  # end of input: serve() returns and the process exits
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.kill()
                self.proc.wait()
        self.kill()  # what the engine started and left running (its group outlives the worker)
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream:
                stream.close()

    def kill(self) -> None:
        """SIGKILL the worker's process group: the worker and every process the engine started."""
        with contextlib.suppress(ProcessLookupError, PermissionError):  # the group is gone already
            os.killpg(self.proc.pid, signal.SIGKILL)


def describe_exit(code: int) -> str:
    """ "exit code 3", or "exit code -9: killed by SIGKILL" (Popen's negative codes are signals)."""
    if code < 0:
        try:
            return f"exit code {code}: killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"exit code {code}"
    return f"exit code {code}"


def last_words(lines, n: int = 3) -> str:
    """The last `n` stderr lines, joined on one line ("" when it said nothing)."""
    tail = [line.strip() for line in list(lines)[-n:]]
    return f"; its last stderr: {' | '.join(tail)}" if tail else "; it wrote nothing to stderr"


def end_group(*_) -> None:
    """Kill this worker and the processes its engine started: its whole group when it leads one (as `Worker` starts
    it), else itself only (never the group of whoever started it by hand)."""
    if os.getpgid(0) == os.getpid():
        os.killpg(0, signal.SIGKILL)
    os._exit(128 + signal.SIGTERM)


def tie_to_parent() -> None:
    """End this worker when the kvbench process that started it dies: a parent-death signal from the kernel (Linux)
    and, after asking for it, a check that the parent is still the one that started it (it may have died first).
    Without prctl, a thread polls the parent's pid instead."""
    parent = int(os.environ.get(PARENT_PID) or os.getppid())
    signal.signal(signal.SIGTERM, end_group)
    try:
        # sent when the thread that started the worker exits: Worker is created on kvbench's main thread
        tied = ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM) == 0
    except (OSError, AttributeError):
        tied = False
    if os.getppid() != parent:
        end_group()
    if not tied:
        threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    end_group()


def serve(handle: Callable[[dict], dict]) -> None:
    """The worker's loop: one request per stdin line -> `handle(request)` -> one reply line. A KvbenchError (or any
    exception) becomes an error reply in one line; the worker keeps serving. Returns at end of input."""
    tie_to_parent()
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # fd 1 (C printf, print()) now goes to stderr
    sys.stdout = sys.stderr
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            reply = {"ok": True, "result": handle(json.loads(line))}
        except KvbenchError as error:
            reply = {"ok": False, "error": str(error)}
        except Exception as error:  # an engine failure: named, one line, the worker stays up
            first = (str(error).strip().splitlines() or [""])[0]
            reply = {"ok": False, "error": f"{type(error).__name__}: {first}"}
        replies.write(json.dumps(reply) + "\n")


OPS: dict[str, Callable[..., dict]] = {}  # ops beyond start/generate/close: name -> function(worker, **fields)


def worker_op(name: str) -> Callable:
    """Register a worker module's function `f(worker, **fields) -> dict` as op `name` (serve_worker dispatches it)."""

    def register(function: Callable[..., dict]) -> Callable[..., dict]:
        OPS[name] = function
        return function

    return register


def serve_worker(worker) -> None:
    """`serve` a worker object whose methods are the ops: start(**fields), generate(**fields), close() (optional);
    and the functions registered with `worker_op`."""

    def handle(request: dict) -> dict:
        op = request.pop("op")
        if op in OPS:
            return OPS[op](worker, **request)
        if op in ("start", "generate"):
            return getattr(worker, op)(**request)
        if op == "close":
            return getattr(worker, "close", dict)() or {}
        raise ValueError(f"unknown op {op!r}")

    serve(handle)


def reset_peak_rss() -> None:
    """Reset the process's peak RSS (VmHWM) so the next `peak_rss_bytes` covers one request (Linux)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # not Linux or not permitted: the peak then covers the process's life


def peak_rss_bytes() -> int:
    """The process's peak resident set size since the last reset (VmHWM), in bytes."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
