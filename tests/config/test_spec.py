"""kvbench.config.spec.RunSpec: the run's settings typed once, with conf/config.yaml's defaults."""

from dataclasses import fields
from pathlib import Path

from omegaconf import OmegaConf

from kvbench import conf_dir
from kvbench.config.spec import RunSpec
from tests.conftest import compose_config

SECTIONS = {"defaults", "launcher", "hydra"}  # Hydra's, and the launcher group (its own rules)


def test_the_spec_has_every_top_level_setting_with_the_configs_default():
    written = OmegaConf.load(conf_dir() / "config.yaml")
    names = {f.name for f in fields(RunSpec)}
    assert set(written) - SECTIONS <= names, set(written) - SECTIONS - names
    spec, default = RunSpec.of(compose_config()), RunSpec()
    for name in names - {"model", "task", "method", "engine", "grid", "verdict"}:
        assert getattr(spec, name) == getattr(default, name), name
    assert spec.grid_padding == 3.0 and spec.task_name == "niah" and spec.verdict["recall_high"] == 0.9
    assert spec.method["name"] == "streamingllm" and spec.grid == {"method": None, "budget": None}


def test_top_level_rules_come_from_the_spec():
    """A setting is declared once: its rule is its RunSpec field's, so the entrance check and the spec agree."""
    from kvbench.config.spec import TOP_LEVEL

    declared = {f.name for f in fields(RunSpec) if "rule" in f.metadata} - {"model", "task", "method", "engine"}
    assert set(TOP_LEVEL) == declared | {"grid.method", "grid.budget"}
    assert TOP_LEVEL["limit"].min == 1 and TOP_LEVEL["prefill"].choices == ("shared", "inline")


def test_values_are_typed_once():
    spec = RunSpec.of(
        compose_config("limit=3", "prefill=inline", "prefill_chunk=64", "batch_size=2", "results_dir=/tmp/x")
    )
    assert (spec.limit, spec.prefill, spec.prefill_chunk, spec.batch_size) == (3, "inline", 64, 2)
    assert spec.results_dir == Path("/tmp/x") and RunSpec.of(spec) is spec
    launched = compose_config("launcher=ray", "+launcher.shard=1", "+launcher.n_shards=4", "+launcher.attempt=ab12")
    assert RunSpec.of(launched).shard == (1, 4) and RunSpec.of(launched).attempt == "ab12"
