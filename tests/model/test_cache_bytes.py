"""kv_bytes counts what the cache physically holds; kv_bytes_full is the analytic formula."""

import torch

from kvbench.methods import build_method
from kvbench.model.cache import cache_from_kv, cache_nbytes, full_cache_nbytes


def test_full_cache_bytes_equal_the_formula(tiny_engine, tiny, prompt_ids):
    gen = tiny_engine.run(build_method("full"), None, prompt_ids, max_new_tokens=5)
    tokens = len(prompt_ids) + gen.decode_steps  # the last generated token is never fed back
    formula = 2 * tiny.n_layers * tiny.n_kv_heads * tiny.head_dim * tokens * 4  # fp32
    assert gen.kv_bytes == gen.kv_bytes_full == formula
    assert gen.kv_ratio == 1.0


def test_formula_for_the_bundled_model_shape():
    # SmolLM2-135M: 30 layers × 3 KV heads × 64 dims, bf16: 23,040 bytes per token
    assert full_cache_nbytes(30, 3, 64, 1, torch.bfloat16) == 23_040
    assert full_cache_nbytes(30, 3, 64, 4096, torch.bfloat16) == 23_040 * 4096


def test_a_slice_that_keeps_the_buffer_alive_counts_in_full():
    keys = torch.zeros(1, 2, 100, 16)
    sliced = cache_from_kv([(keys[:, :, :10], keys[:, :, :10].clone())])
    # the view holds all 100 tokens' storage: masking/slicing is not compression
    assert cache_nbytes(sliced) == keys.nbytes + keys[:, :, :10].nbytes
