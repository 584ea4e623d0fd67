"""kvbench: benchmark KV-cache compression methods on real models, tasks and measurements."""

__version__ = "0.1.0"


class KvbenchError(Exception):
    """Bad input or environment: the message says what is wrong and how to fix it (no traceback shown)."""

    exit_code = 2


class ConfigurationsFailed(KvbenchError):
    """Some configurations failed while running; the others' rows were written (exit 1, each failure named)."""

    exit_code = 1


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised where the run is, like ctrl-C: the runner's cleanup (claims released, no
    half-written file, engine workers closed) runs on the way out."""

    def __init__(self, signum: int):
        import signal

        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def raise_interrupted(signum, frame) -> None:
    """The SIGTERM/SIGHUP handler of kvbench's entry points: raise Interrupted."""
    import signal

    for other in (signal.SIGTERM, signal.SIGHUP):  # a second signal must not cut the cleanup short
        signal.signal(other, signal.SIG_IGN)
    raise Interrupted(signum)


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
