"""The GGUF conversion cache: a GGUF is dequantized once into a safetensors folder under kvbench's cache (one folder
per model and transformers version, `converted_dir`), marked complete last (`MARKER`: its source's digest and every
file's size), and verified at each load (`load_converted`): converted again when made from another GGUF, refused with
the command that removes it when damaged. The loaders that fill it are in gguf_models.py."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvbench import KvbenchError, cache_root
from kvbench.model.checkpoint import from_pretrained_complete
from kvbench.model.loaded import LoadedModel, finish
from kvbench.store.results import file_digest, write_atomic

MARKER = "kvbench-converted.json"  # written last into a conversion: what it was made from and its files' sizes


def convert_gguf(gguf: Path, target: Path, source: dict) -> None:
    """Dequantize the GGUF once into a safetensors directory (fp32: Q4_1 values are exact in fp32). `source` (what
    the GGUF is, `gguf_source`/`package_source`) goes into the completion marker, written last. Each stage says
    what it does and how long it took; the weights show transformers' own progress bar."""
    try:
        model, tokenizer = read_gguf(gguf)
    finally:
        _READERS.clear()  # the memory map closes with the reader
    with _stage(f"saving into {target}"):
        save_conversion(model, tokenizer, target, source)


@contextlib.contextmanager
def _stage(what: str):
    """One line per conversion stage: its name, then its time."""
    print(f"[kvbench]   {what} ...", end="", flush=True)
    start = time.perf_counter()
    try:
        yield
    except BaseException:
        print(" stopped", flush=True)  # the error's own line follows on a line of its own
        raise
    print(f" {time.perf_counter() - start:.0f} s", flush=True)


_READERS: dict[str, Any] = {}  # path -> gguf.GGUFReader, while converting


@contextlib.contextmanager
def _one_parse():
    """transformers opens the GGUF three times (the tokenizer's config, the model's config, the weights), and gguf's
    reader parses every metadata field each time — 8.6 s for Gemma 3's 262K-token vocabulary: here one reader per
    file serves every open (it memory-maps the file and is only read)."""
    import gguf

    opened = gguf.GGUFReader

    def reader(path, *args, **kwargs):
        if args or kwargs:
            return opened(path, *args, **kwargs)
        if str(path) not in _READERS:
            _READERS[str(path)] = opened(path)
        return _READERS[str(path)]

    gguf.GGUFReader = reader  # type: ignore[misc,assignment]  # transformers imports it from gguf at each call
    try:
        yield
    finally:
        gguf.GGUFReader = opened  # type: ignore[misc]


def read_gguf(gguf: Path):
    """The model (fp32, dequantized) and tokenizer a GGUF file holds."""
    from transformers.utils import logging as hf_logging

    kwargs = {}
    try:  # transformers ≥ 5.2x keeps GGUF blocks packed unless asked; older releases always dequantize
        from transformers import GgufConfig

        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:
        pass
    with _one_parse(), _stage("reading the tokenizer (the vocabulary)"):
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    print("[kvbench]   dequantizing the weights to float32", flush=True)
    start = time.perf_counter()
    hf_logging.enable_progress_bar()  # transformers' bar over the tensors: the long stage
    try:
        with _one_parse():
            model = AutoModelForCausalLM.from_pretrained(
                gguf.parent, gguf_file=gguf.name, dtype=torch.float32, attn_implementation="sdpa", **kwargs
            )
    finally:
        hf_logging.disable_progress_bar()
    print(f"[kvbench]   dequantized in {time.perf_counter() - start:.0f} s", flush=True)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None  # type: ignore[assignment]
    return model, tokenizer


def save_conversion(model, tokenizer, target: Path, source: dict) -> None:
    """Into a temporary folder beside `target`, the marker last, then renamed into place: a conversion cut short
    (disk full, a signal) is never found in the cache."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=target.name + ".tmp"))
    old = target.with_name(f"{target.name}.old-{uuid.uuid4().hex[:8]}")
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        write_marker(tmp, source)
        if target.exists():  # an outdated conversion: moved aside, then replaced (os.replace needs an empty target)
            os.replace(target, old)
        os.replace(tmp, target)
    except OSError as error:
        raise KvbenchError(
            f"cannot write the converted model into {target.parent} ({error.strerror}); free space there or set "
            "KVBENCH_CACHE to a writable directory"
        ) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)


def write_marker(directory: Path, source: dict) -> None:
    """The completion marker: the source's digest and the size of every file of the conversion."""
    files = {f.name: f.stat().st_size for f in sorted(directory.iterdir()) if f.is_file() and f.name != MARKER}
    text = json.dumps({"source": source, "files": files}, indent=1, sort_keys=True)
    write_atomic(directory / MARKER, lambda tmp: Path(tmp).write_text(text))


def read_marker(directory: Path) -> dict | None:
    try:
        marker = json.loads((directory / MARKER).read_text())
        return marker if isinstance(marker, dict) and isinstance(marker.get("files"), dict) else None
    except (OSError, ValueError):
        return None


def gguf_source(gguf: Path, recorded: dict | None = None) -> dict:
    """A GGUF file's digest: sha256, size and mtime. The sha256 is reused from `recorded` while size and mtime
    are unchanged (a load stats the file; it hashes it only after a reinstall)."""
    stat = gguf.stat()
    same = recorded and (recorded.get("size"), recorded.get("mtime_ns")) == (stat.st_size, stat.st_mtime_ns)
    sha256 = recorded["sha256"] if same and recorded else file_digest(gguf)
    return {"file": gguf.name, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": sha256}


def package_source(cfg, package) -> dict:
    """An assembled GGUF's digest: the sha256 its package checks it against (the GGUF itself is not kept)."""
    return {"file": cfg.gguf_file, "package": cfg.package, "sha256": getattr(package, "EXPECTED_SHA256", cfg.version)}


def cache_state(target: Path, source: dict) -> tuple[str, str]:
    """(state, why) of the converted folder: "absent"; "unmarked" (converted before kvbench wrote a marker, or a
    conversion cut short: loading it tells); "outdated" (made from another GGUF than the one installed); "damaged"
    (a file the marker lists is missing or resized); "marked" (matches its source)."""
    if not (target / "config.json").exists() and not (target / MARKER).exists():
        return "absent", "is not converted yet"
    marker = read_marker(target)
    if marker is None:
        return "unmarked", "has no completion marker"
    recorded = str((marker.get("source") or {}).get("sha256"))
    if recorded != source["sha256"]:
        now = source["sha256"][:12]
        return "outdated", f"was converted from another {source['file']} (sha256 {recorded[:12]}…, installed: {now}…)"
    for name, size in marker["files"].items():
        found = (target / name).stat().st_size if (target / name).is_file() else None
        if found != size:
            return "damaged", f"has {name} {'missing' if found is None else f'of {found} bytes, not {size}'}"
    return "marked", ""


def load_converted(cfg, target: Path, source: dict, convert, device, dtype) -> LoadedModel:
    """A converted model of the cache, verified: converted (again) when absent or made from another GGUF, saying
    so; a damaged one (unreadable, files missing or resized, weights missing or unexpected) is refused with the
    command that removes it — its weights never run partly random. A folder from before the marker existed is
    checked once by loading it completely, then marked."""
    state, why = cache_state(target, source)
    if state == "damaged":
        raise damaged(target, why)
    if state == "outdated":
        print(f"[kvbench] the converted model in {target} {why}: converting it again", flush=True)
    if state in ("absent", "outdated"):
        convert()
    try:
        tokenizer = AutoTokenizer.from_pretrained(target)
        model, incomplete = from_pretrained_complete(target, dtype, strict_unexpected=True)
    except Exception as error:  # safetensors/json/OSError: a damaged conversion, whatever the library's type
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise damaged(target, f"is unreadable ({reason})") from None
    if incomplete:
        raise damaged(target, f"does not match its config: {incomplete}")
    marker = read_marker(target)
    if marker is None or marker.get("source") != source:  # complete: (re)mark it; later loads only stat the source
        with contextlib.suppress(OSError):
            write_marker(target, source)
            if marker is None:
                print(f"[kvbench] checked the converted model in {target} once (every weight loads) and marked it")
    if not cfg.get("chat", True):
        tokenizer.chat_template = None  # a base model: tasks prompt it with plain text (completion style)
    return finish(model, tokenizer, cfg.name, device, dtype)


def damaged(target: Path, problem: str) -> KvbenchError:
    return KvbenchError(
        f"the converted model in {target} {problem}; delete it (rm -r {target}) and rerun: it is converted again"
    )


def converted_dir(name: str) -> Path:
    """Where model `name` is converted: one folder per transformers version, as a conversion saved by one version
    is not read back alike by another (a tokenizer saved by 5.2 decodes with stray "Ġ" under 5.24), and kvpress's
    venv (transformers 5.2) runs beside the main one."""
    import transformers

    return cache_root() / name / f"transformers-{transformers.__version__}"


def drop_unversioned_conversion(folder: Path) -> None:
    """A conversion written straight into `folder` (the model's cache folder, before one folder per transformers
    version): its marked files are removed when the versioned one is made, saying so — kvbench's own cache, 0.5 GB."""
    marker = read_marker(folder)
    if marker is None:
        return
    with contextlib.suppress(OSError):
        for name in [*marker["files"], MARKER]:
            (folder / name).unlink(missing_ok=True)
        print(f"[kvbench] removed the conversion in {folder} made before one folder per transformers version")


def _make_cache_dir(target: Path) -> None:
    drop_unversioned_conversion(target.parent)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise KvbenchError(
            f"cannot create the model cache {target.parent} ({error.strerror}); set KVBENCH_CACHE to a writable "
            "directory"
        ) from None
