"""Which evidence tokens (NIAH: the value's digits) each layer × KV head kept, from a `diagnose=true` run's rows.

    python -m kvbench.bench diagnose_evidence bench.results=RESULTS_DIR [bench.method=snapkv] [bench.budget=0.1]

Per diagnosed row with evidence: the verdict, the answer and prediction, then one line per layer with one 0/1 mask
per KV head (1 = that evidence token was still in the cache at the first decode step; kvbench.guide.diagnose_run's
`evidence_kept`). Layers that kept all evidence in every head are summarised on one line. Reads rows only (no model).
"""

from __future__ import annotations

import json
from pathlib import Path

from kvbench import KvbenchError
from kvbench.bench.common import tool_options

OPTIONS = {"results": None, "method": None, "budget": None}


def print_row(row, heads) -> None:
    print(
        f"\n{row.method} @{row.budget:g}  {row.example_id}  verdict: {row.verdict}  score {row.score:g}  "
        f"answer {json.loads(row.answers)[0]!r}  prediction {row.prediction.strip()[:30]!r}"
    )
    print(
        f"  mass_recall {row.mass_recall:.3f}  evidence_retention {row.evidence_retention:.3f}  "
        f"kl_mean {row.kl_mean:.3f}  first divergence at step {row.first_divergence_step}"
    )
    whole = []
    for layer, g in heads.groupby("layer", sort=True):
        masks = list(g.sort_values("kv_head")["evidence_kept"])
        if all(set(m) == {"1"} for m in masks):
            whole.append(str(layer))
        else:
            print(f"  layer {layer:2d}: " + "  ".join(masks))
    print(f"  all evidence kept in every head: layers {', '.join(whole) or 'none'}")


def main(overrides: list[str]) -> None:
    from kvbench.guide.diagnose_run import read_side_tables
    from kvbench.store.aggregate import load_rows

    opts = tool_options(overrides, OPTIONS, "diagnose_evidence", required=("results",))
    results = Path(str(opts["results"]))
    rows = load_rows([results])
    side = read_side_tables(results)
    if "verdict" not in rows or side.empty:
        raise KvbenchError(f"{results}: no diagnosed rows (run with diagnose=true)")
    rows = rows[rows["verdict"].notna() & (rows["method"] != "full")]
    if opts["method"]:
        rows = rows[rows["method"] == opts["method"]]
    if opts["budget"] is not None:
        rows = rows[(rows["budget"] - float(opts["budget"])).abs() < 1e-9]
    for row in rows.sort_values(["method", "budget", "example_id"]).itertuples():
        heads = side[(side.config_hash == row.config_hash) & (side.example_id == row.example_id)]
        if not heads.empty and heads["evidence_kept"].astype(bool).any():
            print_row(row, heads)
