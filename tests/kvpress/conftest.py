"""tests/kvpress/: the kvpress adapter (methods/kvpress.py). They run in the venv `make test-kvpress` builds (kvpress
0.5.5 pins transformers < 5.3); in the main venv every test module here skips, saying so (importorskip)."""

import pytest
from omegaconf import OmegaConf

from tests.conftest import CONF_DIR

NO_KVPRESS = "kvpress is not installed in this venv (it pins transformers < 5.3): `make test-kvpress` runs these"


@pytest.fixture(scope="session")
def smol_fp32():
    from kvbench.model.load import load_model
    from kvbench.native.engine import Engine

    lm = load_model(OmegaConf.load(CONF_DIR / "model" / "smollm2-135m.yaml"), "cpu", "float32")
    return lm, Engine(lm)


@pytest.fixture(scope="session")
def niah_prompt(smol_fp32):
    """kvbench's own NIAH prompt at 512 tokens, needle at half depth (query-aware: the question is in the prompt)."""
    from kvbench.tasks import build_task

    lm, _ = smol_fp32
    cfg = OmegaConf.load(CONF_DIR / "task" / "niah.yaml")
    cfg.update({"context_lengths": [512], "depths": [0.5]})
    task = build_task(cfg, lm.tokenizer, 0)
    (example,) = task.examples()[:1]
    return task, example
