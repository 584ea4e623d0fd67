"""`python -m kvbench.serving [overrides]`: conf/serving.yaml (the run's config + conf/experiment/serving.yaml).
Exit 2 with one line on bad input, before the model loads."""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from kvbench import KvbenchError, conf_dir


@hydra.main(config_path=str(conf_dir()), config_name="serving", version_base="1.3")
def _main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    from kvbench.serving.run import main

    out = cfg.serving.get("out") or HydraConfig.get().runtime.output_dir
    try:
        main(cfg, Path(out))
    except KvbenchError as error:
        print(f"kvbench.serving: error: {error}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    _main()
