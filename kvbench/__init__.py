"""kvbench: benchmark KV-cache compression methods on real models, tasks and measurements."""

__version__ = "0.1.0"


class KvbenchError(Exception):
    """Bad input or environment: the message says what is wrong and how to fix it (no traceback shown)."""


def conf_dir():
    """The Hydra config directory: conf/ of a source checkout, else the installed kvbench.conf package."""
    from pathlib import Path

    source = Path(__file__).resolve().parent.parent / "conf"
    if (source / "config.yaml").is_file():
        return source
    from importlib.resources import files

    return Path(str(files("kvbench.conf")))
