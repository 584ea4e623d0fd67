"""KIVI: packed quantization error and bytes, the prefill split and decode flushes, select, bits=16 ≡ full."""

import pytest
import torch

from kvbench import KvbenchError
from kvbench.kernels.quantize import packed_nbytes, quantize_pack, unpack_dequantize
from kvbench.methods import build_method
from kvbench.methods.kivi import KiviLayer
from kvbench.model.cache import cache_nbytes, layer_select
from tests.conftest import compressed

EPS = {torch.float32: 2.0**-22, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-10}  # ≥ one rounding, relative


def _kv(T, D=16, H=2, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(1, H, T, D, generator=g) * torch.linspace(0.5, 4, D)  # (B, H, T, D): outlier-ish channels
    values = torch.randn(1, H, T, D, generator=g) + 1
    return keys.to(dtype), values.to(dtype)


def kivi_bytes(T, n_layers, heads, D, bits, G, R, itemsize):
    """Analytic KIVI cache size after T tokens: payload T·D·bits/8 per K and V + scales and zeros + residuals."""
    tq_k, tq_v = T // R * R, max(0, T - R)
    keys = tq_k * D * bits // 8 + 2 * D * (tq_k // G) * itemsize + (T - tq_k) * D * itemsize
    values = tq_v * D * bits // 8 + 2 * tq_v * (D // G) * itemsize + (T - tq_v) * D * itemsize
    return n_layers * heads * (keys + values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_quantize_error_is_at_most_half_a_step_on_both_axes(bits, dtype):
    keys, values = _kv(64, dtype=dtype)
    for x, group in ((values, 8), (keys.transpose(2, 3), 16)):  # per token along D; per channel along T
        packed, scale, zero = quantize_pack(x, bits, group)
        words = -(-group * bits // 32)  # int32 words per group (2-bit groups of 8 fill half a word)
        assert packed.dtype == torch.int32 and packed.shape[-1] == x.shape[-1] // group * words
        assert scale.dtype == zero.dtype == dtype and scale.shape[-1] == x.shape[-1] // group
        y = unpack_dequantize(packed, scale, zero, bits, group, dtype)
        assert y.dtype == dtype and y.shape == x.shape
        err = (y.float() - x.float()).unflatten(-1, (-1, group)).abs()  # (..., n_groups, G)
        bound = scale.float().unsqueeze(-1) / 2 + EPS[dtype] * y.float().abs().unflatten(-1, (-1, group))
        assert (err <= bound).all()
        assert packed_nbytes(tuple(x.shape), bits, group, dtype) == packed.nbytes + scale.nbytes + zero.nbytes


def test_constant_groups_and_padded_words_round_trip():
    x = torch.full((3, 32), 2.5, dtype=torch.bfloat16)
    x[1] = torch.linspace(-1, 1, 32)
    for bits, group in ((4, 16), (2, 8)):  # 2-bit groups of 8 fill half a word: padded, not shared
        packed, scale, zero = quantize_pack(x, bits, group)
        assert packed.shape[-1] == 4 and scale[0].eq(0).all()  # 2 groups × 2 words; 4 groups × 1 padded word
        y = unpack_dequantize(packed, scale, zero, bits, group, torch.bfloat16)
        assert torch.equal(y[0], x[0]) and torch.equal(y[2], x[2])  # a constant group comes back exactly
        assert y[1, 0] == x[1, 0] and (y[1] - x[1]).abs().max() <= scale[1].float().max() / 2 + 1e-2


def test_prefill_split_residuals_are_bit_exact_and_bytes_match_the_formula():
    keys, values = _kv(100, dtype=torch.bfloat16)
    layer = KiviLayer.from_kv(keys, values, bits=4, group_size=8, residual_length=16)
    # keys: 96 quantized (whole residual blocks), the newest 100 mod 16 = 4 in full precision; values: newest 16
    assert layer.key_packed.shape == (1, 2, 16, 96 * 4 // 32) and layer.key_scale.shape == (1, 2, 16, 96 // 8)
    assert layer.value_packed.shape == (1, 2, 84, 16 * 4 // 32) and layer.value_scale.shape == (1, 2, 84, 2)
    assert torch.equal(layer.key_residual, keys[:, :, 96:]) and torch.equal(layer.value_residual, values[:, :, 84:])
    assert layer.get_seq_length() == 100 and layer.keys is None
    all_keys, all_values = layer.kv()
    assert torch.equal(all_keys[:, :, 96:], keys[:, :, 96:]) and torch.equal(all_values[:, :, 84:], values[:, :, 84:])
    assert (all_keys.float() - keys.float()).abs().max() <= layer.key_scale.float().max() / 2 + 0.05  # + bf16
    method = build_method("kivi", {"bits": 4, "group_size": 8, "residual_length": 16})
    cache = method.compress([(keys, values)], None, None)
    assert cache_nbytes(cache) == kivi_bytes(100, 1, 2, 16, 4, 8, 16, 2)
    # payload alone: T·D·bits/8 for each of K and V
    assert layer.key_packed.nbytes == 2 * 96 * 16 * 4 // 8 and layer.value_packed.nbytes == 2 * 84 * 16 * 4 // 8


def test_short_prompt_stays_full_precision():
    keys, values = _kv(10)
    layer = KiviLayer.from_kv(keys, values, bits=2, group_size=16, residual_length=16)
    assert layer.key_scale.numel() == layer.value_scale.numel() == 0
    assert all(torch.equal(a, b) for a, b in zip(layer.kv(), (keys, values)))


def test_decode_flushes_keys_by_block_and_values_by_token():
    keys, values = _kv(40)
    layer = KiviLayer.from_kv(keys, values, bits=8, group_size=8, residual_length=16)  # K: 32 + 8, V: 24 + 16
    new_k, new_v = _kv(30, seed=1)
    for step in range(8):
        view, same = layer.update(new_k[:, :, step : step + 1], new_v[:, :, step : step + 1])
        assert view is same  # one view of the storage for attention in place of K and V
        k_all, v_all = view.kv()
        assert k_all.shape == v_all.shape == (1, 2, 41 + step, 16)
        # attention sees the newest tokens in full precision, the block about to be flushed included (as KIVI)
        assert torch.equal(k_all[:, :, -(9 + step) :], torch.cat([keys[:, :, 32:], new_k[:, :, : step + 1]], 2))
        assert torch.equal(v_all[:, :, -16:], torch.cat([values, new_v[:, :, : step + 1]], 2)[:, :, -16:])
        assert layer.value_residual.shape[2] == 16 and layer.value_scale.shape[2] == 25 + step
        assert layer.key_residual.shape[2] == (9 + step) % 16  # the 8th new token fills the residual: flushed
    assert layer.key_scale.shape[-1] * 8 == 48 and layer.get_seq_length() == 48
    layer.update(new_k[:, :, 8:30], new_v[:, :, 8:30])  # a multi-token append follows the same rules
    assert (layer.key_scale.shape[-1] * 8, layer.key_residual.shape[2]) == (64, 6)
    assert (layer.value_scale.shape[2], layer.value_residual.shape[2]) == (54, 16)
    for name, tensor in vars(layer).items():  # held: packed payloads, scales, zeros, residuals — never a full copy
        if torch.is_tensor(tensor) and tensor.dim() == 4 and tensor.dtype != torch.int32:
            assert tensor.shape[2] <= 54 or name.endswith(("scale", "zero")), name


def test_select_marks_tokens_dead_and_frees_what_every_head_dropped():
    keys, values = _kv(45)
    index = torch.stack(
        [
            torch.tensor([i for i in range(45) if i % 5]),  # head 0 drops every 5th token
            torch.arange(9, 45),
        ]
    ).unsqueeze(0)  # head 1 drops the oldest 9; (B, H, 36)
    exact = KiviLayer.from_kv(keys, values, bits=16, group_size=8, residual_length=16)
    layer_select(exact, index)
    want = [t.gather(2, index.unsqueeze(-1).expand(-1, -1, -1, 16)) for t in (keys, values)]  # (B, H, 36, D)
    assert all(torch.equal(a, b) for a, b in zip(exact.kv(), want))
    layer = KiviLayer.from_kv(keys, values, bits=8, group_size=8, residual_length=16)
    before = layer.kv()
    layer.select(index)
    assert layer.get_seq_length() == 36
    # slots 0 and 5 are dead in both heads but their key group (0–7) is not: nothing freed, nothing re-quantized
    assert layer.n_stored() == 45 and layer.dead.shape == (1, 2, 9)  # each head's 9 dead slots, still stored
    got = layer.kv()
    for g, b in zip(got, before):
        assert torch.equal(g, b.gather(2, index.unsqueeze(-1).expand(-1, -1, -1, 16)))  # bit for bit the same
    layer.select(torch.arange(8, 36).expand(1, 2, -1))  # both heads drop their 8 oldest: slots 0–7 empty everywhere
    assert layer.n_stored() == 45 - 8 and layer.get_seq_length() == 28  # key group 0–7 freed
    survivors = index[..., 8:].unsqueeze(-1).expand(-1, -1, -1, 16)  # (B, H, 28, D)
    for g, b in zip(layer.kv(), before):
        assert torch.equal(g, b.gather(2, survivors))  # the survivors' stored values are untouched


def _h2o_or_streaming_on_kivi(eviction, n_prompt, steps, budget, monkeypatch):
    """Drive compose(eviction + kivi) like the engine on random K/V; return the layer and the exact kept K/V."""
    from kvbench.methods import Budget
    from kvbench.model.attention import recording

    torch.manual_seed(0)
    keys, values = _kv(n_prompt + steps)  # (1, 2, T, 16): every token's exact key/value
    method = build_method(
        "compose",
        {"stack": [eviction, "kivi"], "overrides": {"kivi": {"bits": 4, "group_size": 8, "residual_length": 16}}},
    )
    with recording(method.stats_request()) as stats:
        stats.record(0, torch.randn(1, 4, n_prompt, 16), keys[:, :, :n_prompt], 0.25)
    eviction, evicted = compressed(
        method.eviction, [(keys[:, :, :n_prompt], values[:, :, :n_prompt])], stats, Budget.parse(budget)
    )
    truth = [evicted.layers[0].keys, evicted.layers[0].values]  # (1, 2, budget, 16) exact
    cache = method.precision.compress([tuple(truth)], None, None)  # what compose's compression does
    layer = cache.layers[0]
    selected = []
    real_select = KiviLayer.select
    monkeypatch.setattr(KiviLayer, "select", lambda self, index: selected.append(index) or real_select(self, index))
    for t in range(n_prompt, n_prompt + steps):
        with recording(eviction.decode_request()) as stats:  # compose decodes with its eviction part's hooks
            k, _ = layer.update(keys[:, :, t : t + 1], values[:, :, t : t + 1])[0].kv()
            truth = [torch.cat([x, src[:, :, t : t + 1]], 2) for x, src in zip(truth, (keys, values))]
            if stats.request:
                stats.record(0, torch.randn(1, 4, 1, 16), k, 0.25)
        eviction.on_decode_step(cache, stats)
        if selected:
            index = selected.pop().unsqueeze(-1).expand(-1, -1, -1, 16)
            truth = [x.gather(2, index) for x in truth]
    return layer, truth


def _relative_error(got, want):
    return float((got - want).norm() / want.norm())


@pytest.mark.parametrize("eviction", ["h2o", "streamingllm"])
def test_decode_eviction_on_kivi_never_requantizes(eviction, monkeypatch):
    layer, truth = _h2o_or_streaming_on_kivi(eviction, 96, 200, 48, monkeypatch)
    assert layer.get_seq_length() == 48
    once = KiviLayer.from_kv(*truth, bits=4, group_size=8, residual_length=16)  # these tokens quantized once
    for got, single, want in zip(layer.kv(), once.kv(), truth):
        # every kept token was quantized exactly once: the error is a single quantization's, not 2–6× it
        assert _relative_error(got, want) <= 1.3 * _relative_error(single, want) + 1e-6
    if eviction == "streamingllm":  # every head drops the same tokens: their groups are freed as they empty
        assert layer.n_stored() <= 48 + 2 * 8


def test_bits16_is_the_full_cache(tiny_engine, prompt_ids):
    full = tiny_engine.run(build_method("full"), None, prompt_ids, max_new_tokens=8, keep_logits=True)
    kivi = tiny_engine.run(build_method("kivi", {"bits": 16}), None, prompt_ids, max_new_tokens=8, keep_logits=True)
    assert kivi.token_ids == full.token_ids
    assert all(torch.equal(a, b) for a, b in zip(kivi.logits, full.logits))
    assert kivi.kv_bytes == full.kv_bytes


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_quantized_generation_and_bytes(bits, tiny, tiny_engine, prompt_ids):
    params = {"bits": bits, "group_size": 16, "residual_length": 32}
    full = tiny_engine.run(build_method("full"), None, prompt_ids, max_new_tokens=12, keep_logits=True)
    gen = tiny_engine.run(build_method("kivi", params), None, prompt_ids, max_new_tokens=12, keep_logits=True)
    tokens = len(prompt_ids) + gen.decode_steps
    assert gen.kv_bytes == kivi_bytes(tokens, tiny.n_layers, tiny.n_kv_heads, tiny.head_dim, bits, 16, 32, 4)
    # fp32 tiny model: bits/32 + (fp32 scale + zero per 16 elements) 1/8 + the residual's share
    assert bits / 32 + 1 / 8 < gen.kv_ratio < bits / 32 + 1 / 8 + 0.1
    if bits == 8:
        assert gen.token_ids == full.token_ids
        assert max((a - b).abs().max() for a, b in zip(gen.logits, full.logits)) < 0.05


def test_question_appended_after_compression(tiny, tiny_engine, prompt_ids):
    """query_aware=false: the suffix goes through one multi-token update of every KiviLayer."""
    params = {"bits": 4, "group_size": 8, "residual_length": 16}
    gen = tiny_engine.run(build_method("kivi", params), None, prompt_ids[:500], prompt_ids[500:], max_new_tokens=4)
    tokens = len(prompt_ids) + gen.decode_steps
    assert gen.kv_bytes == kivi_bytes(tokens, tiny.n_layers, tiny.n_kv_heads, tiny.head_dim, 4, 8, 16, 4)


def test_bad_parameters_name_the_fix(tiny_engine, prompt_ids):
    with pytest.raises(KvbenchError, match="must be 2, 4 or 8"):
        build_method("kivi", {"bits": 3})
    with pytest.raises(KvbenchError, match="multiple of group_size=16"):
        build_method("kivi", {"group_size": 16, "residual_length": 24})
    prefill = tiny_engine.prefill(prompt_ids[:40], build_method("full").stats_request())
    with pytest.raises(KvbenchError, match=r"head_dim=16 .*valid group sizes: 1, 2, 4, 8, 16"):
        build_method("kivi").compress(prefill.kv, prefill.stats, None)  # default group 64 on the tiny model
    assert build_method("kivi", {"bits": 16}).compress(prefill.kv, prefill.stats, None).get_seq_length() == 40
