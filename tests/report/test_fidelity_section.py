"""kvbench.report.sections.fidelity: score vs KL per configuration, the p95 tail over examples, the plot."""

import pandas as pd

from kvbench.report.section import Context
from kvbench.report.sections.fidelity import fidelity_table, score_vs_kl


def _rows() -> pd.DataFrame:
    out = []
    for i in range(20):
        out.append(
            dict(
                model="m",
                task="niah",
                method="full",
                budget=1.0,
                query_aware=True,
                example_id=f"e{i}",
                score=1.0,
                kl_mean=0.0,
                kl_max=0.0,
                top1_agreement=1.0,
                length_vs_full=1.0,
            )
        )
        tail = 1.0 if i >= 17 else 0.01  # three examples of twenty diverge
        out.append(
            dict(
                model="m",
                task="niah",
                method="snapkv",
                budget=0.25,
                query_aware=True,
                example_id=f"e{i}",
                score=float(i % 2),
                kl_mean=tail,
                kl_max=2 * tail,
                top1_agreement=0.8,
                length_vs_full=1.5,
            )
        )
    out.append(
        dict(
            model="m",
            task="niah",
            method="kvpress",
            budget=0.5,
            query_aware=True,
            example_id="e0",
            score=1.0,
            kl_mean=float("nan"),
            kl_max=float("nan"),
            top1_agreement=float("nan"),
        )
    )
    return pd.DataFrame(out)  # fmt: skip


def test_table_has_the_mean_and_the_tail_per_configuration():
    table = fidelity_table(_rows()).set_index("method")
    assert list(table.index) == ["full", "snapkv"]  # rows without KL (a press) are left out
    snap = table.loc["snapkv"]
    assert snap["n"] == 20 and snap["score"] == 0.5 and snap["top1_agreement"] == 0.8
    assert abs(snap["kl_mean"] - (17 * 0.01 + 3) / 20) < 1e-12 and snap["kl_p95"] == 1.0
    assert abs(snap["kl_max"] - 2 * snap["kl_mean"]) < 1e-12 and snap["length_vs_full"] == 1.5
    assert table.loc["full", "kl_p95"] == 0 and table.loc["full", "top1_agreement"] == 1


def test_section_plots_score_vs_kl(tmp_path):
    section = score_vs_kl(_rows(), pd.DataFrame(), Context(out_dir=tmp_path))
    assert [f.name for f in section.files] == ["fidelity_m_niah.png"] and section.files[0].stat().st_size > 1000
    assert "| snapkv |" in section.markdown and "95th percentile" in section.html
    only_full = _rows().query("method == 'full'")
    assert score_vs_kl(only_full, pd.DataFrame(), Context(out_dir=tmp_path)) is None


def test_impossible_fidelity_values_are_shown_apart_not_averaged(tmp_path):
    """A KL below 0 or a top-1 agreement above 1 is a broken measurement: left out of the means, listed with why;
    a KL of -1e-9 is float rounding and counts."""
    rows = _rows()
    snap = rows.index[rows["method"] == "snapkv"]
    rows.loc[snap[0], "kl_mean"] = -0.5
    rows.loc[snap[1], "top1_agreement"] = 1.5
    rows.loc[snap[2], "kl_mean"] = -1e-9
    table = fidelity_table(rows).set_index("method")
    assert table.loc["snapkv", "n"] == 18 and table.loc["snapkv", "top1_agreement"] == 0.8
    assert table.loc["snapkv", "kl_mean"] >= 0
    section = score_vs_kl(rows, pd.DataFrame(), Context(out_dir=tmp_path))
    assert "2 rows with impossible fidelity values" in section.markdown
    assert (
        "kl_mean -0.5 outside [0, inf]" in section.markdown and "top1_agreement 1.5 outside [0, 1]" in section.markdown
    )
