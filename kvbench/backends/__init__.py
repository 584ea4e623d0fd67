"""Serving engines as kvbench backends (engine=<name>): each one module behind `base.Backend`, its engine in its own
venv and worker process (`protocol.py`). Importing this package loads no engine and no torch."""

from __future__ import annotations

from kvbench.backends.base import Backend, EngineGeneration, EngineRequest
from kvbench.config.registry import Registry

BACKENDS = Registry("engine")  # engine name -> Backend subclass

from kvbench.backends import llamacpp, openvino, vllm  # noqa: E402,F401  (each registers itself)


def listed() -> list[str]:
    """The registered engines in the order messages and docs name them (each backend's `order`, then its name)."""
    return sorted(BACKENDS.names(), key=lambda name: (BACKENDS.get(name).order, name))


__all__ = ["BACKENDS", "Backend", "EngineGeneration", "EngineRequest", "listed"]
