"""kvbench/backends/protocol.py with a real worker process (a small module written here; no engine, no torch)."""

from __future__ import annotations

import os
import signal
import sys
import textwrap

import pytest

from kvbench import KvbenchError
from kvbench.backends.protocol import Worker, describe_exit, last_words

WORKER = textwrap.dedent(
    """
    import os, sys
    from kvbench import KvbenchError
    from kvbench.backends import protocol

    def handle(request):
        op = request["op"]
        if op == "echo":
            print("noise from print")            # must not reach the reply stream
            os.write(1, b"noise from fd 1\\n")   # as a C library's printf would
            return {"echo": request["value"], "pid": os.getpid()}
        if op == "refuse":
            raise KvbenchError("type_k=q3: not a cache type")
        if op == "crash":
            raise ValueError("engine blew up\\nsecond line")
        if op == "die":
            sys.stderr.write("loading model\\nggml_abort: out of memory\\n")
            sys.stderr.flush()
            os._exit(3)
        raise KvbenchError(f"unknown op {op}")

    protocol.serve(handle)
    """
)


@pytest.fixture
def worker(tmp_path, monkeypatch):
    (tmp_path / "toy_worker.py").write_text(WORKER)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__import__("kvbench").__file__)))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), root]))
    w = Worker(sys.executable, "toy_worker", "the toy worker")
    yield w
    w.close()


def test_request_reply_survives_stdout_noise(worker):
    assert worker.request("echo", value=[1, 2, 3]) == {"echo": [1, 2, 3], "pid": worker.pid}
    assert worker.request("echo", value="again")["echo"] == "again"  # the stream stays in step


def test_errors_are_one_line_and_the_worker_keeps_serving(worker):
    with pytest.raises(KvbenchError) as refused:
        worker.request("refuse")
    assert str(refused.value) == "the toy worker: type_k=q3: not a cache type"
    with pytest.raises(KvbenchError) as crashed:
        worker.request("crash")
    assert str(crashed.value) == "the toy worker: ValueError: engine blew up"
    assert worker.request("echo", value=1)["echo"] == 1


def test_a_dying_worker_is_named_with_its_exit_code_and_last_stderr(worker):
    with pytest.raises(KvbenchError) as died:
        worker.request("die")
    message = str(died.value)
    assert "\n" not in message
    assert message.startswith("the toy worker died (exit code 3)")
    assert message.endswith("its last stderr: loading model | ggml_abort: out of memory")


def test_a_killed_worker_is_named_with_its_signal(worker):
    worker.request("echo", value=0)
    os.kill(worker.pid, signal.SIGKILL)
    with pytest.raises(KvbenchError) as died:
        worker.request("echo", value=1)
    assert "\n" not in str(died.value)
    assert "died (exit code -9: killed by SIGKILL)" in str(died.value)


def test_close_ends_the_process(worker):
    worker.close()
    assert worker.proc.returncode == 0


def test_missing_interpreter_refused(tmp_path):
    with pytest.raises(KvbenchError, match="does not exist"):
        Worker(tmp_path / "nope" / "bin" / "python", "toy_worker", "the toy worker")


def test_describe_exit_and_last_words():
    assert describe_exit(0) == "exit code 0"
    assert describe_exit(-11) == "exit code -11: killed by SIGSEGV"
    assert last_words([]) == "; it wrote nothing to stderr"
    assert last_words(["a", "b ", "c", "d"]) == "; its last stderr: b | c | d"


def test_the_package_imports_no_torch():
    import subprocess

    code = "import sys, kvbench.backends; print(any(m.startswith('torch') for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_openvino_ir_of_each_hub_checkpoint_has_its_own_folder():
    """Every model=hub checkpoint is named `hub`: its IR folder also names the checkpoint (before: one folder for all,
    so a second hub model reused the first one's IR)."""
    from kvbench.backends.openvino import OpenvinoBackend

    a = OpenvinoBackend.ir_dir({"name": "hub", "name_or_path": "/models/a"})
    b = OpenvinoBackend.ir_dir({"name": "hub", "name_or_path": "/models/b"})
    assert a != b and a.parent.name.startswith("hub-")
    assert OpenvinoBackend.ir_dir({"name": "smollm2-135m"}).parent.name == "smollm2-135m"
