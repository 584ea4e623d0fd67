"""The JSON-lines protocol between kvbench's process and an engine worker (standard library only).

kvbench starts `<venv>/bin/python -m kvbench.backends.<name>_worker`; each request is one JSON object on the
worker's stdin (`{"op": "start" | "generate" | "close", ...}`), each reply one JSON object on its stdout
(`{"ok": true, ...}` or `{"ok": false, "error": "<one line>"}`). Engines print to stdout themselves (vLLM's
logger, OpenVINO's plugins), so the worker keeps a private copy of fd 1 for replies and points fd 1 at stderr.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from kvbench import KvbenchError


def one_line(error: BaseException) -> str:
    """An engine's exception as one line: its type and the first non-empty line of its message."""
    text = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
    text = re.sub(r" at /\S+:\d+:?$", "", text)  # a C++ check's source location: not the user's concern
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def peak_rss_reset() -> None:
    """Start a new peak-RSS window for this process (Linux: writing 5 to clear_refs resets VmHWM)."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def peak_rss_bytes() -> int:
    """This process's peak resident set since the last reset (VmHWM), in bytes; 0 where /proc is absent."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return 0


def serve(handle: Callable[[dict], dict]) -> None:
    """The worker's loop: one reply per request line, until `close` or the end of stdin."""
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # the engine's own prints go to stderr, never into the protocol
    sys.stdout = sys.stderr
    for line in sys.stdin:
        request = json.loads(line)
        try:
            reply = {"ok": True, **handle(request)}
        except Exception as error:  # the engine's failure, whatever its type: one line back to kvbench
            reply = {"ok": False, "error": one_line(error)}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()
        if request.get("op") == "close":
            break


class Worker:
    """kvbench's side: one worker process of an engine venv, called one request at a time."""

    def __init__(self, python: Path, module: str, env: dict | None = None, log: Path | None = None):
        self.module = module
        self.log = log
        stderr = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115  # the worker's lifetime
        self.proc = subprocess.Popen(
            [str(python), "-m", module],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env={**os.environ, **(env or {})},
        )

    def call(self, op: str, **fields) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except BrokenPipeError:
            line = ""
        if not line:
            code = self.proc.wait()
            where = f"; its log: {self.log}" if self.log else ""
            raise KvbenchError(f"the {self.module} worker exited (code {code}) during {op!r}{where}")
        reply = json.loads(line)
        if not reply.pop("ok"):
            raise KvbenchError(f"{self.module}: {reply['error']}")
        return reply

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(KvbenchError):
                self.call("close")
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
