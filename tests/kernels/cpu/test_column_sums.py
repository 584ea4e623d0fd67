"""H2O's / SnapKV's column sums in C (kvbench/kernels/cpu/column_sums.py): equal to their definition and to the torch loop of
kvbench.kernels.attention_stats, whatever the thread count."""

import pytest
import torch

from kvbench.kernels import attention_column_sums, attention_stats
from kvbench.kernels.cpu import column_sums

needs_cc = pytest.mark.skipif(
    column_sums._sgemm_kernel() is None, reason="no C compiler, or a torch without MKL's sgemm_"
)


def _log2_column_sums(rows, key):
    """Σ_i softmax over causal keys of rows_i · k (already in log2 units), in float64: the kernel's definition."""
    group = rows.shape[1] // key.shape[1]
    scores = rows.double() @ key.repeat_interleave(group, dim=1).double().transpose(-1, -2)  # (B, H_q, Q, T)
    n_queries, n_keys = rows.shape[2], key.shape[2]
    future = torch.arange(n_keys)[None, :] > (n_keys - n_queries + torch.arange(n_queries))[:, None]
    probs = torch.exp2(scores.masked_fill(future, float("-inf")) - scores.masked_fill(future, -1e30).amax(-1, True))
    return (probs / probs.sum(-1, keepdim=True)).sum(2)  # (B, H_q, T)


@needs_cc
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_fused_column_sums_meet_their_definition(monkeypatch, dtype, threads):
    torch.manual_seed(0)
    monkeypatch.setattr(column_sums, "_kernel_chunk", lambda n_keys: 11)  # threads' ranges split heads
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        shapes = [(2, 6, 2, 70), (2, 6, 2, 9), (2, 6, 2, 1), (1, 1, 1, 70)]  # (B, H_q, H_kv, Q): a window, one
        for bsz, n_q_heads, n_kv_heads, n_queries in shapes:  # query, one head shared by every thread
            query = (torch.randn(bsz, n_q_heads, n_queries, 16) * 3).to(dtype)  # (B, H_q, Q, D)
            key = (torch.randn(bsz, n_kv_heads, 70, 16) * 3).to(dtype)  # (B, H_kv, T, D)
            fused = attention_column_sums(query, key, 0.25)
            # in bf16 the scaled query rows are rounded to bf16 (as eager attention's product sees them), then the
            # products are exact in fp32: the definition on those rounded rows
            rows = (query.float() * (0.25 * attention_stats._LOG2E)).to(dtype)
            torch.testing.assert_close(fused.double(), _log2_column_sums(rows, key), rtol=2e-5, atol=1e-6)
            assert torch.equal(fused, attention_column_sums(query, key, 0.25))  # no dependence on thread timing
            if dtype == torch.float32:  # and the torch loop it replaces
                monkeypatch.setenv("KVBENCH_NO_CPU_EXT", "1")
                torch.testing.assert_close(fused, attention_column_sums(query, key, 0.25), rtol=1e-5, atol=1e-6)
                monkeypatch.delenv("KVBENCH_NO_CPU_EXT")
    finally:
        torch.set_num_threads(previous)


@needs_cc
@pytest.mark.skipif(not column_sums.bf16_column_sums(), reason="no AVX512-BF16: bf16 rows take the sgemm path")
def test_bf16_dot_products_give_the_sgemm_paths_sums(monkeypatch):
    """bf16 inputs on an AVX512-BF16 CPU take the dot-product path (the same exact products, summed in another order):
    within float32 rounding of the path that widens them for sgemm, at the bundled model's shapes, lengths that are
    not whole 16-key blocks, a window of queries and chunks that are not whole register tiles."""
    calls = []
    bf16_path = column_sums._causal_column_sums_bf16
    monkeypatch.setattr(column_sums, "_causal_column_sums_bf16", lambda *a: calls.append(1) or bf16_path(*a))
    for n_keys, n_queries, chunk in ((1000, 1000, 128), (333, 32, 13), (17, 17, 16)):
        monkeypatch.setattr(column_sums, "_kernel_chunk", lambda n, c=chunk: c)
        generator = torch.Generator().manual_seed(n_keys)
        query = torch.randn(1, 9, n_queries, 64, generator=generator).to(torch.bfloat16)  # (B, H_q, Q, D)
        key = (torch.randn(1, 3, n_keys, 64, generator=generator) * 2).to(torch.bfloat16)  # (B, H_kv, T, D)
        dots = attention_column_sums(query, key, 0.125)
        with monkeypatch.context() as m:
            m.setattr(column_sums, "_causal_column_sums_bf16", lambda *a: False)
            widened = attention_column_sums(query, key, 0.125)
        torch.testing.assert_close(dots, widened, rtol=1e-5, atol=1e-6)
        assert dots.shape == (1, 9, n_keys)
    assert len(calls) == 3


@needs_cc
def test_the_fused_kernel_keeps_fully_masked_rows_and_extreme_scores_finite():
    query = torch.zeros(1, 1, 4, 4)
    query[0, 0, 3] = 1e4  # the last query: scores of ±1e4: everything but the row maximum underflows to zero
    key = torch.randn(1, 1, 4, 4)
    sums = attention_column_sums(query, key, 1.0)
    assert torch.isfinite(sums).all()
    torch.testing.assert_close(sums.sum(-1), torch.tensor([[4.0]]))


@needs_cc
def test_inconsistent_shapes_raise_instead_of_reaching_the_kernel():
    with pytest.raises(RuntimeError):  # more queries than keys: torch's own error, not a read past the keys
        attention_column_sums(torch.randn(1, 2, 8, 16), torch.randn(1, 2, 4, 16), 0.25)
