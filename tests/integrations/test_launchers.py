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
    from kvbench.preflight.entrance import check_config
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


# ------------------------------------------------------------------------------------------ Ray under faults


def ray_run(tmp_path, *extra):
    from kvbench.__main__ import launch
    from tests.conftest import compose_config

    return launch(compose_config(*TINY, "launcher=ray", f"results_dir={tmp_path / 'store'}", *extra), tmp_path / "o")


@pytest.mark.parametrize(
    "address, says",
    [
        ("localhost:1", "no Ray cluster answers at launcher.address=localhost:1 (Connection refused)"),
        ("nonsense", "no Ray cluster answers at launcher.address=nonsense"),
        ("auto", "cannot start or join a Ray cluster (launcher.address=auto): Could not find any running Ray"),
    ],
)
def test_a_ray_address_nothing_answers_at_is_one_line(tmp_path, address, says):
    from kvbench import KvbenchError

    pytest.importorskip("ray")
    with pytest.raises(KvbenchError) as refused:
        ray_run(tmp_path, f"launcher.address={address}")
    assert says in str(refused.value) and "\n" not in str(refused.value)


def test_the_ray_client_without_ray_client_installed_names_the_pip_install(tmp_path):
    import importlib.util

    from kvbench import KvbenchError

    pytest.importorskip("ray")
    if importlib.util.find_spec("grpc") is not None:
        pytest.skip("ray[client] is installed here")
    with pytest.raises(KvbenchError, match=r"needs pip install 'ray\[client\]'"):
        ray_run(tmp_path, "launcher.address=ray://head:10001")


def test_gpus_per_worker_on_a_machine_without_gpus_is_refused(tmp_path):
    import torch

    from kvbench import KvbenchError

    pytest.importorskip("ray")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(KvbenchError, match=r"launcher.num_gpus=1 but this machine has 0 GPU\(s\).*num_gpus=0"):
        ray_run(tmp_path, "launcher.num_gpus=1")


def _fails_with(kind: str):
    from kvbench import KvbenchError

    if kind == "kvbench":
        raise KvbenchError("task.data_dir=/shared/longbench: no such directory on this worker; mount it")
    raise RuntimeError("CUDA error: an illegal memory access\n  many lines of a device traceback")


@pytest.mark.slow
def test_a_worker_failure_is_the_workers_own_line_not_a_remote_traceback():
    from kvbench import KvbenchError
    from kvbench.integrations.ray_launcher import WorkerFailed, worker_error

    ray = pytest.importorskip("ray")
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    try:
        remote = ray.remote(_fails_with)
        for kind in ("kvbench", "other"):
            with pytest.raises(ray.exceptions.RayTaskError) as raised:
                ray.get(remote.remote(kind))
            assert str(raised.value).count("\n") >= 3 and "\x1b[" in str(raised.value)  # what reached the user
            line = worker_error(raised.value, shard=2)
            if kind == "kvbench":
                assert type(line) is KvbenchError and line.exit_code == 2
                assert str(line) == "task.data_dir=/shared/longbench: no such directory on this worker; mount it"
            else:
                assert isinstance(line, WorkerFailed) and line.exit_code == 3 and "\n" not in str(line)
                assert str(line).startswith("shard 2 failed on a Ray worker (RuntimeError: CUDA error: an illegal")
    finally:
        ray.shutdown()
