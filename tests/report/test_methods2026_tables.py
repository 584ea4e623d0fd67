"""`python -m kvbench.bench methods2026` (docs/methods.md's tables of the 2026 methods): cells on each model's common
examples, the configuration names, and one line naming the fix when the store has no such rows."""

import json

import pandas as pd

from kvbench.bench.__main__ import main
from kvbench.bench.methods2026 import cells, configuration
from kvbench.store.aggregate import method_yaml


def rows(model, method, params, budget, scores, kl=None):
    n = len(scores)
    return pd.DataFrame(
        {
            "model": model,
            "method": method,
            "method_params": json.dumps(params),
            "budget": budget,
            "example_id": [f"e{i}" for i in range(n)],
            "score": scores,
            "kv_ratio": 0.25 if budget < 1 else 1.0,
            "kv_bytes": 2**20,
            "kl_mean": kl if kl is not None else [float("nan")] * n,
            "top1_agreement": 1.0,
        }
    )


def test_cells_cover_each_models_common_examples():
    frame = pd.concat(
        [
            rows("smollm2-135m", "full", {}, 1.0, [1.0] * 6),
            rows("smollm2-135m", "snapkv", method_yaml("snapkv"), 0.25, [1.0, 0.0, 1.0, 1.0, 0.0], [0.1] * 5),
            rows("smollm2-135m", "kivi", {"bits": 2}, 1.0, [0.0] * 6, [0.5] * 6),
        ],
        ignore_index=True,
    )
    frame = frame.assign(configuration=configuration(frame))
    assert sorted(set(frame["configuration"])) == ["full", "kivi(bits=2)", "snapkv 0.25"]
    found = cells(frame)
    full = found[("smollm2-135m", "full")]
    assert full[0].startswith("1.00 [") and full[0].endswith("(n=5)")  # e5: snapkv has no row of it
    assert found[("smollm2-135m", "snapkv 0.25")][0].startswith("0.60 [")
    assert found[("smollm2-135m", "snapkv 0.25")][2] == "0.1000 / 0.1000 / 1.00"
    assert found[("smollm2-135m", "full")][2] == "0.0000 / 0.0000 / 1.00"  # the full rows' own: KL 0
    assert found[("smollm2-135m", "kivi(bits=2)")][1] == "1.000 · 1.0"


def test_a_store_without_the_rows_is_one_line_exit_2(tmp_path, capsys):
    assert main(["methods2026", "bench.task=ruler", f"bench.store={tmp_path / 'none'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no such file" in err
