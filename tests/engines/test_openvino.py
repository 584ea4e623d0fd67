"""engine=openvino on the bundled model: its full cache against kvbench's (f32), u8/u4 bytes at their real
precision, an eviction option at budget ≥ prompt ≡ the engine's full run, bad options refused before a worker."""

from __future__ import annotations

import pytest

from kvbench import KvbenchError
from kvbench.engines.base import EngineRequest
from kvbench.engines.openvino import OpenvinoEngine
from kvbench.engines.source import venv_python
from tests.engines.conftest import model_cfg

pytestmark = pytest.mark.real_model
if not (venv_python(".venv-openvino").exists() and venv_python(".venv-ov-convert").exists()):
    pytest.skip(
        "engine=openvino needs .venv-openvino and .venv-ov-convert: `make engine-openvino`",
        allow_module_level=True,
    )


@pytest.fixture(scope="module")
def ov():
    backend = OpenvinoEngine(kv_blocks=64)
    backend.start(model_cfg(), "float32")
    yield backend
    backend.close()


def test_full_matches_kvbench_f32(ov, short_prompts):
    prompts, tokens, stop = short_prompts["float32"]
    for ids, ours in zip(prompts, tokens):
        got = ov.generate(EngineRequest(ids, len(ours), "full", stop_ids=stop))
        assert got.token_ids == ours
        assert got.kv_bytes == got.kv_bytes_full  # full: the held blocks are the full blocks
        assert got.extra["blocks_held"] == -(-(len(ids) + got.decode_steps) // 32)


def test_u8_u4_bytes_at_their_precision(ov, short_prompts):
    prompts, _, stop = short_prompts["float32"]
    u8 = ov.generate(EngineRequest(prompts[1], 8, "u8", stop_ids=stop))
    u4 = ov.generate(EngineRequest(prompts[1], 8, "u4", stop_ids=stop))
    elements = 32 * 2 * 30 * 3 * 64  # one block: K and V, 30 layers, 3 KV heads, head_dim 64
    # u8 holds one byte per element + scales/zero points: a quarter of f32 and a little more
    assert elements <= u8.extra["block_bytes"] < 1.25 * elements
    assert 0.25 < u8.kv_bytes / u8.kv_bytes_full < 0.31
    # u4: half a byte per element (the engine's own block size counts a byte: kvbench takes half of it off)
    assert u4.extra["engine_block_bytes"] - u4.extra["block_bytes"] == elements // 2
    assert u4.kv_bytes < u8.kv_bytes and u4.kv_bytes_full == u8.kv_bytes_full


def test_eviction_at_budget_above_prompt_is_full(ov, short_prompts):
    prompts, _, stop = short_prompts["float32"]
    full = ov.generate(EngineRequest(prompts[1], 12, "full", stop_ids=stop))
    for option in ("sum", "norm_sum"):
        got = ov.generate(EngineRequest(prompts[1], 12, option, budget=1.0, stop_ids=stop))
        assert got.token_ids == full.token_ids and got.kv_bytes == full.kv_bytes
    small = ov.generate(EngineRequest(prompts[1], 12, "sum", budget=0.2, stop_ids=stop))
    assert small.kv_bytes < full.kv_bytes  # a real eviction: fewer blocks held
    assert small.extra["blocks_peak"] >= -(-len(prompts[1]) // 32)  # nothing evicted during the prefill


def test_bad_option_refused_in_one_line():
    backend = OpenvinoEngine()
    why = backend.unavailable(model_cfg(), "q4_0")
    assert why and "\n" not in why and "u8" in why
    with pytest.raises(KvbenchError, match="before start"):
        backend.generate(EngineRequest([1, 2, 3], 2, "full"))
    assert backend.worker is None  # no worker was started
