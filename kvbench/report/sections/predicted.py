"""The report's "Predicted vs measured" section: the capacity planner's numbers (kvbench.plan.planner) beside what
`python -m kvbench.bench throughput` measured — kv_bytes, memory per request, the largest batch within a memory limit
and decode ms per step vs the roofline bound (the difference: per-step overhead, stated, not fitted away).

The benchmark writes `predicted_vs_measured.csv` (one row per configuration × quantity: model, hardware, config,
context, limit_bytes, quantity, predicted, measured, unit) next to its bench.out; the section shows the first such file
found beside the report's inputs: `<input>/`, `<input>/throughput/`, `<input>/../` or `<input>/../throughput/`
(e.g. results/reference/throughput/ for the input results/reference/store). Torch-free."""

from __future__ import annotations

import html
from pathlib import Path

import pandas as pd

from kvbench.guide.selection import markdown
from kvbench.report.section import Context, Section, report_section

FILE = "predicted_vs_measured.csv"
COLUMNS = ["model", "hardware", "config", "context", "limit_bytes", "quantity", "predicted", "measured", "unit"]


def find_csv(inputs: list[Path]) -> Path | None:
    for path in map(Path, inputs):
        bases = [path, path.parent] if path.is_dir() else [path.parent, path.parent.parent]
        for base in bases:
            for candidate in (base / FILE, base / "throughput" / FILE):
                if candidate.is_file():
                    return candidate
    return None


def _number(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:,.4g}"


def table_of(frame: pd.DataFrame) -> tuple[pd.DataFrame, list[str]]:
    """The shown table (readable units, measured ÷ predicted) and one line per configuration on the overhead."""
    missing = [c for c in COLUMNS if c not in frame]
    if missing:
        raise ValueError(f"{FILE} lacks columns {missing}")
    shown, notes = [], []
    for r in frame.to_dict("records"):
        scale, unit = (1e6, "MB") if r["unit"] == "B" else (1.0, r["unit"])
        ratio = r["measured"] / r["predicted"] if r["predicted"] else float("nan")
        shown.append(
            {
                "config": r["config"],
                "quantity": r["quantity"],
                "predicted": _number(r["predicted"] / scale),
                "measured": _number(r["measured"] / scale),
                "measured ÷ predicted": f"{ratio:.3g}",
                "unit": unit,
            }
        )
        if r["unit"] == "ms":
            notes.append(
                f"{r['config']}: a decode step took {r['measured']:.0f} ms against a roofline bound of "
                f"{r['predicted']:.1f} ms — {r['measured'] - r['predicted']:.0f} ms of per-step overhead "
                f"({r['measured'] / r['predicted']:.0f}× the bound)"
            )
    return pd.DataFrame(shown), notes


@report_section("Predicted vs measured (capacity planner)", where="tables")
def predicted_vs_measured(rows: pd.DataFrame, summary: pd.DataFrame, context: Context) -> Section | None:
    path = find_csv(list(context.inputs))
    if path is None:
        return None
    frame = pd.read_csv(path)
    table, notes = table_of(frame)
    first = frame.iloc[0]
    intro = (
        f"{first['model']} on {first['hardware']}, context {int(first['context'])}, memory limit "
        f"{first['limit_bytes'] / 2**30:.2f} GiB (from {path.name}, written by python -m kvbench.bench throughput). "
        "Predicted: the planner (kv_bytes by kvbench.model.kv_bytes; largest batch: weights + KV within the limit; "
        "decode: the roofline bound max(bytes / bandwidth, FLOPs / peak)). Measured: one run on this machine "
        "(memory per request: what decoding a batch adds to the process's peak, divided by the batch)."
    )
    formatted = table.to_html(index=False)
    body = "".join(f"<li>{html.escape(n)}</li>" for n in notes)
    return Section(
        html=f"<p>{html.escape(intro)}</p>{formatted}" + (f"<ul>{body}</ul>" if body else ""),
        markdown=intro + "\n\n" + markdown(table) + "".join(f"\n- {n}" for n in notes),
    )
