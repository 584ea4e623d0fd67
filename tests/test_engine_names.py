"""The adapter is the only door to an engine: outside kvbench/engines no module names a serving engine in its code
(a comment or a docstring may cite one). The run, the serving trace, the report and the config loop over the
registry and ask each engine's ServingEngine; an engine named anywhere else is a second door the next engine would have
to find (tests/engines/test_fake_engine.py adds one without touching a file of kvbench)."""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

from kvbench.engines import ENGINES

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvbench"
DOOR = PACKAGE / "engines"


def engine_words() -> list[str]:
    """Every registered engine's name and the label the report gives it, lower-cased (`vllm`, `llama.cpp`, ...)."""
    words = set()
    for name in ENGINES.names():
        words |= {name.lower(), (ENGINES.get(name).label or name).lower()}
    return sorted(words)


def docstrings(tree: ast.AST) -> set[tuple[int, int]]:
    """Where each docstring of the module, its classes and functions starts (line, column)."""
    starts = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            value = first.value if isinstance(first, ast.Expr) else None
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                starts.add((first.lineno, first.col_offset))
    return starts


def code_of(source: str) -> list[tuple[int, str]]:
    """(line, text) of every token of the source but its comments and docstrings."""
    skip = docstrings(ast.parse(source))
    return [
        (token.start[0], token.string)
        for token in tokenize.generate_tokens(io.StringIO(source).readline)
        if token.type != tokenize.COMMENT and not (token.type == tokenize.STRING and token.start in skip)
    ]


def named(source: str, words: list[str]) -> list[tuple[int, str, str]]:
    """(line, word, token) for each engine word in the source's code."""
    return [(line, w, text) for line, text in code_of(source) for w in words if w in text.lower()]


def test_the_check_reads_code_not_comments_or_docstrings():
    source = '"""Served by vLLM."""\n\n\ndef f():\n    """llama.cpp\'s too."""\n    return x  # openvino\n\n\n'
    source += 'y = "vllm"\n'
    assert named(source, ["vllm", "llama.cpp", "openvino"]) == [(9, "vllm", '"vllm"')]
    assert named("VllmEngine = 1\n", ["vllm"]) == [(1, "vllm", "VllmEngine")]  # identifiers too, any case


def test_no_module_outside_kvbench_engines_names_an_engine():
    words = engine_words()
    assert {"llamacpp", "llama.cpp", "vllm", "openvino"} <= set(words)  # the check knows what it looks for
    found = [
        f"{path.relative_to(ROOT)}:{line}: {word} ({text[:60]!r})"
        for path in sorted(PACKAGE.rglob("*.py"))
        if DOOR not in path.parents
        for line, word, text in named(path.read_text(), words)
    ]
    assert not found, "an engine named outside kvbench/engines (ask its ServingEngine instead):\n" + "\n".join(found)
