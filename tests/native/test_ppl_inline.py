"""task=ppl with prefill=inline (kvbench/native/streaming.py): each layer bounded inside the forward right after its
attention gives exactly what bounding every layer after the chunk's forward gives, one layer's chunk at a time."""

import pytest
import torch

from kvbench import KvbenchError
from kvbench.methods import METHODS, Budget, build_method
from kvbench.model.cache import layer_lengths
from kvbench.native import inline, streaming
from kvbench.native.streaming import Stream, stream_chunks
from tests.conftest import compose_config, native_method_names
from tests.native.test_inline import assert_same_cache, built

CHUNK, BOUND = 64, 100  # 400 tokens: 7 chunks, the cache bounded from the second on
VARIANTS = [(name, {}) for name in native_method_names()] + [
    ("streamingllm", {"positions": "rolling"}),  # RollingLayer caches, positions inside the cache
    ("snapkv", {"aggregate": "none"}),  # one K/V head per query head
    ("h2o", {"score": "mean"}),
]


def refused_by_ppl(method) -> bool:
    """What task=ppl refuses: a method declaring a stream_limit (adakv's ragged heads, compose's stack), or one
    keeping different counts per layer (PyramidKV: each chunk goes through one causal mask)."""
    return bool(method.caps.stream_limit) or len(set(method.layer_tokens(BOUND, 4, 400))) > 1


def variant(name, knobs):
    return build_method(name, knobs) if knobs else built(name)  # built: the tiny model's knobs


def streams(engine, name, knobs, ids, inline_mode):
    method = variant(name, knobs)
    budget = Budget.parse(BOUND) if method.caps.has_budget else None
    return method, stream_chunks(engine.prepared(method), method, budget, ids, CHUNK, inline=inline_mode)


@pytest.mark.parametrize("name, knobs", VARIANTS, ids=[f"{n}{k or ''}" for n, k in VARIANTS])
def test_inline_streaming_equals_whole_chunk_streaming(name, knobs, tiny_engine, prompt_ids, monkeypatch):
    """Per chunk: the same per-token NLL (bit-equal, fp32), the same bounded cache tensors and kept positions, and
    the same window record; methods refused by task=ppl are refused by both paths with the same line."""
    ids = prompt_ids[:400]
    made: list[Stream] = []  # each path's Stream, in the order they start: whole, then inline

    class Recorded(Stream):
        def __init__(self, *args):
            super().__init__(*args)
            made.append(self)

    monkeypatch.setattr(streaming, "Stream", Recorded)
    whole_method, whole = streams(tiny_engine, name, knobs, ids, False)
    inline_method, inlined = streams(tiny_engine, name, knobs, ids, True)
    if not inline.compresses_per_layer(inline_method):  # kvzip: refused by kvbench.rows.modes, before loading
        with pytest.raises(KvbenchError, match="kvzip re-reads the whole prompt"):  # and task=ppl cannot serve it
            list(whole)
        pytest.skip(f"{name} compresses after the whole prefill (refused by kvbench.rows.modes)")
    n_chunks = 0
    while True:  # both in lockstep: a chunk's cache is compared before the next forward appends to it
        try:
            w_a, nll_a, cache_a = next(whole)
        except StopIteration:
            assert next(inlined, None) is None
            break
        except KvbenchError as error:  # adakv, compose, pyramidkv: task=ppl refuses them whatever the prefill
            assert refused_by_ppl(whole_method), error
            with pytest.raises(KvbenchError) as refused:
                next(inlined)
            assert str(refused.value) == str(error)
            return
        w_b, nll_b, cache_b = next(inlined)
        n_chunks += 1
        assert torch.equal(nll_a, nll_b), f"chunk {w_a.index}: per-token NLL differs"
        assert w_a.nll_sum == w_b.nll_sum and w_a.perplexity == w_b.perplexity
        assert (w_a.tokens_seen, w_a.cache_tokens, w_a.kv_bytes) == (w_b.tokens_seen, w_b.cache_tokens, w_b.kv_bytes)
        assert_same_cache(cache_a, cache_b)
        kept_a, kept_b = (s.compression.kept if s.compression else [] for s in made)
        assert len(kept_a) == len(kept_b)
        assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(kept_a, kept_b))
    assert n_chunks == 7
    if whole_method.caps.has_budget:
        assert w_b.cache_tokens == BOUND  # bounded (TOVA included: the stream compresses every chunk)


@pytest.mark.parametrize("name", ["snapkv", "h2o", "streamingllm", "tova"])
def test_inline_streaming_holds_one_layers_chunk_at_a_time(name, tiny_engine, prompt_ids, monkeypatch):
    """At every per-layer hook call at most one layer holds more than the bound (its own chunk, ≤ bound + chunk) and
    one layer's statistics exist; the whole-chunk path, measured the same way, holds every layer's chunk at once."""
    layers_seen: list[tuple[list[int], int]] = []  # (tokens each layer holds, layers with statistics) per call
    hook_call = inline._PerLayer.__call__

    def recording_call(self, layer_idx, keys, values):
        live = {*self.stats.all_queries, *(layer for w in self.stats.window.values() for layer in w)}
        layers_seen.append((layer_lengths(self.cache), len(live)))
        return hook_call(self, layer_idx, keys, values)

    monkeypatch.setattr(inline._PerLayer, "__call__", recording_call)
    list(streams(tiny_engine, name, {}, prompt_ids[:400], True)[1])
    n_layers = tiny_engine.lm.n_layers
    assert len(layers_seen) == 7 * n_layers  # every layer of every chunk went through the hook
    later = layers_seen[n_layers:]  # from the second chunk on the cache is bounded between chunks
    for lengths, n_stats in later:
        over = [n for n in lengths if n > BOUND]
        assert len(over) == 1 and over[0] <= BOUND + CHUNK  # the layer just attended, nothing else
        assert sum(lengths) <= n_layers * BOUND + CHUNK
        assert n_stats <= 1  # earlier layers' statistics are released, later ones not recorded yet

    bound_calls: list[tuple[list[int], int]] = []
    whole_method, whole = streams(tiny_engine, name, {}, prompt_ids[:400], False)
    stream_bound = Stream.bound

    def recording_bound(stream, cache, stats, first):
        live = {*stats.all_queries, *(layer for w in stats.window.values() for layer in w)}
        bound_calls.append((layer_lengths(cache), len(live)))
        return stream_bound(stream, cache, stats, first)

    monkeypatch.setattr(Stream, "bound", recording_bound)
    list(whole)
    for lengths, n_stats in bound_calls[2:-1]:  # full chunks on a bounded cache: the same measure fails here
        assert lengths == [BOUND + CHUNK] * n_layers
        assert n_stats == (n_layers if whole_method.stats_request() else 0)  # streamingllm records none


def ppl_config(tmp_path, *extra):
    return compose_config(
        "model=tiny-random",
        "device=cpu",
        "dtype=float32",
        f"results_dir={tmp_path / 'store'}",
        "report=false",
        "task=ppl",
        "task.length=400",
        "task.chunk=64",
        *extra,
    )


def test_ppl_runs_inline_through_the_runner_and_records_it(tmp_path):
    from kvbench.run.runner import run

    grid = ["grid.method=[h2o,snapkv]", "grid.budget=[0.25]"]
    shared = run(ppl_config(tmp_path, *grid), tmp_path / "a")
    inlined = run(ppl_config(tmp_path, *grid, "prefill=inline"), tmp_path / "b")
    key = ["method", "example_id"]
    shared, inlined = (f.sort_values(key).reset_index(drop=True) for f in (shared, inlined))
    assert len(shared) == len(inlined) == 3 * 7  # full, h2o, snapkv × 7 windows
    assert (inlined["prefill"] == "inline").all() and (shared["prefill"] == "shared").all()
    assert set(inlined["config_hash"]).isdisjoint(shared["config_hash"]) and not inlined["reused"].any()
    for column in ["score", "perplexity_so_far", "cache_tokens", "kv_bytes"]:
        assert inlined[column].tolist() == shared[column].tolist(), column
    assert (inlined[inlined.method != "full"].cache_tokens.iloc[1:7] == 100).all()  # 0.25 of 400 tokens
    assert (inlined["peak_mem_delta_bytes"] < inlined["peak_mem_bytes"]).all()


def test_prefill_chunk_with_ppl_names_task_chunk(tmp_path):
    from kvbench.run.runner import run

    cfg = ppl_config(tmp_path, "prefill=inline", "prefill_chunk=64")
    with pytest.raises(KvbenchError, match=r"drop prefill_chunk and set task\.chunk"):
        run(cfg)


def test_report_peak_table_counts_a_stream_once_at_its_peak_over_the_model():
    import pandas as pd

    from kvbench.report.sections.prefill import peak_by_prefill, peak_table
    from tests.conftest import ppl_window_rows

    windows = ppl_window_rows()
    prompt = windows.iloc[:1].assign(task="niah", window=None, example_id="n1", config_hash="c", context_tokens=2048)
    table = peak_table(pd.concat([windows, prompt], ignore_index=True))
    ppl = table[table.task == "ppl"]
    assert len(ppl) == 1 and ppl.iloc[0].context_tokens == 2048  # one stream, at the text's length
    # the largest window peak, over window 0's baseline (600 MiB: the model), not the largest per-window delta
    assert ppl.iloc[0][["shared", "inline"]].tolist() == ["350 (950)", "260 (860)"]
    assert table[table.task == "niah"].iloc[0]["shared"] == "300 (900)"  # prompt rows as before
    assert "ppl" in peak_by_prefill(windows, None, None).markdown
