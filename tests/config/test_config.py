"""Every config file composes, and every config group entry maps to a registered class."""

import pytest

from kvbench.methods import METHODS, build_method
from kvbench.model.load import LOADERS
from kvbench.tasks import TASKS
from tests.conftest import CONF_DIR, compose_config


def _names(group):
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


@pytest.mark.parametrize("name", _names("method"))
def test_method_configs_compose_and_build(name):
    if name == "kvpress" and "kvpress" not in METHODS.names():  # its extra needs transformers < 5.3: tests/kvpress
        pytest.skip("kvpress is not installed in this venv: `make test-kvpress` builds and tests it")
    cfg = compose_config(f"method={name}")
    assert cfg.method.name == name
    build_method(name, {k: v for k, v in cfg.method.items() if k != "name"})


@pytest.mark.parametrize("name", _names("task"))
def test_task_configs_compose(name):
    cfg = compose_config(f"task={name}")
    assert cfg.task.name in TASKS.names()


@pytest.mark.parametrize("name", _names("model"))
def test_model_configs_compose(name):
    cfg = compose_config(f"model={name}")
    assert cfg.model.loader in LOADERS.names()


def test_defaults_are_the_documented_job():
    cfg = compose_config()
    assert (cfg.model.name, cfg.method.name, cfg.task.name, cfg.budget) == (
        "smollm2-135m",
        "streamingllm",
        "niah",
        None,
    )
    from kvbench.config.spec import RunSpec
    from kvbench.rows.configuration import configurations

    assert [(c.method.name, c.budget_value) for c in configurations(RunSpec.of(cfg))] == [("full", 1.0), ("streamingllm", 0.5)]
    assert len(cfg.task.context_lengths) * len(cfg.task.depths) == 9


@pytest.mark.parametrize("name", _names("experiment"))
def test_experiment_presets_compose(name):
    cfg = compose_config(f"+experiment={name}")
    assert cfg.task.name in TASKS.names() and cfg.model.loader in LOADERS.names()
