"""prefill=inline and prefill_chunk (kvbench/native/inline.py): same kept entries as the shared prefill, every method."""

import pytest
import torch

from kvbench import KvbenchError
from kvbench.config.spec import RunSpec
from kvbench.methods import METHODS, Budget, build_method
from kvbench.methods.base import Capabilities, Method
from kvbench.model.cache import _tensors, layer_lengths
from kvbench.native import inline
from kvbench.native.memory import read_peak, reset_peak
from tests.conftest import compose_config, compressed

ALL_METHODS = METHODS.names()
BUDGETED = [n for n in ALL_METHODS if METHODS.get(n).caps.has_budget]


TINY = {  # knobs that fit the tiny model (head_dim 16)
    "kivi": {"group_size": 16, "residual_length": 32},
    "compose": {"stack": ["snapkv", "kivi"], "overrides": {"kivi": {"group_size": 16, "residual_length": 32}}},
    "hf-quant": {"backend": "fp8"},
}


def built(name):
    try:
        return build_method(name, TINY.get(name))
    except KvbenchError as error:  # an optional backend not installed (hf-quant's quanto)
        pytest.skip(str(error))


def cache_tensors(cache) -> list[torch.Tensor]:
    """Every tensor each layer holds (payloads, scales, residuals, ragged lengths), in attribute order."""
    out = []
    for layer in cache.layers:
        out.append(type(layer).__name__)
        out.extend(_tensors(vars(layer), set()))
    return out


def assert_same_cache(a, b):
    ta, tb = cache_tensors(a), cache_tensors(b)
    assert len(ta) == len(tb)
    for x, y in zip(ta, tb):
        if isinstance(x, str):
            assert x == y
        else:
            assert x.shape == y.shape and x.dtype == y.dtype and torch.equal(x, y)


@pytest.mark.parametrize("name", ALL_METHODS)
def test_inline_keeps_what_shared_keeps_and_generates_the_same(name, tiny_engine, prompt_ids):
    method = built(name)
    if not inline.compresses_per_layer(method):  # refused by kvbench.rows.modes (kvzip needs every layer)
        pytest.skip(f"{name} compresses after the whole prefill")
    budget = Budget.parse(0.25) if method.caps.has_budget else None
    engine = tiny_engine.prepared(method)
    method.bind(engine.lm)
    shared = engine.prefill(prompt_ids, method.stats_request())
    compression, expected = compressed(method, shared.kv, shared.stats, budget)
    snapshot = [t.clone() if isinstance(t, torch.Tensor) else t for t in cache_tensors(expected)]
    kept_shared = [None if p is None else p.clone() for p in compression.kept]
    del expected, compression

    inlined = inline.prefill(engine, method, budget, prompt_ids)
    assert inlined.kv == [] and inlined.n_tokens == len(prompt_ids)
    got = cache_tensors(inlined.compressed)
    assert len(got) == len(snapshot)
    for x, y in zip(got, snapshot):
        assert x == y if isinstance(x, str) else torch.equal(x, y)
    assert inlined.compression is not None and len(inlined.compression.kept) == len(kept_shared)
    for a, b in zip(inlined.compression.kept, kept_shared):
        assert (a is None and b is None) or torch.equal(a, b)
    assert torch.equal(inlined.last_logits, shared.last_logits)

    # decoding from each (the inline prefill's compressed cache is used as it is)
    from_inline = engine.generate(inlined, method, budget, [], 8, keep_logits=True)
    from_shared = engine.generate(shared, method, budget, [], 8, keep_logits=True)
    assert from_inline.token_ids == from_shared.token_ids
    assert all(torch.equal(a, b) for a, b in zip(from_inline.logits, from_shared.logits))
    assert from_inline.kv_bytes == from_shared.kv_bytes
    assert from_inline.peak_mem_delta_bytes is not None and from_inline.peak_mem_delta_bytes >= 0


@pytest.mark.parametrize("name", [n for n in ALL_METHODS if METHODS.get(n).caps.chunk_limit == ""])
def test_a_chunk_at_least_the_prompt_is_the_unchunked_prefill(name, tiny_engine, prompt_ids):
    method = built(name)
    if method.caps.chunk_limit:
        pytest.skip(method.caps.chunk_limit)
    budget = Budget.parse(0.25) if method.caps.has_budget else None
    engine = tiny_engine.prepared(method)
    whole = inline.prefill(engine, method, budget, prompt_ids)
    whole_tensors = [t.clone() if isinstance(t, torch.Tensor) else t for t in cache_tensors(whole.compressed)]
    chunked = inline.prefill(engine, method, budget, prompt_ids, chunk=len(prompt_ids) + 7)
    got = cache_tensors(chunked.compressed)
    assert len(got) == len(whole_tensors)
    for x, y in zip(got, whole_tensors):
        assert x == y if isinstance(x, str) else torch.equal(x, y)
    assert torch.equal(chunked.last_logits, whole.last_logits)


def lengths_after_each_chunk(engine, monkeypatch) -> list[list[int]]:
    seen: list[list[int]] = []
    forward = engine.forward

    def spy(ids, positions, cache, all_logits=False):
        out = forward(ids, positions, cache, all_logits)
        seen.append(layer_lengths(cache))
        return out

    monkeypatch.setattr(engine, "forward", spy)
    return seen


@pytest.mark.parametrize("name", [n for n in BUDGETED if METHODS.get(n).caps.chunk_limit == ""])
@pytest.mark.parametrize("budget", [0.25, 200])
def test_every_chunk_leaves_each_layer_at_its_count(name, budget, tiny, tiny_engine, prompt_ids, monkeypatch):
    method = built(name)
    if method.caps.chunk_limit:
        pytest.skip(method.caps.chunk_limit)
    budget = Budget.parse(budget)
    counts = method.layer_keep_counts(len(prompt_ids), tiny.n_layers, budget)
    seen = lengths_after_each_chunk(tiny_engine, monkeypatch)
    out = inline.prefill(tiny_engine, method, budget, prompt_ids, chunk=128)
    assert len(seen) == 5  # 540 tokens: 4 chunks of 128 and one of 28
    for index, lengths in enumerate(seen):
        given = min(len(prompt_ids), 128 * (index + 1))
        assert lengths == [min(n, given) for n in counts]  # at the budget as soon as the prompt so far exceeds it
    assert layer_lengths(out.compressed) == counts
    assert out.compression is not None
    positions = out.compression.kept  # prompt positions, ascending, ending with the prompt's last token
    if name not in ("random", "knorm", "keydiff", "expected_attention", "tova", "decoding"):
        assert all(int(p[0, 0, -1]) == len(prompt_ids) - 1 for p in positions if p is not None)
    assert all(bool((p[..., 1:] > p[..., :-1]).all()) for p in positions if p is not None)


def test_chunked_full_cache_equals_the_whole_prompt(tiny_engine, prompt_ids):
    """Positions and masks across chunks: with nothing evicted, chunking changes only the summation order."""
    full = build_method("full")
    whole = inline.prefill(tiny_engine, full, None, prompt_ids)
    chunked = inline.prefill(tiny_engine, full, None, prompt_ids, chunk=100)
    assert torch.allclose(chunked.last_logits, whole.last_logits, atol=1e-4)
    for a, b in zip(chunked.compressed.layers, whole.compressed.layers):
        assert torch.allclose(a.keys, b.keys, atol=1e-4) and torch.allclose(a.values, b.values, atol=1e-4)


def test_streamingllm_chunked_keeps_sinks_and_the_most_recent(tiny_engine, prompt_ids):
    method = build_method("streamingllm", {"start_size": 4})
    out = inline.prefill(tiny_engine, method, Budget.parse(100), prompt_ids, chunk=64)
    T = len(prompt_ids)
    assert out.compression is not None
    for positions in out.compression.kept:
        assert positions[0, 0].tolist() == list(range(4)) + list(range(T - 96, T))


def test_pyramidkv_chunks_attend_with_each_layers_own_mask(tiny_engine, prompt_ids):
    """Layers of different lengths: a chunk's causal mask is each layer's own (bottom-right aligned)."""
    from kvbench.model.attention import _own_length_mask

    query, key = torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 5, 4)
    mask = _own_length_mask(torch.ones(1, 1, 3, 9, dtype=torch.bool), query, key)
    assert mask[0, 0].tolist() == [[True] * 3 + [False] * 2, [True] * 4 + [False], [True] * 5]
    method = build_method("pyramidkv", {"window_size": 8, "beta": 2})
    budget = Budget.parse(0.3)
    out = inline.prefill(tiny_engine, method, budget, prompt_ids, chunk=128)
    counts = method.layer_keep_counts(len(prompt_ids), 4, budget)
    assert len(set(counts)) > 1 and layer_lengths(out.compressed) == counts


def test_memory_delta_counts_what_was_touched():
    device = torch.device("cpu")
    baseline = reset_peak(device)
    block = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB, every page touched
    peak = read_peak(device)
    del block
    assert peak - baseline >= 60 << 20


class WholeCacheMethod(Method):
    """A method that needs every layer before selecting (a cross-layer budget): declares it."""

    name = "whole-cache"
    caps = Capabilities(compresses_inline=False)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["prefill_chunk=256"], "needs prefill=inline"),
        (["prefill=inline", "diagnose=true"], "does not combine with diagnose=true"),
        (["prefill=inline", "batch_size=2"], "does not combine with batch_size=2"),
        (["prefill=inline", "prefill_chunk=64", "method=adakv"], "cannot re-compress its cache after each chunk"),
        (["prefill=inline", "prefill_chunk=64", "method=compose"], "cannot re-compress its cache after each chunk"),
    ],
)
def test_bad_combinations_are_one_line_before_the_model_loads(overrides, message, tmp_path):
    from kvbench.run.runner import run

    cfg = compose_config("model=tiny-random", f"results_dir={tmp_path}", *overrides)
    with pytest.raises(KvbenchError, match=message):
        run(cfg)


def test_a_method_that_needs_every_layer_is_refused(tmp_path):
    cfg = compose_config("prefill=inline")
    assert not inline.compresses_per_layer(WholeCacheMethod) and inline.compresses_per_layer(METHODS.get("snapkv"))

    class Task:
        name, kind = "niah", "generate"

    from kvbench.rows.modes import RunFacts, check

    with pytest.raises(KvbenchError, match="use prefill=shared for it"):
        check(RunFacts(RunSpec.of(cfg), Task, (WholeCacheMethod(),)))


@pytest.mark.parametrize("bad", ["prefill=streamed", "prefill_chunk=0", "prefill_chunk=abc"])
def test_bad_values_name_the_fix(bad, tmp_path):
    from kvbench.run.runner import run

    with pytest.raises(KvbenchError, match="prefill"):
        run(compose_config("model=tiny-random", f"results_dir={tmp_path}", bad))


def test_a_run_with_prefill_inline_records_it_and_predicts_what_shared_does(tmp_path):
    from kvbench.run.runner import run
    from tests.conftest import tiny_overrides

    grid = ["grid.method=[snapkv,h2o]", "grid.budget=[0.25]"]
    shared = run(compose_config(*tiny_overrides(tmp_path, *grid)), tmp_path / "a")
    inlined = run(compose_config(*tiny_overrides(tmp_path, *grid, "prefill=inline")), tmp_path / "b")
    chunked_cfg = compose_config(*tiny_overrides(tmp_path, *grid, "prefill=inline", "prefill_chunk=256"))
    chunked = run(chunked_cfg, tmp_path / "c")
    key = ["method", "example_id"]
    shared, inlined, chunked = (f.sort_values(key).reset_index(drop=True) for f in (shared, inlined, chunked))
    assert len(shared) == len(inlined) == len(chunked) == 12  # 4 examples × full, snapkv, h2o
    assert not inlined["reused"].any() and set(inlined["config_hash"]).isdisjoint(shared["config_hash"])
    assert (shared["prefill"] == "shared").all() and shared["prefill_chunk"].isna().all()
    assert (inlined["prefill"] == "inline").all() and (chunked["prefill_chunk"] == 256).all()
    assert list(inlined["prediction"]) == list(shared["prediction"])
    assert list(inlined["kv_bytes"]) == list(shared["kv_bytes"])
    for frame in (shared, inlined, chunked):
        assert (frame["peak_mem_delta_bytes"] >= 0).all()
        assert (frame["peak_mem_delta_bytes"] < frame["peak_mem_bytes"]).all()  # beside the absolute


def test_report_table_of_peak_memory_by_prefill_mode():
    import pandas as pd

    from kvbench.report.sections.prefill import peak_by_prefill, peak_table

    mib = 2**20
    rows = pd.DataFrame(
        {
            "model": "m",
            "context_tokens": 8192,
            "method": ["snapkv"] * 4,
            "budget": 0.25,
            "prefill": ["shared", "inline", "inline", "inline"],
            "prefill_chunk": [None, None, 1024, 1024],
            "peak_mem_delta_bytes": [300 * mib, 120 * mib, 40 * mib, 60 * mib],
            "peak_mem_bytes": [900 * mib, 720 * mib, 640 * mib, 660 * mib],
        }
    )
    table = peak_table(rows)
    assert list(table.columns[-3:]) == ["shared", "inline", "inline + chunk 1024"]
    assert table.iloc[0][["shared", "inline", "inline + chunk 1024"]].tolist() == ["300 (900)", "120 (720)", "50 (650)"]
    assert peak_by_prefill(rows.iloc[:1], None, None) is None  # shared alone: nothing to compare
    assert "inline + chunk 1024" in peak_by_prefill(rows, None, None).markdown


def test_a_model_whose_attention_bypasses_kvbench_is_refused_not_left_uncompressed(tiny, tiny_engine, prompt_ids):
    from kvbench.model.attention import register

    tiny.model.set_attn_implementation("sdpa")
    try:
        with pytest.raises(KvbenchError, match="use prefill=shared with this model"):
            inline.prefill(tiny_engine, build_method("streamingllm"), Budget.parse(0.25), prompt_ids)
    finally:
        tiny.model.set_attn_implementation(register())
