"""Function length, by source lines (def line to last line: docstring and comments included; a nested function counts
on its own and inside its parent).

kvbench/bench holds no function over LIMIT lines. Elsewhere in kvbench/ and methods/ the longest are listed, not
asserted: `python -m tests.test_function_length [-n 15] [folder ...]` prints the N longest, then how many functions
are over 50 and over 100 lines.
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 60
HELD = ("kvbench/bench",)  # folders whose every function stays within LIMIT


def functions(path: Path) -> list[tuple[int, str, int, str]]:
    """(lines, path, first line, qualified name) of every function defined in the file at `path`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{prefix}{child.name}"
                lines = (child.end_lineno or child.lineno) - child.lineno + 1
                out.append((lines, str(path.relative_to(ROOT)), child.lineno, name))
                visit(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")

    visit(tree, "")
    return out


def longest(folders: list[str]) -> list[tuple[int, str, int, str]]:
    """Every function under `folders` (relative to the repository), longest first."""
    found = [f for folder in folders for path in sorted((ROOT / folder).rglob("*.py")) for f in functions(path)]
    return sorted(found, key=lambda f: (-f[0], f[1], f[2]))


def test_no_function_in_the_benchmarks_is_over_the_limit():
    over = [f"{lines:4d}  {path}:{line}  {name}" for lines, path, line, name in longest(list(HELD)) if lines > LIMIT]
    assert not over, f"functions over {LIMIT} lines (split them):\n" + "\n".join(over)


def test_the_count_sees_the_house():
    found = longest(["kvbench", "methods"])
    assert len(found) > 1000 and any(name == "main" for _, path, _, name in found if path.endswith("__main__.py"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=15, help="how many to print")
    parser.add_argument("paths", nargs="*", default=["kvbench", "methods"], help="folders under the repository")
    args = parser.parse_args()
    found = longest(args.paths)
    for lines, path, line, name in found[: args.n]:
        print(f"{lines:5d}  {path}:{line}  {name}")
    over = [sum(f[0] > n for f in found) for n in (50, 100)]
    print(f"{len(found)} functions; {over[0]} over 50 lines, {over[1]} over 100")


if __name__ == "__main__":
    main()
