"""kvbench.config.spec.RunSpec: the run's settings typed once, with conf/config.yaml's defaults."""

from dataclasses import fields
from pathlib import Path

from omegaconf import OmegaConf

from kvbench import conf_dir
from kvbench.config.spec import RunSpec
from tests.conftest import compose_config

SECTIONS = {"defaults", "model", "method", "task", "launcher", "grid", "budget", "hydra"}  # read by their builders


def test_the_spec_has_every_top_level_setting_with_the_configs_default():
    written = OmegaConf.load(conf_dir() / "config.yaml")
    names = {f.name for f in fields(RunSpec)}
    assert set(written) - SECTIONS <= names, set(written) - SECTIONS - names
    spec, default = RunSpec.of(compose_config()), RunSpec()
    for name in names - {"model", "task", "verdict", "grid_padding"}:
        assert getattr(spec, name) == getattr(default, name), name
    assert spec.grid_padding == 2.0 and spec.task_name == "niah" and spec.verdict["recall_high"] == 0.9


def test_values_are_typed_once():
    spec = RunSpec.of(
        compose_config("limit=3", "prefill=inline", "prefill_chunk=64", "batch_size=2", "results_dir=/tmp/x")
    )
    assert (spec.limit, spec.prefill, spec.prefill_chunk, spec.batch_size) == (3, "inline", 64, 2)
    assert spec.results_dir == Path("/tmp/x") and RunSpec.of(spec) is spec
    launched = compose_config("launcher=ray", "+launcher.shard=1", "+launcher.n_shards=4", "+launcher.attempt=ab12")
    assert RunSpec.of(launched).shard == (1, 4) and RunSpec.of(launched).attempt == "ab12"
