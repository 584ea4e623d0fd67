"""Scale-out: work claims (concurrent writers), launcher=ray (shards, a killed worker), Hydra's submitit_local."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from kvbench.store.claims import Claims, is_stale
from kvbench.store.results import read_rows

ROOT = Path(__file__).resolve().parents[2]
TINY = [
    "model=tiny-random",
    "device=cpu",
    "dtype=float32",
    "report=false",
    "task.context_lengths=[700,1000]",
    "task.depths=[0.2,0.8]",
    "task.max_new_tokens=6",
]
CONTENT = [
    "config_hash",
    "example_id",
    "method",
    "budget",
    "prediction",
    "score",
    "kv_bytes",
    "kv_bytes_full",
    "context_tokens",
    "new_tokens",
]


def kvbench(*args: str, env: dict | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "kvbench", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **(env or {})},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def every_stored_row(store: Path) -> pd.DataFrame:
    """All rows of every run file, duplicates kept (read_rows would hide them)."""
    return pd.concat([pd.read_parquet(f) for f in (store / "rows").glob("*.parquet")], ignore_index=True)


def content(frame: pd.DataFrame) -> pd.DataFrame:
    return frame[CONTENT].sort_values(["config_hash", "example_id"]).reset_index(drop=True)


# ------------------------------------------------------------------------------------------------ claims


def test_a_claim_is_held_once_and_released(tmp_path):
    from kvbench.store.claims import _process_start

    a, b = Claims(tmp_path), Claims(tmp_path)
    assert a.try_claim("h1", "ex/1") and a.try_claim("h1", "ex/1")  # idempotent for its owner
    assert not b.try_claim("h1", "ex/1") and b.held_elsewhere("h1", "ex/1") and not a.held_elsewhere("h1", "ex/1")
    a.release([("h1", "ex/1")])
    assert not a._path("h1", "ex/1").exists() and not a.held
    assert b.try_claim("h1", "ex/1")
    path = b._path("h1", "ex/1")  # a live process (our parent) owns it: never stale
    path.write_text(
        json.dumps({"host": b.me["host"], "pid": os.getppid(), "start": _process_start(os.getppid()), "time": 0})
    )
    assert not is_stale(path) and not Claims(tmp_path).try_claim("h1", "ex/1")


def test_a_dead_owners_claim_is_taken_over(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    a = Claims(tmp_path)
    path = a._path("h", "e")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"host": a.me["host"], "pid": int(dead.stdout), "start": "1", "time": 0}))
    assert is_stale(path)
    assert a.try_claim("h", "e") and json.loads(path.read_text())["pid"] == os.getpid()
    assert not list(path.parent.glob("*.stale-*"))


def test_another_hosts_claim_expires_after_the_ttl(tmp_path, monkeypatch):
    import time

    import kvbench.store.claims as claims

    a = Claims(tmp_path)
    path = a._path("h", "e")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"host": "elsewhere", "pid": 1, "start": "1", "time": time.time()}))
    assert not is_stale(path)
    monkeypatch.setattr(claims, "CLAIM_TTL_S", -1.0)
    assert is_stale(path)


@pytest.mark.slow
def test_two_concurrent_runs_on_one_store_compute_each_row_once(tmp_path):
    store = tmp_path / "store"
    args = [*TINY, f"results_dir={store}"]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "kvbench", *args, f"hydra.run.dir={tmp_path / f'out{i}'}"],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs
    stored = every_stored_row(store)
    assert len(stored) == 8 and not stored.duplicated(["config_hash", "example_id"]).any()
    for i in range(2):  # each run's own output still holds all 8 rows (computed, or collected from the store)
        mine = pd.read_parquet(tmp_path / f"out{i}" / "rows.parquet")
        pd.testing.assert_frame_equal(content(mine), content(stored))
    assert not list((store / "claims").rglob("*")) or not [p for p in (store / "claims").rglob("*") if p.is_file()]


# ------------------------------------------------------------------------------------------------ launchers


@pytest.fixture(scope="module")
def local_rows(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("local")
    kvbench(*TINY, f"results_dir={tmp / 'store'}", f"hydra.run.dir={tmp / 'out'}")
    return pd.read_parquet(tmp / "out" / "rows.parquet")


@pytest.mark.slow
def test_ray_with_two_workers_writes_the_rows_a_local_run_writes(tmp_path, local_rows):
    pytest.importorskip("ray")
    proc = kvbench(
        *TINY,
        f"results_dir={tmp_path / 'store'}",
        f"hydra.run.dir={tmp_path / 'out'}",
        "launcher=ray",
        "launcher.workers=2",
        "launcher.shards=3",
    )
    assert "[ray] shards 3/3 done, 8 rows" in proc.stdout
    rows = pd.read_parquet(tmp_path / "out" / "rows.parquet")
    pd.testing.assert_frame_equal(content(rows), content(local_rows))
    assert list(rows["example_id"]) == list(local_rows["example_id"])  # the local run's order too
    stored = every_stored_row(tmp_path / "store")
    assert len(stored) == 8 and stored["run_id"].nunique() == 3  # one file per shard


@pytest.mark.slow
def test_a_worker_killed_mid_shard_loses_and_duplicates_nothing(tmp_path, local_rows):
    pytest.importorskip("ray")
    marker = tmp_path / "killed"
    proc = kvbench(
        *TINY,
        f"results_dir={tmp_path / 'store'}",
        f"hydra.run.dir={tmp_path / 'out'}",
        "launcher=ray",
        "launcher.workers=2",
        "launcher.shards=2",
        env={"KVBENCH_TEST_KILL_ONCE": str(marker)},
    )
    assert marker.exists(), "the fault was not injected"
    rows = pd.read_parquet(tmp_path / "out" / "rows.parquet")
    pd.testing.assert_frame_equal(content(rows), content(local_rows))
    stored = every_stored_row(tmp_path / "store")
    assert len(stored) == 8 and not stored.duplicated(["config_hash", "example_id"]).any()
    assert stored["run_id"].nunique() == 3  # the killed attempt's saved example + its retry + the other shard
    assert rows["reused"].sum() == 2, proc.stdout  # the retry reused what the killed attempt had saved


@pytest.mark.slow
def test_submitit_local_multirun_writes_every_job_to_the_shared_store(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    store = tmp_path / "store"
    kvbench(
        "-m",
        "hydra/launcher=submitit_local",
        *TINY,
        f"results_dir={store}",
        "budget=0.25,0.5",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
        "hydra.launcher.timeout_min=10",
    )
    stored = read_rows(store)
    assert set(stored["budget"]) == {1.0, 0.25, 0.5} and len(stored) == 12  # shared baseline + 2 budgets × 4
    assert not every_stored_row(store).duplicated(["config_hash", "example_id"]).any()


@pytest.mark.parametrize(
    "override, fix",
    [
        ("launcher.workers=0", "launcher.workers=2"),
        ("launcher.num_cpus=-1", "launcher.num_cpus=1"),
        ("launcher.shards=abc", "launcher.shards=8"),
        ("launcher.max_retries=-2", "launcher.max_retries=3"),
        ("launcher.num_gpus=x", "launcher.num_gpus=0"),
    ],
)
def test_bad_launcher_settings_name_the_fix(override, fix):
    from kvbench import KvbenchError
    from kvbench.config.validate import check_config
    from tests.conftest import compose_config

    with pytest.raises(KvbenchError, match=fix.replace(".", r"\.")):
        check_config(compose_config("model=tiny-random", "launcher=ray", override))


@pytest.mark.parametrize("extra", [["task=shared_doc"], ["prefix_cache=true"]])
def test_ray_refuses_to_split_a_workload(tmp_path, extra):
    from kvbench import KvbenchError
    from kvbench.__main__ import launch as run
    from tests.conftest import compose_config

    with pytest.raises(KvbenchError, match="launcher=local"):
        run(compose_config("model=tiny-random", "device=cpu", "launcher=ray", f"results_dir={tmp_path}", *extra))
