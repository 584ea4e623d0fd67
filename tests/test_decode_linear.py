"""The decode-step linear kernel (kernels/csrc/decode_linear.c via kernels/decode_linear.py): each row's result is the
same bits whatever the row count and thread count, close to the float64 product, and everything it does not take
goes to nn.Linear unchanged."""

import copy

import pytest
import torch
import torch.nn.functional as F

from kvbench.kernels import decode_linear

pytestmark = pytest.mark.skipif(decode_linear._kernel() is None, reason="no C compiler: the kernel is not built")

# (N, K): the bundled model's MLP up projection; tails on both axes (N % 4, K % 16 and K % 8 nonzero)
SHAPES = [(1536, 576), (37, 70), (5, 9)]


def inputs(n_out, k_in, rows, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k_in, generator=generator).to(dtype)  # (M, K)
    w = (torch.randn(n_out, k_in, generator=generator) / k_in**0.5).to(dtype)  # (N, K)
    return x, w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_rows_are_independent_of_the_row_count_and_close_to_float64(dtype, shape):
    n_out, k_in = shape
    x, w = inputs(n_out, k_in, decode_linear.MAX_ROWS, dtype)
    alone = torch.cat([decode_linear.linear(x[i : i + 1], w) for i in range(len(x))])  # (M, N), one row per call
    for rows in range(2, decode_linear.MAX_ROWS + 1):
        together = decode_linear.linear(x[:rows], w)  # (rows, N)
        assert together.dtype == dtype and together.shape == (rows, n_out)
        assert torch.equal(together, alone[:rows]), rows
    exact = x.double() @ w.double().T  # (M, N)
    if dtype == torch.float32:
        torch.testing.assert_close(alone.double(), exact, rtol=0, atol=1e-5 * exact.abs().max().item())
    else:  # the float32 sum rounded once to bf16: within one bf16 step of the exact product
        step = exact.abs() * 2.0**-8 + 1e-30
        assert ((alone.double() - exact).abs() <= step).all()
        torch.testing.assert_close(alone, F.linear(x, w), rtol=2**-7, atol=1e-3)  # torch's own bf16 product


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_thread_count_does_not_change_a_bit(dtype):
    x, w = inputs(1536, 576, 7, dtype, seed=1)
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            results.append(decode_linear.linear(x, w))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(r, results[0]) for r in results)


def test_leading_dimensions_and_non_contiguous_inputs():
    x, w = inputs(64, 96, 6, torch.float32, seed=2)
    batched = x.reshape(3, 2, 96)  # (B, T, K): rows are B × T
    want = decode_linear.linear(x, w).reshape(3, 2, 64)
    assert torch.equal(decode_linear.linear(batched, w), want)
    strided = torch.cat([x, x], dim=1)[:, ::2]  # a non-contiguous (6, 96) view with x's values
    assert torch.equal(decode_linear.linear(strided, w), decode_linear.linear(strided.contiguous(), w))


def test_install_swaps_plain_linears_and_leaves_the_rest_to_torch():
    model = torch.nn.Sequential(torch.nn.Linear(96, 64, bias=False), torch.nn.Linear(64, 8, bias=True))
    assert decode_linear.install(model) == 2 and decode_linear.install(model) == 2  # idempotent
    assert decode_linear.installed(model)
    no_bias, biased = model[0], model[1]
    x, _ = inputs(64, 96, decode_linear.MAX_ROWS + 1, torch.float32, seed=3)
    with torch.inference_mode():
        assert torch.equal(no_bias(x[:3]), decode_linear.linear(x[:3], no_bias.weight))  # the kernel
        assert torch.equal(no_bias(x), F.linear(x, no_bias.weight))  # more rows than MAX_ROWS: torch
        h = torch.randn(2, 64)
        assert torch.equal(biased(h), F.linear(h, biased.weight, biased.bias))  # a bias: torch
        wide = copy.deepcopy(no_bias).double()  # float64: torch
        assert torch.equal(wide(x[:3].double()), F.linear(x[:3].double(), wide.weight))
    out = no_bias(x[:3].requires_grad_())  # autograd: torch's product, with its graph
    out.sum().backward()
    assert no_bias.weight.grad is not None


def test_without_the_c_kernels_nothing_is_swapped(monkeypatch):
    monkeypatch.setenv("KVBENCH_NO_CPU_EXT", "1")
    model = torch.nn.Sequential(torch.nn.Linear(8, 8, bias=False))
    assert decode_linear.install(model) == 0 and type(model[0]) is torch.nn.Linear
    assert not decode_linear.installed(model)


def test_the_loader_installs_it_and_a_decode_step_is_row_independent(tiny):
    """The tiny model's whole decode step (every linear incl. the LM head): a row's logits in a batch of 5 are its
    batch-1 logits, bit for bit."""
    assert decode_linear.installed(tiny.model)
    ids = torch.tensor([[5], [17], [99], [3], [250]])  # (B, 1): one token each, no cache
    with torch.inference_mode():
        together = tiny.model(input_ids=ids).logits  # (B, 1, V)
        alone = torch.cat([tiny.model(input_ids=ids[i : i + 1]).logits for i in range(len(ids))])
    assert torch.equal(together, alone)
