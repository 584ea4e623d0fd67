"""docs/models.md's architecture matrix is what the refusal rules say: which registered method runs on which model
family (tests/model/families.py), from the checks kvbench makes before a model loads (kvbench/preflight/support.py). A ✓
pair is run by tests/model/test_architectures.py (budget 1.0 = the full cache, bytes = the accounting).

Regenerate the table (it prints Markdown): `python -m tests.model.test_architecture_matrix`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import cache_utils

from kvbench.methods import METHODS, build_method, method_defaults
from kvbench.model.layout import cache_layout
from kvbench.preflight.support import refusal
from tests.model.families import FAMILIES
from tests.model.test_architectures import KNOBS

DOC = Path(__file__).resolve().parents[2] / "docs" / "models.md"
# the matrix holds the hybrid families, which transformers 5.2 (kvpress's venv) cannot build
pytestmark = pytest.mark.skipif(not hasattr(cache_utils, "LinearAttentionLayer"), reason="an older transformers")


def markdown() -> str:
    """The matrix as a Markdown table: a row per family (its cache layers), a column per registered method."""
    names = METHODS.names()
    lines = ["| family | cache layers | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    methods = [build_method(name, {**method_defaults(name), **KNOBS.get(name, {})}) for name in names]
    for family in sorted(FAMILIES):
        config = FAMILIES[family]()
        layout = cache_layout(config, torch.float32)
        kinds = layout.kinds
        layers = ", ".join(f"{kinds.count(k)} {k}" for k in dict.fromkeys(kinds))
        layers += f", {len(layout.states)} state" if layout.states else ""  # a hybrid's linear/Mamba/conv layers
        cells = ["✓" if refusal(method, config) is None else "–" for method in methods]
        lines.append(f"| {family} | {layers} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def test_the_docs_matrix_is_the_refusal_rules():
    table = markdown()
    assert table in DOC.read_text(), (
        "docs/models.md's architecture matrix is stale: paste `python -m tests.model.test_architecture_matrix`"
    )


if __name__ == "__main__":
    print(markdown())
