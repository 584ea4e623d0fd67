"""kvbench/engines/protocol.py with a real worker process (a small module written here; no engine, no torch)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from kvbench import KvbenchError
from kvbench.engines.protocol import Worker, describe_exit, last_words

WORKER = textwrap.dedent(
    """
    import os, subprocess, sys
    from kvbench import KvbenchError
    from kvbench.engines import protocol

    def handle(request):
        op = request["op"]
        if op == "echo":
            print("noise from print")            # must not reach the reply stream
            os.write(1, b"noise from fd 1\\n")   # as a C library's printf would
            return {"echo": request["value"], "pid": os.getpid()}
        if op == "spawn":                        # as vLLM starts processes of its own
            return {"pid": subprocess.Popen(["sleep", "600"], stdin=-3, stdout=-3, stderr=-3).pid}  # DEVNULL
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


def gone(pid: int) -> bool:
    """The process has exited (a zombie that its new parent has not reaped counts: it holds nothing)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def wait_gone(*pids: int, within: float = 5.0) -> bool:
    deadline = time.monotonic() + within
    while not all(gone(pid) for pid in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_close_ends_what_the_engine_started(worker):
    child = worker.request("spawn")["pid"]
    worker.close()
    assert wait_gone(child)


PARENT = textwrap.dedent(
    """
    import json, sys, time
    from kvbench.engines.protocol import Worker

    w = Worker(sys.executable, "toy_worker", "the toy worker")
    print(json.dumps({"worker": w.pid, "child": w.request("spawn")["pid"]}), flush=True)
    time.sleep(600)
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
def test_a_killed_parent_takes_its_worker_and_the_workers_children(worker):
    """SIGKILL to kvbench (nothing of it runs on the way out): its worker and what the engine started end too."""
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    pids = __import__("json").loads(parent.stdout.readline())
    assert not gone(pids["worker"]) and not gone(pids["child"])
    parent.kill()
    parent.wait()
    assert wait_gone(pids["worker"], pids["child"])


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

    code = "import sys, kvbench.engines; print(any(m.startswith('torch') for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_openvino_ir_of_each_hub_checkpoint_has_its_own_folder():
    """Every model=hub checkpoint is named `hub`: its IR folder also names the checkpoint (before: one folder for all,
    so a second hub model reused the first one's IR)."""
    from kvbench.engines.openvino import OpenvinoEngine

    a = OpenvinoEngine.ir_dir({"name": "hub", "name_or_path": "/models/a"})
    b = OpenvinoEngine.ir_dir({"name": "hub", "name_or_path": "/models/b"})
    assert a != b and a.parent.name.startswith("hub-")
    assert OpenvinoEngine.ir_dir({"name": "smollm2-135m"}).parent.name == "smollm2-135m"


def test_a_damaged_openvino_ir_in_the_cache_is_named_with_the_folder_to_delete(tmp_path, monkeypatch):
    """An empty openvino_model.xml (an export that exited 0) is refused before the worker starts, naming the cached
    folder and the fix; a killed export's temporary folder is swept, a running one's is kept."""
    from kvbench.engines.openvino import OpenvinoEngine

    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path))
    model = {"name": "smollm2-135m"}
    ir = OpenvinoEngine.ir_dir(model)
    ir.mkdir(parents=True)
    (ir / "openvino_model.xml").write_text("")
    (ir / "openvino_model.bin").write_bytes(b"\0" * 8)
    dead = subprocess.Popen([sys.executable, "-c", ""])
    dead.wait()
    killed = ir.parent / f"{ir.name}.tmp{dead.pid}-abc"
    live = ir.parent / f"{ir.name}.tmp{os.getpid()}-def"
    killed.mkdir()
    live.mkdir()
    with pytest.raises(KvbenchError) as damaged:
        OpenvinoEngine().converted(model)
    assert str(damaged.value).startswith(f"the OpenVINO IR cached in {ir} is damaged (openvino_model.xml does not")
    assert str(damaged.value).endswith(f"delete that folder (rm -r {ir}) and rerun: it is exported again")
    assert not killed.exists() and live.exists()
    (ir / "openvino_model.xml").write_text("<net name='m' version='11'><layers/></net>")
    (ir / "openvino_model.bin").write_bytes(b"")
    with pytest.raises(KvbenchError, match=r"damaged \(openvino_model.bin is missing or empty\)"):
        OpenvinoEngine().converted(model)
    (ir / "openvino_model.bin").write_bytes(b"\0" * 8)
    assert OpenvinoEngine().converted(model) == ir
