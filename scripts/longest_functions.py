"""The N longest functions (and methods) of kvbench/ and methods/, by source lines (def line to last line).

    python scripts/longest_functions.py [-n 15] [paths ...]

Lines count the whole definition, docstring and comments included (ast's lineno to end_lineno); a nested function is
counted on its own and inside its parent. Prints `lines  path:line  qualified.name`, longest first, then the total
number of functions and how many are over 50 and 100 lines.
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=15, help="how many to print")
    parser.add_argument("paths", nargs="*", default=["kvbench", "methods"], help="folders under the repository")
    args = parser.parse_args()
    found = [f for folder in args.paths for path in sorted((ROOT / folder).rglob("*.py")) for f in functions(path)]
    found.sort(key=lambda f: (-f[0], f[1], f[2]))
    for lines, path, line, name in found[: args.n]:
        print(f"{lines:5d}  {path}:{line}  {name}")
    over = [sum(f[0] > n for f in found) for n in (50, 100)]
    print(f"{len(found)} functions; {over[0]} over 50 lines, {over[1]} over 100")


if __name__ == "__main__":
    main()
