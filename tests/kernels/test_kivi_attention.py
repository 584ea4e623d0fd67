"""KIVI decode attention on the packed groups (kvbench/kernels/kivi_attention.py) ≡ dequantize-then-attend; separate key
and value bit widths (storage and predicted bytes)."""

import pytest
import torch

from kvbench.kernels.kivi_attention import unpack_codes, unpack_planes
from kvbench.kernels.quantize import quantize_pack, words_per_group
from kvbench.methods import Budget, build_method, method_defaults
from kvbench.methods.kivi import KiviLayer
from kvbench.model.cache import cache_nbytes, layer_select
from kvbench.model.kv_bytes import KVShape, predict_kv_bytes


def _kv(T, D=16, H=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(1, H, T, D, generator=g) * torch.linspace(0.5, 4, D)  # (B, H, T, D): outlier-ish channels
    values = torch.randn(1, H, T, D, generator=g) + 1
    return keys, values


def dense_attention(query, keys, values, scaling):
    """The reference: sdpa over dequantized K/V (B, H_kv, T, D), GQA by repetition; (B, 1, H_q, D) like attend."""
    group = query.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)  # (B, H_q, T, D)
    out = torch.nn.functional.scaled_dot_product_attention(query, keys, values, scale=scaling)  # (B, H_q, 1, D)
    return out.transpose(1, 2)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("group", [4, 8, 16])
def test_unpacked_codes_are_the_quantized_integers(bits, group):
    x = torch.randn(3, 2, 4 * group)  # (..., L)
    packed, _, _ = quantize_pack(x, bits, group)
    codes = unpack_codes(packed, bits, group, torch.float32)  # (..., L/G, G)
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    words = packed.unflatten(-1, (-1, words_per_group(bits, group))).unsqueeze(-1)  # (..., L/G, W, 1)
    want = ((words >> shifts) & (2**bits - 1)).flatten(-2)[..., :group].float()  # the bit fields, read by shifting
    assert codes.shape == (3, 2, 4, group) and torch.equal(codes, want)
    assert codes.max() <= 2**bits - 1 and codes.min() >= 0


def _shift_decoded(packed, bits, group):
    """Each group's codes read by shifting the int32 words, independently of kivi_attention: (..., n_groups, G)."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    words = packed.unflatten(-1, (-1, words_per_group(bits, group))).unsqueeze(-1)  # (..., n_groups, W, 1)
    return ((words >> shifts) & (2**bits - 1)).flatten(-2)[..., :group]


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("group", [8, 12, 64])
def test_bit_planes_hold_field_j_of_every_byte(bits, group):
    """unpack_planes' column j·4W + m is code m·(8/bits) + j, on a strided (transposed) view of the words too."""
    x = torch.randn(2, 5, 3 * group)  # (..., L)
    packed, _, _ = quantize_pack(x, bits, group)
    words = packed.unflatten(-1, (3, -1)).transpose(0, 1)  # (5, 2, 3, W): strided, last axis contiguous
    planes = unpack_planes(words, bits, torch.float32)  # (5, 2, 3, 8/bits · 4W)
    per_byte, n_bytes = 8 // bits, 4 * words.shape[-1]
    codes = _shift_decoded(packed, bits, group).transpose(0, 1)  # (5, 2, 3, G)
    for j in range(per_byte):
        for m in range(n_bytes):
            if m * per_byte + j < group:  # past it: padding
                assert torch.equal(planes[..., j * n_bytes + m], codes[..., m * per_byte + j].float())


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_words_are_the_bitwise_or_of_the_shifted_codes(bits, dtype):
    """quantize_pack sums the shifted fields; that must equal OR-ing them (sign bit included for the top field)."""
    x = (torch.randn(3, 4, 64) * 5).to(dtype)  # (..., L): groups of 32
    x[0, 0, :32] = 1.5  # a constant group: scale 0, codes 0
    packed, scale, zero = quantize_pack(x, bits, 32)
    groups = x.float().unflatten(-1, (-1, 32))  # (..., 2, 32)
    safe = torch.where(scale == 0, 1.0, scale.float()).unsqueeze(-1)
    q = torch.floor((groups - zero.float().unsqueeze(-1)) / safe + 0.5).clamp(0, 2**bits - 1).int()  # (..., 2, 32)
    per_word = 32 // bits
    q = q.unflatten(-1, (-1, per_word))  # (..., 2, W, P)
    want = torch.zeros(q.shape[:-1], dtype=torch.int32)
    for i in range(per_word):
        want |= q[..., i] << (i * bits)
    assert torch.equal(packed, want.flatten(-2))
    assert scale[0, 0, 0] == 0 and torch.equal(_shift_decoded(packed, bits, 32)[0, 0, 0], torch.zeros(32).int())


@pytest.mark.parametrize("key_bits,value_bits", [(4, 4), (2, 2), (8, 8), (4, 2), (2, 8), (16, 4), (4, 16)])
@pytest.mark.parametrize("evict", [False, True])
def test_packed_attention_equals_dequantize_then_attend(key_bits, value_bits, evict):
    keys, values = _kv(100)  # 96 keys quantized in 12 groups of 8 tokens, 84 values in 2 groups of 8 channels each
    layer = KiviLayer.from_kv(keys, values, 4, 8, 16, key_bits=key_bits, value_bits=value_bits)
    if evict:  # dead slots: head 0 drops 0–7 and every 3rd token, head 1 the oldest 39: key group 0–7 freed
        index = torch.stack([torch.tensor([i for i in range(8, 100) if i % 3]), torch.arange(39, 100)]).unsqueeze(0)
        layer_select(layer, index)
        assert layer.dead is not None
    new_k, new_v = _kv(1, seed=1)
    view, _ = layer.update(new_k, new_v)
    query = torch.randn(1, 4, 1, 16)  # (B, H_q, 1, D): 2 query heads per KV head
    got = view.attend(query, 0.25)  # (B, 1, H_q, D)
    want = dense_attention(query, *view.kv(), 0.25)
    assert got.shape == (1, 1, 4, 16)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    assert layer.key_scale.shape[-1] == (0 if key_bits == 16 else 12 - evict)  # the flush happened after the view


@pytest.mark.parametrize("key_bits,value_bits", [(4, 4), (2, 8), (16, 4), (4, 16)])
@pytest.mark.parametrize("chunk", [8, 24, 40])
def test_chunked_unpacking_equals_one_pass(key_bits, value_bits, chunk, monkeypatch):
    """Long contexts unpack CHUNK_SLOTS quantized slots at a time: the same attention as one pass, dead slots too."""
    from kvbench.kernels import kivi_attention

    keys, values = _kv(100)
    layer = KiviLayer.from_kv(keys, values, 4, 8, 16, key_bits=key_bits, value_bits=value_bits)
    index = torch.stack([torch.tensor([i for i in range(8, 100) if i % 3]), torch.arange(39, 100)]).unsqueeze(0)
    layer_select(layer, index)  # dead slots in both heads' quantized parts
    view, _ = layer.update(*_kv(1, seed=1))
    query = torch.randn(1, 4, 1, 16)  # (B, H_q, 1, D)
    one_pass = view.attend(query, 0.25)
    monkeypatch.setattr(kivi_attention, "CHUNK_SLOTS", chunk)  # 1, 3 or 5 key groups; 8–40 value tokens per chunk
    chunked = view.attend(query, 0.25)
    assert torch.allclose(chunked, one_pass, atol=1e-6, rtol=1e-5)
    assert torch.allclose(chunked, dense_attention(query, *view.kv(), 0.25), atol=1e-5, rtol=1e-5)


def test_packed_attention_in_bf16_is_within_rounding():
    keys, values = _kv(300, D=64, H=3)
    layer = KiviLayer.from_kv(keys.bfloat16(), values.bfloat16(), 4, 64, 64)
    view, _ = layer.update(*(t.bfloat16() for t in _kv(1, D=64, H=3, seed=1)))
    query = torch.randn(1, 9, 1, 64).bfloat16()
    got, want = view.attend(query, 0.125).float(), dense_attention(query, *view.kv(), 0.125).float()
    assert got.dtype == torch.float32 and (got - want).abs().max() <= 0.02 * want.abs().max()


@pytest.mark.parametrize("params", [{"bits": 4}, {"bits": 2}, {"key_bits": 4, "value_bits": 2}])
def test_generation_on_packed_groups_equals_dequantized_at_fp32(params, tiny_engine, prompt_ids, monkeypatch):
    method = build_method("kivi", {**method_defaults("kivi"), "group_size": 16, "residual_length": 32, **params})
    calls = []
    real_attend = KiviLayer.attend
    monkeypatch.setattr(KiviLayer, "attend", lambda self, q, s: calls.append(1) or real_attend(self, q, s))
    packed = tiny_engine.run(method, None, prompt_ids, max_new_tokens=12, keep_logits=True)
    assert len(calls) == packed.decode_steps * tiny_engine.lm.n_layers  # every decode step, every layer
    monkeypatch.setattr(KiviLayer, "attend", lambda self, q, s: None)  # the dense path: dequantize, then sdpa
    dense = tiny_engine.run(method, None, prompt_ids, max_new_tokens=12, keep_logits=True)
    assert packed.token_ids == dense.token_ids and packed.kv_bytes == dense.kv_bytes
    assert all(torch.allclose(a, b, atol=1e-4) for a, b in zip(packed.logits, dense.logits))


def test_generation_with_eviction_on_kivi_equals_dequantized_at_fp32(tiny_engine, prompt_ids, monkeypatch):
    """StreamingLLM evicting on top of KIVI while decoding: the packed path, dead slots included, generates what
    dequantize-then-attend generates."""
    kivi = {"bits": 4, "group_size": 16, "residual_length": 16}
    method = build_method("compose", {"stack": ["streamingllm", "kivi"], "overrides": {"kivi": kivi}})
    dead_seen = []
    real_attend = KiviLayer.attend
    monkeypatch.setattr(
        KiviLayer, "attend", lambda self, q, s: dead_seen.append(self.dead is not None) or real_attend(self, q, s)
    )
    budget = Budget.parse(0.25)
    packed = tiny_engine.run(method, budget, prompt_ids, max_new_tokens=24, keep_logits=True)
    assert len(dead_seen) == packed.decode_steps * tiny_engine.lm.n_layers and any(dead_seen)
    monkeypatch.setattr(KiviLayer, "attend", lambda self, q, s: None)  # the dense path: dequantize, then sdpa
    dense = tiny_engine.run(method, budget, prompt_ids, max_new_tokens=24, keep_logits=True)
    assert packed.token_ids == dense.token_ids and packed.kv_bytes == dense.kv_bytes
    assert all(torch.allclose(a, b, atol=1e-4) for a, b in zip(packed.logits, dense.logits))


@pytest.mark.parametrize("key_bits,value_bits", [(4, 2), (2, 4), (16, 2), (8, 16)])
def test_separate_key_and_value_bits_store_and_predict_exact_bytes(key_bits, value_bits, tiny_engine, prompt_ids):
    params = {"bits": 4, "group_size": 16, "residual_length": 32, "key_bits": key_bits, "value_bits": value_bits}
    method = build_method("kivi", {**method_defaults("kivi"), **params})
    gen = tiny_engine.run(method, None, prompt_ids, max_new_tokens=6)
    lm = tiny_engine.lm
    shape = KVShape(lm.n_layers, lm.n_kv_heads, lm.head_dim, lm.dtype)
    assert predict_kv_bytes(method, None, shape, len(prompt_ids), 0, gen.decode_steps).kv_bytes == gen.kv_bytes
    prefill_kv = tiny_engine.prefill(prompt_ids, method.stats_request()).kv  # 540 tokens: 512 keys, 508 values packed
    layer = method.compress(prefill_kv, None, None).layers[0]
    assert layer.key_packed.shape[-1] == (0 if key_bits == 16 else 512 // 16 * words_per_group(key_bits, 16))
    assert layer.value_packed.shape[-1] == (0 if value_bits == 16 else words_per_group(value_bits, 16))
    uniform = build_method("kivi", {**method_defaults("kivi"), **params, "key_bits": None, "value_bits": None})
    assert uniform.bits_of("key") == uniform.bits_of("value") == 4
    assert cache_nbytes(method.compress(prefill_kv, None, None)) != cache_nbytes(
        uniform.compress(prefill_kv, None, None)
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_scales_are_the_exact_scale_rounded_up_to_the_dtype(dtype):
    """quantize_pack's scale is the smallest `dtype` number ≥ (max − min)/levels: never below it (the group's max
    stays reachable), one step above at most (bf16 rounds up by carrying into fp32's top half)."""
    x = (torch.randn(64, 128) * torch.logspace(-30, 30, 64).unsqueeze(-1)).to(dtype)  # (rows, L): many magnitudes
    x = x.masked_fill(torch.isinf(x), 0)
    x[0] = 2.5  # constant groups: scale 0
    _, scale, zero = quantize_pack(x, 4, 32)
    groups = x.float().unflatten(-1, (-1, 32))  # (64, 4, 32)
    exact = (groups.amax(-1) - groups.amin(-1)) / 15  # (64, 4) fp32
    below = torch.nextafter(scale, torch.full_like(scale, -float("inf")))
    assert torch.equal(zero.float(), groups.amin(-1))
    assert (scale.float() >= exact).all() and ((below.float() < exact) | (scale == 0)).all()
    assert (scale[0] == 0).all()
