"""Report sections for serving engines (rows of `engine=<a serving engine>`, kvbench.engines): every engine on
one compression-vs-quality plot (one marker per engine, one colour per option), the parity table (each engine's
uncompressed run against kvbench's full cache on the same token ids), what each engine offers for the model (its
options, bytes held per token, tokens that fit in a KV space), and the rows set apart as garbage (`engine_invalid`:
never averaged). Torch-free (the report must not import torch)."""

from __future__ import annotations

import html
import json
import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pandas as pd

from kvbench.report.plots import method_colours
from kvbench.report.section import Context, Section, report_section, save_figure
from kvbench.report.tables import small_table
from kvbench.store.aggregate import FULL, with_lengths
from kvbench.store.intervals import MIN_N, interval_text, mean_interval
from kvbench.tasks.facts import task_facts

SPACE = 1 << 30  # the KV space "fits" is counted in: 1 GiB


def marker(engine: str) -> str:
    """One marker per engine on the plot of every engine: kvbench's own "o", a serving engine's
    `ServingEngine.marker`."""
    from kvbench.engines import ENGINES

    if engine == "kvbench":
        return "o"
    return ENGINES.get(engine).marker if engine in ENGINES.names() else "P"  # rows of an engine not here: "P"


def baselines() -> str:
    """What each serving engine's kv_ratio is against, engines with the same baseline together
    (`ServingEngine.baseline`, named by `ServingEngine.label`), e.g. `A: f16; B and C: the model's dtype`."""
    from kvbench.engines import ENGINES, listed

    groups: dict[str, list[str]] = {}
    for name in listed():
        serving_engine = ENGINES.get(name)
        groups.setdefault(serving_engine.baseline, []).append(serving_engine.label or name)
    return "; ".join(f"{spoken(names)}: {what}" for what, names in groups.items())


def spoken(names: list[str]) -> str:
    """`a`, `a and b`, `a, b and c`."""
    return " and ".join(filter(None, [", ".join(names[:-1]), names[-1]]))


def engine_labels(rows: pd.DataFrame) -> pd.Series:
    """The rows' method labels, with ` @<engine>` after a serving engine's options when the rows hold several engines
    (kvbench's streamingllm and an engine's are different curves on every plot and table); `full` stays `full`,
    each engine's own baseline (the summary compares every option with its own engine's full run)."""
    if "engine" not in rows or rows["engine"].fillna("kvbench").nunique() < 2:
        return rows["method"]
    engine = rows["engine"].fillna("kvbench").astype(str)
    tagged = (engine != "kvbench") & (rows["method"] != FULL)
    return rows["method"].where(~tagged, rows["method"].astype(str) + " @" + engine)


def option_name(label: str) -> str:
    """An engine option's name from its label (`<option> @<engine>` -> `<option>`)."""
    return str(label).split(" @")[0]


def _extra(rows: pd.DataFrame) -> pd.Series:
    """engine_extra parsed ({} for kvbench's own rows, and for a value that is not a JSON object: a row written by
    another version is still a row)."""
    return rows["engine_extra"].map(_parsed)


def _parsed(value) -> dict:
    if not isinstance(value, str) or not value:
        return {}
    try:
        parsed = json.loads(value)
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def _invalid(rows: pd.DataFrame) -> pd.Series:
    if "engine_invalid" not in rows:
        return pd.Series(False, index=rows.index)
    return rows["engine_invalid"].fillna("").astype(str) != ""


def _label(method: str, budget: float, evicts: bool) -> str:
    return f"{method} {budget:g}" if evicts else method


def _evicts(part: pd.DataFrame) -> bool:
    return bool(part["budget"].nunique() > 1 or (part["budget"] < 1).any())


@report_section("Serving engines: quality vs bytes held, every engine", needs=["engine_extra"], where="plots")
def engines_plot(rows: pd.DataFrame, summary: pd.DataFrame, context: Context) -> Section | None:
    """One plot per (model, task): each configuration's mean score (95 % interval) at its mean kv_ratio, the ratio
    against its own engine's uncompressed cache; rows flagged `engine_invalid` drawn apart as grey crosses."""
    part = summary[(summary["level"] == "task") & summary["compared"].astype(bool)]
    if part.empty or part["engine"].nunique() < 1:
        return None
    colours = method_colours(part["method"])
    files = []
    for (model, task, length), scope in part.groupby(["model", "task", "length"], sort=True):  # lengths apart
        fig, ax = plt.subplots(figsize=(7.5, 4.2))
        for _, r in scope.iterrows():
            few = r["n"] < MIN_N
            colour = colours.get(r["method"], "#333333")
            ax.scatter(
                r["kv_ratio"],
                r["score"],
                marker=marker(str(r["engine"])),
                s=46,
                facecolors="none" if few else colour,
                edgecolors=colour,
            )
            if not few and not math.isnan(r["ci_low"]):
                ax.plot([r["kv_ratio"]] * 2, [r["ci_low"], r["ci_high"]], color=colour, lw=0.8, alpha=0.6)
            name = option_name(r["method"])  # the marker names the engine
            label = name if r["budget"] >= 1 else f"{name} {r['budget']:g}"
            ax.annotate(label, (r["kv_ratio"], r["score"]), fontsize=6, xytext=(3, 3), textcoords="offset points")
        apart = with_lengths(context.set_apart)
        flagged = apart[(apart["model"] == model) & (apart["task"] == task) & (apart["length"] == length)]
        for method, g in flagged.groupby("method"):
            ax.scatter(g["kv_ratio"].mean(), g["score"].mean(), marker="x", color="#999999", s=40)
            ax.annotate(f"{method} (garbage)", (g["kv_ratio"].mean(), g["score"].mean()), fontsize=6, color="#999999")
        for engine in sorted(set(scope["engine"])):
            ax.scatter([], [], marker=marker(engine), color="#333333", label=f"engine={engine}")
        if len(flagged):
            ax.scatter([], [], marker="x", color="#999999", label="flagged garbage: not averaged")
        ax.set(
            xlabel="kv_ratio (bytes held / the same engine's uncompressed cache)",
            ylabel="score",
            title=f"{model} · {task}{f' at {length:,} tokens' if length else ''}: every engine",
        )
        ax.legend(fontsize=7, loc="lower right")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        at = f"_{length}" if part.loc[part["task"] == task, "length"].nunique() > 1 else ""
        path = context.out_dir / f"engines_{model}_{task}{at}.png".replace("/", "_").replace(" ", "_")
        save_figure(fig, path)
        files.append(path)
    note = (
        "<p>One marker per engine, one colour per option. An engine's kv_ratio is against its own uncompressed "
        f"cache (kvbench: its full cache at the run's dtype; {baselines()}). "
        f"Hollow: fewer than {MIN_N} examples, no interval.</p>"
    )
    return Section(html=note, markdown=html.unescape(note.replace("<p>", "").replace("</p>", "")), files=files)


def paritysmall_table(rows: pd.DataFrame) -> pd.DataFrame:
    """Per engine, model, dtype and task: how many of the engine's uncompressed runs generated kvbench's full-cache
    tokens on the same ids, and where the others first diverged."""
    full = rows[(rows["method"] == FULL) & (rows["engine"] != "kvbench")]
    records = []
    keys = [k for k in ("engine", "engine_version", "model", "dtype", "task") if k in full]  # older rows lack some
    for key, g in full.groupby(keys, sort=True):
        # a parity block without its verdict (an older version's) says nothing: left out, not a crash
        parity = [p for e in _extra(g) if isinstance(p := e.get("parity"), dict) and "identical" in p]
        if not parity:
            continue
        steps = sorted(p["first_divergence"] for p in parity if not p["identical"] and "first_divergence" in p)
        compared = [p["compared"] for p in parity if isinstance(p.get("compared"), int)]
        records.append(
            {
                **dict(zip(keys, key)),
                "examples": len(parity),
                "identical tokens": f"{sum(bool(p['identical']) for p in parity)}/{len(parity)}",
                "first divergence (steps)": ", ".join(map(str, steps[:9])) + (" …" if len(steps) > 9 else "") or "–",
                "tokens compared": sum(compared) if compared else "–",
            }
        )
    return pd.DataFrame(records)


def _same_as_full(rows: pd.DataFrame) -> pd.Series:
    """Per row: whether its generated ids are its engine's uncompressed run's on the same example (None when that
    run is not among the rows)."""
    ids = _extra(rows).map(lambda e: e.get("token_ids"))
    keys = rows[["engine", "model", "dtype", "task", "example_id"]].astype(str).agg("\x1f".join, axis=1)
    full = {k: t for k, t, m in zip(keys, ids, rows["method"]) if m == FULL and t is not None}
    return pd.Series([full.get(k) == t if k in full else None for k, t in zip(keys, ids)], index=rows.index)


def offerssmall_table(rows: pd.DataFrame) -> pd.DataFrame:
    """Per engine, model and option: the engine's knobs, the bytes it held per token, the tokens that fit in 1 GiB
    of KV space at that rate, the score with its interval, and how often the option's tokens were the engine's
    uncompressed run's (an eviction option at a budget ≥ the prompt must be: 'no compression')."""
    engines = rows[rows["engine"] != "kvbench"]
    extra, same, bad = _extra(engines), _same_as_full(engines), _invalid(engines)
    records = []
    engines = engines.assign(method=engines["method"].map(option_name))
    for (engine, model, method, budget), g in engines.groupby(["engine", "model", "method", "budget"], sort=True):
        knobs = extra[g.index[0]].get("knobs", {})
        held = g["context_tokens"] + (g["new_tokens"] - 1).clip(lower=0)  # the last generated token is never written
        per_token = float((g["kv_bytes"] / held).mean())
        facts = task_facts(str(g["task"].iloc[0]))
        mean, low, high, _ = mean_interval(g["score"], facts.score_range)
        matched = same[g.index].dropna()
        records.append(
            {
                "engine": engine,
                "model": model,
                "option": _label(method, budget, budget < 1),
                "engine knobs": json.dumps(knobs, sort_keys=True) if knobs else "(its default cache)",
                "n": len(g),
                "score": f"{mean:.3f} [{interval_text(low, high)}]",
                "kv_ratio": float(g["kv_ratio"].mean()),
                "bytes/token": round(per_token),
                "tokens in 1 GiB": int(SPACE // per_token) if per_token > 0 else "–",
                "tokens = engine's full": f"{int(matched.sum())}/{len(matched)}" if len(matched) else "–",
                "valid": "no: " + str(g["engine_invalid"].iloc[0]) if bad[g.index].any() else "yes",
            }
        )
    return pd.DataFrame(records)


@report_section("Serving engines: parity and what each engine offers", needs=["engine_extra"], where="tables")
def engines_tables(rows: pd.DataFrame, summary: pd.DataFrame, context: Context) -> Section | None:
    everything = pd.concat([rows, context.set_apart], ignore_index=True)
    parity, offers = paritysmall_table(everything), offerssmall_table(everything)
    if parity.empty and offers.empty:
        return None
    html_parts, md_parts = [], []
    if len(parity):
        h, m = small_table(parity)
        lead = (
            "Parity: each engine's uncompressed run of an example against kvbench's full cache on the same token "
            "ids, both greedy at the run's dtype (first divergence: the first generated step whose tokens differ)."
        )
        html_parts += [f"<p>{html.escape(lead)}</p>", h]
        md_parts += [lead, "", m, ""]
    if len(offers):
        h, m = small_table(offers)
        lead = (
            "What each engine offers for this model: its options as run, with the engine's own knobs; bytes/token = "
            "bytes held over the tokens written; tokens in 1 GiB = a KV space of 1 GiB at that rate; tokens = "
            "engine's full: examples whose generated ids are the engine's uncompressed run's. Options marked not "
            "valid compute garbage on this engine: shown here, left out of every average (report, guide, gate)."
        )
        html_parts += [f"<p>{html.escape(lead)}</p>", h]
        md_parts += [lead, "", m]
    for line in not_run(everything):
        html_parts.append(f"<p>{html.escape(line)}</p>")
        md_parts += ["", line]
    return Section(html="\n".join(html_parts), markdown="\n".join(md_parts))


def not_run(rows: pd.DataFrame) -> list[str]:
    """Per engine in the rows: the options it offers (kvbench.engines) that these rows do not hold."""
    from kvbench.engines import ENGINES

    lines = []
    for engine in sorted(set(rows["engine"]) - {"kvbench"}):
        if engine not in ENGINES.names():
            continue
        serving_engine = ENGINES.get(engine)
        ran = set(rows.loc[rows["engine"] == engine, "method"].map(option_name))
        rest = [o for o in [*serving_engine.options, *serving_engine.applies] if o not in ran]
        if rest:
            lines.append(f"engine={engine} also offers (not in these rows): {', '.join(rest)}.")
    return lines
