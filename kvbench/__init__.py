"""kvbench: benchmark KV-cache compression methods on real models, tasks and measurements."""

__version__ = "0.1.0"


class KvbenchError(Exception):
    """Bad input or environment: the message says what is wrong and how to fix it (no traceback shown)."""

    exit_code = 2


class ConfigurationsFailed(KvbenchError):
    """Some configurations failed while running; the others' rows were written (exit 1, each failure named)."""

    exit_code = 1


def conf_dir():
    """The Hydra config directory: conf/ of a source checkout, else the installed kvbench.conf package."""
    from pathlib import Path

    source = Path(__file__).resolve().parent.parent / "conf"
    if (source / "config.yaml").is_file():
        return source
    from importlib.resources import files

    return Path(str(files("kvbench.conf")))


def cache_root():
    """$KVBENCH_CACHE (default ~/.cache/kvbench), checked to be a writable directory before any slow work."""
    import os
    from pathlib import Path

    root = Path(os.environ.get("KVBENCH_CACHE", Path.home() / ".cache" / "kvbench")).expanduser()
    if root.exists() and not root.is_dir():
        raise KvbenchError(
            f"KVBENCH_CACHE={root} is a file, not a directory; point KVBENCH_CACHE at a directory "
            "(or unset it for ~/.cache/kvbench)"
        )
    return root
