"""TurboQuant (methods/turboquant.py) against the paper's equations and vLLM's storage layout."""

import math

import pytest
import torch
from transformers import DynamicCache

from kvbench import KvbenchError
from kvbench.methods import Budget, build_method
from kvbench.methods.turboquant import PRESETS, Quantizer, TurboQuantLayer, lloyd_max, pack_bits, unpack_bits
from kvbench.model.cache import cache_nbytes
from kvbench.model.kv_bytes import KVShape, predict_kv_bytes

# Lloyd-Max distortion of N(0, 1) at 1-4 bits (Max 1960), which the sphere's coordinate law approaches as D grows;
# the paper's Theorem 1 quotes D_mse ≈ 0.36, 0.117, 0.03, 0.009 and bounds it by √3·π/2 · 4^−b
MAX_GAUSSIAN = {1: 0.3634, 2: 0.1175, 3: 0.03454, 4: 0.009497}


def bound(bits: int) -> float:
    return math.sqrt(3) * math.pi / 2 / 4**bits


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_lloyd_max_codebook_has_the_papers_distortion(bits):
    centroids, distortion = lloyd_max(128, bits)
    assert centroids.shape == (2**bits,) and bool((centroids[1:] > centroids[:-1]).all())
    assert torch.allclose(centroids, -centroids.flip(0), atol=1e-6)  # a symmetric density, a symmetric codebook
    unit_mse = 128 * distortion  # E‖u − û‖² of a unit vector: D coordinates
    assert unit_mse == pytest.approx(MAX_GAUSSIAN[bits], rel=0.03)
    assert unit_mse < bound(bits)


@pytest.mark.parametrize("rotation", ["hadamard", "random"])
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_reconstruction_mse_of_any_vectors_is_the_codebooks(rotation, bits):
    """The random rotation makes any vectors' directions uniform (here very anisotropic ones: one coordinate 30×
    the others), so their reconstruction error is the codebook's expected one, within the paper's bound. vLLM's
    fixed Hadamard has that guarantee only for directions already spread (isotropic ones here): H·e₀ is one fixed
    vector of ±1/√D, whatever the codebook."""
    x = torch.randn(1, 4, 512, 128, generator=torch.Generator().manual_seed(0))
    if rotation == "random":
        x[..., 0] *= 30
    q = Quantizer("rotated", bits, norm_correction=False, rotation=rotation, seed=3)
    stored = q.encode(x)
    y = q.decode(stored, 128, torch.float32)
    norm = stored["norm"].float().unsqueeze(-1)  # (1, 4, 512, 1) fp16 as stored
    assert torch.allclose(norm, x.norm(dim=-1, keepdim=True), rtol=1e-3)
    mse = ((x / x.norm(dim=-1, keepdim=True) - y / norm) ** 2).sum(-1).mean().item()
    assert mse == pytest.approx(128 * lloyd_max(128, bits)[1], rel=0.1)
    assert mse < bound(bits)


def test_norm_correction_restores_each_vectors_norm():
    x = torch.randn(1, 2, 64, 64, generator=torch.Generator().manual_seed(1))
    for nc in (True, False):
        q = Quantizer("rotated", 3, norm_correction=nc)
        stored = q.encode(x)
        ratio = q.decode(stored, 64, torch.float32).norm(dim=-1) / stored["norm"].float()  # (1, 2, 64)
        if nc:
            assert torch.allclose(ratio, torch.ones_like(ratio), atol=1e-5)
        else:
            assert (ratio - 1).abs().max() > 1e-2  # Lloyd-Max shrinks the norm (centroids are conditional means)


def test_bits_pack_exactly():
    for bits in range(1, 9):
        codes = torch.randint(0, 2**bits, (2, 3, 7, 24))
        packed = pack_bits(codes, bits)
        assert packed.dtype == torch.uint8 and packed.shape[-1] == math.ceil(24 * bits / 8)
        assert torch.equal(unpack_bits(packed, bits, 24), codes)


@pytest.mark.parametrize("bits", range(1, 9))
def test_bit_layout_is_least_significant_first(bits):
    """Code c's bit j is bit (c·bits + j) of the byte stream, byte by byte from bit 0."""
    dim = 13  # not a multiple of 8: the last byte is part padding
    codes = torch.randint(0, 2**bits, (dim,), generator=torch.Generator().manual_seed(bits))
    stream = [(int(c) >> j) & 1 for c in codes for j in range(bits)]
    stream += [0] * (-len(stream) % 8)
    expected = [sum(bit << i for i, bit in enumerate(stream[b : b + 8])) for b in range(0, len(stream), 8)]
    assert pack_bits(codes, bits).tolist() == expected


@pytest.mark.parametrize(
    "preset,key_bytes,value_bytes",
    [  # per token and head at D = 64: vLLM's ⌈D·b/8⌉ + 2 (fp16 norm) keys, ⌈D·b/8⌉ + 4 (fp16 scale, zero) values
        ("turboquant_k8v4", 64, 32 + 4),
        ("turboquant_4bit_nc", 32 + 2, 32 + 4),
        ("turboquant_k3v4_nc", 24 + 2, 32 + 4),
        ("turboquant_3bit_nc", 24 + 2, 24 + 4),
    ],
)
def test_a_layer_holds_vllms_packed_bytes(preset, key_bytes, value_bytes):
    keys, values = torch.randn(2, 1, 3, 37, 64).unbind(0)  # (B=1, H=3, T=37, D=64) each
    method = build_method("turboquant", {"preset": preset})
    layer = TurboQuantLayer.from_kv(keys, values, *method.quantizers())
    cache = DynamicCache()
    cache.layers = [layer]
    assert cache_nbytes(cache) == 3 * 37 * (key_bytes + value_bytes)
    layer.update(*torch.randn(2, 1, 3, 1, 64).unbind(0))  # a decode step is stored packed too
    assert cache_nbytes(cache) == 3 * 38 * (key_bytes + value_bytes) and layer.get_seq_length() == 38
    assert method.layer_bytes(38, 3, 64, 4, full=False) == cache_nbytes(cache)


def test_presets_are_vllms_and_fix_their_bits():
    assert build_method("turboquant", {"preset": "turboquant_k3v4_nc"}).resolved() == {
        "key_bits": 3,
        "value_bits": 4,
        "norm_correction": True,
        "fp8_keys": False,
        "boundary_layers": 2,
    }
    assert PRESETS["turboquant_k8v4"]["fp8_keys"] and not PRESETS["turboquant_k8v4"]["norm_correction"]
    assert build_method("turboquant", {"key_bits": 2, "value_bits": 3}).resolved()["boundary_layers"] == 0
    with pytest.raises(KvbenchError, match="fixes key_bits"):
        build_method("turboquant", {"preset": "turboquant_4bit_nc", "key_bits": 2})
    with pytest.raises(KvbenchError, match="1 to 8 bits"):
        build_method("turboquant", {"key_bits": 9})
    with pytest.raises(KvbenchError, match="rotation=random"):
        Quantizer("rotated", 4).encode(torch.randn(1, 1, 2, 48))  # Hadamard needs a power of two


def test_vllms_boundary_layers_stay_in_full_precision():
    method = build_method("turboquant", {"preset": "turboquant_4bit_nc"})
    assert method.full_precision_layers(30) == {0, 1, 28, 29}
    assert method.full_precision_layers(3) == {0, 2}  # at most half the layers


@pytest.mark.parametrize(
    "params", [{"preset": "turboquant_3bit_nc", "boundary_layers": 1}, {"key_bits": 2, "value_bits": 8}, {}]
)
def test_measured_bytes_are_the_planners(params, tiny_engine, tiny, prompt_ids):
    method = build_method("turboquant", params)
    gen = tiny_engine.run(method, None, prompt_ids, max_new_tokens=6)
    predicted = predict_kv_bytes(method, None, KVShape.of(tiny), len(prompt_ids), 0, gen.decode_steps)
    assert predicted.exact and gen.kv_bytes == predicted.kv_bytes < gen.kv_bytes_full


def test_select_gathers_the_codes_without_requantizing():
    keys, values = torch.randn(2, 1, 2, 20, 32).unbind(0)
    layer = TurboQuantLayer.from_kv(keys, values, *build_method("turboquant").quantizers())
    before_k, before_v = layer.kv()
    index = torch.tensor([[[0, 3, 7, 19], [1, 2, 8, 9]]])  # (B, H, 4): each head its own
    layer.select(index)
    after_k, after_v = layer.kv()
    assert torch.equal(after_k, before_k.gather(2, index[..., None].expand(-1, -1, -1, 32)))
    assert torch.equal(after_v, before_v.gather(2, index[..., None].expand(-1, -1, -1, 32)))


def test_composed_under_eviction(tiny_engine, prompt_ids):
    """compose [h2o, turboquant]: h2o evicts while decoding, the codes are gathered (budget 64 held)."""
    method = build_method("compose", {"stack": ["h2o", "turboquant"]})
    gen = tiny_engine.run(method, Budget.parse(64), prompt_ids, max_new_tokens=8)
    per_token = 2 * (8 + 2 + 8 + 4)  # 2 heads × (keys ⌈16·4/8⌉ + norm, values + scale + zero) at D = 16
    assert gen.kv_bytes == 4 * 64 * per_token


def test_batch_operations_act_on_every_stored_tensor():
    """transformers' batch operations (kvbench.model.cache.MappedLayer) on the packed layers of TurboQuant and
    KIVI: a row selected, reordered or repeated decodes to exactly that row's tokens."""
    from kvbench.methods.kivi import KiviLayer

    keys, values = torch.randn(2, 3, 2, 40, 32).unbind(0)  # (B=3, H=2, T=40, D=32) each
    layers = [
        lambda: TurboQuantLayer.from_kv(keys, values, *build_method("turboquant").quantizers()),
        lambda: KiviLayer.from_kv(keys, values, bits=4, group_size=8, residual_length=16),
    ]
    for make in layers:
        whole_k, whole_v = make().kv()  # (3, 2, 40, 32)
        layer = make()
        layer.batch_select_indices(torch.tensor([2, 0]))
        k, v = layer.kv()
        assert torch.equal(k, whole_k[[2, 0]]) and torch.equal(v, whole_v[[2, 0]])
        layer.reorder_cache(torch.tensor([1, 0]))
        assert torch.equal(layer.kv()[0], whole_k[[0, 2]])
        layer.batch_repeat_interleave(2)
        assert torch.equal(layer.kv()[1], whole_v[[0, 0, 2, 2]])
