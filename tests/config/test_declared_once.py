"""Declared once: a method's knobs and their defaults are its dataclass's fields (methods/<name>.py), which
conf/method/<name>.yaml repeats exactly (so Hydra takes `method.<knob>=...`); an engine's options are its
ServingEngine's (kvbench/engines/<name>.py), and conf/engine/<name>.yaml holds its name alone. One generic check
each, here and in the run's entrance check (kvbench.preflight.entrance): no test restates a method's knobs or an
engine's options."""

from __future__ import annotations

import dataclasses
import importlib
import shutil

import pytest
from omegaconf import OmegaConf

import kvbench
from kvbench import KvbenchError
from kvbench.engines import ENGINES
from kvbench.methods import METHODS
from kvbench.preflight.entrance import check_config, method_yaml_drift
from tests.conftest import CONF_DIR, compose_config

METHOD_YAMLS = sorted(p.stem for p in (CONF_DIR / "method").glob("*.yaml"))


def method_class(name: str) -> type:
    """The registered dataclass, or, for a method this venv cannot run (kvpress: its extra), its module's."""
    if name in METHODS.names():
        return METHODS.get(name)
    module = importlib.import_module(f"kvbench.methods.{name.replace('-', '_')}")
    found = [c for c in vars(module).values() if dataclasses.is_dataclass(c) and getattr(c, "name", None) == name]
    assert len(found) == 1, f"conf/method/{name}.yaml names no method of kvbench/methods/ ({name} is not registered)"
    return found[0]


def test_every_registered_method_has_a_yaml():
    assert sorted(set(METHODS.names()) - set(METHOD_YAMLS)) == []


@pytest.mark.parametrize("name", METHOD_YAMLS)
def test_the_method_yaml_repeats_its_dataclass(name):
    """Every key a field (or `name`), every field a key, every value the field's default: no override."""
    assert method_yaml_drift(name, method_class(name)) is None


def test_a_yaml_that_drifts_is_refused_before_the_model_loads(tmp_path, monkeypatch):
    """An edited conf/method yaml would make `method=snapkv` and `grid.method=[snapkv]` two runs: one line naming
    the file, the key and the dataclass."""
    conf = tmp_path / "conf"
    shutil.copytree(CONF_DIR, conf)
    yaml = OmegaConf.load(conf / "method" / "snapkv.yaml")
    default = yaml.window_size
    yaml.window_size = default * 2
    yaml.windw = 3
    del yaml["pooling"]
    OmegaConf.save(yaml, conf / "method" / "snapkv.yaml")
    monkeypatch.setattr(kvbench, "conf_dir", lambda: conf)
    with pytest.raises(KvbenchError) as error:
        check_config(compose_config("method=snapkv"))
    message = str(error.value)
    assert "\n" not in message and message.startswith("conf/method/snapkv.yaml disagrees with SnapKV")
    assert f"window_size: {default * 2} where the default is {default}" in message
    assert "windw is not a field" in message and "lacks pooling" in message and "method.<knob>=" in message


def test_every_engine_has_a_yaml_holding_its_name_alone():
    """The options live in the ServingEngine; the yaml only makes `engine=<name>` a Hydra choice."""
    yamls = {p.stem: OmegaConf.to_container(OmegaConf.load(p)) for p in (CONF_DIR / "engine").glob("*.yaml")}
    assert sorted(yamls) == sorted(["kvbench", *ENGINES.names()])
    assert {stem: yaml for stem, yaml in yamls.items() if yaml != {"name": stem}} == {}


def test_an_engine_key_beyond_its_name_is_refused():
    with pytest.raises(KvbenchError, match=r"engine\.threads is not a setting: .*grid\.method"):
        check_config(compose_config("engine=llamacpp", "+engine.threads=4"))
