"""Compress once vs per question (kvbench.report.sections.prefix.compare), on a synthetic rows frame: the table
`python -m kvbench.bench compare_reuse` prints (the README's "Prefix caching" tables) and the report section, one
function."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd

from kvbench.bench.compare_reuse import main
from kvbench.report.section import Context
from kvbench.report.sections.prefix import compare, compress_once

CONFIGS = [("full", {}, 1.0), ("snapkv", {}, 0.25), ("snapkv", {}, 0.5), ("kivi", {"bits": 2}, 1.0)]


def rows(reuse: str, cached: bool = True, run: str = "r1", shift: float = 0.0) -> pd.DataFrame:
    """5 requests per configuration and task: shared_doc (0/1 scores and a partial score), shared_doc_qa (F1)."""
    rng = np.random.default_rng(0 if reuse == "per_question" else 1)
    out = []
    for task in ("shared_doc", "shared_doc_qa"):
        for c, (method, params, budget) in enumerate(CONFIGS):
            for i in range(5):
                exact = task == "shared_doc"
                score = float(rng.integers(0, 2)) if exact else round(float(rng.uniform(0, 1)), 3)
                out.append(
                    {
                        "task": task,
                        "method": method,
                        "method_params": json.dumps(params),
                        "budget": budget,
                        "example_id": f"{task}-{i}",
                        "request_index": i,
                        "score": min(1.0, score + shift),
                        "score_partial": round(float(rng.uniform(0, 1)), 3) if exact else np.nan,
                        "held_bytes": (c + 1) * (i + 1) * 1_000_000 * (1 if reuse == "per_question" else 0.5),
                        "reuse": reuse,
                        "prefix_cache": cached or None,
                        "run_id": run,
                        "config_hash": f"{run}-{reuse}-{cached}-{task}-{c}",
                        "timestamp": pd.Timestamp("2026-11-30") + pd.Timedelta(seconds=c * 10 + i),
                    }
                )
    return pd.DataFrame(out)


# what the script printed for these rows before compare() moved into kvbench.report.sections.prefix (the README's format)
PRINTED = """
shared_doc
| method | budget | n | score per q. | score once | once better/worse | partial per q. / once | held MB per q. / once |
|---|---|---|---|---|---|---|---|
| kivi(bits=2) | – | 5 | 0.600 (0.23–0.88) | 0.600 (0.23–0.88) | 1/1 | 0.673 / 0.676 | 20.0 / 10.0 |
| snapkv | 0.5 | 5 | 0.200 (0.04–0.62) | 0.200 (0.04–0.62) | 1/1 | 0.505 / 0.407 | 15.0 / 7.5 |
| snapkv | 0.25 | 5 | 0.800 (0.38–0.96) | 0.400 (0.12–0.77) | 1/3 | 0.425 / 0.587 | 10.0 / 5.0 |
| full | – | 5 | 0.600 (0.23–0.88) | 0.600 (0.23–0.88) | 2/2 | 0.553 / 0.448 | 5.0 / 2.5 |

shared_doc_qa
| method | budget | n | score per q. | score once | once better/worse | held MB per q. / once |
|---|---|---|---|---|---|---|
| kivi(bits=2) | – | 5 | 0.531 (0.25–0.83) | 0.548 (0.34–0.73) | 3/2 | 20.0 / 10.0 |
| snapkv | 0.5 | 5 | 0.444 (0.35–0.54) | 0.637 (0.45–0.80) | 3/2 | 15.0 / 7.5 |
| snapkv | 0.25 | 5 | 0.595 (0.36–0.83) | 0.401 (0.14–0.67) | 1/4 | 10.0 / 5.0 |
| full | – | 5 | 0.492 (0.30–0.67) | 0.529 (0.31–0.68) | 3/2 | 5.0 / 2.5 |
"""


def runs(tmp_path) -> list[str]:
    return [f"bench.per_question={tmp_path / 'pq.parquet'}", f"bench.compress_once={tmp_path / 'once.parquet'}"]


def test_script_prints_the_paired_table(tmp_path, capsys):
    rows("per_question").to_parquet(tmp_path / "pq.parquet")
    rows("compress_once").to_parquet(tmp_path / "once.parquet")
    assert main(runs(tmp_path)) == 0
    assert capsys.readouterr().out == PRINTED


def test_script_ignores_runs_without_the_prefix_cache(tmp_path, capsys):
    # a run without the prefix cache writes reuse=per_question too: it must not be paired (n stays 5 per config)
    mixed = pd.concat([rows("per_question", cached=False, run="r0", shift=0.5), rows("per_question")])
    mixed.to_parquet(tmp_path / "pq.parquet")
    rows("compress_once").to_parquet(tmp_path / "once.parquet")
    assert main(runs(tmp_path)) == 0
    printed = capsys.readouterr().out
    assert sorted(printed.splitlines()) == sorted(PRINTED.splitlines())


def test_report_section_is_the_same_table(tmp_path):
    both = pd.concat([rows("per_question", cached=False, run="r0"), rows("per_question"), rows("compress_once")])
    both = both.assign(method=[m if m != "kivi" else "kivi(bits=2)" for m in both.method])  # the report's labels
    section = compress_once(both, pd.DataFrame(), Context(tmp_path))
    assert section is not None
    markdown = section.markdown.replace(" |  |", " |")  # one table: shared_doc_qa's partial cell is empty
    for line in PRINTED.splitlines():
        if line.startswith("| kivi") or line.startswith("| snapkv") or line.startswith("| full"):
            assert line.split(" | ", 1)[1] in markdown  # every printed row, after its task cell


def test_budget_less_configurations():
    pq, once = rows("per_question"), rows("compress_once")
    labels = {"full": "full", "snapkv": "compose(headmerge+kivi)", "kivi": "headmerge"}
    table = compare(*(r.assign(method=r.method.map(labels)) for r in (pq, once)))
    assert set(table.budget) == {"–"}
    table = compare(*(r.assign(method=r.method.replace("kivi", "compose(snapkv+kivi)")) for r in (pq, once)))
    assert set(table[table.method.str.startswith("compose")].budget) == {"1"}


def test_fewer_than_five_pairs_say_no_interval():
    pq, once = rows("per_question"), rows("compress_once")
    table = compare(pq[pq.request_index < 3], once[once.request_index < 3])
    assert set(table["n"]) == {3}
    assert table["score per q."].str.endswith(" (n<5: no interval)").all()
    assert not table["score once"].str.contains("nan").any()
