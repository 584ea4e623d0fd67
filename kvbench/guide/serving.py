"""Which configuration meets the SLO at this memory: from a serving run's rows (kvbench.serving), per configuration
(kvbench's methods and the engines' options) its run at the largest measured KV budget within --kv-memory, the
share of its requests meeting both SLOs (recomputed from the request rows, so any SLO can be asked), its goodput,
its concurrency and its score drop against the full cache at that same KV budget.

    python -m kvbench.guide.serving SERVING_DIR --kv-memory 40000000 [--slo-ttft 5] [--slo-tpot 0.25]
                                   [--attainment 0.9] [--max-drop 0.05]

`fit`: `meets` when the SLO attainment ≥ --attainment and the score drop ≤ --max-drop; else what fails. Ranked:
those that meet first, then by goodput. Torch-free.

Exit codes: 0 done (or --help); 2 bad input (one line).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import pandas as pd

from kvbench import KvbenchError

CONFIG = ["engine", "method", "budget"]


def load(path: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(request rows, run rows) of a serving output directory (or the directory holding serving_runs.parquet)."""
    path = Path(path)
    if not path.exists():  # named as given, not as its parent (which may well exist)
        raise KvbenchError(f"{path} does not exist; give the output directory of python -m kvbench.serving")
    folder = path if path.is_dir() else path.parent
    files = [folder / "serving_requests.parquet", folder / "serving_runs.parquet"]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise KvbenchError(f"{folder} holds no {missing[0]}; give the output directory of python -m kvbench.serving")
    requests, runs = (pd.read_parquet(f) for f in files)
    for frame in (requests, runs):
        if "engine" not in frame:
            frame["engine"] = "kvbench"
    return requests, runs


def choose(
    requests: pd.DataFrame,
    runs: pd.DataFrame,
    kv_memory: int,
    slo_ttft: float | None = None,
    slo_tpot: float | None = None,
    attainment: float = 0.9,
    max_drop: float = 0.05,
) -> pd.DataFrame:
    """One line per configuration at the largest KV budget ≤ kv_memory it was measured at, ranked."""
    within = runs[runs.kv_budget_bytes <= kv_memory]
    if within.empty:
        raise KvbenchError(
            f"--kv-memory={kv_memory:,}: no run at or below it; the smallest measured KV budget is "
            f"{int(runs.kv_budget_bytes.min()):,}"
        )
    ttft = float(runs.slo_ttft_s.iloc[0]) if slo_ttft is None else slo_ttft
    tpot = float(runs.slo_tpot_s.iloc[0]) if slo_tpot is None else slo_tpot
    if tpot > ttft:
        raise KvbenchError(f"--slo-tpot={tpot} > --slo-ttft={ttft}: the SLOs are in the wrong order; swap them")
    best = within.sort_values("kv_budget_bytes").groupby(CONFIG, sort=False).tail(1)
    full = runs[runs.method == "full"].set_index("kv_budget_bytes")["score"]
    out = []
    for run in best.itertuples():
        mine = requests[
            (requests.engine == run.engine)
            & (requests.method == run.method)
            & (requests.budget == run.budget)
            & (requests.kv_budget_bytes == run.kv_budget_bytes)
        ]
        met = ((mine.ttft_s <= ttft) & (mine.tpot_s.isna() | (mine.tpot_s <= tpot))).sum()  # one token: TPOT met
        share = met / len(mine) if len(mine) else math.nan
        drop = float(full.get(run.kv_budget_bytes, math.nan)) - float(run.score)
        fails = []
        if not share >= attainment:
            fails.append(f"SLO met by {share:.0%} < {attainment:.0%}")
        if drop > max_drop:
            fails.append(f"score drop {drop:.3g} > {max_drop:g}")
        out.append(
            {
                "engine": run.engine,
                "method": run.method,
                "budget": run.budget,
                "kv_budget_MB": run.kv_budget_bytes / 1e6,
                "slo_attainment": share,
                "goodput_req_s": met / run.duration_s if run.duration_s > 0 else math.nan,
                "tokens_s": run.throughput_tokens_s,
                "ttft_p99_s": run.ttft_p99_s,
                "tpot_p99_s": run.tpot_p99_s,
                "concurrency": int(run.max_concurrency),
                "score": run.score,
                "drop": drop,
                "fit": "meets" if not fails else "; ".join(fails),
            }
        )
    table = pd.DataFrame(out)
    table["meets"] = table.fit == "meets"
    table = table.sort_values(["meets", "goodput_req_s"], ascending=[False, False]).drop(columns="meets")
    return table.reset_index(drop=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvbench.guide.serving", description=__doc__.split("\n\n")[0])
    parser.add_argument("serving", type=Path, help="the output directory of python -m kvbench.serving")
    parser.add_argument("--kv-memory", type=float, required=True, help="bytes of KV memory the server has")
    parser.add_argument("--slo-ttft", type=float, help="seconds (default: the run's serving.slo_ttft_s)")
    parser.add_argument("--slo-tpot", type=float, help="seconds (default: the run's serving.slo_tpot_s)")
    parser.add_argument("--attainment", type=float, default=0.9, help="share of requests that must meet both SLOs")
    parser.add_argument("--max-drop", type=float, default=0.05, help="largest acceptable score loss vs full")
    args = parser.parse_args(argv)
    try:
        for key in ("kv_memory", "slo_ttft", "slo_tpot"):
            value = getattr(args, key)
            if value is not None and not value > 0:
                raise KvbenchError(f"--{key.replace('_', '-')}={value} must be > 0")
        if not 0 < args.attainment <= 1:
            raise KvbenchError(f"--attainment={args.attainment} must be in (0, 1]; use --attainment 0.9")
        requests, runs = load(args.serving)
        table = choose(
            requests, runs, int(args.kv_memory), args.slo_ttft, args.slo_tpot, args.attainment, args.max_drop
        )
    except KvbenchError as error:
        print(f"kvbench.guide.serving: error: {error}", file=sys.stderr)
        return 2
    print(table.to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
