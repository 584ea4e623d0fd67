"""`python -m kvbench.bench NAME [overrides]` (NAME: a benchmark of kvbench.bench.BENCHMARKS, or `all` for ALL).

Exit codes: 0 done (or --help); 1 a benchmark's own check failed (outputs that should be identical differ) or a
configuration of a benchmark's own run failed while running (named); 2 bad input (no or an unknown benchmark or
option, an override the configuration refuses: one line naming the fix); 3 a benchmark's temporary store could not be
written mid-run (disk full); 130 interrupted (ctrl-C).
"""

from __future__ import annotations

import importlib
import sys

from kvbench import KvbenchError
from kvbench.bench import ALL, BENCHMARKS

USAGE = "usage: python -m kvbench.bench NAME [key=value ...] [bench.KEY=VALUE ...]; NAME: " + " | ".join(
    [*BENCHMARKS, "all"]
)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE + "\n\n" + (importlib.import_module("kvbench.bench").__doc__ or ""))
        return 0 if argv else 2
    name, overrides = argv[0], argv[1:]
    names = list(ALL) if name == "all" else [name]
    if name not in BENCHMARKS and name != "all":
        choices = ", ".join(BENCHMARKS)
        print(f"kvbench.bench: error: no benchmark {name!r}; choose one of {choices} or all", file=sys.stderr)
        return 2
    code = 0
    try:
        for each in names:
            code = max(code, importlib.import_module(BENCHMARKS[each]).main(overrides) or 0)
    except KvbenchError as error:
        print(f"kvbench.bench: error: {error}", file=sys.stderr)
        return error.exit_code
    except KeyboardInterrupt:
        print("kvbench.bench: interrupted", file=sys.stderr)
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())
