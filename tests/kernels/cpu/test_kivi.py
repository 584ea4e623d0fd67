"""KIVI's C kernel in the CPU backend (kvbench/kernels/cpu/kivi.py): decode attention on the packed groups against the torch
version it replaces (kvbench/kernels/kivi_attention.packed_decode_attention)."""

import shutil

import pytest
import torch

from kvbench.kernels import cpu
from kvbench.kernels.cpu import build, kivi
from kvbench.kernels.quantize import quantize_pack, words_per_group
from kvbench.methods import build_method, method_defaults


@pytest.fixture
def c_kernel():
    """The compiled C kernel; these tests skip only where no C compiler is found (then kvbench runs the torch path)."""
    if not (shutil.which("cc") or shutil.which("gcc")) or not build.enabled():
        pytest.skip("no C compiler, or KVBENCH_NO_CPU_EXT=1")
    assert build.load("kivi_decode_attention") is not None
    return kivi.kivi_decode_attention


def _storage(bsz, heads, dim, group, key_bits, value_bits, n_key_groups, key_residual, value_residual, n_dead,
             dtype=torch.float32, seed=0):  # fmt: skip
    """A KiviStorage built directly by quantize_pack, any split: T = N_k·G + r_k = T_v + r_v slots (bits 16: that part
    all residual), n_dead random dead slots per head (each head its own)."""
    from kvbench.kernels.kivi_attention import KiviStorage

    g = torch.Generator().manual_seed(seed)
    slots = n_key_groups * group + key_residual
    n_keys = n_key_groups * group if key_bits < 16 else 0
    n_values = slots - value_residual if value_bits < 16 else 0
    keys = (torch.randn(bsz, heads, slots, dim, generator=g) * torch.linspace(0.5, 4, dim)).to(dtype)  # (B, H, T, D)
    values = (torch.randn(bsz, heads, slots, dim, generator=g) + 1).to(dtype)
    key_q = quantize_pack(keys[:, :, :n_keys].transpose(2, 3), key_bits, group) if n_keys else None
    words_v = dim // group * words_per_group(value_bits, group) if value_bits < 16 else 0
    empty_k = (torch.zeros(bsz, heads, dim, 0, dtype=torch.int32), *[torch.zeros(bsz, heads, dim, 0, dtype=dtype)] * 2)
    value_q = quantize_pack(values[:, :, :n_values], value_bits, group) if n_values else None
    empty_v = (
        torch.zeros(bsz, heads, 0, words_v, dtype=torch.int32),
        *[torch.zeros(bsz, heads, 0, words_v and dim // group, dtype=dtype)] * 2,
    )
    dead = None
    if n_dead:
        dead = torch.stack([torch.randperm(slots, generator=g)[:n_dead] for _ in range(bsz * heads)])  # (B·H, n_dead)
        dead = dead.view(bsz, heads, -1).to(torch.int32)  # (B, H, n_dead)
    return KiviStorage(*(key_q or empty_k), keys[:, :, n_keys:].contiguous(), *(value_q or empty_v),
                       values[:, :, n_values:].contiguous(), key_bits, value_bits, group, dead)  # fmt: skip


# (dim, group): words per group 1 (generic C path), 2, 3 (generic), 4, 8, 16, 32 across the bit widths (a group in
# one or several passes of 8 vectors); padded groups
@pytest.mark.parametrize("dim,group", [(16, 8), (48, 12), (48, 16), (64, 32), (64, 64), (128, 32), (128, 128)])
@pytest.mark.parametrize("key_bits,value_bits", [(2, 2), (4, 4), (8, 8), (4, 2), (2, 8)])
def test_c_kernel_equals_torch_path(c_kernel, dim, group, key_bits, value_bits):
    """B = 2, GQA (3 query heads per KV head), dead slots, key residual present / empty, value residual present / empty,
    blocks of several hundred slots (the C kernel's work items split at 256 tokens)."""
    from kvbench.kernels.kivi_attention import packed_decode_attention

    for n_groups, key_residual, value_residual, n_dead in [(600 // group, 5, 40, 30), (3, 0, 0, 0), (1, 7, 3, 2)]:
        slots = n_groups * group + key_residual
        storage = _storage(2, 2, dim, group, key_bits, value_bits, n_groups, key_residual, value_residual, n_dead)
        query = torch.randn(2, 6, 1, dim)  # (B, H_q, 1, D)
        got, want = c_kernel(query, storage, dim**-0.5), packed_decode_attention(query, storage, dim**-0.5)
        assert got.shape == want.shape == (2, 1, 6, dim) and slots > n_dead
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # outputs O(1): atol for cancellations


@pytest.mark.parametrize("key_bits,value_bits", [(16, 4), (4, 16), (16, 16)])
def test_c_kernel_with_an_empty_quantized_part(c_kernel, key_bits, value_bits):
    """bits=16 for keys or values (or both): that part is all residual, nothing quantized, in C as in torch."""
    from kvbench.kernels.kivi_attention import packed_decode_attention

    storage = _storage(2, 2, 16, 8, key_bits, value_bits, 5, 3, 11, 4)
    query = torch.randn(2, 4, 1, 16)  # (B, H_q, 1, D)
    got, want = c_kernel(query, storage, 0.25), packed_decode_attention(query, storage, 0.25)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_c_kernel_in_bf16_is_the_torch_path_to_one_rounding(c_kernel):
    from kvbench.kernels.kivi_attention import packed_decode_attention

    storage = _storage(1, 3, 64, 64, 4, 4, 9, 20, 64, 10, dtype=torch.bfloat16)
    query = torch.randn(1, 9, 1, 64).bfloat16()  # (B, H_q, 1, D)
    got, want = c_kernel(query, storage, 0.125), packed_decode_attention(query, storage, 0.125)
    assert got.dtype == torch.bfloat16
    assert ((got.float() - want.float()).abs() <= want.float().abs() * 2**-7 + 1e-6).all()  # one bf16 step at most


def test_c_kernel_is_bit_identical_across_thread_counts(c_kernel):
    """Work items are fixed blocks of tokens, partial sums added in block order: 1 and 2 threads give the same bits."""
    storage = _storage(2, 3, 64, 32, 4, 2, 40, 9, 50, 25)  # 1289 slots: 6 value blocks per head
    query = torch.randn(2, 6, 1, 64)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 1):
            torch.set_num_threads(n)
            outs.append(c_kernel(query, storage, 0.125))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_c_kernel_falls_back_where_it_does_not_apply(c_kernel, monkeypatch):
    """No C: KVBENCH_NO_CPU_EXT=1, or a float16 model: None, and the dispatcher runs the torch path."""
    import kvbench.kernels as kernels
    from kvbench.kernels.kivi_attention import packed_decode_attention

    storage = _storage(1, 2, 16, 8, 4, 4, 4, 3, 16, 0)
    query = torch.randn(1, 2, 1, 16)
    half = storage._replace(**{n: getattr(storage, n).half() for n in ("key_scale", "key_zero", "key_residual")})
    assert c_kernel(query.half(), half, 0.25) is None
    monkeypatch.setenv("KVBENCH_NO_CPU_EXT", "1")
    assert c_kernel(query, storage, 0.25) is None
    want = packed_decode_attention(query, storage, 0.25)
    assert torch.equal(kernels.kivi_decode_attention(query, storage, 0.25), want)


@pytest.mark.parametrize("params", [{"bits": 4}, {"key_bits": 2, "value_bits": 8}])
def test_generation_with_the_c_kernel_equals_the_torch_path(c_kernel, params, tiny_engine, prompt_ids, monkeypatch):
    """The tiny model (fp32) generates the same tokens with the C kernel as with KVBENCH_NO_CPU_EXT=1 (torch)."""
    method = build_method("kivi", {**method_defaults("kivi"), "group_size": 16, "residual_length": 32, **params})
    calls = []
    monkeypatch.setattr(cpu, "kivi_decode_attention", lambda *a: calls.append(1) or c_kernel(*a))
    with_c = tiny_engine.run(method, None, prompt_ids, max_new_tokens=12, keep_logits=True)
    assert len(calls) == with_c.decode_steps * tiny_engine.lm.n_layers  # every decode step, every layer
    monkeypatch.setenv("KVBENCH_NO_CPU_EXT", "1")
    torch_path = tiny_engine.run(method, None, prompt_ids, max_new_tokens=12, keep_logits=True)
    assert with_c.token_ids == torch_path.token_ids
    assert all(torch.allclose(a, b, atol=1e-4) for a, b in zip(with_c.logits, torch_path.logits))
