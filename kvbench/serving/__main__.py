"""`python -m kvbench.serving [overrides]`: conf/serving.yaml (the run's config + conf/experiment/serving.yaml).

Exit codes: 0 done; 1 Hydra's own errors (an unknown config group option: Hydra lists the options); 2 bad input,
one line, before the model loads (also an output folder that cannot be written); 3 writing the rows failed mid-run
(disk full); 130/143/129 ctrl-C, SIGTERM, SIGHUP (the engine workers closed). Every stop says in one line which
finished runs were kept."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from kvbench import Interrupted, KvbenchError, conf_dir, raise_interrupted


@hydra.main(config_path=str(conf_dir()), config_name="serving", version_base="1.3")
def _main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    from kvbench.serving.run import main

    out = cfg.serving.get("out") or HydraConfig.get().runtime.output_dir
    try:
        main(cfg, Path(out))
    except KvbenchError as error:
        print(f"kvbench.serving: error: {error}", file=sys.stderr)
        sys.exit(error.exit_code)


def main() -> None:
    from kvbench.serving.run import kept

    previous = {s: signal.signal(s, raise_interrupted) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        _main()
    except KeyboardInterrupt as stop:  # the engines' workers are closed on the way here (serve_engines' finally)
        signum = stop.signum if isinstance(stop, Interrupted) else int(signal.SIGINT)
        how = {signal.SIGINT: "interrupted", signal.SIGTERM: "terminated (SIGTERM)"}.get(
            signal.Signals(signum), "hung up (SIGHUP)"
        )
        print(f"\nkvbench.serving: {how}; {kept()}", file=sys.stderr)
        sys.exit(128 + signum)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


if __name__ == "__main__":
    main()
