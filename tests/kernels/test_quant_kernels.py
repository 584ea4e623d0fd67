"""The Triton KIVI quantization kernels equal the torch reference: on CPU interpreted, on CUDA compiled.

As in test_kernels.py, the interpreted run happens in a child process whose environment sets TRITON_INTERPRET=1
from the start (conftest's imports already pulled triton in, in JIT mode). The interpreter converts fp32 to bf16 by
truncation rather than round-to-nearest, so interpreted bf16 outputs may sit one bf16 step below the reference's;
compiled on CUDA every dtype must match exactly (both launch with FMA contraction off).
"""

import pytest
import torch

from tests.conftest import run_interpreted

pytest.importorskip("triton")

from kvbench.kernels import quantize_pack_reference, unpack_dequantize_reference

# (shape, dtype, bits, group_size, transpose_last_two): transposed inputs are keys laid out (B, H, D, T), as KIVI
CASES = [
    ((2, 3, 5, 64), torch.float32, 2, 16, False),  # values: per-token groups of channels
    ((1, 2, 24, 16), torch.bfloat16, 4, 8, True),  # keys: per-channel groups of tokens, a strided view
    ((3, 128), torch.float16, 8, 64, False),
    ((2, 96), torch.bfloat16, 2, 48, False),  # 48 two-bit values = 3 words per group
    ((70, 32), torch.float32, 4, 32, False),  # more rows than one block; row 0 constant
    ((1, 1, 4, 24), torch.float32, 2, 8, False),  # 8 two-bit values: half a word, padded
]

_CHILD = """
import sys, torch
from kvbench.kernels.quantize import quantize_pack
from kvbench.kernels.triton.quant import triton_quantize_pack, triton_unpack_dequantize
out = []
for x, bits, group in torch.load(sys.argv[1]):
    packed, scale, zero = quantize_pack(x, bits, group)  # the reference's packing, unpacked by the kernel
    dequantized = triton_unpack_dequantize(packed, scale, zero, bits, group, x.dtype)
    out.append((triton_quantize_pack(x, bits, group), dequantized))
torch.save(out, sys.argv[2])
"""


def _input(shape, dtype, transpose, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * 3 + 1
    x[(0,) * (len(shape) - 1)] = 0.75  # a constant group (scale 0)
    x = x.to(dtype)
    return x.transpose(-1, -2).contiguous().transpose(-1, -2) if transpose else x


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    inputs = [(_input(shape, dtype, transpose), bits, group) for shape, dtype, bits, group, transpose in CASES]
    return inputs, run_interpreted(_CHILD, inputs, tmp_path_factory.mktemp("triton_quant"))


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"{c[0]}-{c[1]}-{c[2]}bit-g{c[3]}" for c in CASES])
def test_interpreted_triton_matches_reference(interpreted, case):
    (x, bits, group), (quantized, dequantized) = interpreted[0][case], interpreted[1][case]
    reference = quantize_pack_reference(x, bits, group)
    for got, want in zip(quantized, reference):  # packed words, scales and zeros: bit for bit
        assert got.dtype == want.dtype and torch.equal(got, want)
    want = unpack_dequantize_reference(*reference, bits, group, x.dtype)
    assert dequantized.dtype == x.dtype and dequantized.shape == x.shape
    if x.dtype == torch.bfloat16:  # the interpreter truncates to bf16: at most one bf16 step apart
        torch.testing.assert_close(dequantized, want, rtol=2**-7, atol=0)
    else:
        assert torch.equal(dequantized, want)


def test_dispatch_uses_the_reference_off_cuda(monkeypatch):
    from kvbench.kernels import quantize_pack, unpack_dequantize

    x = _input((2, 64), torch.bfloat16, False)
    for env in ("0", "1"):
        monkeypatch.setenv("KVBENCH_NO_TRITON", env)
        got = quantize_pack(x, 4, 32)
        assert all(torch.equal(a, b) for a, b in zip(got, quantize_pack_reference(x, 4, 32)))
        assert torch.equal(unpack_dequantize(*got, 4, 32, x.dtype), unpack_dequantize_reference(*got, 4, 32, x.dtype))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled Triton needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_compiled_triton_matches_reference_on_cuda(dtype):
    from kvbench.kernels import quantize_pack, unpack_dequantize
    from kvbench.kernels.triton.quant import triton_quantize_pack, triton_unpack_dequantize

    cases = [(shape, bits, group, transpose) for shape, _, bits, group, transpose in CASES]
    cases += [((1, 8, 128, 4096), 2, 64, True), ((1, 8, 4096, 128), 4, 32, False), ((2, 8, 4096, 128), 8, 128, False)]
    for shape, bits, group, transpose in cases:
        x = _input(shape, dtype, transpose).cuda()
        want = quantize_pack_reference(x, bits, group)
        for fn in (triton_quantize_pack, quantize_pack):  # the kernel, and the dispatch that picks it
            assert all(torch.equal(a, b) for a, b in zip(fn(x, bits, group), want))
        want_x = unpack_dequantize_reference(*want, bits, group, dtype)
        assert torch.equal(triton_unpack_dequantize(*want, bits, group, dtype), want_x)
        assert torch.equal(unpack_dequantize(*want, bits, group, dtype), want_x)
