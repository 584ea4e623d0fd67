"""Report sections contributed by other modules, so a feature shows its columns without editing report.py.

How to add a section (e.g. prefix caching, diagnostics, the planner, the selection guide):

1. Write a torch-free module `kvbench/report/sections/<name>.py` and add its name to the import in that
   package's `__init__.py` (the order there is the order on the page;
   `python -m kvbench.report` must not import torch or transformers — tests/report/test_report.py checks it).
2. In it, register one function per section:

       from kvbench.report.section import Section, report_section

       @report_section("Prefix reuse", needs=["reused_tokens"], where="tables")
       def prefix_reuse(rows, summary, context):
           table = rows.groupby("method")["reused_tokens"].mean()
           return Section(html=table.to_frame().to_html(), markdown=table.to_markdown())

   - `needs`: row columns the section reads; it runs only when every one is present with at least one value.
   - `where`: "summary" (the takeaways at the top, after the headline plots: e.g. the selection guide's
     verdict), "plots" or "tables" (the default; after the per-task tables).
   - arguments: `rows` (pandas DataFrame, one row per example × configuration as loaded from the store, with
     `method` already the variant label such as `kivi(bits=2)`), `summary` (aggregate.summarize's frame:
     levels subset/task/overall, `compared` marks the configurations pooled on common examples) and `context`
     (a `Context`: `out_dir`, the report's directory — write PNGs there and list them in `files`; `inputs`, the
     report's store directories or row files — a section reading files written beside the store looks there).
   - return a `Section` or None (nothing to show). `html` is a fragment: escape your own text
     (`html.escape`); `files` are PNGs the report embeds after the fragment (data URIs) and links in report.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

PLACES = ("summary", "plots", "tables")


@dataclass
class Section:
    html: str = ""
    markdown: str = ""
    files: list[Path] = field(default_factory=list)
    title: str = ""  # filled from the registration when empty


@dataclass(frozen=True)
class Context:
    """What a section gets besides the rows and the summary, given by build_report."""

    out_dir: Path  # the report's directory: a section's PNGs go there
    inputs: tuple[Path, ...] = ()  # the report's store directories or row files, as given on its command line
    set_apart: pd.DataFrame = field(default_factory=pd.DataFrame)  # rows left out of every average (a serving
    # engine's option known to compute garbage: `engine_invalid`), for the sections that show them apart


def save_figure(fig, path: Path, tight: bool = False) -> Path:
    """Write a section's figure as a PNG into the report's directory and free it; its path for `Section.files`."""
    import matplotlib.pyplot as plt  # here: importing a section's module stays free of matplotlib

    fig.savefig(path, dpi=110, **({"bbox_inches": "tight"} if tight else {}))
    plt.close(fig)
    return path


@dataclass
class _Entry:
    title: str
    needs: tuple[str, ...]
    where: str
    build: Callable[[pd.DataFrame, pd.DataFrame, Context], Section | None]


SECTIONS: list[_Entry] = []


def report_section(title: str, needs: list[str] | tuple[str, ...] = (), where: str = "tables"):
    """Decorator: register `build(rows, summary, context) -> Section | None` (see the module docstring)."""
    if where not in PLACES:
        raise ValueError(f"report_section {title!r}: where must be one of {', '.join(PLACES)}, got {where!r}")

    def wrap(build):
        SECTIONS.append(_Entry(title, tuple(needs), where, build))
        return build

    return wrap


def build_sections(rows: pd.DataFrame, summary: pd.DataFrame, context: Context, where: str) -> list[Section]:
    """The sections for one place of the report whose columns are present, in registration order."""
    out = []
    for entry in SECTIONS:
        if entry.where != where:
            continue
        if not all(c in rows.columns and rows[c].notna().any() for c in entry.needs):
            continue
        section = entry.build(rows, summary, context)
        if section is not None:
            section.title = section.title or entry.title
            out.append(section)
    return out
