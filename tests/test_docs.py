"""The README stays one screen and the docs stay about the code as it is: no links out of the repository, no
commit hashes, no narrative of past rounds, and every relative link resolves."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, ROOT / "CONTRIBUTING.md", *DOCS]
MAX_README_LINES = 320

FENCE = re.compile(r"^\s*(```|~~~)")
HEX = re.compile(r"\b[0-9a-f]{7,40}\b")
SHORT_HEX = re.compile(r"\b[0-9a-f]{7,12}\b")  # inside code blocks: digests and config hashes are 16+ digits
ROUND = re.compile(r"\bround[- ]?\d+\b|\b(this|previous|last|next|earlier) round\b|\bround-\d", re.IGNORECASE)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _split(text: str) -> tuple[list[str], list[str]]:
    """(prose lines, fenced code lines) of a Markdown page."""
    prose, code, fenced = [], [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        (code if fenced else prose).append(line)
    return prose, code


def _is_hash(token: str) -> bool:
    return any(c.isdigit() for c in token) and any(c.isalpha() for c in token)  # 1234567 and "defaced" are not


def commit_hashes(text: str) -> list[str]:
    """Commit-hash-like tokens: 7–40 hex digits mixing letters and digits in prose (inline code included, where
    file names like bf16_<sha>.txt would sit), 7–12 in code blocks (longer ones there are digests)."""
    prose, code = _split(text)
    found = [t for line in prose for t in HEX.findall(line.replace("_", " ")) if _is_hash(t)]
    found += [t for line in code for t in SHORT_HEX.findall(line.replace("_", " ")) if _is_hash(t)]
    return found


def test_the_checker_finds_hashes_and_spares_digests():
    sample = "Measured at main 1a2b3c4 (`decode/bf16_5e6f7a8.txt`).\n```\nconfig 0123456789abcdef\n```"
    assert commit_hashes(sample) == ["1a2b3c4", "5e6f7a8"]
    assert commit_hashes("a 7-digit value 4957714, a word like defaced, kv_bytes 0.25") == []
    assert commit_hashes("```\ngit worktree add /tmp/base c0ffee1\n```") == ["c0ffee1"]


def test_readme_is_one_screen():
    lines = README.read_text().count("\n")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; move reference text to docs/"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_links_outside_the_repository(page):
    assert "../shared" not in page.read_text(), f"{page.name} points outside the repository (../shared)"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_commit_hashes(page):
    assert commit_hashes(page.read_text()) == [], f"{page.name}: say what is true now, without commit hashes"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_round_narrative(page):
    rounds = [m.group(0) for m in ROUND.finditer(page.read_text())]
    assert rounds == [], f"{page.name}: no history of rounds in the docs: {rounds}"


def test_readme_links_every_docs_page_it_names_and_they_exist():
    linked = {m for m in LINK.findall(README.read_text()) if m.startswith("docs/")}
    assert linked, "README.md links no docs/ page"
    missing = sorted(m for m in linked if not (ROOT / m.split("#")[0]).is_file())
    assert missing == [], f"README.md links missing pages: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page):
    prose, _ = _split(page.read_text())
    targets = [m.split("#")[0] for line in prose for m in LINK.findall(line)]
    broken = [t for t in targets if t and "://" not in t and not (page.parent / t).exists()]
    assert broken == [], f"{page.name}: links to nothing: {broken}"


def test_every_top_level_key_is_in_the_command_line_contract():
    from kvbench.config.spec import TOP_LEVEL
    from kvbench.preflight.entrance import LAUNCHER

    cli = (ROOT / "docs" / "cli.md").read_text()
    # `grid` is documented by its two keys, the verdict thresholds as one row, launcher.name as `launcher=ray`
    keys = {"verdict.*" if key.startswith("verdict.") else key for key in [*TOP_LEVEL, *LAUNCHER]}
    missing = sorted(key for key in keys - {"grid", "launcher.name"} if f"`{key}`" not in cli)
    assert missing == [], f"docs/cli.md does not document {missing}"


def test_every_contract_column_is_in_the_results_page():
    from kvbench.store.results import COLUMNS

    results = (ROOT / "docs" / "results.md").read_text()
    assert [c for c in COLUMNS if f"`{c}`" not in results] == []


@pytest.mark.parametrize("kind,page", [("method", "methods.md"), ("task", "tasks.md")])
def test_every_method_and_task_is_listed(kind, page):
    names = sorted(p.stem for p in (ROOT / "conf" / kind).glob("*.yaml"))
    readme, reference = README.read_text(), (ROOT / "docs" / page).read_text()
    assert [n for n in names if f"`{n}`" not in readme] == [], f"README.md misses a {kind}"
    assert [n for n in names if f"`{n}`" not in reference] == [], f"docs/{page} misses a {kind}"
