"""kvbench's measured RULER leaderboard against kvpress's published one, per method pair: the same order or not.

    python -m kvbench.bench leaderboard_vs_kvpress [bench.ours=results/leaderboard/report/leaderboard.csv]
                                                   [bench.pairs=true]

kvpress's numbers: `bench.theirs` (results/leaderboard/kvpress_published.csv: RULER 4K, Llama-3.1-8B-Instruct and
Qwen3-8B, the scores of its leaderboard; docs/leaderboard.md names the source). Prints, per our model × their model ×
compression ratio, how many pairs agree, disagree or tie, and among the pairs our 95 % intervals separate
(`bench.pairs=true`: every pair), as Markdown. Reads CSVs only (no model).
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from kvbench import KvbenchError
from kvbench.bench.common import tool_options

OPTIONS = {
    "ours": "results/leaderboard/report/leaderboard.csv",
    "theirs": "results/leaderboard/kvpress_published.csv",
    "pairs": False,
}


def read(path: str) -> pd.DataFrame:
    if not Path(path).is_file():
        raise KvbenchError(f"{path}: no such file (run from the repository root, or give bench.ours= / bench.theirs=)")
    return pd.read_csv(path)


def print_pairs(details: list) -> None:
    for model, board_model, pairs in details:
        print(
            f"\n{model} vs {board_model}\n\n| ratio | pair | ours | kvpress | order | ours apart |\n"
            "|---|---|---|---|---|---|"
        )
        for r in pairs.itertuples():
            print(
                f"| {r.ratio:g} | {r.a} – {r.b} | {r.ours_a:.1f} – {r.ours_b:.1f} | "
                f"{r.theirs_a:.1f} – {r.theirs_b:.1f} | {r.verdict} | {'yes' if r.apart else ''} |"
            )


def main(overrides: list[str]) -> None:
    from kvbench.report.sections.leaderboard import pair_agreement

    opts = tool_options(overrides, OPTIONS, "leaderboard_vs_kvpress")
    ours, theirs = read(str(opts["ours"])), read(str(opts["theirs"]))
    ours = ours[ours["engine"] == "kvbench"]
    if "length" in ours:  # kvpress's board is RULER at 4K: other lengths are not its lines
        ours = ours[ours["length"].isin([0, 4096])]
    print("| our model | kvpress's model | ratio | pairs | same order | opposite | tie | ours apart: same / opposite |")
    print("|---|---|---|---|---|---|---|---|")
    details = []
    for model, mine in ours.groupby("model"):
        for board_model, board in theirs.groupby("model"):
            pairs = pair_agreement(mine, board)
            for ratio, part in pairs.groupby("ratio") if len(pairs) else ():
                n, apart = part["verdict"].value_counts(), part[part["apart"]]["verdict"].value_counts()
                print(
                    f"| {model} | {board_model} | {ratio:g} | {len(part)} | {n.get('same', 0)} | "
                    f"{n.get('opposite', 0)} | {n.get('tie', 0)} | "
                    f"{apart.get('same', 0)} / {apart.get('opposite', 0)} |"
                )
            details.append((model, board_model, pairs))
    if opts["pairs"]:
        print_pairs(details)
