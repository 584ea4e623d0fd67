"""`python -m kvbench.bench NAME [overrides]` (NAME: sweep | decode | stats | all): kvbench.bench's benchmarks.

Exit codes: 0 done (or --help); 1 a configuration of a benchmark's own run failed while running (sweep: named);
2 bad input (no or an unknown benchmark, an override the configuration refuses: one line naming the fix); 3 a
benchmark's temporary store could not be written mid-run (disk full); 130 interrupted (ctrl-C).
"""

from __future__ import annotations

import importlib
import sys

from kvbench import KvbenchError
from kvbench.bench import BENCHMARKS

USAGE = f"usage: python -m kvbench.bench {{{' | '.join([*BENCHMARKS, 'all'])}}} [key=value ...]"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE + "\n\n" + (importlib.import_module("kvbench.bench").__doc__ or ""))
        return 0 if argv else 2
    name, overrides = argv[0], argv[1:]
    names = list(BENCHMARKS) if name == "all" else [name]
    if name not in BENCHMARKS and name != "all":
        choices = ", ".join(BENCHMARKS)
        print(f"kvbench.bench: error: no benchmark {name!r}; choose one of {choices} or all", file=sys.stderr)
        return 2
    try:
        for each in names:
            importlib.import_module(BENCHMARKS[each]).main(overrides)
    except KvbenchError as error:
        print(f"kvbench.bench: error: {error}", file=sys.stderr)
        return error.exit_code
    except KeyboardInterrupt:
        print("kvbench.bench: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
