"""The C CPU kernels (kernels/csrc/, built by kernels/cpu_ext.py) equal their torch paths, and their absence is safe."""

import pytest
import torch

from kvbench.kernels import attention_column_sums, attention_stats, cpu_ext, prefill_attention

needs_cc = pytest.mark.skipif(
    attention_stats._fused_kernel(torch.device("cpu"), torch.float32, None, None) is None,
    reason="no C compiler, or a torch without MKL's sgemm_",
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
    monkeypatch.setattr(attention_stats, "_kernel_chunk", lambda n_keys: 11)  # threads' ranges split heads
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
@pytest.mark.skipif(not prefill_attention.supported(64), reason="no AVX512-BF16: bf16 rows take the sgemm path")
def test_bf16_dot_products_give_the_sgemm_paths_sums(monkeypatch):
    """bf16 inputs on an AVX512-BF16 CPU take the dot-product path (the same exact products, summed in another order):
    within float32 rounding of the path that widens them for sgemm, at the bundled model's shapes, lengths that are
    not whole 16-key blocks, a window of queries and chunks that are not whole register tiles."""
    calls = []
    bf16_path = attention_stats._causal_column_sums_bf16
    monkeypatch.setattr(attention_stats, "_causal_column_sums_bf16", lambda *a: calls.append(1) or bf16_path(*a))
    for n_keys, n_queries, chunk in ((1000, 1000, 128), (333, 32, 13), (17, 17, 16)):
        monkeypatch.setattr(attention_stats, "_kernel_chunk", lambda n, c=chunk: c)
        generator = torch.Generator().manual_seed(n_keys)
        query = torch.randn(1, 9, n_queries, 64, generator=generator).to(torch.bfloat16)  # (B, H_q, Q, D)
        key = (torch.randn(1, 3, n_keys, 64, generator=generator) * 2).to(torch.bfloat16)  # (B, H_kv, T, D)
        dots = attention_column_sums(query, key, 0.125)
        with monkeypatch.context() as m:
            m.setattr(attention_stats, "_causal_column_sums_bf16", lambda *a: False)
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


def test_disabled_or_unbuildable_kernels_fall_back(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("KVBENCH_NO_CPU_EXT", "1")
    assert cpu_ext.load("softmax_column_sums") is None
    monkeypatch.delenv("KVBENCH_NO_CPU_EXT")
    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path))
    (tmp_path / "broken.c").write_text("this is not C\n")
    monkeypatch.setattr(cpu_ext, "SOURCES", tmp_path)
    if cpu_ext.shutil.which("cc") or cpu_ext.shutil.which("gcc"):
        assert cpu_ext._build("broken") is None
        assert "C kernel broken did not build; using torch" in capsys.readouterr().err
    monkeypatch.setattr(cpu_ext.shutil, "which", lambda name: None)
    assert cpu_ext._build("broken") is None
    assert "no C compiler" in capsys.readouterr().err
    assert not list(tmp_path.glob("cpu_ext/*.so"))  # nothing half-written


@needs_cc
def test_inconsistent_shapes_raise_instead_of_reaching_the_kernel():
    with pytest.raises(RuntimeError):  # more queries than keys: torch's own error, not a read past the keys
        attention_column_sums(torch.randn(1, 2, 8, 16), torch.randn(1, 2, 4, 16), 0.25)


def test_an_unwritable_cache_falls_back_to_torch(monkeypatch, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("KVBENCH_CACHE", str(blocker))  # a file where the cache folder should be
    monkeypatch.delenv("KVBENCH_NO_CPU_EXT", raising=False)
    cpu_ext._load.cache_clear()
    try:
        assert cpu_ext.load("softmax_column_sums") is None
        assert "using torch" in capsys.readouterr().err
    finally:
        cpu_ext._load.cache_clear()


@needs_cc
def test_editing_a_header_rebuilds_the_kernels(monkeypatch, tmp_path):
    for source in cpu_ext.SOURCES.iterdir():
        (tmp_path / source.name).write_bytes(source.read_bytes())
    monkeypatch.setattr(cpu_ext, "SOURCES", tmp_path)
    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path / "cache"))
    before = cpu_ext._build("softmax_column_sums")
    header = tmp_path / "kvbench_math.h"
    header.write_text(header.read_text() + "\n/* edited */\n")
    after = cpu_ext._build("softmax_column_sums")
    assert before is not None and after is not None and before != after


@needs_cc
def test_a_built_kernel_is_cached_under_kvbench_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path))
    first = cpu_ext._build("softmax_column_sums")
    assert first is not None and first.parent == tmp_path / "cpu_ext" and first.exists()
    mtime = first.stat().st_mtime_ns
    assert cpu_ext._build("softmax_column_sums") == first and first.stat().st_mtime_ns == mtime  # not rebuilt


@needs_cc
def test_the_engine_builds_every_kernel_before_anything_is_timed(monkeypatch, tmp_path, tiny):
    from kvbench.engine.engine import Engine

    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path))
    cpu_ext._load.cache_clear()  # as a new process on a machine without them
    try:
        Engine(tiny)
        built = sorted(path.name.split("-")[0] for path in (tmp_path / "cpu_ext").glob("*.so"))
        assert built == sorted(path.stem for path in cpu_ext.SOURCES.glob("*.c"))
    finally:
        cpu_ext._load.cache_clear()  # the other tests load from the default cache again
