"""`python -m kvbench [overrides]`: Hydra entry point (see conf/config.yaml for every key).

Exit codes: 0 done; 1 some configurations failed while running (each named; the others' rows are written);
2 bad input (one line naming the fix; in a multirun the other jobs still run, and the failed ones are listed at the
end); 130 interrupted (ctrl-C: rows computed so far are in the store, rerun to resume).
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from kvbench import KvbenchError, conf_dir

FAILED_JOBS: list[str] = []  # multirun: "job N (overrides): message" for each job whose input was bad


def launch(cfg: DictConfig, output_dir: str | None = None):
    """The launcher picks where the run's examples go: this process (launcher=local) or Ray workers, each running
    `kvbench.run.runner.run` on its shard (launcher=ray; the driver gathers them)."""
    if (cfg.get("launcher") or {}).get("name", "local") == "ray" and (cfg.launcher.get("shard") is None):
        from kvbench.integrations.ray_launcher import run_ray

        return run_ray(cfg, output_dir)
    from kvbench.run.runner import run

    return run(cfg, output_dir)


@hydra.main(config_path=str(conf_dir()), config_name="config", version_base="1.3")
def _main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hydra_cfg = HydraConfig.get()
    try:
        launch(cfg, output_dir=hydra_cfg.runtime.output_dir)
    except KvbenchError as error:
        print(f"kvbench: error: {error}", file=sys.stderr)
        if hydra_cfg.mode != RunMode.MULTIRUN:
            sys.exit(error.exit_code)
        overrides = " ".join(hydra_cfg.overrides.task)
        FAILED_JOBS.append(f"job {hydra_cfg.job.num} ({overrides}): {error}")


def main() -> None:
    try:
        _main()
    except KeyboardInterrupt:
        print(
            "\nkvbench: interrupted; the rows computed so far are in the store: rerun the same command to resume",
            file=sys.stderr,
        )
        sys.exit(130)
    if FAILED_JOBS:
        print(f"kvbench: {len(FAILED_JOBS)} multirun job(s) failed on bad input (the others ran):", file=sys.stderr)
        for line in FAILED_JOBS:
            print(f"  {line}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
