"""The Triton column-sum kernel equals the torch reference: on CPU under the Triton interpreter, on CUDA compiled.

TRITON_INTERPRET must be set before triton is first imported (it picks JIT or interpreter as each @triton.jit,
triton's own tl.sum / tl.zeros included, is decorated). conftest's imports already pull triton in through
torch._dynamo, so setting it here would come too late and would leak into every later test: the interpreted run
happens in a child process whose environment sets it from the start.
"""

import pytest
import torch

from tests.conftest import run_interpreted

pytest.importorskip("triton")

from kvbench.kernels import attention_column_sums_reference

# (H_q, H_kv, T, Q, D); block size 64
CASES = [
    (4, 4, 128, 128, 16),  # MHA, full prefill, T a multiple of the block
    (6, 2, 150, 150, 64),  # GQA, full prefill, T not a multiple of the block
    (9, 3, 200, 8, 16),  # GQA observation window
    (6, 2, 133, 1, 64),  # a single (decode-step) query
    (2, 1, 70, 70, 40),  # head_dim not a power of two: padded and masked
]

_CHILD = """
import sys, torch
from kvbench.kernels.triton.stats import triton_attention_column_sums
inputs = torch.load(sys.argv[1])
torch.save([triton_attention_column_sums(q, k, s) for q, k, s in inputs], sys.argv[2])
"""


def _inputs(n_q_heads, n_kv_heads, n_keys, n_queries, head_dim, dtype=torch.float32, bsz=1):
    g = torch.Generator().manual_seed(n_keys * 1000 + n_queries)
    query = torch.randn(bsz, n_q_heads, n_keys, head_dim, generator=g, dtype=dtype)[:, :, -n_queries:]  # strided
    key = torch.randn(bsz, n_kv_heads, n_keys, head_dim, generator=g, dtype=dtype)  # (B, H_kv, T, D)
    return query, key, head_dim**-0.5  # query (B, H_q, Q, D)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    """Every case (fp32 CASES, then bf16 batched GQA) run once by the interpreter in a child process."""
    inputs = [_inputs(*case) for case in CASES] + [_inputs(6, 2, 97, 8, 64, dtype=torch.bfloat16, bsz=2)]
    return inputs, run_interpreted(_CHILD, inputs, tmp_path_factory.mktemp("triton"))


@pytest.mark.parametrize("case", range(len(CASES)), ids=[str(c) for c in CASES])
def test_interpreted_triton_matches_reference_fp32(interpreted, case):
    (query, key, scaling), got = interpreted[0][case], interpreted[1][case]
    torch.testing.assert_close(got, attention_column_sums_reference(query, key, scaling), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got.sum(-1), torch.full(got.shape[:2], float(query.shape[2])))  # rows sum to 1


def test_interpreted_triton_matches_reference_bf16(interpreted):
    """The Triton kernel keeps bf16 inputs' scores in fp32 (tl.dot accumulates and returns fp32); the torch version
    rounds QKᵀ to bf16 as eager attention does (within 1 %: checked here too)."""
    (query, key, scaling), got = interpreted[0][-1], interpreted[1][-1]
    assert got.dtype == torch.float32 and query.dtype == torch.bfloat16
    fp32_scores = attention_column_sums_reference(query.float(), key.float(), scaling)
    torch.testing.assert_close(got, fp32_scores, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(attention_column_sums_reference(query, key, scaling), fp32_scores, rtol=1e-2, atol=2e-3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled Triton needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_compiled_triton_matches_reference_on_cuda(dtype):
    from kvbench.kernels import attention_column_sums
    from kvbench.kernels.triton.stats import triton_attention_column_sums

    for case in CASES + [(32, 8, 1000, 1000, 128), (32, 8, 1000, 32, 128)]:
        query, key, scaling = (t.cuda() if torch.is_tensor(t) else t for t in _inputs(*case, dtype=dtype))
        want = attention_column_sums_reference(query, key, scaling)
        torch.testing.assert_close(triton_attention_column_sums(query, key, scaling), want, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(attention_column_sums(query, key, scaling), want, rtol=1e-4, atol=1e-5)
