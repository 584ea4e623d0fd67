"""`python -m kvbench [overrides]`: Hydra entry point (see conf/config.yaml for every key)."""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from kvbench import KvbenchError, conf_dir


@hydra.main(config_path=str(conf_dir()), config_name="config", version_base="1.3")
def _main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    from kvbench.runner import run

    try:
        run(cfg, output_dir=HydraConfig.get().runtime.output_dir)
    except KvbenchError as error:
        print(f"kvbench: error: {error}", file=sys.stderr)
        sys.exit(2)


def main() -> None:
    _main()


if __name__ == "__main__":
    main()
