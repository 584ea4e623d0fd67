"""transformers' QuantizedCache as a method: bytes really fall, and a missing backend names the extra."""

import importlib.util

import pytest

from kvbench import KvbenchError
from kvbench.methods import build_method


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["fp8", "quanto"])
def test_quantized_cache_holds_fewer_bytes_and_still_decodes(tiny_engine, prompt_ids, backend):
    if backend == "quanto" and importlib.util.find_spec("optimum") is None:
        pytest.skip("optimum-quanto not installed")
    full = tiny_engine.run(build_method("full"), None, prompt_ids, max_new_tokens=6)
    gen = tiny_engine.run(
        build_method("hf-quant", {"backend": backend, "q_group_size": 16, "residual_length": 32}),
        None,
        prompt_ids,
        max_new_tokens=6,
    )
    assert gen.kv_bytes_full == full.kv_bytes_full
    # fp8: 1 byte per element of fp32 → 0.25 plus two scales; quanto 4-bit: 0.125 + scales/zeros + residual
    assert gen.kv_ratio < 0.3
    assert gen.token_ids[0] == full.token_ids[0]


def test_missing_backend_names_the_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "hqq" else real(name, *a))
    with pytest.raises(KvbenchError, match=r"pip install 'kvbench\[hqq\]'"):
        build_method("hf-quant", {"backend": "hqq"})
    with pytest.raises(KvbenchError, match="use one of quanto, hqq, fp8"):
        build_method("hf-quant", {"backend": "int3"})
