"""`python -m kvbench [overrides]`: Hydra entry point (see conf/config.yaml for every key).

Exit codes: 0 done; 2 bad input (one line naming the fix; in a multirun the other jobs still run, and the failed
ones are listed at the end); 130 interrupted (ctrl-C: rows computed so far are in the store, rerun to resume).
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from kvbench import KvbenchError, conf_dir

FAILED_JOBS: list[str] = []  # multirun: "job N (overrides): message" for each job whose input was bad


@hydra.main(config_path=str(conf_dir()), config_name="config", version_base="1.3")
def _main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hydra_cfg = HydraConfig.get()
    try:
        from kvbench.runner import run

        run(cfg, output_dir=hydra_cfg.runtime.output_dir)
    except KvbenchError as error:
        print(f"kvbench: error: {error}", file=sys.stderr)
        if hydra_cfg.mode != RunMode.MULTIRUN:
            sys.exit(2)
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
