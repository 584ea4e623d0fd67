"""`python -m kvbench [overrides]`: Hydra entry point (see conf/config.yaml for every key).

Exit codes: 0 done; 1 some configurations failed while running (each named; the others' rows are written), or
Hydra's own errors (an unknown config group option: Hydra lists the options); 2 bad input or setup (one line naming
the fix, an unknown key too, before Hydra; in a multirun the other jobs still run, and the failed ones are listed at
the end); 3 the store or run directory failed mid-run (disk full, read-only, ...: one line saying how many rows
are safe and the command that resumes); 130/143/129 interrupted (ctrl-C), terminated (SIGTERM: a Slurm cancel or
time limit), hung up (SIGHUP): the rows computed so far are in the store, the run's claims are released, rerun to
resume.
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
import tempfile
from pathlib import Path

import hydra
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from kvbench import Interrupted, KvbenchError, conf_dir, raise_interrupted

FAILED_JOBS: list[tuple[int, str]] = []  # multirun: (exit code, "job N (overrides): message") per failed job


def resume_command() -> str:
    """The command that was run, to rerun it (what resumes a run)."""
    return shlex.join(["python", "-m", "kvbench", *sys.argv[1:]])


def message(error: KvbenchError) -> str:
    """The one line for a KvbenchError; a fault mid-run gets the command that resumes it."""
    return f"{error}: {resume_command()}" if getattr(error, "resumable", False) else str(error)


def _dir_problem(directory: Path) -> str | None:
    """Why `directory` (Hydra is about to create it) cannot be created and written: a file in its place or on its
    path, a read-only or forbidden parent; None when it can. Probes the nearest existing parent, creates nothing."""
    from kvbench.store.results import fault_text

    existing = directory
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is a file, not a directory"
    try:
        fd, probe = tempfile.mkstemp(dir=existing, prefix=".kvbench-probe")
        os.close(fd)
        os.unlink(probe)
    except OSError as error:
        return fault_text(error, existing)[0]
    return None


class RunDirCheck(Callback):
    """Hydra callback (conf/config.yaml hydra.callbacks): the run or sweep directory Hydra is about to create can be
    created and written, else one line naming the key to change, exit 2 (Hydra itself would print a traceback)."""

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        self._check(config.hydra.run.dir, "hydra.run.dir")

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        self._check(config.hydra.sweep.dir, "hydra.sweep.dir")

    @staticmethod
    def _check(directory: str, key: str) -> None:
        problem = _dir_problem(Path(str(directory)).absolute())
        if problem:
            print(
                f"kvbench: error: cannot create the run directory {directory}: {problem}; choose another {key}=PATH",
                file=sys.stderr,
            )
            sys.exit(2)


def launch(cfg: DictConfig, output_dir: str | None = None):
    """The launcher picks where the run's examples go: this process (launcher=local) or Ray workers, each running
    `kvbench.run.runner.run` on its shard (launcher=ray; the driver gathers them). A config with a `serving:` block
    (`+experiment=serving`) serves a request trace under KV memory budgets instead (kvbench.serving.run)."""
    if cfg.get("serving") is not None:
        from kvbench.serving.run import main as serve_trace

        return serve_trace(cfg, Path(cfg.serving.get("out") or output_dir or "outputs/serving"))
    if (cfg.get("launcher") or {}).get("name", "local") == "ray" and (cfg.launcher.get("shard") is None):
        from kvbench.integrations.ray_launcher import run_ray

        return run_ray(cfg, output_dir)
    from kvbench.run.runner import run

    return run(cfg, output_dir)


@hydra.main(config_path=str(conf_dir()), config_name="config", version_base="1.3")
def _main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from kvbench.store.results import StoreFault, fault_text

    hydra_cfg = HydraConfig.get()
    try:
        try:
            launch(cfg, output_dir=hydra_cfg.runtime.output_dir)
        except OSError as error:  # a write the runner does not own (a report's plot, ...): named, not dumped
            what, remedy = fault_text(error)
            raise StoreFault(
                f"{what}: the rows saved before are safe in the store; {remedy}, then rerun to resume"
            ) from None
    except KvbenchError as error:
        print(f"kvbench: error: {message(error)}", file=sys.stderr)
        if hydra_cfg.mode != RunMode.MULTIRUN:
            sys.exit(error.exit_code)
        overrides = " ".join(hydra_cfg.overrides.task)
        FAILED_JOBS.append((error.exit_code, f"job {hydra_cfg.job.num} ({overrides}): {error}"))


def engine_option_as_method(argv: list[str]) -> str | None:
    """`engine=E method=X` with X an option of engine E and no kvbench method of that name: Hydra would list kvbench's
    methods; the line names the form that takes an engine's option (an option is a grid entry, not a config group)."""
    given = dict(arg.split("=", 1) for arg in argv if "=" in arg and not arg.startswith(("+", "~")))
    option, engine = given.get("method"), given.get("engine")
    if not option or not engine or (conf_dir() / "method" / f"{option}.yaml").exists():
        return None
    from kvbench.engines import ENGINES

    try:
        serving_engine = ENGINES.get(engine)
    except KvbenchError:
        return None  # an unknown engine: the run's own check names it
    if option not in (*serving_engine.options, *serving_engine.applies):
        return None
    return f"method={option} is engine={engine}'s option, not a kvbench method: give it as 'grid.method=[{option}]'"


def known_keys() -> set[str]:
    """Top-level keys an override may name: conf/config.yaml's settings, the config groups, the other conf files
    (serving.yaml, ...) and what each experiment adds (+experiment=serving brings `serving`)."""
    from omegaconf import OmegaConf

    conf = conf_dir()
    keys = set(OmegaConf.load(conf / "config.yaml").keys())
    keys |= {p.name for p in conf.iterdir() if p.is_dir()} | {p.stem for p in conf.glob("*.yaml")}
    for path in (conf / "experiment").glob("*.yaml"):
        keys |= set(OmegaConf.load(path).keys())
    return {str(key) for key in keys}


def unknown_key(argv: list[str]) -> str | None:
    """`key=value` whose top-level key no setting, config group or experiment has: Hydra would answer in several
    lines (exit 1); one line names what to use instead. `+key=`/`~key` and `hydra.*`/`hydra/*` are Hydra's."""
    from kvbench.config.rules import did_you_mean

    given = [arg for arg in argv if "=" in arg and not arg.startswith(("+", "~", "-"))]
    tops = [arg.split("=", 1)[0].replace("/", ".").split(".", 1)[0] for arg in given]
    known = known_keys() if any(key != "hydra" for key in tops) else set()
    for key in tops:
        if key == "hydra" or key in known:
            continue
        if key == "output_dir":
            return "output_dir is not a kvbench setting: a run's directory is hydra.run.dir=PATH (-m: hydra.sweep.dir)"
        return f"{key} is not a kvbench setting; {did_you_mean(key, known)}the settings are listed in conf/config.yaml"
    return None


def main() -> None:
    wrong = engine_option_as_method(sys.argv[1:]) or unknown_key(sys.argv[1:])
    if wrong:
        print(f"kvbench: error: {wrong}", file=sys.stderr)
        sys.exit(2)
    previous = {s: signal.signal(s, raise_interrupted) for s in (signal.SIGTERM, signal.SIGHUP)}
    serving = sys.modules.get("kvbench.serving.run")  # an earlier command in this process (tests): not this one's
    if serving is not None:
        serving.KEPT.update(started=False, runs=0, out=None)
    try:
        _main()
    except KeyboardInterrupt as stop:
        signum = stop.signum if isinstance(stop, Interrupted) else int(signal.SIGINT)
        how = {signal.SIGINT: "interrupted", signal.SIGTERM: "terminated (SIGTERM)"}.get(
            signal.Signals(signum), "hung up (SIGHUP)"
        )
        from kvbench.store.results import saved_rows

        saved = saved_rows()  # what this process's stores hold of it on disk (kvbench.store.results.ResultStore)
        where = f"the {saved} rows computed so far are in the store" if saved else "no row was computed before it"
        from kvbench.serving.run import KEPT, kept

        if KEPT["started"]:  # +experiment=serving: its rows are files, not the store
            where = kept()
        print(  # the run's claims are released on the way here (kvbench.run.runner's finally)
            f"\nkvbench: {how}; {where}: rerun the same command to {'resume' if saved else 'start again'}",
            file=sys.stderr,
        )
        sys.exit(128 + signum)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if FAILED_JOBS:
        print(f"kvbench: {len(FAILED_JOBS)} multirun job(s) failed (the others ran):", file=sys.stderr)
        for _, line in FAILED_JOBS:
            print(f"  {line}", file=sys.stderr)
        sys.exit(max(code for code, _ in FAILED_JOBS))


if __name__ == "__main__":
    main()
