"""`launcher=ray`: a run's examples in shards on Ray workers; the driver gathers them and writes the outputs.

Shard k of S holds examples k, k+S, k+2S, … (all configurations of an example stay together, so the shared prefill
still serves them all). Each shard is a Ray task that calls `kvbench.run.runner.run` on its slice; Ray reuses worker
processes, and kvbench caches the loaded model per process, so a worker loads the model once. Rows reach the shared
store (`results_dir`) after every example, under a run id of their own per attempt; work is claimed before it is
computed (kvbench.store.claims), so concurrent runs or a retried shard never compute a row twice. A shard whose worker
dies is retried (`launcher.max_retries`) and reuses the rows its first attempt saved. A killed driver: rerun the
same command; only what is missing is computed.
"""

from __future__ import annotations

import importlib.util
import math
import os
import socket
import time
from pathlib import Path
from typing import cast

import pandas as pd
from omegaconf import DictConfig, OmegaConf

from kvbench import ConfigurationsFailed, KvbenchError
from kvbench.store.results import ResultStore


class WorkerFailed(KvbenchError):
    """A shard failed on a Ray worker for a reason that is not bad input (it crashed past its retries, or raised
    an unexpected error): one line; the rows saved before are in the store, rerun to resume (exit 3)."""

    exit_code = 3
    resumable = True


KILL_ONCE_ENV = "KVBENCH_TEST_KILL_ONCE"  # tests: a marker path; the first worker to see it absent dies mid-shard


def _run_shard(cfg_dict: dict, shard: int, n_shards: int, threads: int) -> pd.DataFrame:
    """Inside a Ray worker: this shard's rows (computed here or reused from the store)."""
    import uuid

    import torch

    from kvbench.run import runner

    os.environ["KVBENCH_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    _maybe_die_after_first_save()
    cfg = OmegaConf.create(cfg_dict)
    cfg.launcher.shard, cfg.launcher.n_shards = shard, n_shards
    cfg.launcher.attempt = uuid.uuid4().hex[:6]  # a retried shard writes its own file: nothing is overwritten
    frame = runner.run(cfg)
    return frame.assign(shard=shard)


def _maybe_die_after_first_save() -> None:
    """Fault injection for the tests: die (like a killed worker) right after the first example's rows are saved."""
    marker = os.environ.get(KILL_ONCE_ENV)
    if not marker:
        return
    try:  # created atomically: two workers starting together must not both see it absent and both die
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    from kvbench.store.results import ResultStore as Store

    original = Store.save_run

    def save_then_die(self, run_id, rows):
        original(self, run_id, rows)
        os._exit(1)

    Store.save_run = save_then_die  # type: ignore[method-assign]  # deliberate: fault injection


def _example_order(frame: pd.DataFrame, shard: int, n_shards: int) -> pd.Series:
    """Global example index of each row: the shard's i-th example is example i·S + k."""
    first_seen = {e: i for i, e in enumerate(dict.fromkeys(frame["example_id"]))}
    return frame["example_id"].map(first_seen) * n_shards + shard


def run_ray(cfg: DictConfig, output_dir: str | Path | None = None) -> pd.DataFrame:
    """The driver: shard, submit at most `workers` shards at once, report progress, gather, write outputs."""
    try:
        import ray
    except ImportError:
        raise KvbenchError("launcher=ray needs Ray: pip install 'kvbench[ray]' (or use launcher=local)") from None
    from kvbench.preflight.entrance import check_run
    from kvbench.run.runner import check_outputs, failures_text, finish_run
    from kvbench.tasks import TASKS

    spec, _ = check_run(cfg)
    if cfg.get("prefix_cache") or TASKS.get(cfg.task.name).kind == "workload":
        raise KvbenchError(
            "launcher=ray splits a run's examples across workers, which would split a workload's "
            "requests from their shared prefix; run prefix_cache / workload tasks with "
            "launcher=local (or one Hydra multirun job per workload)"
        )
    launcher = cfg.launcher
    workers = int(launcher.workers)
    num_cpus, num_gpus = float(launcher.num_cpus), float(launcher.num_gpus)
    if workers < 1 or num_cpus <= 0 or num_gpus < 0:
        raise KvbenchError("launcher=ray needs launcher.workers >= 1, launcher.num_cpus > 0, launcher.num_gpus >= 0")
    n_shards = int(launcher.shards) if launcher.get("shards") else 4 * workers
    if cfg.get("limit"):
        n_shards = min(n_shards, int(cfg.limit))
    store = ResultStore(Path(cfg.results_dir).expanduser().resolve())  # workers may run elsewhere: absolute paths
    out_dir = check_outputs(store, output_dir)
    cfg_dict = cast(dict, OmegaConf.to_container(cfg, resolve=True))  # cfg is a DictConfig
    cfg_dict["results_dir"] = str(store.root)

    address = launcher.get("address")
    connect(ray, address, workers, num_cpus, num_gpus)
    task = ray.remote(_run_shard).options(num_cpus=num_cpus, num_gpus=num_gpus, max_retries=int(launcher.max_retries))
    threads = max(1, int(num_cpus))
    started = time.perf_counter()
    queue, frames = list(range(n_shards)), []
    failed: dict[str, str] = {}  # configuration → its first error, from every shard
    running: dict = {}  # ray object ref → shard
    print(f"[ray] {n_shards} shards on {workers} workers ({'cluster ' + address if address else 'local cluster'})")
    while queue or running:
        while queue and len(running) < workers:
            shard = queue.pop(0)
            running[task.remote(cfg_dict, shard, n_shards, threads)] = shard
        done, _ = ray.wait(list(running), num_returns=1)
        shard = running.pop(done[0])
        try:
            frame = ray.get(done[0])
        except ray.exceptions.RayError as error:
            raise worker_error(error, shard) from None
        failed.update(frame.attrs.get("failed") or {})
        frames.append(frame.assign(_order=_example_order(frame, shard, n_shards)) if len(frame) else frame)
        n_done, elapsed = len(frames), time.perf_counter() - started
        eta = elapsed / n_done * (n_shards - n_done)
        print(
            f"[ray] shards {n_done}/{n_shards} done, {sum(len(f) for f in frames)} rows, "
            f"{elapsed:.0f} s elapsed, ETA {eta:.0f} s",
            flush=True,
        )
    frames = [f for f in frames if len(f)]
    if not frames and failed:  # every configuration failed in every shard
        raise ConfigurationsFailed(failures_text(failed, rows=0))
    if not frames:
        raise KvbenchError("the task selected no examples; check the task's grid/subsets and `limit`")
    frame = pd.concat(frames, ignore_index=True).sort_values("_order", kind="stable")
    frame = frame.drop(columns=["_order", "shard"]).reset_index(drop=True)
    finish_run(spec, frame, out_dir, store, int((~frame["reused"].astype(bool)).sum()), time.perf_counter() - started)
    if failed:
        raise ConfigurationsFailed(failures_text(failed, rows=len(frame)))
    return frame


def connect(ray, address: str | None, workers: int, num_cpus: float, num_gpus: float) -> None:
    """Start a local cluster or join `address`, refusing in one line what would otherwise be a traceback, a
    two-minute retry loop or tasks pending forever: the Ray Client without `ray[client]`, an address nothing
    answers at, GPUs per worker where the machine or cluster has none."""
    import torch

    if address and str(address).startswith("ray://") and importlib.util.find_spec("grpc") is None:
        raise KvbenchError(
            f"launcher.address={address} is the Ray Client, which needs pip install 'ray[client]'; or run the "
            "driver on a node of the cluster with launcher.address=auto"
        )
    if address and str(address) != "auto" and not str(address).startswith("ray://"):
        host, _, port = str(address).rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=5).close()
        except (OSError, ValueError) as error:
            raise KvbenchError(
                f"no Ray cluster answers at launcher.address={address} ({getattr(error, 'strerror', None) or error}); "
                "give its head's host:port (ray start --head prints it), auto on a node of the cluster, or null for "
                "a local cluster"
            ) from None
    if not address and num_gpus > 0 and torch.cuda.device_count() < math.ceil(num_gpus):
        raise KvbenchError(
            f"launcher.num_gpus={num_gpus:g} but this machine has {torch.cuda.device_count()} GPU(s) visible to "
            "torch; use launcher.num_gpus=0 (CPU workers), or join a GPU cluster with launcher.address=..."
        )
    try:
        if address:
            ray.init(address=address, ignore_reinit_error=True, log_to_driver=False)
        else:
            ray.init(
                num_cpus=max(1, math.ceil(workers * num_cpus)),
                num_gpus=math.ceil(num_gpus * workers) or None,
                include_dashboard=False,
                ignore_reinit_error=True,
                log_to_driver=False,
            )
    except (ConnectionError, ValueError, RuntimeError, SystemExit) as error:  # SystemExit: Ray's give-up
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise KvbenchError(f"cannot start or join a Ray cluster (launcher.address={address}): {first}") from None
    gpus = ray.cluster_resources().get("GPU", 0)
    if num_gpus > gpus:
        ray.shutdown()
        raise KvbenchError(
            f"launcher.num_gpus={num_gpus:g} per worker but the Ray cluster has {gpus:g} GPU(s): its tasks would "
            "wait forever; use launcher.num_gpus=0 or a cluster with GPUs"
        )


def worker_error(error: Exception, shard: int) -> KvbenchError:
    """A shard's failure as one line: a worker's KvbenchError as it was raised there (not Ray's coloured remote
    traceback); anything else named by type and first line."""
    cause = getattr(error, "cause", None)
    if isinstance(cause, KvbenchError):
        return cause
    reason = cause if isinstance(cause, BaseException) else error
    if cause is None:  # a crashed worker: Ray's own message, whose first line says which
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
    else:
        first = f"{type(reason).__name__}: " + (str(reason).strip().splitlines() or [""])[0]
    return WorkerFailed(
        f"shard {shard} failed on a Ray worker ({first}); the rows saved before are in the store, rerun to resume"
    )
