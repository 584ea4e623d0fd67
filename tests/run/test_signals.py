"""Signals: SIGTERM (a Slurm cancel or time limit) and SIGHUP (a closed terminal) end a sweep like ctrl-C — the rows
saved so far stay, the run's work claims are released (a rerun elsewhere does not wait the claim TTL), one line
names the command that resumes — and the rerun completes it with no row computed twice."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[2]
SWEEP = [  # 15 examples × 3 configurations: long enough to be caught mid-run
    "model=tiny-random",
    "device=cpu",
    "dtype=float32",
    "report=false",
    "task.context_lengths=[700,1000,1400]",
    "task.depths=[0.1,0.3,0.5,0.7,0.9]",
    "task.max_new_tokens=6",
    "grid.method=[snapkv,streamingllm]",
    "grid.budget=[0.5]",
]


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_signalled_sweep_releases_its_claims_and_the_rerun_completes_it(tmp_path, signum):
    store = tmp_path / "store"
    args = [sys.executable, "-m", "kvbench", *SWEEP, f"results_dir={store}"]
    proc = subprocess.Popen(
        [*args, f"hydra.run.dir={tmp_path / 'a'}"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 300
    while not list((store / "rows").glob("*.parquet")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)  # the first example's rows are saved: the sweep is under way
    proc.send_signal(signum)
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == 128 + signum, err[-3000:]
    how = "terminated (SIGTERM)" if signum == signal.SIGTERM else "hung up (SIGHUP)"
    # every rows file the run saved (the signal may land after a second example's rows were written)
    saved = pd.concat([pd.read_parquet(f) for f in (store / "rows").glob("*.parquet")], ignore_index=True)
    assert err.strip().splitlines()[-1] == (
        f"kvbench: {how}; the {len(saved)} rows computed so far are in the store: rerun the same command to resume"
    )  # the line ctrl-C prints, with the signal's name and what the store holds of the run
    assert not list((store / "claims").rglob("*"))  # released and their folders removed, not left for the TTL
    assert 0 < len(saved) < 45 and len(saved) % 3 == 0  # whole examples only, the one in flight lost
    assert not list(store.rglob("*.tmp"))

    rerun = subprocess.run(
        [*args, f"hydra.run.dir={tmp_path / 'b'}"], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    rows = pd.read_parquet(tmp_path / "b" / "rows.parquet")
    assert len(rows) == 45 and rows["reused"].sum() == len(saved)
    stored = pd.concat([pd.read_parquet(f) for f in (store / "rows").glob("*.parquet")], ignore_index=True)
    assert len(stored) == 45 and not stored.duplicated(["config_hash", "example_id"]).any()
