"""Building and calling the C kernels (csrc/): compiled on first use with the machine's C compiler, called through
ctypes.

Why C: some CPU paths are a chain of elementwise torch passes over a tile that a single loop does in one (H2O's
prefill statistics: widen, row max, subtract, exp2, row sum — five passes over every score). Why ctypes and not
torch.utils.cpp_extension: a plain C file builds in about a second with no torch headers (those take ~40 s) and
needs no binding code; tensors go in as data pointers (`function` declares each kernel's argument types), so
callers pass contiguous tensors of the stated dtypes.

Built once per source, compiler flags and CPU into KVBENCH_CACHE (default ~/.cache/kvbench)/cpu_ext/, written
atomically (concurrent first uses are safe). `-march=native`: the library is built for the machine that uses it,
which is why the CPU's flags are part of the cache key. No compiler, a failed build or KVBENCH_NO_CPU_EXT=1 →
`load` returns None and the callers run their torch path (a failed build is said once on stderr).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SOURCES = Path(__file__).parent / "csrc"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-shared", "-fPIC", "-std=c11"]


def enabled() -> bool:
    return os.environ.get("KVBENCH_NO_CPU_EXT") != "1"


def _cpu_key() -> str:
    """What the library is built for: the CPU's model and flags (what -march=native compiles for; on CPUs whose
    /proc/cpuinfo has neither, the whole file), the architecture and the C library."""
    machine = [platform.machine(), *platform.libc_ver()]
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "\n".join([sys.platform, *machine])
    wanted = {line for line in lines if line.startswith(("model name", "flags"))} or set(lines)
    return "\n".join([*machine, *sorted(wanted)])


def _cache_dir() -> Path:
    return Path(os.environ.get("KVBENCH_CACHE", Path.home() / ".cache" / "kvbench")) / "cpu_ext"


def _build(name: str) -> Path | None:
    source = SOURCES / f"{name}.c"
    compiler = shutil.which(os.environ.get("CC") or "cc") or shutil.which("gcc")
    if compiler is None:
        print(f"[kvbench] no C compiler (cc, gcc or $CC): C kernel {name} not built; using torch", file=sys.stderr)
        return None
    headers = [header.read_text() for header in sorted(SOURCES.glob("*.h"))]  # included by any kernel
    text = "\0".join([source.read_text(), *headers, compiler, *FLAGS, _cpu_key()])
    key = hashlib.sha256(text.encode()).hexdigest()[:16]
    target = _cache_dir() / f"{name}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        command = [compiler, *FLAGS, f"-I{SOURCES}", str(source), "-o", str(built), "-lm"]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            error = result.stderr.strip()[:300]
            print(f"[kvbench] C kernel {name} did not build; using torch: {error}", file=sys.stderr)
            return None
        os.replace(built, target)  # atomic: a concurrent builder's identical file is simply replaced
    return target


@functools.cache
def _load(name: str) -> ctypes.CDLL | None:
    try:  # an unwritable cache, a noexec mount, a library this libc cannot load: torch, not a crash
        path = _build(name)
        return ctypes.CDLL(str(path)) if path else None
    except OSError as error:
        print(f"[kvbench] C kernel {name} not usable ({error}); using torch", file=sys.stderr)
        return None


def load(name: str) -> ctypes.CDLL | None:
    """The compiled csrc/`name`.c, or None (no compiler, failed build, KVBENCH_NO_CPU_EXT=1)."""
    return _load(name) if enabled() else None


def load_all() -> None:
    """Build (or find built) every kernel now — `install` does this — so a first build's second never lands
    inside a timed prefill or decode step."""
    for source in sorted(SOURCES.glob("*.c")):
        load(source.stem)


def scratch(name: str, signature: str, symbol: str, args: tuple, dtype):
    """A kernel's work buffer, sized by the kernel itself: `symbol` of csrc/`name`.c takes `args` and writes
    the element count (of `dtype`) through its last, pointer argument. None where the kernel is not loaded."""
    import torch

    size_of = function(name, signature, symbol)
    if size_of is None:
        return None
    count = torch.zeros(1, dtype=torch.int64)
    size_of(*args, count.data_ptr())
    return torch.empty(int(count), dtype=dtype)


@functools.cache
def torch_blas(symbol: str) -> int | None:
    """The address of a BLAS routine exported by torch's own CPU library (x86 builds link MKL, e.g. `sgemm_`), for
    kernels that call it per tile; None where this torch has none (then the callers run torch)."""
    import torch

    if not torch.backends.mkl.is_available():  # another BLAS may run its own threads inside the kernels' threads
        return None
    for path in sorted((Path(torch.__file__).parent / "lib").glob("libtorch_cpu*")):
        try:
            return ctypes.cast(getattr(ctypes.CDLL(str(path)), symbol), ctypes.c_void_p).value
        except (OSError, AttributeError):
            continue
    return None


_C_TYPES = {"p": ctypes.c_void_p, "i": ctypes.c_int, "l": ctypes.c_int64, "d": ctypes.c_double}


def function(name: str, signature: str, symbol: str | None = None):
    """csrc/`name`.c's function `symbol` (default `name`) with its argument types declared (one letter
    each: p pointer, i int, l int64, d double; returns int), or None as `load`. Declared types let a call take plain
    Python ints and floats (tensor.data_ptr() for pointers), converted in C: per call ~half the cost of building
    ctypes objects."""
    lib = load(name)
    if lib is None:
        return None
    fn = getattr(lib, symbol or name)
    if fn.argtypes is None:
        fn.argtypes, fn.restype = [_C_TYPES[code] for code in signature], ctypes.c_int
    return fn
