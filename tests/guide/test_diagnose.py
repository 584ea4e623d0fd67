"""Diagnostics (kvbench.guide.diagnose): kept-position tracking, identity at budget 1.0, hand-checked recall and evidence,
the runner's columns and side table."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch

from kvbench.guide.diagnose import PositionTracker, compare, evidence_positions, teacher_forced
from kvbench.methods import Budget, build_method
from kvbench.model.attention import StatsRequest, recording
from kvbench.model.cache import cache_kv
from kvbench.run.runner import run
from kvbench.store.results import read_rows
from tests.conftest import compose_config, compressed, tiny_overrides


def passes(engine, prompt_ids, name, budget, **params):
    method = build_method(name, params)
    prefill = engine.prefill(prompt_ids, method.stats_request())
    full = teacher_forced(engine, prefill, build_method("full"), None, [], None, 6)
    other = teacher_forced(engine, prefill, method, Budget.parse(budget), [], full.token_ids, 6)
    return prefill, full, other


def test_tracker_follows_decode_time_eviction(tiny_engine, prompt_ids):
    """H2O evicts at every decode step: the tracked positions must name exactly the keys the cache holds."""
    method = build_method("h2o")
    prefill = tiny_engine.prefill(prompt_ids, method.stats_request())
    method.bind(tiny_engine.lm)
    compression, cache = compressed(method, prefill.kv, prefill.stats, Budget.parse(0.2))
    tracker = PositionTracker(cache, compression.kept, prefill.n_tokens, [k.shape[1] for k, _ in prefill.kv])
    position, token = prefill.n_tokens, 5
    with tracker.observing():
        for _ in range(8):
            with torch.inference_mode(), recording(compression.decode_request()) as stats:
                tiny_engine.forward([token], [position], cache)
            compression.on_decode_step(cache, stats)
            position += 1
    for (keys, _), (full_keys, _), positions in zip(cache_kv(cache), prefill.kv, tracker.current(cache)):
        assert positions.shape == keys.shape[1:3]  # (H_kv, T_cache)
        assert bool((positions[:, 1:] > positions[:, :-1]).all())  # sorted, distinct
        prompt = positions < prefill.n_tokens  # (H_kv, T): prompt entries must be those prefill keys exactly
        for head in range(keys.shape[1]):
            expected = full_keys[0, head, positions[head][prompt[head]]]  # (N, D)
            assert torch.equal(keys[0, head, prompt[head]], expected)
        assert int((~prompt).sum(1).max()) >= 1  # decode tokens are tracked too


def test_budget_one_is_the_full_cache(tiny_engine, prompt_ids):
    _, full, other = passes(tiny_engine, prompt_ids, "snapkv", 1.0)
    columns, records = compare(full, other, torch.tensor([10, 11, 12]), tiny_engine.full_kv_heads)
    assert columns["kl_mean"] == 0 and columns["top1_agreement"] == 1 and math.isnan(columns["first_divergence_step"])
    assert columns["mass_recall"] == pytest.approx(1.0, abs=1e-5) and columns["evicted_share"] == 0
    assert columns["evidence_retention"] == 1
    assert len(records) == tiny_engine.lm.n_layers * tiny_engine.lm.n_kv_heads
    assert all(r["entropy_full"] == pytest.approx(r["entropy_compressed"]) for r in records)


def test_streaming_recall_and_evidence_by_hand(tiny_engine, prompt_ids):
    """StreamingLLM keeps sinks + the recent window: recall at the first decode step is the full attention mass
    on exactly those positions, and evidence in the middle is gone."""
    prefill, full, other = passes(tiny_engine, prompt_ids, "streamingllm", 0.25)
    n = prefill.n_tokens
    n_keep = Budget.parse(0.25).tokens(n)
    kept = list(range(4)) + list(range(n - (n_keep - 4), n + 1))  # + the first decode token itself
    evidence = torch.arange(n // 2, n // 2 + 5)
    columns, records = compare(full, other, evidence, tiny_engine.full_kv_heads)
    assert columns["evidence_retention"] == 0 and columns["evidence_mass_compressed"] == 0
    assert columns["evidence_mass_full"] > 0
    assert all(r["evidence_kept"] == "00000" for r in records)
    layer0 = full.attention[0][0]  # (H_q, T) first decode query, layer 0
    group = layer0.shape[0] // tiny_engine.full_kv_heads
    by_hand = float(layer0[:group, kept].sum(1).mean())  # KV head 0's query group, step 0
    assert other.positions[0][0][0].tolist() == kept
    one_step = compare(pass_prefix(full, 1), pass_prefix(other, 1), evidence, tiny_engine.full_kv_heads)[1]
    assert one_step[0]["mass_recall"] == pytest.approx(by_hand, rel=1e-5)
    assert 0 < columns["mass_recall"] < 1


def pass_prefix(p, steps):
    from kvbench.guide.diagnose import Pass

    return Pass(p.token_ids[:steps], p.logits[:steps], p.attention[:steps], p.positions[:steps])


def test_evidence_positions_locate_the_value(tiny):
    ids = tiny.tokenizer("noise noise. The magic number is: 4817263. more noise")["input_ids"]
    found = evidence_positions(tiny.tokenizer, ids, ["4817263"])
    assert "4817263" in tiny.tokenizer.decode([ids[i] for i in found.tolist()])
    assert len(evidence_positions(tiny.tokenizer, ids, [])) == 0


def test_runner_columns_side_table_and_reuse(tmp_path):
    overrides = tiny_overrides(
        tmp_path,
        "diagnose=true",
        "limit=1",
        "task.context_lengths=[700]",
        "grid.method=[streamingllm]",
        "grid.budget=[0.1]",
    )
    rows = run(compose_config(*overrides), tmp_path / "out")
    assert len(rows) == 2
    for column in ("verdict", "mass_recall", "kl_mean", "first_divergence_step", "evidence_retention"):
        assert rows[column].notna().any(), column
    streaming = rows[rows.method == "streamingllm"].iloc[0]
    assert streaming.evidence_retention == 0  # the needle at depth 0.2 is outside sinks + recent window
    assert streaming.evidence_tokens == 7  # 7 digits
    side = pd.read_parquet(tmp_path / "out" / "rows.diagnose.parquet")
    assert len(side) == 2 * 4 * 2  # configurations × layers × KV heads of the tiny model
    assert side.groupby("config_hash").mass_recall.mean().min() == pytest.approx(streaming.mass_recall, rel=1e-9)
    assert len(read_rows(tmp_path / "store")) == 2  # side tables are not rows
    again = run(compose_config(*overrides), tmp_path / "out2")
    assert again.reused.all() and list(again.verdict) == list(rows.verdict)
    assert len(pd.read_parquet(tmp_path / "out2" / "rows.diagnose.parquet")) == len(side)  # reused rows' records

    from kvbench.report.build import build_report

    files = build_report([tmp_path / "out" / "rows.parquet"], tmp_path / "report", tolerance=0.02)
    names = {f.name for f in files}
    assert {"diagnose_mass_recall_by_layer_head.png", "diagnose_kl_per_step.png"} <= names
    md = (tmp_path / "report" / "report.md").read_text()
    assert "## Why quality dropped (diagnostics)" in md and "## Which method (selection guide)" in md


def test_diagnose_refuses_streamed_tasks(tmp_path):
    from kvbench import KvbenchError

    with pytest.raises(KvbenchError, match="diagnose"):
        run(
            compose_config(
                "model=tiny-random",
                "device=cpu",
                "dtype=float32",
                f"results_dir={tmp_path}",
                "report=false",
                "task=ppl",
                "diagnose=true",
            ),
            tmp_path / "out",
        )


def test_full_pass_matches_the_engine(tiny_engine, prompt_ids):
    """The greedy full pass decodes the same tokens as Engine.generate (the row's prediction)."""
    full_method = build_method("full")
    prefill = tiny_engine.prefill(prompt_ids, StatsRequest())
    full = teacher_forced(tiny_engine, prefill, full_method, None, [], None, 6)
    gen = tiny_engine.generate(prefill, full_method, None, [], 6)
    assert full.token_ids == gen.token_ids
