"""Workloads with shared prefixes on the tiny model (fp32): prefix caching changes what is computed and held,
never the tokens; compress-once answers exactly as compressing the context alone (query_aware=false)."""

from __future__ import annotations

import json

import pytest

from kvbench import KvbenchError
from kvbench.run.runner import run
from tests.conftest import compose_config

GRID = "grid.method=[streamingllm,snapkv,{name:kivi,group_size:16,residual_length:32}]"


def workload(tmp_path, name, *extra):
    overrides = [
        "model=tiny-random",
        "device=cpu",
        "dtype=float32",
        f"results_dir={tmp_path / 'store'}",
        "report=false",
        "task=shared_doc",
        "task.questions=3",
        "task.context_length=400",
        "task.max_new_tokens=4",
        GRID,
        "grid.budget=[0.5]",
        *extra,
    ]
    return run(compose_config(*overrides), output_dir=tmp_path / name).sort_values(["request_index", "method"])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("workloads")
    return {
        "dir": tmp,
        "plain": workload(tmp, "plain"),
        "cached": workload(tmp, "cached", "prefix_cache=true"),
        "once": workload(tmp, "once", "prefix_cache=true", "reuse=compress_once"),
        "context_only": workload(tmp, "context_only", "query_aware=false"),
    }


def tokens(rows):
    return list(zip(rows.method, rows.request_index, rows.prediction))


def test_prefix_cache_keeps_every_output(runs):
    plain, cached = runs["plain"], runs["cached"]
    assert len(plain) == 3 * 4 and tokens(plain) == tokens(cached)
    assert list(plain.score) == list(cached.score)


def test_prefix_cache_computes_only_the_rest(runs):
    plain, cached = runs["plain"], runs["cached"]
    prompt = plain.prefill_tokens.to_numpy()
    assert (plain.reused_tokens == 0).all() and (cached.prefill_tokens + cached.reused_tokens == prompt).all()
    first, later = cached[cached.request_index == 0], cached[cached.request_index > 0]
    assert (first.reused_tokens == 0).all()
    assert (later.reused_tokens >= 320).all() and (later.reused_tokens % 16 == 0).all()  # whole pages
    # the one shared prefill serves every configuration: the reuse is capped by SnapKV's 32-token window
    assert (later.prefill_tokens >= 32).all()


def test_shared_pages_are_held_once(runs):
    plain, cached = runs["plain"], runs["cached"]
    full_plain, full_cached = plain[plain.method == "full"], cached[cached.method == "full"]
    assert list(full_plain.held_bytes) == list(full_plain.kv_bytes.cumsum())
    assert list(full_plain.kv_bytes) == list(full_cached.kv_bytes)  # each request's cache: the same bytes
    # held: the store's pages once + each request's private tail, far below three whole caches
    assert full_cached.held_bytes.iloc[-1] < 0.6 * full_plain.held_bytes.iloc[-1]
    assert (full_cached.held_bytes >= full_cached.store_bytes).all()


def test_compress_once_answers_as_context_only_compression(runs):
    once, context_only = runs["once"], runs["context_only"]
    assert tokens(once) == tokens(context_only)
    assert list(once.kv_bytes) == list(context_only.kv_bytes)
    assert (~once.query_aware).all() and (once.reuse == "compress_once").all()
    assert (once[once.request_index > 0].reused_tokens == 400).all()  # the shared context: task.context_length
    assert (once[once.request_index == 0].reused_tokens == 0).all()


def test_compress_once_holds_the_compressed_context_once(runs):
    once = runs["once"]
    snap = once[once.method == "snapkv"]
    # the second and third requests add only their own question and answer, not another compressed context
    added = snap.held_bytes.diff().iloc[1:]
    assert (added < 0.5 * snap.kv_bytes.iloc[1:]).all()
    assert json.loads(snap.method_params.iloc[0])["window_size"] == 32


def test_sliding_window_layers_resume_from_the_pages_and_keep_their_window(tmp_path):
    """A model with sliding-window layers (tiny Gemma 3: 5 layers of a 128-token window per global layer, a 400-token
    document): a request resumes every layer from the cached pages, each window layer then keeps only its own last
    W − 1 tokens, as without caching: the same tokens and bytes per request; compress-once as context-only."""
    gemma = ("model=tiny-gemma3",)
    plain, cached = workload(tmp_path, "plain", *gemma), workload(tmp_path, "cached", *gemma, "prefix_cache=true")
    assert len(plain) == 3 * 4 and tokens(plain) == tokens(cached) and list(plain.score) == list(cached.score)
    assert list(plain.kv_bytes) == list(cached.kv_bytes)  # windows of 127 tokens, not the reused pages
    later = cached[cached.request_index > 0]
    assert (later.reused_tokens >= 320).all() and (later.reused_tokens % 16 == 0).all()
    # the store holds every layer's pages (a later request may resume anywhere: its windows come from them);
    # a page is (6 layers, K/V, B, H_kv=1, P=16, D=32) fp32
    full = cached[cached.method == "full"]
    page_bytes = 6 * 2 * 16 * 32 * 4
    assert full.store_bytes.iloc[0] == page_bytes * (int(full.prefill_tokens.iloc[0]) // 16)
    once = workload(tmp_path, "once", *gemma, "prefix_cache=true", "reuse=compress_once")
    context_only = workload(tmp_path, "context_only", *gemma, "query_aware=false")
    assert tokens(once) == tokens(context_only) and list(once.kv_bytes) == list(context_only.kv_bytes)
    assert (once[once.request_index > 0].reused_tokens == 400).all()


def test_prefix_cache_budget_evicts_and_keeps_outputs(tmp_path, runs):
    small = workload(tmp_path, "small", "prefix_cache=true", "prefix_cache_bytes=100000", "grid.method=[h2o]")
    full = small[small.method == "full"]
    # while a request runs, the store holds its own whole pages (in use: never freed, even over the budget); the
    # previous requests' pages were evicted when released. Page: (L=4, K/V, B, H_kv=2, P=16, D=16) fp32.
    page_bytes = 4 * 2 * 2 * 16 * 16 * 4
    assert list(full.store_bytes) == [page_bytes * (n // 16) for n in full.prefill_tokens + full.reused_tokens]
    assert (small.reused_tokens == 0).all()  # H2O sums every query's attention: its prefill reuses nothing
    without = workload(tmp_path, "without", "grid.method=[h2o]")
    assert tokens(small) == tokens(without)


def test_multiturn_reuses_the_growing_history(tmp_path):
    rows = run(
        compose_config(
            "model=tiny-random",
            "device=cpu",
            "dtype=float32",
            f"results_dir={tmp_path}",
            "report=false",
            "task=multiturn",
            "task.turns=3",
            "task.context_length=400",
            "task.max_new_tokens=3",
            "method=full",
            "prefix_cache=true",
            "page_size=1",
        ),
        output_dir=tmp_path / "o",
    )
    prompts = list(rows.prefill_tokens + rows.reused_tokens)
    assert prompts == sorted(prompts) and list(rows.turn) == [0, 1, 2]
    # token-level pages: each turn reuses the whole previous prompt (up to its last token's first logits)
    assert list(rows.reused_tokens[1:]) >= [p - 8 for p in prompts[:-1]]


def test_report_shows_prefix_sections(runs, tmp_path):
    from kvbench.report.build import build_report

    paths = [runs["dir"] / name / "rows.parquet" for name in ("plain", "cached", "once")]
    files = build_report(paths, tmp_path / "report", tolerance=0.02)
    md = (tmp_path / "report" / "report.md").read_text()
    assert "Prefix caching: time to first token and memory vs requests" in md and "Compress once vs per question" in md
    assert any(f.name == "prefix_shared_doc.png" for f in files)
    section = md.split("Compress once vs per question")[1]
    assert "snapkv" in section and "compress_once" in section
    assert "| held MB per q. / once |" in section
    kivi = next(line for line in section.splitlines() if "| kivi" in line)
    assert kivi.split(" | ")[3] == "3"  # n: the 3 requests, each mode


@pytest.mark.parametrize(
    "extra, message",
    [
        (["reuse=sometimes"], "reuse=sometimes is not one of per_question, compress_once"),
        (["reuse=compress_once"], "add prefix_cache=true"),
        (["prefix_cache=true", "page_size=0"], "page_size=0 must be ≥ 1"),
        (["prefix_cache=true", "prefix_cache_bytes=-1"], "prefix_cache_bytes=-1 must be ≥ 0"),
        (["prefix_cache=yes"], "prefix_cache=yes is not a boolean"),
    ],
)
def test_bad_prefix_settings_name_the_fix(tmp_path, extra, message):
    with pytest.raises(KvbenchError, match=message):
        run(compose_config("model=tiny-random", f"results_dir={tmp_path}", "task=shared_doc", *extra))


DIAGNOSED = ["kl_mean", "top1_agreement", "mass_recall", "evidence_retention", "evicted_share"]


@pytest.mark.slow
def test_diagnose_on_workloads_per_request(tmp_path):
    """diagnose=true on a workload: every request's row gets the diagnostics of the caches it was answered from —
    per question through the prefix cache the same as without it; compressed once the same as compressing the
    context alone (query_aware=false) without caching; the side table has each row's layer × head records."""
    import pandas as pd

    def diagnosed(name, *extra):
        rows = workload(tmp_path, name, "diagnose=true", "task.questions=2", *extra)
        return rows.sort_values(["request_index", "method"]).reset_index(drop=True)

    plain, cached = diagnosed("plain"), diagnosed("cached", "prefix_cache=true")
    once, context_only = (
        diagnosed("once", "prefix_cache=true", "reuse=compress_once"),
        diagnosed("context_only", "query_aware=false"),
    )
    for rows in (plain, cached, once, context_only):
        assert rows.verdict.map(lambda v: isinstance(v, str)).all() and len(rows) == 2 * 4
        full = rows[rows.method == "full"]
        assert (full.kl_mean.abs() < 1e-6).all() and (full.mass_recall > 1 - 1e-6).all()  # full vs itself
        # the evidence (each request's value) is found in the shared document
        assert (rows.evidence_tokens == 7).all()
    for a, b in ((plain, cached), (context_only, once)):
        assert list(a.verdict) == list(b.verdict)
        pd.testing.assert_frame_equal(a[DIAGNOSED], b[DIAGNOSED], rtol=1e-4, atol=1e-6)
    evicting = once[once.method == "snapkv"]
    assert (evicting.evicted_share > 0.3).all() and (evicting.mass_recall < 1).all()
    side = pd.read_parquet(tmp_path / "once" / "rows.diagnose.parquet")
    assert len(side) == len(once) * 4 * 2  # 4 layers × 2 KV heads per row


def test_decode_time_compression_scores_the_whole_stored_context(tmp_path):
    """DecodingPress-style re-selection after compress-once: the cache's layers sit over the stored compressed context
    (a private tail after it), and the re-selection scores all of it — the same tokens as context-only compression."""
    method = "grid.method=[{name:decoding,compress_every:2,decode_budget:60}]"
    once = workload(tmp_path, "once", "prefix_cache=true", "reuse=compress_once", method, "task.max_new_tokens=6")
    alone = workload(tmp_path, "alone", "query_aware=false", method, "task.max_new_tokens=6")
    assert tokens(once) == tokens(alone) and list(once.kv_bytes) == list(alone.kv_bytes)
    assert (once[once.method == "decoding"].kv_bytes < once[once.method == "full"].kv_bytes.to_numpy()).all()
