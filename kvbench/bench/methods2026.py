"""docs/methods.md's tables of the 2026 methods at 2K (`+experiment=methods2026_niah` / `methods2026_ruler`) from a
store's rows: per configuration and model, the mean score [95 % interval], the examples, kv_ratio · MiB held at the
end of generation, and KL(full ‖ compressed) per answer token — the mean over examples, the 95th percentile over
examples, the top-1 agreement. Each model's cells cover the same examples (those every configuration of the tables
has); where the store holds a configuration's row of an example twice (another experiment), the newest counts. Reads
rows only (no model).

    python -m kvbench.bench methods2026 bench.task=ruler                   # results/reference/store
    python -m kvbench.bench methods2026 bench.task=niah bench.store=DIR [bench.length=2048]
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd

from kvbench import KvbenchError
from kvbench.bench.common import tool_options

OPTIONS = {"task": None, "store": "results/reference/store", "length": 2048}
MODELS = {"smollm2-135m": "SmolLM2", "gemma3-270m": "Gemma 3"}
EVICTION = ["full"] + [
    f"{m} {b}" for m in ("rkv", "kvcrush", "triattention", "chunkkv", "snapkv") for b in ("0.5", "0.25")
]
PRECISION = (
    ["kivi(bits=8)"]
    + [f"turboquant(preset=turboquant_{p})" for p in ("k8v4", "4bit_nc", "k3v4_nc", "3bit_nc")]
    + ["kivi", "kivi(bits=2)"]
)


def configuration(rows: pd.DataFrame) -> pd.Series:
    """`snapkv 0.25` for a method with a budget, the variant label (`kivi(bits=2)`) for one without."""
    from kvbench.store.aggregate import variant_label

    variants = [variant_label(m, p) for m, p in zip(rows["method"], rows["method_params"].map(json.loads))]
    return pd.Series(
        [v if b >= 1 else f"{v} {b:g}" for v, b in zip(variants, rows["budget"])], index=rows.index, dtype=str
    )


def cells(rows: pd.DataFrame) -> dict[tuple[str, str], list[str]]:
    """(model, configuration) → [score [CI] (n), kv_ratio · MiB, KL mean / p95 / top-1] on each model's common
    examples."""
    from kvbench.store.intervals import interval_text, mean_interval

    out = {}
    for model, scope in rows.groupby("model"):
        per_config = scope.groupby("configuration")["example_id"].agg(frozenset)
        common = frozenset.intersection(*per_config)
        scope = scope[scope["example_id"].isin(common)]
        for name, g in scope.groupby("configuration"):
            mean, low, high, _ = mean_interval(g["score"])
            kl = g["kl_mean"].fillna(0).to_numpy()  # the full cache's own rows: 0
            out[(str(model), str(name))] = [
                f"{mean:.2f} [{interval_text(low, high)}] (n={len(g)})",
                f"{g['kv_ratio'].mean():.3f} · {g['kv_bytes'].mean() / 2**20:.1f}",
                f"{kl.mean():.4f} / {np.percentile(kl, 95):.4f} / {g['top1_agreement'].fillna(1).mean():.2f}",
            ]
    return out


def table(found: dict, order: list[str], models: list[str]) -> str:
    head = ["method budget"] + [
        f"{MODELS[m]}: {c}" for m in models for c in ("score [95 % CI]", "kv_ratio · MiB", "KL")
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in order:
        if any((m, name) in found for m in models):
            values = [v for m in models for v in found.get((m, name), ["–", "–", "–"])]
            lines.append("| " + " | ".join([name] + values) + " |")
    return "\n".join(lines)


def main(overrides: list[str]) -> None:
    from kvbench.store.aggregate import load_rows

    opts = tool_options(overrides, OPTIONS, "methods2026", required=("task",))
    task, store, length = opts["task"], str(opts["store"]), opts["length"]
    if task not in ("niah", "ruler"):
        raise KvbenchError(f"bench.task={task}: the tables are bench.task=niah or bench.task=ruler")
    rows = load_rows([store])
    rows = rows[(rows["task"] == task) & rows["model"].isin(list(MODELS)) & (rows["dtype"] == "bfloat16")]
    rows = rows[rows["length_target"] == length] if "length_target" in rows else rows.iloc[:0]
    if not len(rows):
        raise KvbenchError(f"no {task} rows at {length} tokens in {store}: run the experiment first")
    rows = rows.assign(configuration=configuration(rows))
    rows = rows[rows["configuration"].isin(EVICTION + PRECISION)]
    rows = rows.sort_values("timestamp").drop_duplicates(["model", "configuration", "example_id"], keep="last")
    found = cells(rows)
    models = [m for m in MODELS if m in set(rows["model"])]
    print(table(found, EVICTION, models), end="\n\n")
    print(table(found, PRECISION, models))
