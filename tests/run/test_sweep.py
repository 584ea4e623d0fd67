"""Shared-prefill grids give the same rows as running each configuration alone."""

import pytest

from kvbench.run.runner import run
from kvbench.store.results import read_rows
from tests.conftest import compose_config, tiny_overrides

SAME = ["prediction", "score", "kv_bytes", "kv_bytes_full", "new_tokens", "context_tokens"]
GRID_METHODS = ["snapkv", "h2o", "streamingllm", "pyramidkv", "random"]


def _rows(rows):
    return rows.sort_values(["method", "budget", "example_id"]).reset_index(drop=True)


@pytest.mark.slow
@pytest.mark.parametrize("query_aware", [True, False])
def test_grid_equals_one_by_one(tmp_path, query_aware):
    extra = [f"query_aware={query_aware}", "task.max_new_tokens=5"]
    grid = run(
        compose_config(
            *tiny_overrides(tmp_path / "g", f"grid.method=[{','.join(GRID_METHODS)}]", "grid.budget=[0.1,0.3]", *extra)
        ),
        output_dir=tmp_path / "g" / "out",
    )
    assert len(grid) == 4 * (1 + len(GRID_METHODS) * 2)
    singles = []
    for name in GRID_METHODS:
        for budget in (0.1, 0.3):
            singles.append(
                run(
                    compose_config(
                        *tiny_overrides(tmp_path / f"{name}{budget}", f"method={name}", f"budget={budget}", *extra)
                    ),
                    output_dir=tmp_path / "s" / f"{name}{budget}",
                )
            )
    import pandas as pd

    one_by_one = pd.concat(singles).drop_duplicates(["method", "budget", "example_id"])
    a, b = _rows(grid), _rows(one_by_one)
    assert list(zip(a.method, a.budget, a.example_id)) == list(zip(b.method, b.budget, b.example_id))
    pd.testing.assert_frame_equal(a[SAME], b[SAME])
    assert (a.config_hash == b.config_hash).all()  # so a grid run and single runs share the store


def test_grid_prefills_once_per_example(tmp_path, monkeypatch):
    import kvbench.run.runner as runner

    calls = []
    real = runner.Engine.prefill
    monkeypatch.setattr(runner.Engine, "prefill", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    run(
        compose_config(*tiny_overrides(tmp_path, "grid.method=[snapkv,h2o,streamingllm]", "grid.budget=[0.2,0.5]")),
        output_dir=tmp_path / "out",
    )
    assert len(calls) == 4  # 4 examples, 7 configurations each
    assert len(read_rows(tmp_path / "store")) == 4 * 7


def test_grid_entries_with_parameters(tmp_path):
    cfg = compose_config(
        *tiny_overrides(
            tmp_path,
            "task.context_lengths=[700]",
            "task.depths=[0.5]",
            "grid.method=[{name: streamingllm, start_size: 8},streamingllm,{name: headmerge, kv_heads: 1}]",
            "grid.budget=[0.5]",
        )
    )
    rows = run(cfg, output_dir=tmp_path / "out")
    assert sorted(rows.method_params.map(lambda p: p.replace(" ", ""))) == sorted(
        [
            "{}",
            '{"evict_during_decode":true,"evict_every":1,"positions":"absolute","ring":false,"start_size":4}',
            '{"evict_during_decode":true,"evict_every":1,"positions":"absolute","ring":false,"start_size":8}',
            '{"kv_heads":1}',
        ]
    )
    merged = rows[rows.method == "headmerge"].iloc[0]
    assert merged.budget == 1.0 and merged.kv_ratio == pytest.approx(0.5, abs=0.01)
