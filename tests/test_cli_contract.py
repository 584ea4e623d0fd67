"""docs/cli.md is the whole command-line contract, derived from the tree so it cannot drift: every entry point (each
`kvbench/**/__main__.py`, and each module that runs as `__main__`), the exit codes each one declares in its
docstring (`Exit codes: N what; N what; ...`, which the codes in its source must not exceed), every model and
experiment preset, every engine and every config group."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvbench"
CLI = (ROOT / "docs" / "cli.md").read_text()


@dataclass(frozen=True)
class EntryPoint:
    module: str  # what `python -m` takes
    path: Path  # the file that runs as __main__

    @property
    def internal(self) -> bool:
        """An engine's worker: started by kvbench in the engine's venv, not by a user."""
        return self.module.endswith("_worker")


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _runs_as_main(tree: ast.Module) -> bool:
    """`if __name__ == "__main__":` at the top level."""
    for node in tree.body:
        test = node.test if isinstance(node, ast.If) else None
        if (
            isinstance(test, ast.Compare)
            and isinstance(test.left, ast.Name)
            and test.left.id == "__name__"
            and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in test.comparators)
        ):
            return True
    return False


def entry_points() -> list[EntryPoint]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if path.name == "__main__.py":
            found.append(EntryPoint(".".join(parts[:-1]), path))
        elif path.name != "__init__.py" and _runs_as_main(_tree(path)):
            found.append(EntryPoint(".".join(parts), path))
    return found


ENTRY_POINTS = entry_points()
COMMANDS = [e for e in ENTRY_POINTS if not e.internal]


def _strip_parentheses(text: str) -> str:
    while True:
        stripped = re.sub(r"\([^()]*\)", "", text)
        if stripped == text:
            return text
        text = stripped


def declared_codes(entry: EntryPoint) -> set[int]:
    """The codes after `Exit codes:` in the module's docstring: clauses separated by `;`, each opening with its code
    (or codes, `130/143/129`); what is in parentheses is a clause's own."""
    doc = ast.get_docstring(_tree(entry.path)) or ""
    assert "Exit codes:" in doc, f"{entry.path.relative_to(ROOT)}: the docstring has no `Exit codes: N what; ...`"
    text = doc.split("Exit codes:", 1)[1].split("\n\n")[0]
    codes: set[int] = set()
    for clause in _strip_parentheses(" ".join(text.split())).split(";"):
        opening = re.match(r"\s*(\d+(?:/\d+)*)\s", clause)
        assert opening, f"{entry.path.relative_to(ROOT)}: an Exit codes clause opens without its code: {clause!r}"
        codes |= {int(c) for c in opening.group(1).split("/")}
    return codes


def _literal_ints(node: ast.AST | None) -> set[int]:
    """The integer an exit or return gives, where it is written as one (`2`, `0 if ok else 1`)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return {node.value}
    if isinstance(node, ast.IfExp):
        return _literal_ints(node.body) | _literal_ints(node.orelse)
    if isinstance(node, ast.BinOp) and isinstance(node.left, ast.Constant) and node.left.value == 128:
        return {130}  # 128 + signum: a signal's exit, ctrl-C's at least
    return set()


def _is_exit(call: ast.AST) -> bool:
    return (
        isinstance(call, ast.Call)
        and isinstance(call.func, ast.Attribute)
        and call.func.attr == "exit"
        and isinstance(call.func.value, ast.Name)
        and call.func.value.id == "sys"
    )


def _is_hydra_main(function: ast.FunctionDef) -> bool:
    return any(
        isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute) and d.func.attr == "main"
        for d in function.decorator_list
    )


def code_facts(entry: EntryPoint) -> tuple[set[int], bool]:
    """The exit codes written as literals where the entry point exits (any `sys.exit(N)` in its file, `return N` in
    the `main`/`_main` it runs, its own or imported), and whether that is a Hydra app (Hydra's own errors exit 1)."""
    sources = [(entry.path, None)]
    for node in ast.walk(_tree(entry.path)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvbench"):
            names = {a.name for a in node.names} & {"main", "_main"}
            if names:
                sources.append((ROOT / Path(*node.module.split(".")).with_suffix(".py"), names))
    codes, hydra = set(), False
    for path, names in sources:
        tree = _tree(path)
        functions = [
            n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name in (names or {"main", "_main"})
        ]
        scopes: list[ast.AST] = functions if names else [tree]
        for scope in scopes:
            for node in ast.walk(scope):
                if _is_exit(node) and node.args:  # type: ignore[union-attr]
                    codes |= _literal_ints(node.args[0])  # type: ignore[union-attr]
        for function in functions:
            hydra |= _is_hydra_main(function)
            for node in ast.walk(function):
                if isinstance(node, ast.Return):
                    codes |= _literal_ints(node.value)
    return codes, hydra


def section(title: str, text: str = CLI) -> str:
    """A `## title` or `### title` section, up to the next heading."""
    match = re.search(rf"^#+ {re.escape(title)}\n(.*?)(?=^#)", text + "\n#", re.MULTILINE | re.DOTALL)
    assert match, f"docs/cli.md has no section {title!r}"
    return match.group(1)


def table(text: str) -> list[list[str]]:
    """The rows of the first Markdown table in `text` (header first, the rule left out)."""
    rows = []
    for line in text.splitlines():
        if line.startswith("|") and not re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", line.strip()):
            rows.append([c.strip() for c in line.strip().strip("|").replace("\\|", "¦").split("|")])
    return rows


def _mentions(text: str, module: str) -> bool:
    return re.search(rf"`python -m\s+{re.escape(module)}[\s`]", text) is not None


def test_the_tree_has_the_entry_points_this_test_knows_how_to_read():
    modules = {e.module for e in ENTRY_POINTS}
    assert {"kvbench", "kvbench.bench", "kvbench.check", "kvbench.serving", "kvbench.serving.prefix"} <= modules
    assert [e.module for e in ENTRY_POINTS if e.internal], "no engine worker found"


@pytest.mark.parametrize("entry", ENTRY_POINTS, ids=lambda e: e.module)
def test_every_entry_point_is_on_the_page(entry):
    where = CLI if entry.internal else section("Entry points")
    assert _mentions(where, entry.module), f"docs/cli.md's Entry points do not name `python -m {entry.module}`"


def test_the_benchmarks_are_listed_by_their_own_help():
    assert "`python -m kvbench.bench --help`" in section("Entry points")


@pytest.mark.parametrize("entry", COMMANDS, ids=lambda e: e.module)
def test_the_docstring_declares_every_exit_code_the_code_uses(entry):
    declared = declared_codes(entry)
    used, hydra = code_facts(entry)
    assert 0 in declared and 2 in declared, f"{entry.module}: every command exits 0 when done and 2 on bad input"
    assert used <= declared, f"{entry.module} exits with {sorted(used - declared)} its docstring does not declare"
    assert not hydra or 1 in declared, f"{entry.module} is a Hydra app: Hydra's own errors exit 1; declare it"


@pytest.mark.parametrize("entry", COMMANDS, ids=lambda e: e.module)
def test_every_exit_code_is_in_the_table(entry):
    """One row per command; a cell under each code it declares, none under a code it does not."""
    header, *rows = table(section("Exit codes"))
    columns = [{int(c) for c in re.findall(r"\d+", cell)} for cell in header[1:]]
    mine = [r for r in rows if re.search(rf"`python -m {re.escape(entry.module)}`", r[0])]
    assert len(mine) == 1, f"docs/cli.md's exit-code table needs one row for `python -m {entry.module}`"
    declared = declared_codes(entry)
    assert declared <= set().union(*columns), f"{entry.module}: add a column for {declared - set().union(*columns)}"
    for codes, cell in zip(columns, mine[0][1:], strict=True):
        assert bool(cell) == bool(codes & declared), f"{entry.module}: the {sorted(codes)} cell says {cell!r}"
        if len(codes) > 1 and cell:  # a column of several codes names those the command uses
            named = {int(c) for c in re.findall(r"\b\d{3}\b", cell)}
            assert named & codes == codes & declared, f"{entry.module}: the {sorted(codes)} cell names {named}"


@pytest.mark.parametrize(
    ("group", "title"), [("model", "Models"), ("experiment", "Experiments"), ("engine", "Engines")]
)
def test_every_preset_has_its_row(group, title):
    rows = table(section(title))[1:]
    firsts = {re.sub(r"`([^`]+)`.*", r"\1", r[0]) for r in rows}
    names = {p.stem for p in (ROOT / "conf" / group).glob("*.yaml")}
    assert sorted(names - firsts) == [], f"docs/cli.md's {title} table lacks {sorted(names - firsts)}"
    assert sorted(firsts - names) == [], f"docs/cli.md's {title} table names presets conf/{group}/ lacks"


def test_every_engine_row_names_its_make_target():
    from kvbench.engines import ENGINES

    rows = {re.sub(r"`([^`]+)`.*", r"\1", r[0]): r for r in table(section("Engines"))[1:]}
    for name in ENGINES.names():
        target = ENGINES.get(name).make_target
        assert f"`make {target}`" in rows[name], f"docs/cli.md's Engines row of {name} does not say `make {target}`"


def test_every_config_group_is_listed():
    groups = {p.relative_to(ROOT / "conf").as_posix() for p in (ROOT / "conf").rglob("*") if any(p.glob("*.yaml"))}
    firsts = {r[0].strip("`") for r in table(section("Config groups"))[1:]}
    assert sorted(groups - firsts) == [], f"docs/cli.md's Config groups table lacks {sorted(groups - firsts)}"
