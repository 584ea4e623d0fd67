"""The Triton ragged decode kernel against the torch reference, under TRITON_INTERPRET=1 (CPU) and on CUDA."""

import pytest
import torch

from kvbench.model.ragged import RaggedKV, ragged_attention_reference
from tests.conftest import run_interpreted

pytest.importorskip("triton")

# (B, H_q, H_kv, segment lengths, D)
CASES = [
    (1, 4, 2, [70, 5], 16),  # GQA, one short and one multi-block head
    (2, 3, 3, [1, 64, 65, 130, 2, 9], 40),  # MHA, batch 2, head_dim not a power of two
]

_CHILD = """
import sys, torch
from kvbench.kernels.triton.ragged import triton_ragged_decode
inputs = torch.load(sys.argv[1])
torch.save([triton_ragged_decode(q, k, v, lengths, n_kv, s) for q, k, v, lengths, n_kv, s in inputs], sys.argv[2])
"""


def _inputs(bsz, n_q_heads, n_kv_heads, lengths, head_dim, dtype=torch.float32):
    g = torch.Generator().manual_seed(sum(lengths))
    query = torch.randn(bsz, n_q_heads, head_dim, generator=g, dtype=dtype)
    keys = torch.randn(sum(lengths), head_dim, generator=g, dtype=dtype)
    values = torch.randn(sum(lengths), head_dim, generator=g, dtype=dtype)
    return query, keys, values, lengths, n_kv_heads, head_dim**-0.5


def test_interpreted_triton_matches_reference(tmp_path):
    inputs = [_inputs(*case) for case in CASES] + [_inputs(*CASES[0], dtype=torch.bfloat16)]
    outputs = run_interpreted(_CHILD, inputs, tmp_path)
    for (query, keys, values, lengths, n_kv, scaling), (bsz, *_), got in zip(inputs, CASES + CASES[:1], outputs):
        expected = ragged_attention_reference(
            query[:, :, None], RaggedKV(keys, lengths, bsz, n_kv), RaggedKV(values, lengths, bsz, n_kv), scaling
        )[:, 0]  # (B, H_q, D)
        tolerance = 1e-5 if query.dtype == torch.float32 else 2e-2
        assert got.dtype == query.dtype
        torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled Triton needs CUDA")
def test_compiled_triton_matches_reference_on_cuda():
    from kvbench.kernels.triton.ragged import triton_ragged_decode

    for case in CASES + [(1, 32, 8, [1000, 10, 500, 4000, 1, 77, 2048, 3], 128)]:
        query, keys, values, lengths, n_kv, scaling = (x.cuda() if torch.is_tensor(x) else x for x in _inputs(*case))
        expected = ragged_attention_reference(
            query[:, :, None], RaggedKV(keys, lengths, case[0], n_kv), RaggedKV(values, lengths, case[0], n_kv), scaling
        )[:, 0]
        torch.testing.assert_close(
            triton_ragged_decode(query, keys, values, lengths, n_kv, scaling), expected, rtol=1e-4, atol=1e-4
        )
