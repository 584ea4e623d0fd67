"""The decode-step linear kernel (kvbench/kernels/cpu/csrc/decode_linear.c via kvbench/kernels/cpu/decode_linear.py): each row's
result is the same bits whatever the row count and thread count, close to the float64 product, and everything it
does not take goes to nn.Linear unchanged."""

import copy

import pytest
import torch
import torch.nn.functional as F

from kvbench.kernels.cpu import decode_linear

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
    assert not decode_linear.rows_independent(
        model
    )  # the biased layer stays torch's: decode steps are not row-independent
    assert decode_linear.rows_independent(model[:1])
    half = copy.deepcopy(model[:1]).half()
    assert not decode_linear.rows_independent(half)  # float16: torch's
    mixed = torch.nn.Sequential(copy.deepcopy(model[0]), copy.deepcopy(model[0]).to(torch.bfloat16))
    assert not decode_linear.rows_independent(mixed)  # two dtypes
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
    assert not decode_linear.rows_independent(model)


def test_the_loader_installs_it_and_a_decode_step_is_row_independent(tiny):
    """The tiny model's whole decode step (every linear incl. the LM head): a row's logits in a batch of 5 are its
    batch-1 logits, bit for bit."""
    assert decode_linear.rows_independent(tiny.model)
    ids = torch.tensor([[5], [17], [99], [3], [250]])  # (B, 1): one token each, no cache
    with torch.inference_mode():
        together = tiny.model(input_ids=ids).logits  # (B, 1, V)
        alone = torch.cat([tiny.model(input_ids=ids[i : i + 1]).logits for i in range(len(ids))])
    assert torch.equal(together, alone)


@pytest.mark.parametrize("rows", [3, 10])  # oneDNN's bf16 products round a row differently at these counts
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_decode_step_at_the_bundled_models_shapes_is_row_independent(dtype, rows):
    """A random Llama with SmolLM2-135M's layer shapes (hidden 576, MLP 1536, 9 query / 3 KV heads of 64; 2 layers):
    one decode step of 3 or 10 rows over their caches gives each row's logits of its own 1-row step, bit for bit — the
    linear kernel and the attention kernel together (torch's products fail this: see the fp32 case above)."""
    from omegaconf import OmegaConf
    from transformers import DynamicCache

    from kvbench.model.load import load_model
    from tests.conftest import CONF_DIR

    cfg = OmegaConf.load(CONF_DIR / "model" / "tiny-random.yaml")
    cfg.name = "tiny-random-smollm-shapes"
    cfg.architecture.update(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=2, num_attention_heads=9, num_key_value_heads=3
    )
    cfg.architecture.head_dim = 64
    lm = load_model(cfg, "cpu", dtype)
    assert decode_linear.rows_independent(lm.model)
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, 256, (rows, 40), generator=generator)  # (B, T): one length, so the caches stack
    last = torch.randint(0, 256, (rows, 1), generator=generator)  # (B, 1): the step's tokens
    with torch.inference_mode():
        caches = []
        for row in prompts:  # each prefilled alone: the prefill's products are torch's and not under test
            cache = DynamicCache()
            lm.model(input_ids=row[None], cache=cache, use_cache=True)
            caches.append(cache)
        alone = [
            lm.model(input_ids=last[i : i + 1], cache=copy.deepcopy(c), use_cache=True).logits
            for i, c in enumerate(caches)
        ]  # (1, 1, V) each
        stacked = DynamicCache()
        for layer in range(len(caches[0].layers)):
            keys = torch.cat([c.layers[layer].keys for c in caches])  # (B, H_kv, T, D)
            values = torch.cat([c.layers[layer].values for c in caches])
            stacked.update(keys, values, layer)
        together = lm.model(input_ids=last, cache=stacked, use_cache=True).logits  # (B, 1, V)
    assert torch.equal(together, torch.cat(alone))
