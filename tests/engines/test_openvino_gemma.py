"""engine=openvino on Gemma 3 270M (15 sliding-window layers of 512, 3 global): exported by the converter venv's
optimum-intel, its full run at f32 generates kvbench's full-cache tokens on a NIAH prompt longer than the window (so
the sliding layers' mask matters), and an eviction that leaves the start tokens inside the sliding window is flagged
invalid while one that keeps them out of it is valid and exact."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from kvbench.engines.base import EngineRequest
from kvbench.engines.openvino import OpenvinoEngine
from kvbench.engines.source import venv_python
from tests.conftest import CONF_DIR

pytestmark = [pytest.mark.real_model, pytest.mark.slow]
if not (venv_python(".venv-openvino").exists() and venv_python(".venv-ov-convert").exists()):
    pytest.skip(
        "engine=openvino needs .venv-openvino and .venv-ov-convert: `make engine-openvino`",
        allow_module_level=True,
    )

NEW = 12


@pytest.fixture(scope="module")
def gemma():
    """One 700-token NIAH prompt (needle at 50 %), kvbench's full-cache greedy tokens at f32, its stop ids."""
    from kvbench.methods import build_method
    from kvbench.model.load import load_model
    from kvbench.native.engine import Engine
    from kvbench.tasks.base import build_task

    model = OmegaConf.load(CONF_DIR / "model" / "gemma3-270m.yaml")
    lm = load_model(model, "cpu", "float32")
    engine = Engine(lm)
    task = OmegaConf.load(CONF_DIR / "task" / "niah.yaml")
    task.update({"context_lengths": [700], "depths": [0.5], "max_new_tokens": NEW})
    example = build_task(task, lm.tokenizer, 0).examples()[0]
    ids = example.context_ids + example.question_ids
    ours = engine.run(build_method("full"), None, ids, max_new_tokens=NEW).token_ids
    return OmegaConf.to_container(model), ids, ours, sorted(engine.eos_ids), lm.tokenizer.decode(ours), example.answers


def test_gemma3_full_matches_kvbench_f32_and_sliding_eviction_is_flagged(gemma):
    model, ids, ours, stop, text, answers = gemma
    assert len(ids) > 512 and any(answer in text for answer in answers)  # kvbench's full cache finds the needle
    backend = OpenvinoEngine(kv_blocks=64)
    try:
        backend.start(model, "float32")
        assert backend.shape is not None and (backend.shape.sliding_layers, backend.shape.window) == (15, 512)
        full = backend.generate(EngineRequest(ids, NEW, "full", stop_ids=stop))
        assert full.token_ids == ours and full.invalid == ""  # exact at f32, sliding-window masks included
        assert full.extra["blocks_held"] == -(-(len(ids) + full.decode_steps) // 32)  # every token, every layer
        # 501 + 12 tokens -> max_cache_size 544, - start_size 32 = the window: the start tokens stay outside it
        kept = backend.generate(EngineRequest(ids, NEW, "sum", budget=501, stop_ids=stop))
        assert kept.extra["knobs"]["cache_eviction"]["max_cache_size"] == 544 and kept.invalid == ""
        assert kept.token_ids == ours and kept.kv_bytes < full.kv_bytes
        # one token less: 512 - 32 < 512, the start tokens fall inside the sliding layers' window: run, flagged invalid
        broken = backend.generate(EngineRequest(ids, NEW, "sum", budget=500, stop_ids=stop))
        assert broken.extra["knobs"]["cache_eviction"]["max_cache_size"] == 512
        assert "sliding-window layers" in broken.invalid and "valid from budget >= 501 tokens" in broken.invalid
    finally:
        backend.close()
