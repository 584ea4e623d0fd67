"""tests/engines/: the engines behind kvbench's ServingEngine interface, on the bundled model (real_model). Each engine
runs in its own venv; a module skips, naming the make target, where that venv is absent."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from tests.conftest import CONF_DIR


def model_cfg() -> dict:
    return OmegaConf.to_container(OmegaConf.load(CONF_DIR / "model" / "smollm2-135m.yaml"))  # type: ignore[return-value]


@pytest.fixture(scope="session")
def short_prompts():
    """Two of kvbench's NIAH prompts at 300 and 500 tokens (query-aware), kvbench's full-cache greedy tokens for
    each at float32 and bfloat16, and the stop ids kvbench decodes with."""
    from kvbench.methods import build_method
    from kvbench.model.load import load_model
    from kvbench.native.engine import Engine
    from kvbench.tasks.base import build_task

    out = {}
    for dtype in ("float32", "bfloat16"):
        lm = load_model(OmegaConf.load(CONF_DIR / "model" / "smollm2-135m.yaml"), "cpu", dtype)
        engine = Engine(lm)
        cfg = OmegaConf.load(CONF_DIR / "task" / "niah.yaml")
        cfg.update({"context_lengths": [300, 500], "depths": [0.5], "max_new_tokens": 12})
        examples = build_task(cfg, lm.tokenizer, 0).examples()
        prompts = [ex.context_ids + ex.question_ids for ex in examples]
        tokens = [engine.run(build_method("full"), None, ids, max_new_tokens=12).token_ids for ids in prompts]
        out[dtype] = (prompts, tokens, sorted(engine.eos_ids))
    return out
