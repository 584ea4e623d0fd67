"""The causal prefill attention kernel for bf16 on AVX512-BF16 CPUs (kernels/cpu/csrc/prefill_attention.c via
kernels/cpu/causal_prompt.py): as close to the float64 attention as torch's sdpa is, the same bits at any thread
count, NaN where sdpa has NaN, taken for the model's prompts and only for what it models, and its rows hash apart."""

import pytest
import torch
import torch.nn.functional as F

from kvbench.kernels import cpu
from kvbench.kernels.cpu import causal_prompt

pytestmark = pytest.mark.skipif(
    not causal_prompt.supported(64), reason="the kernel needs a C compiler and a CPU with AVX512-BF16"
)

# (B, H_q, H_kv, T, D): the bundled model's GQA at odd lengths (one 16-key block, a chunk and one, several chunks);
# MHA; the 8B architecture's head size 128 with 2 rows; MQA
SHAPES = [(1, 9, 3, 37, 64), (1, 9, 3, 513, 64), (1, 9, 3, 1100, 64), (1, 4, 4, 200, 64), (2, 8, 2, 300, 128),
          (1, 8, 1, 65, 128), (1, 2, 1, 2, 64)]  # fmt: skip


def inputs(shape, seed=0):
    batch, n_q, n_kv, n_tokens, dim = shape
    generator = torch.Generator().manual_seed(seed)
    # the query as the model makes it: (B, T, H_q, D) projected, viewed as (B, H_q, T, D) — not contiguous
    q = torch.randn(batch, n_tokens, n_q, dim, generator=generator).to(torch.bfloat16).transpose(1, 2)
    k = (torch.randn(batch, n_kv, n_tokens, dim, generator=generator) * 2).to(torch.bfloat16)  # (B, H_kv, T, D)
    v = torch.randn(batch, n_kv, n_tokens, dim, generator=generator).to(torch.bfloat16)
    return q, k, v


def reference(q, k, v, scale):
    """float64 causal softmax attention → (B, T, H_q, D)."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(group, dim=1) for t in (k, v))  # (B, H_q, T, D)
    scores = q.double() @ k.transpose(-1, -2) * scale  # (B, H_q, T, T)
    future = torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1)
    return (scores.masked_fill(future, float("-inf")).softmax(-1) @ v).transpose(1, 2)


@pytest.mark.parametrize("shape", SHAPES)
def test_as_close_to_float64_as_sdpa(shape):
    q, k, v = inputs(shape)
    scale = shape[-1] ** -0.5
    assert causal_prompt.applies(q, k, v)
    out = causal_prompt.attend(q, k, v, scale)  # (B, T, H_q, D)
    want = reference(q, k, v, scale)
    sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True).transpose(1, 2)
    assert out.dtype == torch.bfloat16 and out.shape == want.shape == sdpa.shape
    error, sdpa_error = (out.double() - want).abs(), (sdpa.double() - want).abs()
    assert error.max() <= 1.25 * sdpa_error.max() + 1e-3
    assert error.mean() <= 1.1 * sdpa_error.mean() + 1e-6  # no worse on average: same roundings, other order
    assert (out == sdpa).float().mean() > 0.8  # mostly the very bf16 values sdpa gives


def test_keys_and_values_inside_a_longer_buffer():
    """K/V as the cache holds them after growing: slices of longer per-head buffers (head stride ≠ T·D), 2 rows, and
    K from a (B, T, H, D) layout — the same bits as from contiguous copies."""
    q, k, v = inputs((2, 9, 3, 300, 64), seed=4)
    buffer_k = torch.zeros(2, 3, 512, 64, dtype=torch.bfloat16)
    buffer_v = torch.zeros(2, 3, 512, 64, dtype=torch.bfloat16)
    buffer_k[:, :, :300], buffer_v[:, :, :300] = k, v
    sliced_k, sliced_v = buffer_k[:, :, :300], buffer_v[:, :, :300]  # (B, H_kv, T, D) views, head stride 512·D
    token_major = k.transpose(1, 2).contiguous().transpose(1, 2)  # (B, H_kv, T, D) over (B, T, H_kv, D) memory
    want = causal_prompt.attend(q, k, v, 0.125)
    assert causal_prompt.applies(q, sliced_k, sliced_v) and causal_prompt.applies(q, token_major, v)
    assert torch.equal(causal_prompt.attend(q, sliced_k, sliced_v, 0.125), want)
    assert torch.equal(causal_prompt.attend(q, token_major, v, 0.125), want)


def test_switching_the_c_kernels_off_mid_process_goes_back_to_sdpa(monkeypatch):
    """KVBENCH_NO_CPU_EXT=1 set after the kernel was used (benchmarks switch it between runs): nothing takes the
    kernel any more, a call that still reaches it gets None (sdpa), and bf16 rows lose the kernels' hash key."""
    from types import SimpleNamespace

    from kvbench.model.attention import _plain_attention
    from kvbench.run.config_hash import bf16_kernels

    q, k, v = inputs((1, 9, 3, 50, 64))
    lm = SimpleNamespace(dtype=torch.bfloat16, device=torch.device("cpu"), model=torch.nn.Sequential())
    assert causal_prompt.applies(q, k, v) and bf16_kernels(lm)
    monkeypatch.setenv("KVBENCH_NO_CPU_EXT", "1")
    assert not causal_prompt.applies(q, k, v) and not bf16_kernels(lm)
    assert causal_prompt.attend(q, k, v, 0.125) is None
    module = torch.nn.Module()  # an attention module as the model's: 3 query heads per KV head, causal
    module.num_key_value_groups, module.is_causal = 3, True
    module.config = SimpleNamespace(num_key_value_heads=3)
    sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.125, enable_gqa=True).transpose(1, 2)
    out, _ = _plain_attention(module, q, k, v, None, 0.125)
    torch.testing.assert_close(out, sdpa, rtol=0, atol=0)


def test_the_same_bits_at_any_thread_count():
    q, k, v = inputs((1, 9, 3, 700, 64), seed=1)
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            results.append(causal_prompt.attend(q, k, v, 0.125))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(r, results[0]) for r in results)


def test_nan_reaches_the_queries_that_see_it_only():
    """A NaN key at position 17 makes its heads' outputs NaN from query 17 on (as sdpa's); earlier queries and
    the other heads are untouched."""
    q, k, v = inputs((1, 9, 3, 100, 64), seed=2)
    clean = causal_prompt.attend(q, k, v, 0.125)
    k[0, 1, 17, 5] = float("nan")
    out = causal_prompt.attend(q, k, v, 0.125)  # (1, T, H_q, D)
    assert out[0, 17:, 3:6].isnan().all() and not out[0, :17].isnan().any()
    assert torch.equal(out[0, :, :3], clean[0, :, :3]) and torch.equal(out[0, :, 6:], clean[0, :, 6:])


def test_what_it_does_not_take_goes_to_sdpa():
    from kvbench.model.attention import _causal_prefill_ok

    q, k, v = inputs((1, 9, 3, 50, 64))
    module = torch.nn.Module()
    assert _causal_prefill_ok(module, k, {}) and _causal_prefill_ok(module, k, {"sliding_window": 50})
    assert not causal_prompt.applies(q.float(), k.float(), v.float())  # float32: sdpa is as fast there
    assert not causal_prompt.applies(q.half(), k.half(), v.half())
    assert not causal_prompt.applies(q[:, :, :1], k[:, :, :1], v[:, :, :1])  # one query: a decode step
    assert not causal_prompt.applies(q[:, :, 10:], k, v)  # fewer queries than keys (a suffix): masked
    assert not causal_prompt.applies(*inputs((1, 4, 2, 50, 80)))  # head size neither 64 nor 128
    assert not causal_prompt.applies(q, k.transpose(-1, -2).contiguous().transpose(-1, -2), v)
    for kwargs in ({"softcap": 30.0}, {"s_aux": torch.zeros(9)}, {"dropout": 0.1}, {"sliding_window": 49},
                   {"is_causal": False}, {"position_bias": torch.zeros(1)}):  # fmt: skip
        assert not _causal_prefill_ok(module, k, kwargs), kwargs
    module.is_causal = False  # an encoder's attention
    assert not _causal_prefill_ok(module, k, {})


def test_the_models_prompts_use_it_and_predict_as_with_sdpa(monkeypatch):
    """A random Llama with the bundled model's attention shapes in bf16: every layer's prefill attention goes
    through the kernel, and its logits are sdpa's within bf16 noise (same greedy next token)."""
    from omegaconf import OmegaConf

    from kvbench.engine.engine import Engine
    from kvbench.methods import build_method
    from kvbench.model.load import load_model
    from kvbench.run.config_hash import bf16_kernels
    from tests.conftest import CONF_DIR

    cfg = OmegaConf.load(CONF_DIR / "model" / "tiny-random.yaml")
    cfg.name = "tiny-random-smollm-attention"
    cfg.architecture.update(hidden_size=576, num_hidden_layers=2, num_attention_heads=9, num_key_value_heads=3)
    cfg.architecture.head_dim = 64
    lm = load_model(cfg, "cpu", "bfloat16")
    assert bf16_kernels(lm)
    engine, method = Engine(lm), build_method("full", {})
    ids = torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(3)).tolist()
    calls = []
    attend = causal_prompt.attend
    monkeypatch.setattr(causal_prompt, "attend", lambda *a, **kw: calls.append(1) or attend(*a, **kw))
    with_kernel = engine.prefill(ids, method.stats_request())
    assert len(calls) == 2  # both layers
    monkeypatch.setattr(causal_prompt, "applies", lambda *a: False)
    with_sdpa = engine.prefill(ids, method.stats_request())
    assert len(calls) == 2
    torch.testing.assert_close(with_kernel.last_logits, with_sdpa.last_logits, rtol=0.05, atol=0.05)
    assert with_kernel.last_logits.argmax() == with_sdpa.last_logits.argmax()
    assert all(k.shape == (1, 3, 300, 64) for k, _ in with_kernel.kv)
    assert torch.equal(with_kernel.kv[0][0], with_sdpa.kv[0][0])  # layer 0's K/V come before any attention


def test_rows_computed_with_it_hash_apart(monkeypatch):
    from types import SimpleNamespace

    from kvbench.run.config_hash import bf16_kernels, hash_configuration
    from kvbench.run.configuration import configurations
    from tests.conftest import compose_config

    cfg = compose_config("model=tiny-random")
    conf = configurations(cfg)[0]
    model = torch.nn.Sequential()

    def lm(dtype, device="cpu"):
        return SimpleNamespace(dtype=dtype, device=torch.device(device), model=model)

    assert bf16_kernels(lm(torch.bfloat16)) and not bf16_kernels(lm(torch.float32))
    assert not bf16_kernels(lm(torch.bfloat16, "meta"))  # CUDA and other devices: torch's kernels
    with_kernels = hash_configuration(conf, cfg, lm(torch.bfloat16))
    monkeypatch.setattr(cpu, "prefill_attention_supported", lambda head_dim: False)  # a CPU without AVX512-BF16
    assert not bf16_kernels(lm(torch.bfloat16))
    assert with_kernels != hash_configuration(conf, cfg, lm(torch.bfloat16))
