"""`serve` end to end on the tiny model: request rows and run rows, scores, the planner's prediction beside."""

from __future__ import annotations

import itertools
import math
import sys

import pandas as pd

from kvbench.plan.hardware import Hardware
from kvbench.serving.metrics import REQUEST_COLUMNS, percentile
from kvbench.serving.run import serve, table
from kvbench.serving.trace import TraceSpec, arrivals, random_trace, shared_prefix_tokens
from tests.serving.test_inputs import serving_config

HW = Hardware("test", 10**12, 1e11, 1e12, "test")  # the planner's hardware: no CPU calibration in tests


def test_serve_writes_request_and_run_rows(tmp_path):
    cfg = serving_config("serving.requests=5", "serving.kv_budget_bytes=[700000,4000000]", "serving.rate=50")
    requests, runs = serve(cfg, tmp_path, hardware=HW, echo=False)
    assert len(requests) == 5 * 3 * 2 and len(runs) == 3 * 2
    assert set(REQUEST_COLUMNS) <= set(requests.columns)
    assert pd.read_parquet(tmp_path / "serving_runs.parquet").shape == runs.shape
    assert pd.read_parquet(tmp_path / "serving_requests.parquet").shape == requests.shape
    assert requests["score"].notna().all()  # NIAH prompts: every request scored
    assert (requests["ttft_s"] >= requests["queue_s"]).all()
    for _, run in runs.iterrows():
        assert run.peak_kv_bytes <= run.kv_budget_bytes
        assert run.predicted_max_concurrency >= 1 and run.predicted_tokens_s > 0
        own = requests[(requests.method == run.method) & (requests.kv_budget_bytes == run.kv_budget_bytes)]
        assert run.ttft_p50_s == percentile(own.ttft_s.tolist(), 50)
        assert math.isclose(run.throughput_tokens_s, own.output_tokens.sum() / run.duration_s)
    full = runs[runs.method == "full"].set_index("kv_budget_bytes").max_concurrency
    assert full[700000] < full[4000000]  # the small budget makes the full cache queue
    assert "conc_plan" in table(runs)


def test_random_prompts_share_a_prefix():
    spec = TraceSpec(requests=4, prompts="random", prompt_tokens=(40, 80), shared_prefix=0.5, output_tokens=(3, 5))
    reqs = random_trace(spec, list(range(256)))
    assert shared_prefix_tokens(reqs) >= 20 and all(r.prefix_tokens == 20 for r in reqs)
    assert all(40 <= len(r.prompt_ids) <= 80 and 3 <= r.max_new_tokens <= 5 for r in reqs)


def test_poisson_arrivals_are_seeded_and_at_the_rate():
    times = arrivals(2000, "poisson", 4.0, seed=1)
    assert times == arrivals(2000, "poisson", 4.0, seed=1) and times != arrivals(2000, "poisson", 4.0, seed=2)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert abs(sum(gaps) / len(gaps) - 0.25) < 0.02
    assert arrivals(3, "burst", 4.0, 0) == [0.0, 0.0, 0.0]


def test_a_failing_engine_is_skipped_with_one_line_and_the_rest_is_written(tmp_path, monkeypatch, capsys):
    """An engine that fails after the checks (here OpenVINO's model export, raised as the real backend raises it)
    keeps kvbench's rows and the other engines: the run writes its rows, names the engine in one line and in
    skipped.txt. Isolated from the real engines: the venv check sees a python, the backend fails at its start."""
    from pathlib import Path

    from kvbench import KvbenchError
    from kvbench.engines import source
    from kvbench.engines.openvino import OpenvinoEngine
    from kvbench.serving import run

    monkeypatch.setattr(source, "venv_python", lambda venv: Path(sys.executable))

    def unexportable(self, model_cfg, dtype):
        raise KvbenchError("optimum-intel could not export the model to OpenVINO IR (ValueError: too new)")

    monkeypatch.setattr(OpenvinoEngine, "start", unexportable)
    cfg = serving_config("serving.requests=2", "serving.engines=[openvino:full,openvino:sum]")
    assert run.main(cfg, tmp_path) == 0
    out = capsys.readouterr()
    line = "openvino skipped (openvino:full, openvino:sum not served): optimum-intel could not export"
    assert f"[serving] {line}" in out.err and f"not served: {line}" in out.out
    runs = pd.read_parquet(tmp_path / "serving_runs.parquet")
    assert sorted(runs.method) == ["full", "snapkv", "streamingllm"] and (runs.engine == "kvbench").all()
    assert (tmp_path / "skipped.txt").read_text().startswith(line)
    assert "Not served:\n- openvino skipped" in (tmp_path / "serving.md").read_text()


def test_an_unwritable_output_folder_is_refused_before_the_model_loads(tmp_path, monkeypatch):
    import pytest

    from kvbench import KvbenchError

    (tmp_path / "file").write_text("")
    monkeypatch.setattr("kvbench.model.load.load_model", lambda *a: pytest.fail("the model loaded"))
    with pytest.raises(KvbenchError) as refused:
        serve(serving_config(), tmp_path / "file" / "out", hardware=HW, echo=False)
    assert str(refused.value).startswith("the output folder cannot be written: a part of the path is a file")


def test_a_full_disk_keeps_the_runs_that_finished(tmp_path, monkeypatch):
    """Each run is written as it ends, atomically: a write that fails (ENOSPC) leaves the previous runs' files whole,
    no temporary file, and one line naming what was kept."""
    import errno

    import pytest

    from kvbench.serving import OutputFailed
    from kvbench.store import results

    real, writes = results.write_atomic, []

    def filling(path, write):  # two runs' files (requests, runs) fit; the third run's do not
        writes.append(path)
        if len(writes) > 4:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, write)

    monkeypatch.setattr(results, "write_atomic", filling)
    with pytest.raises(OutputFailed) as full:
        serve(serving_config("serving.requests=3"), tmp_path, hardware=HW, echo=False)
    message = str(full.value)
    assert "\n" not in message and message.startswith("writing the serving rows failed: disk full")
    assert f"the 2 runs that finished are kept in {tmp_path / 'serving_runs.parquet'}" in message
    assert len(pd.read_parquet(tmp_path / "serving_runs.parquet")) == 2
    assert len(pd.read_parquet(tmp_path / "serving_requests.parquet")) == 2 * 3
    assert not list(tmp_path.glob("*.tmp"))


def test_sigterm_after_the_first_run_keeps_it_and_says_so(tmp_path):
    """SIGTERM to `python -m kvbench.serving` once a run has finished: exit 143, one line naming the kept file."""
    import signal
    import subprocess
    from pathlib import Path

    from tests.serving.test_inputs import TINY

    command = [sys.executable, "-m", "kvbench.serving", *TINY, "serving.requests=6", f"hydra.run.dir={tmp_path}"]
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, cwd=root, stdout=subprocess.DEVNULL)
    assert proc.stderr is not None
    for line in proc.stderr:
        if line.startswith("[serving] full"):  # the first run is written
            break
    proc.send_signal(signal.SIGTERM)
    rest = proc.stderr.read().strip().splitlines()
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    assert rest[-1].startswith("kvbench.serving: terminated (SIGTERM); the 1 runs that finished are kept in")
    assert len(pd.read_parquet(tmp_path / "serving_runs.parquet")) == 1
