"""Benchmarks of kvbench itself, over the validated configuration: `python -m kvbench.bench NAME [overrides]`.

Each prints ratios measured in one run on this machine (named with its CPU or GPU), never asserted in a test. The
overrides are `python -m kvbench`'s (model=, dtype=, task.context_lengths=...), checked as a run checks them: a bad
one is one line and exit 2. `make bench` runs sweep (in the resolved dtype and fp32), decode and stats.

- sweep: a grid's price. Plain transformers (prefill + greedy loop, its own DynamicCache) vs `method=full` vs the
  default sweep (full + five methods × two budgets, fidelity on), on the same prompts; the outputs compared; each
  part's share (fidelity, the grid's decode) from the rows.
- decode: a grid decode step of B rows against one row's, and each one's share of the bandwidth bound.
- stats: the attention statistics' cost (H2O's and TOVA's column sums, SnapKV's window) over the plain prefill.
"""

from __future__ import annotations

BENCHMARKS = {
    "sweep": "kvbench.bench.sweep",
    "decode": "kvbench.bench.decode",
    "stats": "kvbench.bench.stats",
}
