"""kvbench: benchmark KV-cache compression methods on real models, tasks and measurements."""

__version__ = "0.1.0"


class KvbenchError(Exception):
    """Bad input or environment: the message says what is wrong and how to fix it (no traceback shown)."""
