"""Print the architecture matrix as a Markdown table: which registered method runs on which model family
(tests/model/families.py), from the refusal rules kvbench checks before a model loads (kvbench/run/support.py).
A ✓ pair is run by tests/model/test_architectures.py (budget 1.0 = the full cache, bytes = the accounting).

    python scripts/architecture_matrix.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvbench.run.support import refusal  # noqa: E402
from kvbench.methods import METHODS, build_method, method_defaults  # noqa: E402
from kvbench.model.layout import cache_layout  # noqa: E402
from tests.model.families import FAMILIES  # noqa: E402
from tests.model.test_architectures import KNOBS  # noqa: E402


def main() -> None:
    names = METHODS.names()
    print("| family | cache layers | " + " | ".join(names) + " |")
    print("|---|---|" + "---|" * len(names))
    for family in sorted(FAMILIES):
        config = FAMILIES[family]()
        layout = cache_layout(config, torch.float32)
        kinds = layout.kinds
        layers = ", ".join(f"{kinds.count(k)} {k}" for k in dict.fromkeys(kinds))
        layers += f", {len(layout.states)} state" if layout.states else ""  # a hybrid's linear/Mamba/conv layers
        cells = []
        for name in names:
            method = build_method(name, {**method_defaults(name), **KNOBS.get(name, {})})
            cells.append("✓" if refusal(method, config) is None else "–")
        print(f"| {family} | {layers} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
