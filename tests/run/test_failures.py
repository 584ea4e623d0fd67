"""A configuration that fails while running loses only its own rows: the others are written, the failure is named,
the run exits 1 (not 2: the input was good)."""

from __future__ import annotations

import pandas as pd
import pytest

from kvbench import ConfigurationsFailed
from kvbench.run.runner import run
from tests.conftest import compose_config, tiny_overrides


def test_one_failing_method_keeps_the_rows_of_the_others(tmp_path, monkeypatch):
    from kvbench.methods.h2o import H2O

    def broken(self, *args, **kwargs):
        raise RuntimeError("shape mismatch in a kernel\nsecond line of a long traceback")

    monkeypatch.setattr(H2O, "begin", broken)  # its compression of every example
    cfg = compose_config(*tiny_overrides(tmp_path, "grid.method=[snapkv,h2o,streamingllm]", "grid.budget=[0.5]"))
    with pytest.raises(ConfigurationsFailed) as failed:
        run(cfg, tmp_path / "out")
    message = str(failed.value)
    assert "1 configuration(s) failed" in message and "h2o" in message and "RuntimeError: shape mismatch" in message
    assert "second line" not in message  # one line per failure
    assert failed.value.exit_code == 1
    rows = pd.read_parquet(tmp_path / "out" / "rows.parquet")
    assert sorted(rows.method.unique()) == ["full", "snapkv", "streamingllm"]
    assert len(rows) == 3 * 4  # 4 examples each: nothing else lost
    # a rerun computes only what is missing: the h2o rows, once the method works again
    monkeypatch.undo()
    again = run(
        compose_config(*tiny_overrides(tmp_path, "grid.method=[snapkv,h2o,streamingllm]", "grid.budget=[0.5]")),
        tmp_path / "out2",
    )
    assert (~again[again.method != "h2o"].reused).sum() == 0 and (~again[again.method == "h2o"].reused).all()


def test_every_configuration_failing_ends_with_the_list_of_failures(tmp_path, monkeypatch):
    from kvbench.native.engine import Engine

    def broken(self, *args, **kwargs):
        raise RuntimeError("out of memory in a kernel")

    monkeypatch.setattr(Engine, "compressed", broken)  # the baseline and every method fail
    cfg = compose_config(*tiny_overrides(tmp_path, "grid.method=[snapkv,h2o]", "grid.budget=[0.5]"))
    with pytest.raises(ConfigurationsFailed) as failed:  # before: a KeyError traceback hid the failures
        run(cfg, tmp_path / "out")
    message = str(failed.value)
    assert message.startswith("every configuration failed (3); no row was computed, nothing was written:")
    assert all(name in message for name in ("full", "snapkv", "h2o")) and "RuntimeError: out of memory" in message
    assert failed.value.exit_code == 1
    assert not (tmp_path / "out" / "rows.parquet").exists()
