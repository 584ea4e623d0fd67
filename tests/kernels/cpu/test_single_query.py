"""The single-query attention kernel (kvbench/kernels/cpu/csrc/decode_attention.c via kvbench/kernels/cpu/single_query.py): close to the
float64 softmax attention, each row's output the same bits whatever the other rows and the thread count, and the
decode steps the model makes go through it (and the rest through sdpa)."""

import pytest
import torch
import torch.nn.functional as F

from kvbench.kernels.cpu import single_query

pytestmark = pytest.mark.skipif(single_query._kernel() is None, reason="no C compiler: the kernel is not built")

# (H_q, H_kv, D): the bundled model's GQA; MHA; MQA with a head size that is not a multiple of the vector width;
# the kernel's bounds (16 query heads per KV head, head size 256)
HEADS = [(9, 3, 64), (4, 4, 16), (8, 1, 24), (16, 1, 256)]
LENGTHS = [1, 255, 256, 1000, 4100]  # one chunk, chunk boundaries, 16 chunks of uneven size


def reference(q, k, v, scale):
    """float64 softmax attention of q (B, H_q, 1, D) over k, v (B, H_kv, T, D) → (B, 1, H_q, D)."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(group, dim=1) for t in (k, v))  # (B, H_q, T, D)
    weights = torch.softmax(q.double() @ k.transpose(-1, -2) * scale, dim=-1)  # (B, H_q, 1, T)
    return (weights @ v).transpose(1, 2)  # (B, 1, H_q, D)


def inputs(heads, n_tokens, dtype, batch=1, seed=0):
    n_q, n_kv, dim = heads
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, n_q, 1, dim, generator=generator).to(dtype)  # (B, H_q, 1, D)
    k = (torch.randn(batch, n_kv, n_tokens, dim, generator=generator) * 2).to(dtype)  # (B, H_kv, T, D)
    v = torch.randn(batch, n_kv, n_tokens, dim, generator=generator).to(dtype)
    return q, k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("n_tokens", LENGTHS)
def test_close_to_float64_and_to_sdpa(dtype, heads, n_tokens):
    q, k, v = inputs(heads, n_tokens, dtype)
    scale = heads[2] ** -0.5
    assert single_query.applies(q, k, v)
    out = single_query.attend(q, k, v, scale)  # (1, 1, H_q, D)
    want = reference(q, k, v, scale)
    assert out.dtype == dtype and out.shape == want.shape
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), want, rtol=0, atol=2e-6)
    else:  # the float32 result rounded once to bf16: one bf16 step of the output's size
        assert ((out.double() - want).abs() <= want.abs() * 2.0**-8 + 1e-6).all()
    sdpa = F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(
        out, sdpa, rtol=2e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-2 if dtype == torch.bfloat16 else 1e-6
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_are_their_own_whatever_the_batch_and_threads(dtype):
    """A grid's layout: rows are slices of a longer tensor (capacity), each with its own length; every row equals
    the row computed alone from a contiguous copy, at 1, 2 and 3 threads; a row of no tokens gets zeros."""
    lengths = [4096, 1024, 300, 0, 2049, 17, 256]
    q, k, v = inputs((9, 3, 64), 4200, dtype, batch=len(lengths), seed=1)  # (B, H_kv, capacity, D)
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            results.append(single_query.attend(q, k, v, 0.125, lengths))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(r, results[0]) for r in results)
    for row, n in enumerate(lengths):
        alone = single_query.attend(
            q[row : row + 1], k[row : row + 1, :, :n].contiguous(), v[row : row + 1, :, :n].contiguous(), 0.125
        )
        assert torch.equal(results[0][row : row + 1], alone), row
    assert (results[0][3] == 0).all()
    with pytest.raises(ValueError, match="do not fit"):
        single_query.attend(q, k, v, 0.125, [5000] * len(lengths))


def test_what_it_does_not_take_goes_to_sdpa():
    q, k, v = inputs((9, 3, 64), 50, torch.float32)
    assert not single_query.applies(torch.cat([q, q], dim=2), k, v)  # two queries: a prefill chunk
    assert not single_query.applies(q.half(), k.half(), v.half())  # float16
    assert not single_query.applies(q.double(), k.double(), v.double())
    assert not single_query.applies(q, k.transpose(2, 3).contiguous().transpose(2, 3), v)  # tokens not contiguous
    wide = inputs((9, 3, 300), 50, torch.float32)  # head size over the kernel's bound
    assert not single_query.applies(*wide)


def test_the_models_decode_steps_use_it_and_generate_as_with_sdpa(tiny_engine, prompt_ids, monkeypatch):
    """The tiny model's decode steps go through the kernel; with sdpa instead (the kernel switched off) greedy
    decoding gives the same tokens in float32."""
    from kvbench.methods import build_method

    calls = []
    attend = single_query.attend
    monkeypatch.setattr(single_query, "attend", lambda *a, **k: calls.append(1) or attend(*a, **k))
    method = build_method("full", {})
    prefill = tiny_engine.prefill(prompt_ids, method.stats_request())
    with_kernel = tiny_engine.generate(prefill, method, None, [], max_new_tokens=12)
    assert len(calls) == 11 * tiny_engine.lm.model.config.num_hidden_layers  # every decode step, every layer
    monkeypatch.setattr(single_query, "applies", lambda *a: False)
    with_sdpa = tiny_engine.generate(tiny_engine.prefill(prompt_ids, method.stats_request()), method, None, [], 12)
    assert with_kernel.token_ids == with_sdpa.token_ids


def test_nan_propagates_and_rows_stay_apart():
    """A NaN key makes its row's heads NaN, as sdpa does (not a silent zero); the other rows are untouched."""
    q, k, v = inputs((9, 3, 64), 300, torch.float32, batch=2, seed=2)
    clean = single_query.attend(q, k, v, 0.125)
    k[0, 1, 17, 5] = float("nan")
    out = single_query.attend(q, k, v, 0.125)
    assert out[0, 0, 3:6].isnan().all() and not out[0, 0, :3].isnan().any() and not out[0, 0, 6:].isnan().any()
    assert torch.equal(out[1], clean[1])


def test_the_attention_function_keeps_sdpa_for_what_the_kernel_does_not_model(monkeypatch):
    """Soft-capped logits, attention sinks, dropout and a sliding window shorter than the cache go to torch."""
    from kvbench.model.attention import _single_query_ok

    k = inputs((9, 3, 64), 50, torch.float32)[1]
    assert _single_query_ok(k, {})
    assert _single_query_ok(k, {"sliding_window": 50, "dropout": 0.0})
    for kwargs in ({"softcap": 30.0}, {"s_aux": torch.zeros(9)}, {"dropout": 0.1}, {"sliding_window": 49}):
        assert not _single_query_ok(k, kwargs), kwargs
