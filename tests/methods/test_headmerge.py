"""Head merging: the GQA conversion by mean-pooling K/V projections."""

import pytest
import torch

from kvbench import KvbenchError
from kvbench.methods import build_method
from kvbench.methods.headmerge import merge_kv_heads


def test_merged_projections_are_group_means(tiny):
    merged = merge_kv_heads(tiny.model, 1)
    k = tiny.model.model.layers[0].self_attn.k_proj.weight.view(2, 16, -1)  # (H_kv, D, hidden)
    torch.testing.assert_close(merged.model.layers[0].self_attn.k_proj.weight, k.mean(0))
    assert merged.config.num_key_value_heads == 1 and tiny.model.config.num_key_value_heads == 2
    assert merged.model.layers[0].self_attn.num_key_value_groups == 4


def test_fewer_heads_shrink_the_cache_by_the_ratio(tiny_engine, prompt_ids):
    full = tiny_engine.run(build_method("full"), None, prompt_ids, max_new_tokens=4)
    mqa = tiny_engine.run(build_method("headmerge", {"kv_heads": 1}), None, prompt_ids, max_new_tokens=4)
    assert mqa.kv_bytes_full == full.kv_bytes_full  # measured against the original model's cache
    tokens = len(prompt_ids) + mqa.decode_steps
    assert mqa.kv_bytes == 2 * 4 * 1 * 16 * tokens * 4 and mqa.kv_ratio == pytest.approx(
        0.5 * tokens / (len(prompt_ids) + mqa.decode_steps)
    )
    assert full.kv_bytes_mha == 2 * full.kv_bytes_full  # 4 query heads vs 2 KV heads


def test_kv_heads_must_divide(tiny):
    with pytest.raises(KvbenchError, match="valid values: 1, 2"):
        merge_kv_heads(tiny.model, 3)
