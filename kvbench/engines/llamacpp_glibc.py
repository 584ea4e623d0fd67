"""Make llama-cpp-py-sync's prebuilt CPU wheel load on a glibc older than 2.38 (Debian 12 has 2.36).

The wheel (tagged manylinux2014, built on a newer system) needs glibc 2.38 for four symbols only: the C23 variants
`__isoc23_strtol/strtoul/strtoull/sscanf` (they differ from the classic ones in accepting a "0b" prefix, which
llama.cpp's own parsing never relies on). This module, run once by `make engine-llamacpp` (standard library only:
importing it does nothing):
  1. compiles `libkvbench-isoc23.so`, which defines the four symbols by calling the classic functions;
  2. edits each bundled library in place: those symbols lose their version requirement (.gnu.version -> global, so
     the loader takes the shim's definition) and the GLIBC_2.38 requirement is marked weak (VER_FLG_WEAK: the loader
     no longer refuses the library for it).
The worker loads the shim with RTLD_GLOBAL before llama.cpp (kvbench/engines/llamacpp_worker.py). Idempotent; on
a glibc >= 2.38 it changes nothing. Usage: python -m kvbench.engines.llamacpp_glibc <venv>

Exit codes: 0 done (patched, or nothing to patch); 1 it failed (no llama.cpp package in the venv, no C compiler:
Python's traceback, under `make engine-llamacpp`); 2 no venv folder given: one line.
"""

from __future__ import annotations

import platform
import struct
import subprocess
import sys
from pathlib import Path

SYMBOLS = {b"__isoc23_strtol", b"__isoc23_strtoul", b"__isoc23_strtoull", b"__isoc23_sscanf"}
SHIM = """#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
long __isoc23_strtol(const char *s, char **end, int base) { return strtol(s, end, base); }
unsigned long __isoc23_strtoul(const char *s, char **end, int base) { return strtoul(s, end, base); }
unsigned long long __isoc23_strtoull(const char *s, char **end, int base) { return strtoull(s, end, base); }
int __isoc23_sscanf(const char *s, const char *fmt, ...) {
    va_list ap; va_start(ap, fmt); int n = vsscanf(s, fmt, ap); va_end(ap); return n;
}
"""
SHT_DYNSYM, SHT_GNU_VERSYM, SHT_GNU_VERNEED, VER_FLG_WEAK = 11, 0x6FFFFFFF, 0x6FFFFFFE, 0x2


def sections(elf: bytes | bytearray) -> list[tuple[int, int, int, int, int]]:
    """(type, offset, size, link, entsize) of every section of a little-endian ELF64 file."""
    shoff, shentsize, shnum = struct.unpack_from("<Q", elf, 0x28)[0], *struct.unpack_from("<HH", elf, 0x3A)
    out = []
    for i in range(shnum):
        _, typ, _, _, off, size, link, _, _, entsize = struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * shentsize)
        out.append((typ, off, size, link, entsize))
    return out


def cstr(elf: bytes | bytearray, at: int) -> bytes:
    return bytes(elf[at : elf.index(b"\0", at)])


def patch(path: Path) -> bool:
    """Clear the version of SYMBOLS and make the GLIBC_2.38 requirement weak; True when the file changed."""
    elf = bytearray(path.read_bytes())
    secs = sections(elf)
    changed = False
    dynsym = next(s for s in secs if s[0] == SHT_DYNSYM)
    strtab = secs[dynsym[3]][1]
    versym = next((s for s in secs if s[0] == SHT_GNU_VERSYM), None)
    for i in range(dynsym[2] // dynsym[4]):  # Elf64_Sym: st_name u32 first; .gnu.version: one u16 per symbol
        name = cstr(elf, strtab + struct.unpack_from("<I", elf, dynsym[1] + i * dynsym[4])[0])
        if versym and name in SYMBOLS and struct.unpack_from("<H", elf, versym[1] + 2 * i)[0] > 1:
            struct.pack_into("<H", elf, versym[1] + 2 * i, 1)  # 1 = global: any definition satisfies it
            changed = True
    verneed = next((s for s in secs if s[0] == SHT_GNU_VERNEED), None)
    at, names = (verneed[1], secs[verneed[3]][1]) if verneed else (None, 0)  # its entries, its string table
    while at is not None:  # Elf64_Verneed: version, cnt, file, aux, next; Elf64_Vernaux: hash, flags, other, name, next
        _, cnt, _, aux, nxt = struct.unpack_from("<HHIII", elf, at)
        a = at + aux
        for _ in range(cnt):
            _, flags, _, name, anext = struct.unpack_from("<IHHII", elf, a)
            if cstr(elf, names + name) == b"GLIBC_2.38" and not flags & VER_FLG_WEAK:
                struct.pack_into("<H", elf, a + 4, flags | VER_FLG_WEAK)
                changed = True
            a += anext
        at = at + nxt if nxt else None
    if changed:
        path.write_bytes(elf)
    return changed


def main(venv: str) -> None:
    if tuple(int(x) for x in platform.libc_ver()[1].split(".")[:2]) >= (2, 38):
        print("glibc >= 2.38: the wheel loads as it is")
        return
    package = next(Path(venv).glob("lib/python3*/site-packages/llama_cpp_py_sync"))
    source = package / "isoc23.c"
    source.write_text(SHIM)
    subprocess.run(
        ["cc", "-shared", "-fPIC", "-O2", "-o", str(package / "libkvbench-isoc23.so"), str(source)], check=True
    )
    patched = [
        p.name
        for p in sorted(package.glob("lib*.so*"))
        if not p.is_symlink() and p.name != "libkvbench-isoc23.so" and patch(p)
    ]
    print(
        f"glibc {platform.libc_ver()[1]}: libkvbench-isoc23.so built; "
        f"patched {', '.join(patched) or 'nothing (done before)'}"
    )


if __name__ == "__main__":
    if len(sys.argv) != 2 or not Path(sys.argv[1]).is_dir():
        print("llamacpp_glibc: error: give the venv: python -m kvbench.engines.llamacpp_glibc .venv-llamacpp")
        sys.exit(2)
    main(sys.argv[1])
