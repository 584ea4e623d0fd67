"""The serving engines (engine=<name>): each one module behind `base.ServingEngine`, its engine in its own venv and
worker process (`protocol.py`). Importing this package loads no engine and no torch. (kvbench's own engine, in this
process, is kvbench.native.)

Every module here but those run by `python -m` (the workers, `llamacpp_glibc` for `make engine-llamacpp`, `vllm_gpu`)
is imported (an engine's module registers its ServingEngine with `@ENGINES.register`), so adding an engine is its
module and its worker: no list to edit. A worker (`<name>_worker.py`) imports its engine and runs in the engine's
venv only."""

from __future__ import annotations

import importlib
import pkgutil

from kvbench.config.registry import Registry
from kvbench.engines.base import EngineGeneration, EngineRequest, ServingEngine

ENGINES = Registry("engine")  # engine name -> ServingEngine subclass

RUN_AS_MAIN = ("_worker", "_glibc", "_gpu")  # workers, make's llama.cpp fix, the GPU tool: run by `python -m` only
for _module in pkgutil.iter_modules(__path__):
    if not _module.name.endswith(RUN_AS_MAIN):
        importlib.import_module(f"{__name__}.{_module.name}")


def listed() -> list[str]:
    """The registered engines in the order messages and docs name them (each engine's `order`, then its name)."""
    return sorted(ENGINES.names(), key=lambda name: (ENGINES.get(name).order, name))


__all__ = ["ENGINES", "EngineGeneration", "EngineRequest", "ServingEngine", "listed"]
